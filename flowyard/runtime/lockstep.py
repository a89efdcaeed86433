"""Lockstep mode of a Ray actor: the driver steps it one step at a time, on the driver's clock.

Ray actors normally step concurrently on the wall clock, so which arrival a step sees depends
on timing. In lockstep (`RayCluster(..., lockstep=True)`) the driver decides everything: it
runs one actor's step at a time in the order `flowyard.cluster.turns.Turns` gives (the
simulator's shared device), every call carries the driver's clock, and a step stops at the
points where time passes, so the driver can say what time it is when the step goes on:

- after the forward pass, before the outputs are applied (`StepPause` kind "executed"), and
- at each operator boundary of a preemptible prefill (kind "boundary", FlowPrefill).

While a step is stopped the driver may deliver what happens meanwhile (arrivals, which may
signal the running prefill to stop at this boundary; periodic ticks), reading fresh snapshots.
With a virtual clock and a cost model pricing each stop, a Ray cluster then makes exactly the
decisions the simulator makes (tests/test_three_executors.py). The step runs on its own
thread, parked at each stop; the actor's worker thread stays free for the driver's calls.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from flowyard.core.plan import BatchShape, StepPlan


@dataclass(frozen=True)
class StepPause:
    """Where a lockstep step stopped. kind: "executed" (the forward pass is done) or
    "boundary" (an operator boundary of a preemptible plan); start: the clock when the step
    began; shape: the plan's batch shape; stride: its preemption stride (0: not preemptible);
    ops_done: operators it had done when this step resumed it; ops: operators done now."""

    instance: int
    kind: str
    start: float
    shape: BatchShape
    stride: int
    ops_done: int
    ops: int


class Stepper:
    """Runs a call on its own thread, which stops at every `pause(info)` until `resume`."""

    def __init__(self) -> None:
        self._out: queue.Queue = queue.Queue()
        self._in: queue.Queue = queue.Queue()
        self.active = False

    def start(self, fn: Callable[[], Any]) -> tuple[bool, Any]:
        """Start fn; returns (True, info) at its first pause, or (False, result) when it ends."""
        self.active = True
        threading.Thread(target=self._main, args=(fn,), daemon=True, name="flowyard-lockstep").start()
        return self._wait()

    def resume(self) -> tuple[bool, Any]:
        self._in.put(None)
        return self._wait()

    def pause(self, info: Any) -> None:
        """On the call's thread: report info and wait for `resume`."""
        self._out.put(("pause", info))
        self._in.get()

    def _main(self, fn: Callable[[], Any]) -> None:
        try:
            self._out.put(("done", fn()))
        except BaseException as err:  # noqa: BLE001 - handed to the caller's thread
            self._out.put(("error", err))

    def _wait(self) -> tuple[bool, Any]:
        kind, value = self._out.get()
        if kind != "pause":
            self.active = False
        if kind == "error":
            raise value
        return kind == "pause", value


class LockstepActor:
    """Mixed into `EngineActor`: the calls a lockstep driver makes. Each sets the actor's
    clock (`vnow`) to the driver's `now` before it acts."""

    engine: Any
    vnow: float
    errors: list  # refusals and lost migrations (RequestOutput), sent with the next step
    events: list[tuple]
    arriving: list[tuple[str, Any]]
    admitted: list[tuple[int, int]]

    if TYPE_CHECKING:  # defined by EngineActor
        async def _run(self, seq: int, fn: Callable[..., Any], *args: Any) -> Any: ...
        def _apply_add(self, rid: str, state: Any, params: Any, seq: int | None = None) -> None: ...
        def _step(self, admit: bool = True) -> Any: ...
        def _drain(self, only_adds: bool = False) -> None: ...
        def _receive(self, block: bool = False) -> None: ...
        def _admit(self) -> None: ...

    def _lockstep_hooks(self) -> None:
        self._stepper = Stepper()
        self._step_start = 0.0
        self.engine.on_executed = lambda plan: self._stop("executed", plan, plan.ops_done)
        self.engine.boundary_hook = lambda: self._stop("boundary", self.engine.pool.running, self.engine.pool.ops)

    def _stop(self, kind: str, plan: StepPlan, ops: int) -> None:
        shape = plan.shape(1)
        self._stepper.pause(StepPause(self.engine.instance, kind, self._step_start, shape, plan.preempt_stride,
                                      plan.ops_done, ops))

    async def lockstep_add(self, seq: int, now: float, rid: str, state, params) -> list[tuple]:
        """Queue a request now; returns the decisions it caused here (a refusal, a preemption
        signal to the step stopped here), which the driver logs at once."""
        return await self._run(seq, self._lockstep_add, now, rid, state, params)

    async def lockstep_step(self, seq: int, now: float):
        """Start one step now: a `StepPause` where it stops, or its `StepReport`."""
        return await self._run(seq, self._lockstep_step, now)

    async def lockstep_resume(self, seq: int, now: float):
        """Go on with the stopped step, now: its next `StepPause`, or its `StepReport`."""
        return await self._run(seq, self._lockstep_resume, now)

    async def lockstep_admit(self, seq: int, now: float) -> list[tuple[int, int]]:
        """Take in the migrations sent here and import the KV of those there is room for;
        returns (request, source instance) for each, as `StepReport.admitted`."""
        return await self._run(seq, self._lockstep_admit, now)

    def _lockstep_add(self, now: float, rid: str, state, params) -> list[tuple]:
        self.vnow = now
        n = len(self.errors)
        self._apply_add(rid, state, params)
        del self.errors[n:]  # a refusal: the driver raises it to its caller
        events, self.events = self.events, []
        return events

    def _lockstep_step(self, now: float):
        self.vnow = self._step_start = now
        paused, value = self._stepper.start(lambda: self._step(admit=False))
        return value

    def _lockstep_resume(self, now: float):
        if not self._stepper.active:
            raise RuntimeError("no lockstep step is stopped here")
        self.vnow = now
        paused, value = self._stepper.resume()
        return value

    def _lockstep_admit(self, now: float) -> list[tuple[int, int]]:
        self.vnow = now
        self._drain()
        if self.arriving:
            self._receive(block=True)
        self._admit()
        admitted, self.admitted = self.admitted, []
        return admitted
