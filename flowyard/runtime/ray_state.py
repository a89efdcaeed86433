"""The state `RayCluster`'s parts share, declared in one place.

`RayCluster` is assembled from parts kept in their own files by job: applying actors' reports
(`ray_reports`), stepping in lockstep (`ray_lockstep`) and living with dying actors
(`ray_faults`). Each part reads state the others keep; declaring it here, once, with its types,
lets each part be type-checked on its own and says what they share. The values are set by
`RayCluster.__init__` and `RayLockstep._init_lockstep`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flowyard.cluster.turns import Turns
from flowyard.core.request import SLO, RequestState
from flowyard.engine.preemption import PreemptionStats
from flowyard.engine.sampling import RequestOutput, SamplingParams
from flowyard.policies.framework.contracts import InstanceSnapshot, Role
from flowyard.runtime.base import ClusterBase


class RayState(ClusterBase):
    """RayCluster's fields; its parts subclass this."""

    RETRY_AFTER_S: float
    _ray: Any  # the `ray` module
    actors: list[Any]  # one actor handle per instance
    lockstep: bool
    turns: Turns
    _snaps: list[InstanceSnapshot]  # each instance's last snapshot
    _busy: list[bool]
    _wake_at: list[float | None]
    _stale: set[int]
    _rid: dict[int, str]  # int id -> request id
    _states: dict[int, RequestState]
    _inputs: dict[str, tuple]
    _new: dict[int, SamplingParams]  # being routed
    _down: dict[int, Any]  # instance -> its replacement's start-up (ObjectRef)
    _watch: dict[int, Any]
    _unapplied: dict[int, dict[int, Any]]
    _inflight: dict[int, Any]  # instance -> the step it is running (ObjectRef)
    _sent_during_step: set[int]
    _failed: list[RequestOutput]
    _preemption: dict[int, PreemptionStats]
    _prefix: dict[int, tuple[int, int]]
    _prefix_retired: tuple[int, int]
    _kv_home: dict[int, int]  # moving request -> the instance still holding its KV
    failures: int
    restarts: int

    if TYPE_CHECKING:  # defined by RayCluster or one of its parts
        def _call(self, i: int, method: str, *args: Any) -> Any: ...
        def _spawn(self, i: int, actor: Any = None) -> Any: ...
        def _kick(self, i: int) -> None: ...
        def _mark_busy(self, i: int) -> None: ...
        def _released(self, admitted: list[tuple[int, int]]) -> None: ...
        def _ended(self, req_id: int, status: str) -> None: ...
        def has_unfinished(self) -> bool: ...
        def _instance_died(self, i: int) -> list[RequestOutput]: ...
        def _apply(self, i: int, report: Any) -> list[RequestOutput]: ...
        def instance_ids(self, role: Role | None = None) -> list[int]: ...
        def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                        slo: SLO | None = None, arrival: float | None = None, *,
                        session: str | None = None, task: str | None = None, priority: int = 0) -> None: ...
