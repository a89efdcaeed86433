"""`EngineClient` over an `LLMEngine` running in a background thread.

The engine loop owns the engine: it drains a command queue (add, abort), runs one step when
there is work, and pushes each request's outputs to that request's asyncio queue with
`call_soon_threadsafe`. PyTorch releases the GIL inside its kernels, so the asyncio server
stays responsive while a step runs.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import AsyncIterator

from flowyard.core.request import SLO
from flowyard.engine.llm_engine import LLMEngine
from flowyard.engine.protocol import EngineStats, EngineUnavailableError, QueueFullError
from flowyard.engine.sampling import RequestOutput, SamplingParams

log = logging.getLogger(__name__)


class AsyncLLMEngine:
    """`start=False` leaves the loop to the caller's `run_forever()`: `flowyard serve` runs it on
    the main thread. With the engine on a second thread, libgomp sees more threads than cores
    and throttles its spin-wait, so every oneDNN/OpenMP region wakes its worker through a futex:
    a single-stream decode step took 38-41 ms on a thread against 23.6-26 ms on the main thread
    (2-core VM, SmolLM2 bf16; same slowdown on the main thread with OMP_WAIT_POLICY=passive)."""

    def __init__(self, engine: LLMEngine, max_waiting: int | None = None, start: bool = True) -> None:
        self.engine = engine
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len
        self.tokenizer = engine.tokenizer
        self.max_waiting = max_waiting if max_waiting is not None else engine.config.max_waiting
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._pending = 0  # accepted, not yet seen by the engine loop
        self._stop = threading.Event()
        self._error: str | None = None
        self._deferred: list[tuple] = []  # commands met at an operator boundary, for after the step
        self._polled = 0.0  # when the idle loop last ran `poll`
        if hasattr(engine, "boundary_hook"):
            engine.boundary_hook = self._admit_arrivals
        if start:
            self._thread = threading.Thread(target=self._loop, name="flowyard-engine", daemon=True)
            self._thread.start()
        else:  # the caller runs the loop (run_forever) on this thread
            self._thread = threading.current_thread()

    # -- EngineClient -----------------------------------------------------------------------
    async def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, slo: SLO | None = None,
        session: str | None = None, task: str | None = None, priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        if self._error:
            raise EngineUnavailableError(f"engine failed: {self._error}", retry_after=30.0)
        with self._lock:
            if self.engine.num_waiting + self._pending >= self.max_waiting:
                raise QueueFullError(
                    f"the server is at capacity ({self.max_waiting} requests waiting); retry later"
                )
            self._pending += 1
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), q)
        fields: dict[str, str | int] = {k: v for k, v in (("session", session), ("task", task)) if v is not None}
        if priority:
            fields["priority"] = priority
        self._commands.put(("add", request_id, prompt_ids, params, slo, time.monotonic(), fields))
        finished = False
        try:
            while True:
                out: RequestOutput = await q.get()
                if out.error:  # rejected at admission (bad input), or an engine/instance broke
                    if out.retry_after is not None:  # not the request's fault: 503 + Retry-After
                        raise EngineUnavailableError(out.error, out.retry_after)
                    raise (ValueError if out.finish_reason == "rejected" else RuntimeError)(out.error)
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:  # client went away or the consumer stopped: free the KV
                self._commands.put(("abort", request_id))

    async def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def stats(self) -> EngineStats:
        """Healthy: the loop runs and some instance can take work (a cluster whose instances
        are all restarting is not)."""
        e = self.engine
        instances = e.instance_states() if hasattr(e, "instance_states") else [
            {"instance": 0, "role": "mixed", "state": "serving", "running": e.num_running,
             "waiting": e.num_waiting, "kv_usage": e.kv.usage}]
        running = self._error is None and self._thread.is_alive()
        if not running:
            for inst in instances:
                inst["state"] = "failed"
        return EngineStats(
            num_running=e.num_running, num_waiting=e.num_waiting + self._pending,
            kv_usage=e.kv.usage, prefix_cache_hit_rate=getattr(e.kv, "hit_rate", 0.0),
            prefix_cache_queries=getattr(e.kv, "queries", 0), prefix_cache_hits=getattr(e.kv, "hits", 0),
            healthy=running and getattr(e, "accepting", True),
            detail=self._error if self._error else str(getattr(e, "health_detail", "")), instances=instances,
            preemption=getattr(e, "preemption_stats", None),
            cpu_threads=getattr(e, "cpu_threads", None),
        )

    #: How often an idle loop asks the engine to look after itself (`poll`: a cluster notices
    #: dead instances and rejoining replacements without waiting for traffic).
    POLL_S = 0.5

    def _poll(self) -> None:
        poll = getattr(self.engine, "poll", None)
        if poll is None:
            return
        self._polled = time.monotonic()
        try:
            for out in poll():
                self._deliver(out)
        except Exception:  # noqa: BLE001 - a failed health check must not stop the loop
            log.exception("engine poll failed")

    def run_forever(self, until=lambda: False) -> None:
        """Run the engine loop on this thread until `shutdown()` or `until()` is true (checked
        at least every half second)."""
        self._loop(until)

    def shutdown(self) -> None:
        self._stop.set()
        self._commands.put(("wake",))
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    # -- engine thread ----------------------------------------------------------------------
    def _deliver(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is not None:
            loop, q = stream
            loop.call_soon_threadsafe(q.put_nowait, out)

    def _apply(self, cmd: tuple) -> None:
        if cmd[0] == "add":
            _, rid, prompt, params, slo, arrival, fields = cmd  # "wake" commands fall through
            with self._lock:
                self._pending -= 1
            try:
                self.engine.add_request(rid, prompt, params, slo, arrival=arrival, **fields)
            except EngineUnavailableError as e:  # no live instance can take it now
                self._deliver(RequestOutput(rid, finished=True, finish_reason="error", error=str(e),
                                            retry_after=e.retry_after))
            except ValueError as e:
                self._deliver(RequestOutput(rid, finished=True, finish_reason="rejected", error=str(e)))
        elif cmd[0] == "abort":
            self.engine.abort(cmd[1])

    def _admit_arrivals(self) -> None:
        """At an operator boundary of a preemptible step: hand new requests to the engine now
        (an arrival is a FlowPrefill scheduling event); anything else waits for the step end."""
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add" and not self._deferred:
                self._apply(cmd)
            else:  # keep the order of an abort and anything after it
                self._deferred.append(cmd)

    def _idle_wait(self) -> None:
        """After a step that ran nothing (a batching window still open, work parked), wait for
        a command or the scheduler's wake-up time instead of spinning."""
        delay = self.engine.wake_delay() if hasattr(self.engine, "wake_delay") else 0.0
        if delay == 0.0:
            return
        try:
            self._deferred.append(self._commands.get(timeout=min(0.5, delay or 0.5)))
        except queue.Empty:
            pass

    def _loop(self, until=lambda: False) -> None:
        while not self._stop.is_set() and not until():
            deferred, self._deferred = self._deferred, []
            for cmd in deferred:
                self._apply(cmd)
            if not self.engine.has_unfinished():
                # idle, or only refusing requests (say, while every prefill instance restarts):
                # still look after the instances, however often commands come
                if time.monotonic() - self._polled >= self.POLL_S:
                    self._poll()
                try:
                    self._apply(self._commands.get(timeout=self.POLL_S))
                except queue.Empty:
                    continue
            while True:  # take every pending add/abort before the next step
                try:
                    self._apply(self._commands.get_nowait())
                except queue.Empty:
                    break
            if not self.engine.has_unfinished():
                continue
            try:
                for out in self.engine.step():
                    self._deliver(out)
                self._idle_wait()
            except Exception as e:  # a broken step must not hang clients: fail them all
                log.exception("engine step failed")
                self._error = f"{type(e).__name__}: {e}"
                for rid in list(self._streams):
                    self._deliver(RequestOutput(rid, finished=True, finish_reason="error", error=self._error,
                                                retry_after=30.0))
                return
