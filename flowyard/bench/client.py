"""Async HTTP client for OpenAI-compatible servers: one streaming request, timed per chunk.

`flowyard bench` must measure any server (ours, vLLM, SGLang), so this module speaks only the
public OpenAI wire format: POST a JSON body with `stream: true`, read the SSE `data:` lines,
time every chunk that carries generated text, and take the token counts from the final
`usage` chunk (`stream_options.include_usage`). Timing follows `vllm bench serve`: the clock
starts when the request is sent and a timestamp is taken when each chunk is read, so TTFT and
ITL include the network and HTTP overhead a real client sees.

A request never raises: every failure (HTTP status, timeout, refused connection, a stream
that ends without a token) becomes `RequestOutput.error`, so one bad request cannot stop a
load test, and the report can count and list them.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

MAX_ERROR_BODY = 300  # characters of an error response kept in the message


class BenchError(Exception):
    """A problem that stops the whole benchmark (server down, no model): one line for the CLI."""


@dataclass(slots=True)
class RequestOutput:
    """What one streamed request measured. Times are `time.perf_counter()` seconds.

    token_times: read time of every chunk that carried generated text (one per token on
    servers that stream token by token). prompt_tokens/completion_tokens: the server's
    `usage`, None when it sent none. kind: "" on success, else "http", "timeout", "connect",
    "protocol" or "other", so callers can tell a refusal (HTTP) from a broken transport.
    """

    start: float = 0.0
    token_times: list[float] = field(default_factory=list)
    text: str = ""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    status_code: int | None = None
    error: str = ""
    kind: str = ""

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.start if self.token_times else None


def api_root(base_url: str) -> str:
    """'http://h:8000', 'http://h:8000/' and 'http://h:8000/v1' all → 'http://h:8000/v1'.

    vLLM takes a bare host URL and OpenAI clients take one ending in /v1; accept both."""
    url = base_url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"base URL must start with http:// or https://, got {base_url!r}")
    return url if url.endswith("/v1") else url + "/v1"


def auth_headers(api_key: str | None) -> dict[str, str]:
    """Bearer header from `api_key`, else from $OPENAI_API_KEY (as vLLM's client does)."""
    key = api_key or os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def make_client(max_concurrency: int | None = None) -> httpx.AsyncClient:
    """One pooled client for the whole run. httpx caps a pool at 100 connections by default,
    which would silently cap the offered load, so the pool is unbounded unless the benchmark
    itself limits concurrency. Per-request deadlines are applied by `stream_request`."""
    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(None))


def describe_exception(e: BaseException, timeout: float) -> tuple[str, str]:
    """(kind, one-line message) for a transport-level failure."""
    if isinstance(e, (asyncio.TimeoutError, httpx.TimeoutException)):
        return "timeout", f"timeout: no complete response within {timeout:g} s"
    if isinstance(e, httpx.ConnectError):
        return "connect", f"cannot connect: {_root_cause(e)}"
    if isinstance(e, (httpx.RemoteProtocolError, httpx.ReadError)):
        return "protocol", f"connection broken mid-response: {e or type(e).__name__}"
    return "other", f"{type(e).__name__}: {e}"


