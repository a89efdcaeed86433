"""Global scheduling as parts: a `Composed` global scheduler is a dispatcher, an optional
splitter, an optional decode router and any number of controllers, over an optional pool
model (`pools.Pools`). Every registry policy is one of these assemblies, so a new policy can
take Arrow's pools, PLA-Serve's length classes and DynaServe's splits from the same shelf
instead of subclassing one of them.

- **Dispatcher** (`route`): the instance a new request starts on.
- **Splitter** (`split`): given that instance, where the request really starts and whether
  it is cut into micro-requests, (first, (s, B) or None), decided together (DynaServe).
- **Decode router** (`route_decode`): where a request continues after its prefill; one that
  declares `routes_mixed` is also asked for requests prefilled on MIXED instances (Arrow).
- **Controllers** (`tick`, `period`): periodic work (Arrow's monitor, PLA's pressure
  controller).
- **Learners**: any part that declares `learns` hears of every finished request through
  `on_finished` (DynaServe's length predictor).

Each part declares what it does beyond its role's methods as a `capabilities.Capabilities`
(`routes_mixed`, `chunked_kv`, `learns`, `has_pools`); `Composed` reads those declarations and
declares its own from them.

One object may play several parts when they share state (Arrow's dispatch, decode routing and
monitor read and flip the same pools).
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence, cast, runtime_checkable

from flowyard.cluster.index import least
from flowyard.core.request import Request, RequestState
from flowyard.policies.framework.capabilities import Capabilities, capabilities_of
from flowyard.policies.framework.contracts import ClusterView, GlobalScheduler, InstanceSnapshot, Role
from flowyard.policies.framework.pools import Pools


class Dispatcher(Protocol):
    def route(self, req: Request, view: ClusterView, now: float) -> int | None: ...


class Splitter(Protocol):
    def split(self, req: Request, dst: int, view: ClusterView,
              now: float) -> tuple[int | None, tuple[int, int] | None]: ...


class DecodeRouter(Protocol):
    def route_decode(self, state: RequestState, src: int, view: ClusterView, now: float) -> int: ...


class Learner(Protocol):
    """A part that declares `learns`: hears of every finished request."""

    def on_finished(self, state: RequestState, now: float) -> None: ...


class PoolKeeper(Protocol):
    """A part that declares `has_pools`: keeps a pool model (None until its first use)."""

    @property
    def pools(self) -> Pools | None: ...


@runtime_checkable
class Controller(Protocol):
    period: float | None

    def tick(self, view: ClusterView, now: float) -> None: ...


class Composed(GlobalScheduler):
    """A global scheduler assembled from parts (module docstring)."""

    def __init__(self, name: str, dispatcher: Dispatcher, splitter: Splitter | None = None,
                 decode_router: DecodeRouter | None = None, controllers: Sequence[Controller] = (),
                 pools: Pools | None = None) -> None:
        self.name = name
        self.dispatcher, self.splitter, self.decode_router = dispatcher, splitter, decode_router
        self.controllers = list(controllers)
        self._pools = pools
        periods = [c.period for c in self.controllers if c.period is not None]
        if periods:  # else the class's (None, or a subclass's own timer)
            self.period = min(periods)
        self._ticked: dict[int, float] = {}
        parts = self.parts
        # what these capabilities declare (`capabilities`): the methods and attributes below
        self._learners = [cast(Learner, p) for p in parts if capabilities_of(p).learns]
        self._pool_keepers = [cast(PoolKeeper, p) for p in parts if capabilities_of(p).has_pools]
        self.capabilities = Capabilities(
            routes_mixed=decode_router is not None and capabilities_of(decode_router).routes_mixed,
            chunked_kv=splitter is None or capabilities_of(splitter).chunked_kv,
            learns=bool(self._learners), has_pools=pools is not None or bool(self._pool_keepers))

    @property
    def parts(self) -> list[object]:
        """Every distinct part, for reports that read a part's counters."""
        out: list[object] = []
        for p in (self.dispatcher, self.splitter, self.decode_router, *self.controllers):
            if p is not None and p not in out:
                out.append(p)
        return out

    @property
    def pools(self) -> Pools | None:
        """The pool model: the one given, else the one a part keeps (created on first use)."""
        if self._pools is not None:
            return self._pools
        for p in self._pool_keepers:
            pools = p.pools
            if isinstance(pools, Pools):
                return pools
        return None

    # -- GlobalScheduler -----------------------------------------------------------------------
    def route(self, req: Request, view: ClusterView, now: float) -> int | None:
        return self.dispatcher.route(req, view, now)

    def dispatch(self, req: Request, view: ClusterView, now: float) -> tuple[int | None, tuple[int, int] | None]:
        dst = self.route(req, view, now)
        if dst is None:
            return None, None
        if self.splitter is None:
            return dst, self.split_point(req, dst, view, now)
        return self.splitter.split(req, dst, view, now)

    def route_decode(self, state: RequestState, src: int, view: ClusterView, now: float) -> int:
        if self.decode_router is None:
            return super().route_decode(state, src, view, now)
        return self.decode_router.route_decode(state, src, view, now)

    def tick(self, view: ClusterView, now: float) -> None:
        """Tick every controller whose own period has passed (all of them when they share
        the composed period, which is the executor's)."""
        for c in self.controllers:
            last = self._ticked.get(id(c))
            period = c.period  # None: at every composed tick
            if period is None or period == self.period or last is None or now - last >= period - 1e-9:
                self._ticked[id(c)] = now
                c.tick(view, now)

    def on_finished(self, state: RequestState, now: float) -> None:
        for p in self._learners:
            p.on_finished(state, now)

    def pool_moves(self) -> Sequence[tuple[float, int, str, str]]:
        pools = self.pools
        return () if pools is None else pools.logged()


