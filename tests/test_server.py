"""HTTP server tests against a fake EngineClient: error table, happy paths, streaming,
metrics, API key, overload (503), client disconnects, and a live uvicorn + official `openai` client."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import anyio
import httpx
import pytest
from fastapi.testclient import TestClient

from flowyard.core.request import SLO
from flowyard.engine.protocol import EngineStats, QueueFullError
from flowyard.engine.sampling import RequestOutput, SamplingParams
from flowyard.server import build_app
from flowyard.server.errors import ERROR_TYPES

REPLY = "Hello, world! How are you?"


class FakeTokenizer:
    """One token per character (id = code point); BOS = 1 when special tokens are added."""

    eos_token_ids = (0,)
    vocab_size = 0x110000

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([1] if add_special_tokens else []) + [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids if i > 1)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if any(m["role"] == "tool" for m in messages):
            raise ValueError("tool messages are not supported by this template")
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


class FakeEngine:
    """Deterministic EngineClient: streams REPLY one character per token, `delay` apart.

    Applies max_tokens, stop strings and stop_token_ids; bounded queue (`max_queue` active
    requests) raising QueueFullError at generate() or, with lazy_queue_error, on first step;
    `fail` = "raise" (exception after 2 tokens), "error" (an error output) or "reject"
    (ValueError from generate(), the engine's own input validation)."""

    model_name = "fake-model"

    def __init__(self, delay: float = 0.0, first_delay: float = 0.0, max_queue: int = 64,
                 max_model_len: int = 256, fail: str | None = None, lazy_queue_error: bool = False) -> None:
        self.tokenizer = FakeTokenizer()
        self.delay, self.first_delay, self.max_queue = delay, first_delay, max_queue
        self.max_model_len, self.fail, self.lazy_queue_error = max_model_len, fail, lazy_queue_error
        self.calls: list[tuple[str, list[int], SamplingParams, SLO | None]] = []
        self.routing: list[dict] = []  # session/task/priority hints the server passed
        self.active: set[str] = set()
        self.aborted: list[str] = []
        self.closed_early: list[str] = []
        self.healthy = True

    def generate(self, request_id, prompt_ids, params, slo=None, **routing):
        self.calls.append((request_id, list(prompt_ids), params, slo))
        self.routing.append(routing)
        if self.fail == "reject":
            raise ValueError("token id 99999 is not in the vocabulary")
        if len(self.active) >= self.max_queue:
            if self.lazy_queue_error:
                return self._refuse()
            raise QueueFullError(f"{self.max_queue} requests already queued")
        self.active.add(request_id)
        return self._run(request_id, prompt_ids, params)

    async def _refuse(self):
        raise QueueFullError("queue full")
        yield  # pragma: no cover

    async def _run(self, rid: str, prompt_ids: list[int], params: SamplingParams):
        reply, reason = REPLY, "stop"
        cuts = [reply.find(s) for s in params.stop if s in reply]
        cuts += [i for i, c in enumerate(reply) if ord(c) in params.stop_token_ids]
        if cuts:
            reply = reply[: min(cuts)]
        if len(reply) > params.max_tokens:
            reply, reason = reply[: params.max_tokens], "length"
        done = False
        try:
            await asyncio.sleep(self.first_delay)
            if self.fail == "error":
                done = True
                yield RequestOutput(rid, finished=True, finish_reason="error", error="kaput")
                return
            for i, ch in enumerate(reply):
                if i:
                    await asyncio.sleep(self.delay)
                if self.fail == "raise" and i == 2:
                    raise RuntimeError("engine exploded")
                last = i == len(reply) - 1
                done = last
                lps = None if params.logprobs is None else [{ord(ch): -0.25, ord(ch) + 1: -1.5}]
                yield RequestOutput(rid, [ord(ch)], ch, last, reason if last else None,
                                    len(prompt_ids), i + 1, logprobs=lps)
            if not reply:
                done = True
                yield RequestOutput(rid, finished=True, finish_reason=reason, prompt_tokens=len(prompt_ids))
        finally:
            if not done:
                self.closed_early.append(rid)
            self.active.discard(rid)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.active.discard(request_id)

    def stats(self) -> EngineStats:
        return EngineStats(num_running=len(self.active), num_waiting=0, kv_usage=0.25, healthy=self.healthy)


def chat_body(**kw) -> dict:
    return {"model": "fake-model", "messages": [{"role": "user", "content": "Hi"}], **kw}


def cmpl_body(**kw) -> dict:
    return {"model": "fake-model", "prompt": "Say hi", **kw}


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def client(engine: FakeEngine) -> TestClient:
    return TestClient(build_app(engine), raise_server_exceptions=False)


def sse(text: str) -> list:
    """Parse an SSE body into JSON objects, with '[DONE]' kept as the string."""
    assert text.endswith("data: [DONE]\n\n"), text[-200:]
    events = [e for e in text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    return [e[6:] if e == "data: [DONE]" else json.loads(e[6:]) for e in events]


# ---- bad input: status, error type, code/param; never a 500 -------------------------------

C, P = "/v1/chat/completions", "/v1/completions"
BIG = 5 * 1024 * 1024
BAD = [
    # (id, method, path, body (dict | bytes | None), status, code, param)
    ("malformed-json", "POST", C, b'{"model": "fake-model", "messages": [', 400, "invalid_json", None),
    ("not-utf8", "POST", C, b"\xff\xfe{}", 400, "invalid_json", None),
    ("json-not-object", "POST", P, b"[1, 2]", 400, "invalid_json", None),
    ("nan-temperature", "POST", P, b'{"prompt": "x", "temperature": NaN}', 400, "invalid_value", "temperature"),
    ("missing-messages", "POST", C, {"model": "fake-model"}, 400, "invalid_value", "messages"),
    ("messages-not-list", "POST", C, chat_body(messages="hi"), 400, "invalid_value", "messages"),
    ("empty-messages", "POST", C, chat_body(messages=[]), 400, "invalid_value", "messages"),
    ("message-no-role", "POST", C, chat_body(messages=[{"content": "x"}]), 400, "invalid_value", "messages.0.role"),
    ("bad-role", "POST", C, chat_body(messages=[{"role": "wizard", "content": "x"}]), 400, None, "messages.0.role"),
    ("image-part", "POST", C, chat_body(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
     400, None, "messages.0.content"),
    ("template-refuses", "POST", C, chat_body(messages=[{"role": "tool", "content": "x"}]), 400, None, "messages"),
    ("missing-prompt", "POST", P, {"model": "fake-model"}, 400, "invalid_value", "prompt"),
    ("prompt-wrong-type", "POST", P, cmpl_body(prompt=5), 400, None, "prompt"),
    ("prompt-float-ids", "POST", P, cmpl_body(prompt=[1.5, 2]), 400, None, "prompt"),
    ("prompt-negative-id", "POST", P, cmpl_body(prompt=[5, -2]), 400, None, "prompt"),
    ("prompt-id-out-of-vocab", "POST", P, cmpl_body(prompt=[0x110000]), 400, None, "prompt"),
    ("prompt-empty-list", "POST", P, cmpl_body(prompt=[]), 400, None, "prompt"),
    ("multiple-prompts", "POST", P, cmpl_body(prompt=["a", "b"]), 400, None, "prompt"),
    ("max-tokens-mistyped", "POST", C, chat_body(max_tokens="abc"), 400, "invalid_value", "max_tokens"),
    ("max-tokens-zero", "POST", C, chat_body(max_tokens=0), 400, "invalid_value", "max_tokens"),
    ("max-tokens-negative", "POST", P, cmpl_body(max_tokens=-3), 400, "invalid_value", "max_tokens"),
    ("max-completion-tokens-zero", "POST", C, chat_body(max_completion_tokens=0), 400, None, "max_completion_tokens"),
    ("unknown-model", "POST", C, chat_body(model="gpt-9"), 404, "model_not_found", "model"),
    ("unknown-model-cmpl", "POST", P, cmpl_body(model="gpt-9"), 404, "model_not_found", "model"),
    ("prompt-too-long", "POST", P, cmpl_body(prompt="x" * 300), 400, "context_length_exceeded", "prompt"),
    ("prompt-fills-context", "POST", P, cmpl_body(prompt=[5] * 256), 400, "context_length_exceeded", "prompt"),
    ("chat-too-long", "POST", C, chat_body(messages=[{"role": "user", "content": "x" * 300}]),
     400, "context_length_exceeded", "messages"),
    ("prompt-plus-max-tokens", "POST", P, cmpl_body(max_tokens=250), 400, "context_length_exceeded", "max_tokens"),
    ("temperature-negative", "POST", C, chat_body(temperature=-0.5), 400, "invalid_value", "temperature"),
    ("top-p-zero", "POST", C, chat_body(top_p=0), 400, "invalid_value", "top_p"),
    ("top-p-above-one", "POST", P, cmpl_body(top_p=1.5), 400, "invalid_value", "top_p"),
    ("top-k-below-minus-one", "POST", P, cmpl_body(top_k=-2), 400, "invalid_value", "top_k"),
    ("min-tokens-over-max", "POST", P, cmpl_body(max_tokens=2, min_tokens=5), 400, "invalid_value", "min_tokens"),
    ("seed-too-big", "POST", P, cmpl_body(seed=2**70), 400, "invalid_value", "seed"),
    ("empty-stop", "POST", C, chat_body(stop=["ok", ""]), 400, None, "stop"),
    ("stop-wrong-type", "POST", C, chat_body(stop=5), 400, None, "stop"),
    ("n-two", "POST", C, chat_body(n=2), 400, "unsupported_parameter", "n"),
    ("top-logprobs-alone", "POST", C, chat_body(top_logprobs=2), 400, "invalid_value", "top_logprobs"),
    ("top-logprobs-21", "POST", C, chat_body(logprobs=True, top_logprobs=21), 400, "invalid_value", "top_logprobs"),
    ("logprobs-negative", "POST", P, cmpl_body(logprobs=-1), 400, "invalid_value", "logprobs"),
    ("echo", "POST", P, cmpl_body(echo=True), 400, "unsupported_parameter", "echo"),
    ("penalty", "POST", P, cmpl_body(presence_penalty=0.5), 400, "unsupported_parameter", "presence_penalty"),
    ("stream-options-no-stream", "POST", C, chat_body(stream_options={"include_usage": True}), 400, None,
     "stream_options"),
    ("slo-negative", "POST", C, chat_body(ttft_slo=-1), 400, "invalid_value", "ttft_slo"),
    ("slo-zero-object", "POST", C, chat_body(slo={"ttft": 0}), 400, "invalid_value", "slo.ttft"),
    ("slo-unknown-key", "POST", C, chat_body(slo={"ttf": 1.0}), 400, "invalid_value", "slo.ttf"),
    ("slo-both-forms", "POST", C, chat_body(slo={"ttft": 1.0}, tpot_slo=0.1), 400, None, "slo"),
    ("body-too-large", "POST", C, b"x" * BIG, 413, "request_too_large", None),
    ("unknown-route", "GET", "/v1/nope", None, 404, "not_found", None),
    ("unknown-route-post", "POST", "/v2/chat", {}, 404, "not_found", None),
    ("wrong-method", "GET", C, None, 405, "method_not_allowed", None),
    ("wrong-method-health", "DELETE", "/health", None, 405, "method_not_allowed", None),
]


AUTH = {"Authorization": "Bearer k"}
BAD += [  # rows that need a particular engine or headers: (..., opts)
    ("api-key-missing", "POST", C, chat_body(), 401, "invalid_api_key", None, {"headers": {}}),
    ("api-key-wrong", "POST", C, chat_body(), 401, "invalid_api_key", None, {"headers": {"Authorization": "Bearer x"}}),
    ("api-key-not-bearer", "GET", "/v1/models", None, 401, "invalid_api_key", None, {"headers": {"Authorization": "k"}}),
    ("queue-full", "POST", C, chat_body(), 503, "queue_full", None, {"engine": {"max_queue": 0}}),
    ("queue-full-stream", "POST", P, cmpl_body(stream=True), 503, "queue_full", None, {"engine": {"max_queue": 0}}),
]


def _slo_headers(**h: str) -> dict:
    return {"headers": {**AUTH, **{k.replace("_", "-"): v for k, v in h.items()}}}


BAD += [  # issue 17: per-request SLOs and priority; a type slip is a 400, never a silent 1 s or 1
    ("priority-bool", "POST", C, chat_body(priority=True), 400, "invalid_value", "priority"),
    ("priority-string", "POST", P, cmpl_body(priority="5"), 400, "invalid_value", "priority"),
    ("priority-fraction", "POST", P, cmpl_body(priority=1.5), 400, "invalid_value", "priority"),
    ("priority-null", "POST", P, cmpl_body(priority=None), 400, "invalid_value", "priority"),
    ("priority-too-big", "POST", C, chat_body(priority=2**31), 400, "invalid_value", "priority"),
    ("slo-bool", "POST", C, chat_body(ttft_slo=True), 400, "invalid_value", "ttft_slo"),
    ("slo-string", "POST", P, cmpl_body(tpot_slo="0.1"), 400, "invalid_value", "tpot_slo"),
    ("slo-object-string", "POST", P, cmpl_body(slo={"tbt": "fast"}), 400, "invalid_value", "slo.tbt"),
    ("slo-header-negative", "POST", C, chat_body(), 400, "invalid_value", "x-slo-ttft-ms",
     _slo_headers(x_slo_ttft_ms="-5")),
    ("slo-header-zero", "POST", P, cmpl_body(), 400, "invalid_value", "x-slo-tpot-ms", _slo_headers(x_slo_tpot_ms="0")),
    ("slo-header-text", "POST", C, chat_body(), 400, "invalid_value", "x-slo-tpot-ms",
     _slo_headers(x_slo_tpot_ms="50ms")),
    ("slo-header-inf", "POST", C, chat_body(), 400, "invalid_value", "x-slo-ttft-ms", _slo_headers(x_slo_ttft_ms="inf")),
    ("slo-header-empty", "POST", P, cmpl_body(), 400, "invalid_value", "x-slo-tbt-ms", _slo_headers(x_slo_tbt_ms="")),
    ("slo-header-contradicts-body", "POST", C, chat_body(ttft_slo=0.5), 400, "invalid_value", "ttft_slo",
     _slo_headers(x_slo_ttft_ms="900")),
]


@pytest.mark.parametrize("row", BAD, ids=[r[0] for r in BAD])
def test_bad_requests(row):
    """Every bad input gets its status and an OpenAI error body; none reaches the engine
    (except the queue-full rows, which the engine refuses) and none is a 500."""
    name, method, path, body, status, code, param, *rest = row
    opts = rest[0] if rest else {}
    engine = FakeEngine(**opts.get("engine", {}))
    client = TestClient(build_app(engine, api_key="k"), raise_server_exceptions=False)
    kw = {"content": body} if isinstance(body, bytes) else ({"json": body} if body is not None else {})
    r = client.request(method, path, headers=opts.get("headers", AUTH), **kw)
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == ERROR_TYPES[status] and status != 500
    if code is not None:
        assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
        assert param.split(".")[0] in err["message"] or err["code"] != "invalid_value"
    assert engine.calls == [] or code == "queue_full"
    assert not engine.active and engine.aborted == []


def test_body_too_large_without_content_length(client):
    def chunks():
        for _ in range(5):
            yield b"x" * (1024 * 1024)

    r = client.post(C, content=chunks())  # chunked transfer: counted while reading
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


@pytest.mark.parametrize("lazy", [False, True])
def test_queue_full_is_503_with_retry_after(lazy):
    """Overload is 503 + Retry-After (what load balancers and retrying clients act on), whether
    the engine refuses in generate() or on the first step of its generator; a stream is
    refused before its headers, so it gets the same status, not a 200 and an error event."""
    engine = FakeEngine(max_queue=0, lazy_queue_error=lazy)
    client = TestClient(build_app(engine), raise_server_exceptions=False)
    for body in (chat_body(), chat_body(stream=True)):
        r = client.post(C, json=body)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.headers["content-type"] == "application/json"
        err = r.json()["error"]
        assert err["type"] == "service_unavailable_error" and err["code"] == "queue_full"
        assert "overloaded" in err["message"]
    assert engine.aborted == [] and len(engine.calls) == 2


def test_engine_value_error_is_400():
    client = TestClient(build_app(FakeEngine(fail="reject")), raise_server_exceptions=False)
    for body in (chat_body(), chat_body(stream=True)):
        r = client.post(C, json=body)
        assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]


@pytest.mark.parametrize("fail", ["raise", "error"])
def test_engine_failure_is_json_500_or_error_event(fail):
    engine = FakeEngine(fail=fail)
    client = TestClient(build_app(engine), raise_server_exceptions=False)
    r = client.post(C, json=chat_body())
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    r = client.post(P, json=cmpl_body(stream=True))
    assert r.status_code == 200
    events = sse(r.text)
    assert events[-2]["error"]["type"] == "server_error" and events[-1] == "[DONE]"
    assert client.get("/health").status_code == 200  # still serving
    assert not engine.active
    t = client.get("/metrics").text
    assert 'request_success_total{finished_reason="error",model_name="fake-model"} 2.0' in t
    assert 'finished_reason="abort"' not in t


# ---- happy paths ---------------------------------------------------------------------------


def chat_prompt_len(content: str = "Hi") -> int:
    return len(FakeTokenizer().apply_chat_template([{"role": "user", "content": content}]))


def test_chat_non_streaming(client, engine):
    r = client.post(C, json=chat_body(max_tokens=50, user="u1"))
    assert r.status_code == 200
    b = r.json()
    assert b["id"].startswith("chatcmpl-") and b["object"] == "chat.completion" and b["model"] == "fake-model"
    assert isinstance(b["created"], int) and r.headers["x-request-id"] == b["id"]
    assert b["choices"] == [{"index": 0, "message": {"role": "assistant", "content": REPLY},
                             "logprobs": None, "finish_reason": "stop"}]
    n = chat_prompt_len()
    assert b["usage"] == {"prompt_tokens": n, "completion_tokens": len(REPLY), "total_tokens": n + len(REPLY)}
    rid, ids, params, slo = engine.calls[0]
    assert rid == b["id"] and ids == FakeTokenizer().encode("<user>Hi\n<assistant>", add_special_tokens=False)
    assert params.max_tokens == 50 and slo is None and not engine.active


def test_finish_reasons_stop_and_length(client, engine):
    b = client.post(C, json=chat_body(max_tokens=5)).json()
    assert b["choices"][0]["message"]["content"] == "Hello" and b["choices"][0]["finish_reason"] == "length"
    assert b["usage"]["completion_tokens"] == 5
    b = client.post(C, json=chat_body(stop="world")).json()
    assert b["choices"][0]["message"]["content"] == "Hello, " and b["choices"][0]["finish_reason"] == "stop"
    b = client.post(P, json=cmpl_body(stop=["How", "!"], stop_token_ids=[ord("w")])).json()
    assert b["choices"][0]["text"] == "Hello, " and b["choices"][0]["finish_reason"] == "stop"
    assert engine.calls[1][2].stop == ("world",) and engine.calls[2][2].stop == ("How", "!")
    assert engine.calls[2][2].stop_token_ids == (ord("w"),)
    # max_completion_tokens wins over max_tokens for chat, as in OpenAI
    client.post(C, json=chat_body(max_tokens=9, max_completion_tokens=3))
    assert engine.calls[3][2].max_tokens == 3


def test_sampling_fields_reach_engine(client, engine):
    client.post(P, json=cmpl_body(temperature=0, top_p=0.5, top_k=0, seed=7, min_tokens=2, ignore_eos=True,
                                  max_tokens=8, unknown_field="ignored"))
    p = engine.calls[0][2]
    assert (p.temperature, p.top_p, p.top_k, p.seed, p.min_tokens, p.ignore_eos, p.max_tokens) == \
        (0.0, 0.5, -1, 7, 2, True, 8)
    client.post(P, json=cmpl_body(top_k=40))
    p = engine.calls[1][2]
    assert (p.top_k, p.temperature, p.top_p) == (40, 1.0, 1.0)


def test_default_max_tokens_fills_context_up_to_cap():
    for max_len, expect in ((64, 64 - 7), (4096, 256)):
        engine = FakeEngine(max_model_len=max_len)
        client = TestClient(build_app(engine))
        assert client.post(P, json=cmpl_body()).status_code == 200  # "Say hi" + BOS = 7 tokens
        assert engine.calls[0][2].max_tokens == expect


def test_completion_prompt_forms(client, engine):
    for prompt, ids in (("Say hi", [1] + [ord(c) for c in "Say hi"]), ([5, 6, 7], [5, 6, 7]),
                        (["ab"], [1, 97, 98]), ([[8, 9]], [8, 9])):
        b = client.post(P, json=cmpl_body(prompt=prompt, max_tokens=4)).json()
        assert b["object"] == "text_completion" and b["id"].startswith("cmpl-")
        assert b["choices"] == [{"index": 0, "text": "Hell", "logprobs": None, "finish_reason": "length"}]
        assert b["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 4, "total_tokens": len(ids) + 4}
        assert engine.calls[-1][1] == ids


def test_chat_streaming_with_usage(client, engine):
    r = client.post(C, json=chat_body(stream=True, stream_options={"include_usage": True}))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    ev = sse(r.text)
    chunks, usage_chunk, done = ev[:-2], ev[-2], ev[-1]
    assert done == "[DONE]"
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert all(c["usage"] is None for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == REPLY
    # as vLLM's: the last token's chunk carries the finish reason (no extra empty chunk)
    assert chunks[-1]["choices"][0] == {"index": 0, "delta": {"content": REPLY[-1]}, "logprobs": None,
                                        "finish_reason": "stop"}
    assert len(chunks) == 1 + len(REPLY)  # the role chunk, then one chunk per token
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    n = chat_prompt_len()
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == {
        "prompt_tokens": n, "completion_tokens": len(REPLY), "total_tokens": n + len(REPLY)}
    assert not engine.active and engine.aborted == []


def test_completion_streaming_without_usage(client, engine):
    r = client.post(P, json=cmpl_body(stream=True, max_tokens=5))
    ev = sse(r.text)
    assert ev[-1] == "[DONE]" and all("usage" not in c for c in ev[:-1])
    assert all(c["object"] == "text_completion" for c in ev[:-1])
    assert "".join(c["choices"][0]["text"] for c in ev[:-1]) == "Hello"
    assert ev[-2]["choices"][0]["finish_reason"] == "length"


def test_slo_fields_reach_engine(client, engine):
    client.post(C, json=chat_body(ttft_slo=0.5, tpot_slo=0.05))
    client.post(P, json=cmpl_body(slo={"ttft": 2.0, "tpot": 0.1, "tbt": 0.2}))
    client.post(P, json=cmpl_body(slo={}))
    assert [c[3] for c in engine.calls] == [SLO(ttft=0.5, tpot=0.05), SLO(ttft=2.0, tpot=0.1, tbt=0.2), None]


def test_slo_headers_merge_with_body_and_priority_reaches_engine(client, engine):
    """Headers are milliseconds, body fields seconds; a header and a body field for different
    objectives combine, the same value in both is fine, and priority 0 (vLLM's default) stays
    out of the routing hints."""
    ok = [client.post(C, json=chat_body(tpot_slo=0.05), headers={"x-slo-ttft-ms": "250"}),
          client.post(P, json=cmpl_body(slo={"ttft": 0.25}), headers={"X-SLO-TTFT-MS": "250", "x-slo-tbt-ms": "1e2"}),
          client.post(P, json=cmpl_body(priority=-3), headers={"x-slo-tpot-ms": " 40 "})]
    assert [r.status_code for r in ok] == [200, 200, 200], [r.text for r in ok]
    assert [c[3] for c in engine.calls] == [SLO(ttft=0.25, tpot=0.05), SLO(ttft=0.25, tbt=0.1), SLO(tpot=0.04)]
    assert engine.routing == [{}, {}, {"priority": -3}]


def test_priority_in_prepared_routing():
    from flowyard.server.protocol import CompletionRequest
    from flowyard.server.prepare import prepare_completion

    eng = FakeEngine()
    hints = [prepare_completion(CompletionRequest(prompt="hi", **kw), eng, "fake-model", 16).routing
             for kw in ({}, {"priority": 7}, {"priority": 1.0, "session_id": "s"})]
    assert hints == [{}, {"priority": 7}, {"session": "s", "priority": 1}]


def test_models_health_and_served_name():
    engine = FakeEngine()
    client = TestClient(build_app(engine, served_model_name="smol"))
    m = client.get("/v1/models").json()
    assert m["object"] == "list" and [d["id"] for d in m["data"]] == ["smol"]
    assert m["data"][0]["object"] == "model" and m["data"][0]["max_model_len"] == 256
    assert client.post(C, json=chat_body(model="smol")).status_code == 200
    assert client.post(C, json=chat_body(model="fake-model")).status_code == 404
    assert client.post(C, json={"messages": [{"role": "user", "content": "x"}]}).json()["model"] == "smol"
    h = client.get("/health")
    assert h.status_code == 200 and h.json()["num_running"] == 0 and h.json()["healthy"] is True
    engine.healthy = False
    assert client.get("/health").status_code == 503 and client.get("/health").json()["healthy"] is False


def test_api_key():
    client = TestClient(build_app(FakeEngine(), api_key="s3cret"))
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "s3cret"}):
        r = client.post(C, json=chat_body(), headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert client.get("/v1/models").status_code == 401
    ok = {"Authorization": "Bearer s3cret"}
    assert client.post(C, json=chat_body(), headers=ok).status_code == 200
    assert client.get("/v1/models", headers=ok).status_code == 200
    assert client.get("/health").status_code == 200 and client.get("/metrics").status_code == 200


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_metrics(client, engine):
    client.post(C, json=chat_body(ttft_slo=60.0, tpot_slo=60.0))
    client.post(P, json=cmpl_body(max_tokens=3, stream=True, slo={"ttft": 1e-9}))
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    t = r.text
    for name in ("time_to_first_token_seconds_bucket", "time_per_output_token_seconds_bucket",
                 "request_time_per_output_token_seconds_count", "e2e_request_latency_seconds_bucket",
                 "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert f"flowyard:{name}{{" in t, name
    n_chat = chat_prompt_len()
    assert metric(t, "flowyard:prompt_tokens_total") == n_chat + 7
    assert metric(t, "flowyard:generation_tokens_total") == len(REPLY) + 3
    assert 'flowyard:request_success_total{finished_reason="stop",model_name="fake-model"} 1.0' in t
    assert 'flowyard:request_success_total{finished_reason="length",model_name="fake-model"} 1.0' in t
    assert metric(t, "flowyard:slo_attained_total") == 1 and metric(t, "flowyard:slo_violated_total") == 1
    assert metric(t, "flowyard:time_to_first_token_seconds_count") == 2
    assert metric(t, "flowyard:kv_cache_usage_perc") == 0.25
    assert metric(t, "flowyard:time_per_output_token_seconds_count") == len(REPLY) - 1 + 2


# ---- client disconnects abort the engine request -------------------------------------------


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def call_asgi(app, path: str, body: dict, *, after_chunks: int | None = None,
                    after_s: float | None = None) -> list[dict]:
    """Drive the ASGI app directly; the client 'hangs up' after N body chunks or S seconds."""
    raw, sent, gone, body_sent = json.dumps(body).encode(), [], anyio.Event(), False

    async def receive() -> dict:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(msg: dict) -> None:
        sent.append(msg)
        if after_chunks is not None and sum(1 for m in sent if m.get("body")) >= after_chunks:
            gone.set()

    async def hang_up_later() -> None:
        await anyio.sleep(after_s)
        gone.set()

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000),
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]}
    async with anyio.create_task_group() as tg:
        if after_s is not None:
            tg.start_soon(hang_up_later)
        with anyio.fail_after(3):
            await app(scope, receive, send)
        tg.cancel_scope.cancel()
    return sent


@pytest.mark.anyio
@pytest.mark.parametrize("case", ["mid-stream", "before-first-token", "non-streaming"])
async def test_disconnect_aborts_engine_request(case):
    engine = FakeEngine(delay=0.05, first_delay=10.0 if case == "before-first-token" else 0.0)
    app = build_app(engine)
    t0 = time.perf_counter()
    if case == "mid-stream":
        sent = await call_asgi(app, C, chat_body(stream=True), after_chunks=3)
        assert sent[0]["status"] == 200
        assert b"[DONE]" not in b"".join(m.get("body", b"") for m in sent)
    else:
        sent = await call_asgi(app, C if case == "non-streaming" else P,
                               chat_body(stream=False) if case == "non-streaming" else cmpl_body(stream=True),
                               after_s=0.1)
        assert sent[0]["status"] == 499
    assert time.perf_counter() - t0 < 1.0  # did not wait for the engine to finish
    rid = engine.calls[0][0]
    assert engine.aborted == [rid] and engine.closed_early == [rid] and not engine.active
    metrics = app.state.flowyard.metrics.render().decode()
    assert 'request_success_total{finished_reason="abort",model_name="fake-model"} 1.0' in metrics


# ---- live server: uvicorn on a free port + the official openai client ---------------------


@pytest.fixture(scope="module")
def live():
    import uvicorn

    engine = FakeEngine(delay=0.001)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(build_app(engine, api_key="k"), log_level="warning", lifespan="off"))
    th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    deadline = time.time() + 5
    while not server.started and time.time() < deadline:
        time.sleep(0.01)
    assert server.started
    yield engine, f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    th.join(5)
    sock.close()


def test_openai_client_against_uvicorn(live):
    import openai

    engine, url = live
    oc = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0, timeout=10)
    assert [m.id for m in oc.models.list()] == ["fake-model"]
    msgs = [{"role": "user", "content": "Hi"}]
    r = oc.chat.completions.create(model="fake-model", messages=msgs, max_tokens=5)
    assert r.choices[0].message.content == "Hello" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5 and r.usage.prompt_tokens == chat_prompt_len()
    chunks = list(oc.chat.completions.create(model="fake-model", messages=msgs, stream=True,
                                             stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == REPLY
    assert chunks[-1].usage.completion_tokens == len(REPLY)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    c = oc.completions.create(model="fake-model", prompt="Say hi", stop=["!"])
    assert c.choices[0].text == "Hello, world" and c.usage.prompt_tokens == 7
    chunks = list(oc.completions.create(model="fake-model", prompt="Say hi", max_tokens=4, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == "Hell" and chunks[-1].choices[0].finish_reason == "length"
    with pytest.raises(openai.NotFoundError):
        oc.chat.completions.create(model="nope", messages=msgs)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        oc.completions.create(model="fake-model", prompt="x", max_tokens=0)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    engine.max_queue = 0
    try:
        with pytest.raises(openai.InternalServerError) as refused:
            oc.chat.completions.create(model="fake-model", messages=msgs)
        assert refused.value.status_code == 503 and refused.value.response.headers["retry-after"] == "1"
        # overload is a 503, which the openai package retries by itself (honouring Retry-After)
        calls = len(engine.calls)
        with pytest.raises(openai.InternalServerError):
            openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=1, timeout=10).chat.completions.create(
                model="fake-model", messages=msgs)
        assert len(engine.calls) == calls + 2
    finally:
        engine.max_queue = 64


def test_live_disconnect_aborts(live):
    engine, url = live
    engine.delay, n_aborted = 0.05, len(engine.aborted)
    try:
        with httpx.Client(timeout=5) as hc:
            with hc.stream("POST", url + C, json=chat_body(stream=True), headers={"Authorization": "Bearer k"}) as r:
                lines = r.iter_lines()
                got = [next(lines) for _ in range(4)]
                assert got[0].startswith("data: {")
        deadline = time.time() + 3
        while len(engine.aborted) == n_aborted and time.time() < deadline:
            time.sleep(0.01)
        assert len(engine.aborted) == n_aborted + 1 and engine.aborted[-1] == engine.calls[-1][0]
        assert not engine.active
    finally:
        engine.delay = 0.001


# ---- /tokenize and /detokenize (vLLM's) -----------------------------------------------------


def test_tokenize_prompt_and_messages_as_the_completion_endpoints_do(client, engine):
    r = client.post("/tokenize", json={"model": "fake-model", "prompt": "Say hi"})
    assert r.status_code == 200
    b = r.json()
    assert b["tokens"] == engine.tokenizer.encode("Say hi", add_special_tokens=True) and b["count"] == len(b["tokens"])
    assert b["max_model_len"] == engine.max_model_len
    client.post(C, json=chat_body())
    r = client.post("/tokenize", json={"messages": chat_body()["messages"]})
    assert r.json()["tokens"] == engine.calls[-1][1]  # what /v1/chat/completions sent the engine
    r = client.post("/detokenize", json={"tokens": b["tokens"]})
    assert r.status_code == 200 and r.json()["prompt"] == engine.tokenizer.decode(b["tokens"])


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {}, "prompt"), ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, None),
    ("/tokenize", {"prompt": "a", "model": "other"}, "model"), ("/detokenize", {"tokens": []}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"), ("/detokenize", {"tokens": ["x"]}, "tokens"),
])
def test_tokenize_bad_input_is_a_clear_error(client, path, body, param):
    r = client.post(path, json=body)
    assert r.status_code in (400, 404), r.text
    err = r.json()["error"]
    assert err["message"]
    if param == "model":
        assert r.status_code == 404


# ---- log-probabilities, in OpenAI's chat and completions shapes -----------------------------


def test_chat_logprobs_whole_and_streamed(client, engine):
    b = client.post(C, json=chat_body(logprobs=True, top_logprobs=2)).json()
    content = b["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == list(REPLY) and engine.calls[-1][2].logprobs == 2
    first = content[0]
    assert first["logprob"] == -0.25 and first["bytes"] == list(REPLY[0].encode())
    assert [t["token"] for t in first["top_logprobs"]] == [REPLY[0], chr(ord(REPLY[0]) + 1)]
    chunks = sse(client.post(C, json=chat_body(logprobs=True, stream=True)).text)[:-1]
    streamed = [t for c in chunks[1:] for t in c["choices"][0]["logprobs"]["content"]]
    assert [t["token"] for t in streamed] == list(REPLY)
    assert all(t["top_logprobs"] == [] for t in streamed)  # top_logprobs defaults to 0
    assert client.post(C, json=chat_body()).json()["choices"][0]["logprobs"] is None


def test_completion_logprobs_legacy_shape(client, engine):
    b = client.post(P, json=cmpl_body(logprobs=1, max_tokens=3)).json()
    lp = b["choices"][0]["logprobs"]
    assert lp["tokens"] == list(REPLY[:3]) and lp["token_logprobs"] == [-0.25] * 3
    assert lp["text_offset"] == [0, 1, 2]
    assert lp["top_logprobs"][0] == {REPLY[0]: -0.25, chr(ord(REPLY[0]) + 1): -1.5}