def _root_cause(e: BaseException) -> str:
    """The OS-level reason behind an httpx ConnectError ("connection refused", "name or
    service not known"), which httpx hides behind "All connection attempts failed"."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, ConnectionRefusedError):
            return "connection refused"
        if isinstance(cur, OSError) and cur.strerror:
            return cur.strerror.lower()
        cur = cur.__cause__ or cur.__context__
    return str(e) or type(e).__name__


def _error_message(status: int, body: bytes) -> str:
    """'HTTP 429: <message>' from an OpenAI-style or FastAPI-style JSON error body."""
    text = body.decode("utf-8", "replace").strip()
    try:
        obj = json.loads(text)
        err = obj.get("error", obj.get("detail", obj)) if isinstance(obj, dict) else obj
        if isinstance(err, dict):
            err = err.get("message", err)
        text = err if isinstance(err, str) else json.dumps(err)
    except (json.JSONDecodeError, AttributeError):
        pass
    text = " ".join(text.split())[:MAX_ERROR_BODY]
    return f"HTTP {status}: {text}" if text else f"HTTP {status}"


def _chunk_text(choice: dict[str, Any]) -> str | None:
    """Generated text of one streamed choice, or None when the chunk carries no token.

    Chat servers send a first chunk with only `role` and a last one with only
    `finish_reason`; counting those as tokens (as vllm bench does for the role chunk) would
    shorten TTFT and add a ~0 ITL, so they are skipped. A token whose text is empty (a special
    or partial-UTF-8 token) still counts when nothing else marks the chunk as framing."""
    delta = choice.get("delta")
    if isinstance(delta, dict):  # chat
        text = delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
        if text:
            return text
        framing = "role" in delta or choice.get("finish_reason") is not None
        return None if framing or delta.get("content") is None else ""
    text = choice.get("text")  # completions
    if text:
        return text
    return None if text is None or choice.get("finish_reason") is not None else ""


async def stream_request(client: httpx.AsyncClient, url: str, payload: dict[str, Any], *,
                         headers: dict[str, str] | None = None, timeout: float = 300.0
                         ) -> RequestOutput:
    """POST `payload` to `url` and consume the SSE stream; never raises (see RequestOutput).

    `timeout` bounds the whole request, connection to last byte, so a stalled server cannot
    hold the benchmark open."""
    out = RequestOutput(start=time.perf_counter())
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", url, json=payload, headers=headers) as resp:
                out.status_code = resp.status_code
                if resp.status_code != 200:
                    out.kind, out.error = "http", _error_message(resp.status_code, await resp.aread())
                    return out
                await _consume(resp, out)
    except Exception as e:  # noqa: BLE001 - every failure becomes a counted error
        out.kind, out.error = describe_exception(e, timeout)
        return out
    if not out.token_times and not out.error:
        out.kind, out.error = "protocol", "stream ended without any generated token"
    return out


async def _consume(resp: httpx.Response, out: RequestOutput) -> None:
    parts: list[str] = []
    finish_at: float | None = None  # when a choice carried finish_reason (maybe with the last token)
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue  # blank separators, SSE comments (": ping"), event:/id: fields
        data = line[5:].strip()
        if data == "[DONE]":
            break
        now = time.perf_counter()
        try:
            obj = json.loads(data)
        except json.JSONDecodeError:
            out.kind, out.error = "protocol", f"invalid JSON in stream: {data[:80]!r}"
            return
        if not isinstance(obj, dict):
            continue
        if "error" in obj and not obj.get("choices"):  # error reported inside the stream
            err = obj["error"]
            msg = err.get("message", err) if isinstance(err, dict) else err
            out.kind, out.error = "http", f"error in stream: {msg}"
            return
        for choice in obj.get("choices") or []:
            if isinstance(choice, dict) and choice.get("finish_reason") is not None and finish_at is None:
                finish_at = now
            text = _chunk_text(choice) if isinstance(choice, dict) else None
            if text is not None:
                out.token_times.append(now)
                parts.append(text)
                break
        usage = obj.get("usage")
        if isinstance(usage, dict):
            if isinstance(usage.get("prompt_tokens"), int):
                out.prompt_tokens = usage["prompt_tokens"]
            if isinstance(usage.get("completion_tokens"), int):
                out.completion_tokens = usage["completion_tokens"]
    if not out.token_times and finish_at is not None and (out.completion_tokens or 0) >= 1:
        # one token whose text is empty (a special token), sent with finish_reason, so it
        # looked like framing: the server's usage says it was generated, then
        out.token_times.append(finish_at)
    out.text = "".join(parts)


async def list_models(client: httpx.AsyncClient, base_url: str, *,
                      headers: dict[str, str] | None = None, timeout: float = 30.0) -> list[str]:
    """Model ids from GET /v1/models. Also the benchmark's reachability check: a server that
    is down raises BenchError with one line saying so. A server without /v1/models (404)
    gives an empty list, so a run with an explicit --model still proceeds."""
    url = api_root(base_url) + "/models"
    try:
        resp = await asyncio.wait_for(client.get(url, headers=headers), timeout)
    except Exception as e:  # noqa: BLE001
        _, msg = describe_exception(e, timeout)
        raise BenchError(f"server at {base_url} is not reachable ({msg})") from None
    if resp.status_code == 404:
        return []
    if resp.status_code != 200:
        raise BenchError(f"GET {url} failed: {_error_message(resp.status_code, resp.content)}")
    try:
        data = resp.json().get("data") or []
        return [str(m["id"]) for m in data if isinstance(m, dict) and "id" in m]
    except (ValueError, AttributeError):
        raise BenchError(f"GET {url} did not return an OpenAI model list") from None


__all__ = ["BenchError", "RequestOutput", "api_root", "auth_headers", "describe_exception",
           "list_models", "make_client", "stream_request"]
