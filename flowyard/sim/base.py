"""What the simulator's parts share: its event kinds and the state they read and write.

`Simulator` (`simulator.py`: the event loop and the per-instance driver around each step) is
assembled from `SimTransport` (`transport.py`: what the cluster core drives and reads) and
`StepExecution` (`steps.py`: how a step runs on the virtual clock, priced by the cost model);
`SimBase` declares the state the three use, so each part type-checks on its own.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from flowyard.cluster.core import ClusterCore
from flowyard.cluster.driver import InstanceDriver
from flowyard.cluster.index import Touched
from flowyard.cluster.timeline import Timeline
from flowyard.core.events import EventKind
from flowyard.core.plan import StepOutput, StepPlan
from flowyard.core.request import RequestState
from flowyard.costmodel.base import CostModel
from flowyard.policies.framework.contracts import InstanceSnapshot, Role
from flowyard.sim.instance import SimInstance
from flowyard.sim.kv_push import KVPush

# Event kinds in the heap; at equal times the lower kind comes first (arrivals, step ends, KV
# landings, timers, then SCHEDULE: an idle instance plans once every other event of the
# instant has been applied).
ARRIVAL, STEP, KV_DONE = int(EventKind.ARRIVAL), int(EventKind.STEP_DONE), int(EventKind.KV_DONE)
SCHEDULE, TIMER, CLIENT = int(EventKind.SCHEDULE), int(EventKind.TIMER), int(EventKind.CLIENT)
INF = float("inf")


class SimulationError(RuntimeError):
    """A run ended with a request neither finished nor rejected, or with KV still held."""


class SimBase(InstanceDriver):
    """The simulator's state, as its parts use it (set by `Simulator.__init__`)."""

    now: float
    cost: CostModel
    instances: list[SimInstance]
    core: ClusterCore
    kv_push: KVPush
    timeline: Timeline | None
    on_step: Callable[[int, StepPlan, int], None] | None
    shared_device: bool
    snapshot_staleness: float
    steps: int
    preemption_blocking: list[float]
    _device_free: float  # when the step in flight ends (only `shared_device` waits for it)
    _export_s: float  # a moved request's KV export time on its source (CostModel.kv_export_time)
    _gap: float  # the serving loop after each step (CostModel.step_gap)
    _by_role: dict[Role | None, list[int]]
    _snap_cache: dict[int, tuple[float, InstanceSnapshot]]
    _touched: Touched
    _recent: set[int]

    def _output(self, inst: SimInstance, ends: np.ndarray) -> StepOutput:
        """What `inst`'s scheduler is told steps ending at `ends` produced: each step's tokens,
        and the time a policy measures it took, end `_gap` before the instance is free again
        (the serving loop after it), never before the run started."""
        return StepOutput(end_times=np.maximum(ends - self._gap, inst.started) if self._gap else ends)

    # provided by the parts (the simulator, its transport, its step execution)
    def _push(self, t: float, kind: int, payload: object) -> None:
        raise NotImplementedError

    def _kick(self, inst: SimInstance) -> None:
        raise NotImplementedError

    def _ended(self, st: RequestState, reject: str | None = None) -> None:
        raise NotImplementedError

    def _changed(self, inst: SimInstance) -> None:  # SimTransport
        raise NotImplementedError


    def _preempt(self, inst: SimInstance, plan: StepPlan) -> None:  # StepExecution
        raise NotImplementedError

    def _interrupt(self, inst: SimInstance) -> bool:  # StepExecution
        raise NotImplementedError
