"""Hostile input against the real app (embedded SmolLM2 behind AsyncLLMEngine, uvicorn):
no body, however malformed, gets a 5xx, every error is an OpenAI-style JSON body, the
keep-alive connection stays usable after every 4xx, and the server is healthy afterwards.

Known cases first (issue 29: a lone surrogate in a JSON string was a 500 TypeError from the
tokenizer and reset the connection; deep nesting was a 500 RecursionError), then hypothesis
over the request schemas of every POST endpoint.
"""

from __future__ import annotations

import collections
import http.client
import json
from urllib.parse import urlparse

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers_server import serving
from flowyard.engine.async_engine import AsyncLLMEngine
from flowyard.engine.engine_config import EngineConfig
from flowyard.engine.llm_engine import LLMEngine
from flowyard.server.app import build_app
from flowyard.server.jsoncheck import MAX_JSON_DEPTH
from flowyard.server.protocol import ChatCompletionRequest, CompletionRequest
from flowyard.server.tokenize import DetokenizeRequest, TokenizeRequest

MAX_BODY = 64 * 1024
ENDPOINTS = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest,
             "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}


class Conn:
    """One keep-alive HTTP/1.1 connection that fails loudly if the server drops it."""

    def __init__(self, url: str) -> None:
        u = urlparse(url)
        self.c = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
        self.c.connect()

    def request(self, method: str, path: str, body: bytes | None = None,
                headers: dict | None = None) -> tuple[int, bytes, http.client.HTTPResponse]:
        sock = self.c.sock
        self.c.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        r = self.c.getresponse()
        data = r.read()
        assert self.c.sock is sock and not r.will_close, f"{path}: the server closed the connection ({r.status})"
        return r.status, data, r

    def close(self) -> None:
        self.c.close()


@pytest.fixture(scope="module")
def server():
    engine = LLMEngine.from_path(None, EngineConfig(kv_cache_memory_mb=64, max_waiting=8))
    client = AsyncLLMEngine(engine)
    # default_max_tokens=2 keeps every accepted request short on a CPU
    with serving(build_app(client, max_body_bytes=MAX_BODY, default_max_tokens=2), timeout=30) as url:
        yield url
    client.shutdown()


def _check(status: int, data: bytes, what: object) -> None:
    assert status < 500, (what, status, data[:500])
    if status >= 400:
        err = json.loads(data)["error"]
        assert err["message"] and err["type"], (what, data)


def _healthy(conn: Conn) -> None:
    status, data, _ = conn.request("GET", "/health")
    assert status == 200, data
    body = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}).encode()
    status, data, _ = conn.request("POST", "/v1/chat/completions", body)
    assert status == 200 and json.loads(data)["choices"][0]["finish_reason"] in ("length", "stop"), data


def raw(obj: object) -> bytes:
    return json.dumps(obj).encode()  # ensure_ascii: a lone surrogate travels as "\ud800"


