"""Turning a `Generation` into an HTTP answer: one JSON body, or SSE chunks.

Streaming shape follows OpenAI and vLLM: chat sends a first chunk with `delta.role`, then
content deltas, the last of which carries `finish_reason` (an empty delta when the last
output had no text), each with its tokens' `logprobs` when asked for, then (stream_options.
include_usage) a chunk with empty `choices` and `usage`, then `data: [DONE]`. Completions
send `text_completion` chunks the same way. An engine failure after the headers are out is
reported as a `data: {"error": ...}` event followed by `[DONE]` (what vLLM does), since the
status code can no longer change.
"""

from __future__ import annotations

import json
import logging
from typing import Any, AsyncIterator, Awaitable, Callable

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from flowyard.engine.sampling import RequestOutput
from flowyard.server.errors import APIError, error_body, server_error
from flowyard.server.logprobs import LogprobFormatter, merge
from flowyard.server.protocol import (AssistantMessage, ChatChoice, ChatCompletionResponse,
                                      CompletionChoice, CompletionResponse, UsageInfo)
from flowyard.server.serving import Generation

log = logging.getLogger("flowyard.server")


def usage(gen: Generation, completion_tokens: int) -> UsageInfo:
    p = len(gen.p.prompt_ids)
    return UsageInfo(prompt_tokens=p, completion_tokens=completion_tokens, total_tokens=p + completion_tokens)


class _Acc:
    """Accumulates text, token count and finish reason over a request's outputs."""

    def __init__(self, fmt: LogprobFormatter | None = None) -> None:
        self.fmt = fmt  # set when the request asked for log-probabilities
        self.logprobs: list[dict] = []  # formatted, one object per output
        self.text: list[str] = []
        self.tokens = 0
        self.reported_tokens = 0
        self.finish_reason: str | None = None
        self.error: str | None = None

    def add(self, out: RequestOutput) -> dict | None:
        """Take one output; return its formatted log-probabilities (None if not asked)."""
        lp = self.fmt.format(out.new_token_ids, out.logprobs) if self.fmt is not None else None
        if lp is not None:
            self.logprobs.append(lp)
        self.text.append(out.new_text)
        self.tokens += len(out.new_token_ids)
        self.reported_tokens = max(self.reported_tokens, out.completion_tokens)
        if out.finished:
            self.finish_reason = out.finish_reason or ("error" if out.error else "stop")
            self.error = out.error if (out.error or out.finish_reason == "error") else None
            if self.finish_reason == "error" and self.error is None:
                self.error = "the engine reported an error"
        return lp

    @property
    def completion_tokens(self) -> int:
        # the engine's cumulative count when it gives one, else what we saw stream by
        return self.reported_tokens or self.tokens


def _formatter(kind: str, gen: Generation) -> LogprobFormatter | None:
    n = gen.p.params.logprobs
    return None if n is None else LogprobFormatter(gen.engine.tokenizer, kind, n)


async def collect(gen: Generation, first: RequestOutput | None, kind: str = "cmpl") -> _Acc:
    acc = _Acc(_formatter(kind, gen))
    out = first
    while out is not None:
        acc.add(out)
        if out.finished:
            break
        out = await gen.next()
    if acc.finish_reason is None:
        acc.finish_reason = "stop"  # engine stream ended without a finished flag
    return acc


def full_response(kind: str, gen: Generation, acc: _Acc) -> dict[str, Any]:
    if acc.error is not None:
        raise APIError(500, f"the engine failed on this request: {acc.error}", code="engine_error")
    p, text, u = gen.p, "".join(acc.text), usage(gen, acc.completion_tokens)
    if kind == "chat":
        return ChatCompletionResponse(
            id=p.request_id, created=p.created, model=p.model, usage=u,
            choices=[ChatChoice(index=0, message=AssistantMessage(content=text), finish_reason=acc.finish_reason,
                                logprobs=merge(acc.logprobs))],
        ).model_dump()
    return CompletionResponse(
        id=p.request_id, created=p.created, model=p.model, usage=u,
        choices=[CompletionChoice(index=0, text=text, finish_reason=acc.finish_reason, logprobs=merge(acc.logprobs))],
    ).model_dump()


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


async def sse_events(kind: str, gen: Generation, first: RequestOutput | None) -> AsyncIterator[str]:
    """The SSE body. Exceptions become an error event; cancellation (client gone) propagates."""
    p = gen.p
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

    def chunk(delta_or_text: Any, finish_reason: str | None = None, logprobs: dict | None = None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if kind == "chat":
            choice["delta"] = delta_or_text
        else:
            choice["text"] = delta_or_text
        choice.update(logprobs=logprobs, finish_reason=finish_reason)
        c: dict[str, Any] = {"id": p.request_id, "object": obj, "created": p.created, "model": p.model,
                             "choices": [choice]}
        if p.include_usage:
            c["usage"] = None
        return c

    acc = _Acc(_formatter(kind, gen))
    try:
        if kind == "chat":
            yield _sse(chunk({"role": "assistant", "content": ""}))
        out, last_text, last_lp = first, "", None
        while out is not None:
            lp = acc.add(out)
            if out.finished:  # its text goes out with the finish reason, below
                last_text, last_lp = out.new_text, lp
                break
            if out.new_text or lp:
                yield _sse(chunk({"content": out.new_text} if kind == "chat" else out.new_text, logprobs=lp))
            out = await gen.next()
        if acc.error is not None:
            if last_text:
                yield _sse(chunk({"content": last_text} if kind == "chat" else last_text, logprobs=last_lp))
            yield _sse(error_body(f"the engine failed on this request: {acc.error}", "server_error",
                                  code="engine_error"))
        else:
            # As vLLM does: the last token's chunk carries the finish reason (a separate empty
            # chunk would count as one more token interval in clients that time every chunk).
            delta = {"content": last_text} if last_text else {}
            yield _sse(chunk(delta if kind == "chat" else last_text, acc.finish_reason or "stop", last_lp))
            if p.include_usage:
                final = {"id": p.request_id, "object": obj, "created": p.created, "model": p.model,
                         "choices": [], "usage": usage(gen, acc.completion_tokens).model_dump()}
                yield _sse(final)
    except APIError as e:
        gen.failed()
        yield _sse(e.body())
    except Exception as e:
        log.exception("engine failed while streaming %s", p.request_id)
        gen.failed()
        yield _sse(server_error(e).body())
    yield "data: [DONE]\n\n"


class SSEResponse(StreamingResponse):
    """StreamingResponse that always listens for the client hanging up (whatever ASGI spec
    version the server announces) and always runs `on_close` afterwards, shielded, so that an
    unfinished request is aborted in the engine exactly when the client goes away, even if
    the engine is silent at that moment."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], Awaitable[None]],
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def listen() -> None:
                    await self.listen_for_disconnect(receive)
                    tg.cancel_scope.cancel()

                tg.start_soon(listen)
                try:
                    await self.stream_response(send)
                except OSError:  # uvicorn's ClientDisconnected on send to a closed socket
                    pass
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    try:
                        await aclose()
                    except Exception:
                        log.exception("error closing an SSE body")
                await self._on_close()
