"""FlowPrefill's Execution Pool on the real engine: cooperative preemption at operator
boundaries (FlowPrefill §5.1, Fig. 7).

A preemptible plan runs as the model's operator-step generator. After every operator whose
index is a multiple of the plan's stride (1: operator level, 5: layer level) the pool

1. lets pending events in (`boundary_hook`: the serving loop hands new arrivals to the
   scheduler here, which is how an arrival reaches the scheduler while a prefill runs), and
2. checks the preemption signal. The scheduler raises it (`signal`) when an arrival outranks
   the running task; the pool acknowledges at this boundary, parks the generator, whose frame
   holds all intermediate activations, and tells the scheduler (`suspend`). When the
   scheduler hands the same plan back, the generator continues from exactly that operator:
   nothing is recomputed.

The blocking time, from the signal (the arrival that caused it) to the acknowledgement, is the
paper's preemption latency; it is recorded in `PreemptionStats` and exported as a metric.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Callable, Generator

import torch

from flowyard.core.plan import StepPlan
from flowyard.core.request import RequestState, Status
from flowyard.engine.runner import ModelRunner
from flowyard.policies.framework.contracts import LocalScheduler

BLOCKING_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)

ForwardGen = Generator[tuple[int, str], None, torch.Tensor]


@dataclass
class PreemptionStats:
    """Cumulative histogram of preemption blocking times (Prometheus buckets), thread-safe
    enough for a scrape: plain ints and floats updated by the engine thread."""

    buckets: tuple[float, ...] = BLOCKING_BUCKETS
    counts: list[int] = field(default_factory=lambda: [0] * (len(BLOCKING_BUCKETS) + 1))
    total: float = 0.0
    count: int = 0
    recent: list[float] = field(default_factory=list)  # last 1,000 values, for tests and logs

    @classmethod
    def merged(cls, parts: "list[PreemptionStats]") -> "PreemptionStats":
        out = cls()
        for p in parts:
            out.counts = [a + b for a, b in zip(out.counts, p.counts)]
            out.total += p.total
            out.count += p.count
        return out

    def cumulative(self) -> list[tuple[str, int]]:
        """Prometheus histogram buckets: (upper bound, observations at or below it)."""
        acc, out = 0, []
        for bound, n in zip([*map(str, self.buckets), "+Inf"], self.counts):
            acc += n
            out.append((bound, acc))
        return out

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, seconds)] += 1
        self.total += seconds
        self.count += 1
        self.recent.append(seconds)
        if len(self.recent) > 1000:
            del self.recent[:-1000]


class ExecutionPool:
    def __init__(self, runner: ModelRunner, scheduler: LocalScheduler, clock: Callable[[], float],
                 total_ops: int) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.clock = clock
        self.total_ops = total_ops
        self.boundary_hook: Callable[[], None] | None = None
        self.stats = PreemptionStats()
        self.running: StepPlan | None = None
        self.ops = 0  # operators of the running plan done at the last boundary
        self._signal: float | None = None  # when the event that asked for preemption arrived
        self._suspended: dict[int, tuple[StepPlan, ForwardGen, list[RequestState]]] = {}

    @property
    def signalled(self) -> bool:
        """A preemption of the running task was asked for and has not happened yet."""
        return self._signal is not None

    def signal(self, since: float) -> None:
        """The scheduler wants the running task off the device (since = the triggering
        event's arrival time, on the engine clock)."""
        if self.running is not None and self._signal is None:
            self._signal = since

    def run(self, plan: StepPlan) -> tuple[torch.Tensor | None, list[RequestState]]:
        """Run (or resume) a preemptible plan. Returns (logits, samplers), or (None, samplers)
        when it was suspended at a boundary; the scheduler already knows."""
        parked = self._suspended.pop(id(plan), None)
        gen, samplers = parked[1:] if parked is not None else self.runner.forward_steps(plan)
        ops, stride = plan.ops_done, plan.preempt_stride
        self.running = plan
        try:
            while True:
                try:
                    next(gen)
                except StopIteration as stop:
                    return stop.value, samplers
                ops += 1
                if ops % stride or ops >= self.total_ops:
                    continue
                if self.boundary_hook is not None:
                    self.ops = ops  # operators done, for a hook that keeps a virtual clock
                    self.boundary_hook()
                if self._signal is not None:
                    now = self.clock()
                    self.stats.observe(max(0.0, now - self._signal))
                    self.scheduler.suspend(plan, ops, now)
                    self._suspended[id(plan)] = (plan, gen, samplers)
                    return None, samplers
        finally:
            self.running = None
            self._signal = None

    @property
    def num_suspended(self) -> int:
        return len(self._suspended)

    def prune(self) -> None:
        """Forget parked tasks whose requests were all aborted (the scheduler drops them)."""
        for key, (plan, _, _) in list(self._suspended.items()):
            if all(s.state.status is Status.ABORTED for s in plan.prefills):
                del self._suspended[key]