NEST = MAX_JSON_DEPTH + 1
KNOWN: list[tuple[str, bytes, int, str]] = [
    ("/v1/chat/completions", raw({"messages": [{"role": "user", "content": "a\ud800b"}]}), 400, "invalid_unicode"),
    ("/v1/chat/completions", raw({"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]}),
     400, "invalid_unicode"),
    ("/v1/completions", raw({"prompt": "\ud800"}), 400, "invalid_unicode"),
    ("/v1/completions", raw({"prompt": "hi", "stop": ["\udc00"]}), 400, "invalid_unicode"),
    ("/v1/completions", raw({"prompt": "hi", "\ud800": 1}), 400, "invalid_unicode"),
    ("/tokenize", raw({"prompt": "x\ud83d"}), 400, "invalid_unicode"),
    ("/tokenize", raw({"messages": [{"role": "user", "content": "\ud800"}]}), 400, "invalid_unicode"),
    ("/v1/chat/completions", b"[" * 30_000 + b"]" * 30_000, 400, "invalid_json"),
    ("/v1/completions", b'{"prompt": ' + b"[" * 20_000 + b"]" * 20_000 + b"}", 400, "invalid_json"),
    ("/v1/completions", raw({"prompt": "hi", "response_format": json.loads("[" * NEST + "]" * NEST)}),
     400, "invalid_json"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": NaN}', 400, "invalid_value"),
    ("/v1/completions", b"\xff\xfe{}", 400, "invalid_json"),
    ("/v1/completions", b"", 400, "invalid_json"),
    ("/v1/completions", b"null", 400, "invalid_json"),
    ("/v1/completions", raw({"prompt": "x" * (MAX_BODY + 10)}), 413, "request_too_large"),
    ("/detokenize", raw({"tokens": [10**30]}), 400, None),
    ("/detokenize", raw({"tokens": [2**40]}), 400, None),
]


def test_known_hostile_bodies_are_4xx_and_keep_the_connection(server):
    conn = Conn(server)
    try:
        for path, body, status, code in KNOWN:
            got, data, _ = conn.request("POST", path, body)
            _check(got, data, (path, body[:80]))
            assert got == status, (path, body[:80], data[:300])
            if code is not None:
                assert json.loads(data)["error"]["code"] == code, (path, data[:300])
            _healthy(conn)  # the same connection serves the next request
    finally:
        conn.close()


# ---- hypothesis over the schemas ---------------------------------------------------------------

text = st.text(st.characters() | st.characters(categories=["Cs"]), max_size=12)
leaf = (st.none() | st.booleans() | st.integers(-3, 4)
        | st.sampled_from([2**31, 2**63, 2**64, -(2**63) - 1, 10**30]) | st.floats(width=32) | text)
value = st.recursive(leaf, lambda c: st.lists(c, max_size=4) | st.dictionaries(text, c, max_size=4), max_leaves=10)
role = st.sampled_from(["system", "user", "assistant", "tool", "developer", "robot"]) | value
message = st.fixed_dictionaries({"role": role}, optional={"content": text | value, "name": value})
messages = st.lists(message | value, min_size=0, max_size=3) | value
prompt = text | st.lists(st.integers(-2, 60_000), max_size=6) | value
REQUIRED = {"/v1/chat/completions": {"messages": messages}, "/v1/completions": {"prompt": prompt},
            "/tokenize": {}, "/detokenize": {"tokens": st.lists(st.integers(-2, 60_000), max_size=6) | value}}


def body_for(path: str) -> st.SearchStrategy[dict]:
    fields = ENDPOINTS[path].model_fields
    optional = {f: value for f in fields if f not in REQUIRED[path]}
    if path == "/tokenize":
        optional.update(prompt=prompt, messages=messages)
    return st.fixed_dictionaries(REQUIRED[path], optional=optional)


SEEN: collections.Counter = collections.Counter()  # status codes the fuzzing got
VALID = {"/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}]},
         "/v1/completions": {"prompt": "Say hi"}, "/tokenize": {"prompt": "Hi"}, "/detokenize": {"tokens": [42]}}


def one_field(path: str) -> st.SearchStrategy[dict]:
    """A valid body with one field fuzzed: what reaches the engine's own checks."""
    names = sorted(set(ENDPOINTS[path].model_fields) | {"prompt", "messages"})
    return st.tuples(st.sampled_from(names), value).map(lambda kv: {**VALID[path], kv[0]: kv[1]})


bodies = st.sampled_from(sorted(ENDPOINTS)).flatmap(
    lambda p: st.tuples(st.just(p), body_for(p) | one_field(p)))


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=bodies)
def test_fuzzed_bodies_never_get_a_5xx(server, case):
    path, body = case
    conn = Conn(server)
    try:
        status, data, _ = conn.request("POST", path, raw(body))
        _check(status, data, (path, body))
        SEEN[status] += 1
        status, data, _ = conn.request("GET", "/v1/models")  # the connection survived the answer
        assert status == 200
    finally:
        conn.close()


def test_healthy_after_the_fuzzing(server):
    if SEEN:  # the fuzzing reached the engine, not only the validators
        print(dict(SEEN))
        assert SEEN[200] > 0 and sum(v for k, v in SEEN.items() if k >= 400) > 0
    conn = Conn(server)
    try:
        _healthy(conn)
    finally:
        conn.close()
