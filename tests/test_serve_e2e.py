"""The server on the real engine (embedded SmolLM2), driven by the official openai client."""

from __future__ import annotations

import os
import socket
import threading
import time

import httpx
import pytest

from flowyard.engine.async_engine import AsyncLLMEngine
from flowyard.engine.engine_config import EngineConfig
from flowyard.engine.llm_engine import LLMEngine
from flowyard.server.app import build_app

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def server():
    import uvicorn

    engine = LLMEngine.from_path(None, EngineConfig(kv_cache_memory_mb=64, max_waiting=8))
    client = AsyncLLMEngine(engine)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(build_app(client), log_level="warning", lifespan="off"))
    th = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    deadline = time.time() + 10
    while not srv.started and time.time() < deadline:
        time.sleep(0.01)
    yield engine, client, f"http://127.0.0.1:{sock.getsockname()[1]}"
    srv.should_exit = True
    th.join(5)
    client.shutdown()
    sock.close()


def wait_idle(engine, timeout=10.0):
    deadline = time.time() + timeout
    while engine.has_unfinished() and time.time() < deadline:
        time.sleep(0.02)
    return not engine.has_unfinished()


def test_chat_and_completions_streaming_and_not(server):
    engine, _, url = server
    oc = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    name = oc.models.list().data[0].id
    assert name == "SmolLM2-135M-Instruct"
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    r = oc.chat.completions.create(model=name, messages=msgs, max_tokens=24, temperature=0)
    assert "Paris" in r.choices[0].message.content and r.usage.completion_tokens <= 24
    streamed = oc.chat.completions.create(model=name, messages=msgs, max_tokens=24, temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == r.choices[0].message.content  # same greedy answer, streamed
    c = oc.completions.create(model=name, prompt="The capital of France is", max_tokens=8, temperature=0,
                              extra_body={"ttft_slo": 5.0, "tpot_slo": 1.0})
    assert c.usage.completion_tokens == 8 and c.choices[0].finish_reason == "length"
    metrics = httpx.get(url + "/metrics").text
    assert "flowyard:time_to_first_token_seconds_count" in metrics
    assert "flowyard:slo_attained_total" in metrics
    threads = [ln for ln in metrics.splitlines() if ln.startswith("flowyard:engine_cpu_threads{")]
    assert len(threads) == 1 and 1 <= float(threads[0].rsplit(" ", 1)[1]) <= (os.cpu_count() or 1)
    assert wait_idle(engine) and engine.kv.num_used_blocks == 0


def test_disconnect_mid_stream_frees_kv(server):
    engine, _, url = server
    body = {"messages": [{"role": "user", "content": "Count from one to one hundred."}],
            "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=30) as hc:
        with hc.stream("POST", url + "/v1/chat/completions", json=body) as r:
            lines = r.iter_lines()
            for _ in range(6):
                next(lines)
            assert engine.has_unfinished()
    assert wait_idle(engine), "the aborted request kept running"
    assert engine.kv.num_used_blocks == 0 and not engine.kv.leaked()


def test_bad_requests_get_4xx_not_500(server):
    _, _, url = server
    cases = [
        ({"messages": []}, 400),
        ({"messages": [{"role": "user", "content": "x" * 60_000}]}, 400),  # longer than the context
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}, 400),
        ({"messages": [{"role": "user", "content": "hi"}], "model": "gpt-4"}, 404),
    ]
    for body, status in cases:
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == status, (body, r.text)
        assert r.json()["error"]["message"]
    assert httpx.post(url + "/v1/chat/completions", content=b"{oops", timeout=5).status_code == 400
