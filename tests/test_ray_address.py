"""`--ray-address`: instances as actors of a Ray cluster started outside flowyard (`ray start
--head`), the way a cluster of several machines is joined."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from helpers_models import make_tiny_model
from helpers_serve import free_port, wait_healthy
from flowyard.engine.engine_config import EngineConfig
from flowyard.engine.llm_engine import LLMEngine
from flowyard.engine.loader import load_checkpoint
from flowyard.engine.model import CausalLM
from flowyard.engine.sampling import SamplingParams

ray = pytest.importorskip("ray")
PROMPTS = [[(5 * i + j) % 200 + 3 for j in range(n)] for i, n in enumerate([30, 12, 50])]
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def external_cluster(tmp_path_factory):
    if shutil.which("ray") is None:
        pytest.skip("the ray command line is not installed")
    if ray.is_initialized():
        ray.shutdown()
    port = free_port()
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    start = subprocess.run(["ray", "start", "--head", f"--port={port}", "--num-cpus=2", "--include-dashboard=false",
                            "--disable-usage-stats"], env=env, capture_output=True, text=True, timeout=180)
    assert start.returncode == 0, start.stderr[-2000:]
    try:
        yield f"127.0.0.1:{port}"
    finally:
        if ray.is_initialized():
            ray.shutdown()
        subprocess.run(["ray", "stop", "--force"], env=env, capture_output=True, timeout=120)


@pytest.mark.parametrize("policy", ["distserve", "dynaserve"])
def test_serve_joins_an_external_ray_cluster(tmp_path, external_cluster, policy):
    """`flowyard serve --ray-address` in its own process, as a user runs it: the instances are
    actors of the external cluster, and a completion gives the in-process engine's text (for
    an SLO-aware policy too: serve gives it the served model's roofline as its predictor)."""
    pytest.importorskip("transformers")
    import json
    import sys
    import urllib.request

    d, _ = make_tiny_model(tmp_path, "llama")
    ckpt = load_checkpoint(d)
    model = CausalLM(ckpt.config)
    model.load_weights(ckpt.weights)
    prompt = "the quick brown fox jumps over"
    ids = ckpt.tokenizer.encode(prompt)
    ref = LLMEngine(model, ckpt.tokenizer, EngineConfig(dtype="float32", kv_cache_tokens=4096)).generate([ids], GREEDY)[0]
    port = free_port()
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    server = subprocess.Popen([sys.executable, "-m", "flowyard.cli", "serve", "--model", str(d), "--instances", "2",
                               "--policy", policy, "--ray-address", external_cluster, "--port", str(port)],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(server, base, timeout=240)
        with urllib.request.urlopen(base + "/v1/models", timeout=10) as r:
            name = json.loads(r.read())["data"][0]["id"]
        body = json.dumps({"model": name, "prompt": prompt, "max_tokens": GREEDY.max_tokens, "temperature": 0,
                           "ignore_eos": True, "session_id": "s1", "task": "chat", "ttft_slo": 5}).encode()
        req = urllib.request.Request(base + "/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            out = json.loads(r.read())
        assert out["usage"]["completion_tokens"] == GREEDY.max_tokens
        assert out["choices"][0]["text"] == ref.new_text
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
