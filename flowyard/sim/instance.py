"""The simulator's per-instance state and its result record."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from flowyard.core.plan import StepPlan
from flowyard.core.request import RequestState, Status
from flowyard.policies.base import LocalScheduler


class SimInstance:
    """One simulated serving instance: a local scheduler plus the step it is running."""

    __slots__ = ("id", "sched", "plan", "ends", "version", "busy_s", "wake_pending", "bounds",
                 "suspend_at", "timer_at")

    def __init__(self, iid: int, sched: LocalScheduler) -> None:
        self.id = iid
        self.sched = sched
        self.plan: StepPlan | None = None
        self.ends: np.ndarray = np.empty(0)
        self.version = 0
        self.busy_s = 0.0
        self.wake_pending = False
        self.bounds: np.ndarray | None = None  # operator end times of a preemptible plan
        self.suspend_at = -1  # operators done when a requested preemption takes effect
        self.timer_at: float | None = None  # when the scheduler asked to be woken (wake_at)


@dataclass
class SimResult:
    states: list[RequestState]
    sim_time: float
    wall_s: float
    events: int
    steps: int
    instance_busy_s: list[float] = field(default_factory=list)
    # FlowPrefill: seconds from each preemption signal to the operator boundary that acked it
    preemption_blocking: list[float] = field(default_factory=list)

    @property
    def completed(self) -> list[RequestState]:
        return [s for s in self.states if s.status is Status.FINISHED]

    @property
    def rejected(self) -> list[RequestState]:
        return [s for s in self.states if s.status is Status.REJECTED]
