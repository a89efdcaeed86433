"""Instances as Ray actors (one process each): DistServe PD with KV through the object store."""

from __future__ import annotations

import pytest

from helpers_models import make_tiny_model
from flowyard.engine.llm_engine import EngineConfig, LLMEngine
from flowyard.engine.loader import load_checkpoint
from flowyard.engine.model import CausalLM
from flowyard.engine.sampling import SamplingParams
from flowyard.policies.registry import PolicyOptions, build_policy

ray = pytest.importorskip("ray")
PROMPTS = [[(7 * i + j) % 200 + 3 for j in range(n)] for i, n in enumerate([40, 9, 70, 25])]
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def drive(engine):
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, GREEDY)
    got = {f"r{i}": [] for i in range(len(PROMPTS))}
    for _ in range(10_000):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            got[o.request_id] += o.new_token_ids
    return [got[f"r{i}"] for i in range(len(PROMPTS))]


def test_distserve_on_two_ray_actors_gives_the_same_tokens(tmp_path):
    pytest.importorskip("transformers")
    from flowyard.runtime.ray_cluster import RayCluster

    d, _ = make_tiny_model(tmp_path, "llama")
    ckpt = load_checkpoint(d)
    model = CausalLM(ckpt.config)
    model.load_weights(ckpt.weights)
    ref = drive(LLMEngine(model, ckpt.tokenizer, EngineConfig(kv_cache_tokens=4096)))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        cluster = RayCluster(str(d), build_policy("distserve", PolicyOptions(num_instances=2)),
                             EngineConfig(kv_cache_tokens=2048))
        assert drive(cluster) == ref
        assert cluster.migrations == len(PROMPTS)
        snaps = [ray.get(a.snapshot.remote()) for a in cluster.actors]
        assert all(s.kv_free_blocks == s.kv_total_blocks for s in snaps)  # KV back to full
        cluster.shutdown()
    finally:
        ray.shutdown()
