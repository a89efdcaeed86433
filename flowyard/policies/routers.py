"""Global schedulers of the baselines: data-parallel routers and DistServe's PD dispatch.

Each reads only `InstanceSnapshot`s, so it runs unchanged over simulated or real instances.
Ties break towards the lowest instance id, which keeps runs deterministic.
"""

from __future__ import annotations

from flowyard.core.request import Request, RequestState
from flowyard.policies.base import ClusterView, GlobalScheduler, InstanceSnapshot, Role


def _entry(view: ClusterView) -> list[int]:
    """Instances a new request may start on: the prefill pool if there is one, else all."""
    return list(view.instances(Role.PREFILL)) or list(view.instances(Role.MIXED))


class RoundRobin(GlobalScheduler):
    """SGLang router `round_robin`: the next instance in turn, whatever its load."""

    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def route(self, req: Request, view: ClusterView, now: float) -> int | None:
        ids = _entry(view)
        pick = ids[self._next % len(ids)]
        self._next += 1
        return pick


def _argmin(view: ClusterView, ids: list[int], score) -> int:
    return min(ids, key=lambda i: (score(view.snapshot(i)), i))


class LeastLoad(GlobalScheduler):
    """SGLang router's load-based choice: the instance with the fewest requests in flight
    (running, waiting and arriving)."""

    name = "least-load"

    def route(self, req: Request, view: ClusterView, now: float) -> int | None:
        return _argmin(view, _entry(view), lambda s: s.num_requests)


class VllmDataParallel(GlobalScheduler):
    """vLLM v1's data-parallel load balancer (DPLBAsyncMPClient in vllm/v1/engine/
    core_client.py): score = waiting * 4 + running, lowest score wins."""

    name = "vllm"

    def route(self, req: Request, view: ClusterView, now: float) -> int | None:
        return _argmin(view, _entry(view), lambda s: 4 * s.num_waiting + s.num_running)


def _decode_load(s: InstanceSnapshot) -> tuple[float, int]:
    return (-s.kv_free_blocks, s.num_requests)


class DistServeDispatch(GlobalScheduler):
    """DistServe's static PD dispatch: a new request goes to the prefill instance with the
    shortest queue (in prompt tokens still to compute); a finished prefill goes to the decode
    instance with the most free KV (then the fewest requests)."""

    name = "distserve"

    def route(self, req: Request, view: ClusterView, now: float) -> int | None:
        ids = list(view.instances(Role.PREFILL))
        return _argmin(view, ids, lambda s: s.waiting_tokens)

    def route_decode(self, state: RequestState, src: int, view: ClusterView, now: float) -> int:
        return _argmin(view, list(view.instances(Role.DECODE)), _decode_load)


class RoundRobinPD(DistServeDispatch):
    """FlowPrefill's proxy: new requests to the prefill instances in turn, whatever their load
    (§4: load balancing across instances is out of the paper's scope); finished prefills to the
    decode instance with the most free KV, as DistServe."""

    name = "round-robin-pd"

    def __init__(self) -> None:
        self._next = 0

    def route(self, req: Request, view: ClusterView, now: float) -> int | None:
        ids = list(view.instances(Role.PREFILL))
        pick = ids[self._next % len(ids)]
        self._next += 1
        return pick
