"""The lifetime of one engine request (the body was made into one by `prepare.py`).

`Generation` owns one `engine.generate` stream: it records metrics and guarantees
that a request which did not finish is aborted in the engine however the HTTP side ends
(client gone, exception, cancellation).
"""

from __future__ import annotations

import logging
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

import anyio
from fastapi import Request

from flowyard.engine.protocol import EngineClient, EngineUnavailableError, QueueFullError
from flowyard.engine.sampling import RequestOutput
from flowyard.server.errors import APIError, unavailable
from flowyard.server.metrics import RequestMetrics, ServerMetrics
from flowyard.server.prepare import Prepared

log = logging.getLogger("flowyard.server")

#: How long the server waits for engine.abort / generator close before giving up on it.
CLEANUP_TIMEOUT_S = 5.0

T = TypeVar("T")


class Generation:
    """One running engine request. `next()` yields outputs (None at the end); `close()` must
    be called in a `finally`: it closes the engine's iterator and aborts the request in the
    engine unless it finished, shielded from cancellation and bounded in time."""

    def __init__(self, engine: EngineClient, metrics: ServerMetrics, p: Prepared, arrival: float) -> None:
        self.engine, self.p = engine, p
        self.rm: RequestMetrics = metrics.start(len(p.prompt_ids), p.slo, arrival)
        self.finished = False
        self._it: AsyncIterator[RequestOutput] | None = None
        self._closed = False
        self._seen = False  # any output received yet

    def start(self) -> None:
        try:
            self._it = aiter(self.engine.generate(self.p.request_id, self.p.prompt_ids, self.p.params, slo=self.p.slo,
                                                     **self.p.routing))
        except QueueFullError as e:
            self.finished = True  # never queued: nothing to abort
            raise queue_full(e) from None
        except EngineUnavailableError as e:
            self.finished = True
            self.rm.finish("error")
            raise unavailable(e) from None
        except ValueError as e:  # the engine's own input validation (vLLM answers these 400)
            self.finished = True
            raise rejected(e) from None

    async def next(self) -> RequestOutput | None:
        assert self._it is not None, "start() first"
        if self.finished:
            return None
        try:
            out = await anext(self._it)
        except StopAsyncIteration:
            self.finished = True
            self.rm.finish("stop")
            return None
        except EngineUnavailableError as e:  # its instance died, or none can take it: retryable
            self.finished = True
            self.rm.finish("error")
            raise unavailable(e) from None
        except (QueueFullError, ValueError) as e:
            if self._seen:  # mid-stream failures are engine errors, not bad input
                raise
            # engines written as async generators refuse a request on its first step
            self.finished = True
            self.rm.done = True
            raise (queue_full(e) if isinstance(e, QueueFullError) else rejected(e)) from None
        self._seen = True
        self.rm.on_output(out)
        if out.finished:
            self.finished = True
            self.rm.finish(out.finish_reason or ("error" if out.error else "stop"))
        return out

    def failed(self) -> None:
        """Record an engine failure (so close() does not count it as a client abort)."""
        self.rm.finish("error")

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            aclose = getattr(self._it, "aclose", None)
            if aclose is not None:
                await _bounded(aclose, "closing the engine stream of " + self.p.request_id)
            if not self.finished:
                self.rm.finish("abort")
                await _bounded(lambda: self.engine.abort(self.p.request_id), "engine.abort " + self.p.request_id)


def queue_full(e: Exception) -> APIError:
    """Overload is the server's state, not the client's fault: 503 + Retry-After, which load
    balancers and retrying clients act on (the same answer as an instance's death), rather
    than 429, which OpenAI clients read as the caller's own rate limit."""
    detail = str(e) or "the engine's request queue is full"
    return APIError(503, f"Server is overloaded: {detail}; retry later", code="queue_full",
                    headers={"Retry-After": "1"})


def rejected(e: Exception) -> APIError:
    return APIError(400, f"the engine rejected the request: {e}", code="invalid_request")


async def _bounded(fn: Callable[[], Awaitable[Any]], what: str) -> None:
    """Run a cleanup step; log (never raise) if it fails or hangs."""
    try:
        with anyio.fail_after(CLEANUP_TIMEOUT_S):
            await fn()
    except Exception:
        log.exception("error while %s", what)


async def until_disconnect(request: Request, fn: Callable[[], Awaitable[T]]) -> tuple[bool, T | None]:
    """Run `fn` while watching the connection; returns (disconnected, result). A client that
    hangs up cancels `fn` (which the caller's `finally` turns into an engine abort). The
    body must have been read already: the watcher consumes ASGI receive messages."""
    result: T | None = None
    error: BaseException | None = None
    disconnected = False
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            nonlocal disconnected
            while (await request.receive())["type"] != "http.disconnect":
                pass
            disconnected = True
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        try:
            result = await fn()
        except Exception as e:  # re-raised outside the task group, unwrapped
            error = e
        tg.cancel_scope.cancel()
    if error is not None:
        raise error
    return disconnected, result