# -- the baselines' parts ----------------------------------------------------------------------
def entry(view: ClusterView) -> list[int]:
    """Instances a new request may start on: the prefill pool if there is one, else all."""
    return list(view.instances(Role.PREFILL)) or list(view.instances(Role.MIXED))


def argmin(view: ClusterView, ids: list[int], score: Callable[[InstanceSnapshot], Any]) -> int:
    """Lowest score; ties towards the lowest instance id (deterministic runs)."""
    return min(ids, key=lambda i: (score(view.snapshot(i)), i))


class RoundRobinDispatch:
    """The next entry instance in turn, whatever its load."""

    def __init__(self) -> None:
        self._next = 0

    def route(self, req: Request, view: ClusterView, now: float) -> int | None:
        ids = entry(view)
        pick = ids[self._next % len(ids)]
        self._next += 1
        return pick


def _requests(s: InstanceSnapshot) -> float:
    return s.num_requests


def _vllm_score(s: InstanceSnapshot) -> float:
    return 4 * s.num_waiting + s.num_running


def _waiting_tokens(s: InstanceSnapshot) -> float:
    return s.waiting_tokens


SCORES = {"requests": _requests, "vllm": _vllm_score, "waiting-tokens": _waiting_tokens}


class LeastScoreDispatch:
    """The entry instance with the lowest load score: "requests" in flight (SGLang's
    load-based router), "vllm" (vLLM v1's DP balancer: waiting * 4 + running) or
    "waiting-tokens" (DistServe: prompt tokens still to compute)."""

    def __init__(self, score: str = "requests") -> None:
        if score not in SCORES:
            raise ValueError(f"score must be one of {', '.join(SCORES)}, got {score!r}")
        self.score = score

    def route(self, req: Request, view: ClusterView, now: float) -> int | None:
        # these scores change only when an instance's scheduler does: an executor's index
        # answers in O(log n) (`flowyard.cluster.index`), else every snapshot is read
        return least(view, f"entry:{self.score}", SCORES[self.score], lambda: entry(view))


def _decode_load(s: InstanceSnapshot) -> tuple[float, int]:
    return (-s.kv_free_blocks, s.num_requests)


class MostFreeKVDecode:
    """DistServe's decode routing: the decode instance with the most free KV, then the fewest
    requests."""

    def route_decode(self, state: RequestState, src: int, view: ClusterView, now: float) -> int:
        return argmin(view, list(view.instances(Role.DECODE)), _decode_load)
