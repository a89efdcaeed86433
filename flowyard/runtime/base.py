"""What every cluster runtime shares: the cluster core that routes, splits and moves requests
(`flowyard.cluster`), conversation sessions, periodic ticks on the wall clock, and the
aggregate gauges the server reads (`AsyncLLMEngine` drives any runtime)."""

from __future__ import annotations

import collections
from dataclasses import dataclass

from flowyard.cluster.core import ClusterCore, DecisionLog
from flowyard.cluster.driver import InstanceDriver
from flowyard.cluster.timeline import Timeline
from flowyard.core.request import RequestState
from flowyard.policies.framework.contracts import InstanceSnapshot
from flowyard.policies.framework.policy import Policy


@dataclass
class KVUsage:
    """What /metrics and /health read as `kv.usage` and `kv.hit_rate` for the whole cluster."""

    usage: float
    hit_rate: float
    queries: int = 0  # prompt tokens looked up in the instances' prefix caches
    hits: int = 0


class Sessions:
    """Conversation turns as the global scheduler sees them: a request that names a session
    continues it, and the prefix its prompt shares with that session's last prompt and reply
    is its history (what PLA-Serve's session affinity and re-prefill act on)."""

    def __init__(self, limit: int = 100_000) -> None:
        self._last: dict[str, tuple[int, tuple[int, ...]]] = {}  # session -> (turn, tokens)
        self.limit = limit

    def fields(self, prompt_ids: list[int], session: str | None) -> dict:
        if session is None:
            return {}
        turn, seen = self._last.get(session, (-1, ()))
        n = 0
        for a, b in zip(prompt_ids, seen):
            if a != b:
                break
            n += 1
        return {"session": session, "turn": turn + 1, "history_len": min(n, len(prompt_ids) - 1)}

    def finished(self, st: RequestState) -> None:
        req = st.req
        if req.session is None or req.prompt_tokens is None:
            return
        if len(self._last) >= self.limit and req.session not in self._last:
            self._last.pop(next(iter(self._last)))  # oldest session first
        self._last[req.session] = (req.turn, req.prompt_tokens + tuple(st.output_tokens))


class ClusterBase(InstanceDriver):
    """The parts of a runtime that do not depend on where its instances run."""

    policy: Policy
    core: ClusterCore
    _where: dict[str, int]  # request id -> instance that tracks it

    def _init_core(self, policy: Policy, decisions: DecisionLog | None, timeline: Timeline | None) -> None:
        self.policy = policy
        self.timeline = timeline
        if timeline is not None:
            decisions = decisions or timeline.log
            timeline.roles.update({i: r.value for i, r in enumerate(policy.roles)})
        self.core = ClusterCore(policy, self, decisions)  # type: ignore[arg-type]
        self.sessions = Sessions()
        self._where = {}
        # the last KV transfers, (time, request, src, dst, seconds): the live page shows them
        self.transfers: collections.deque[tuple[float, int, int, int, float]] = collections.deque(maxlen=500)
        self.transfers_total = 0

    def _transferred(self, t: float, request: int, src: int, dst: int, seconds: float) -> None:
        self.transfers.append((t, request, src, dst, seconds))
        self.transfers_total += 1

    def _periodic(self) -> None:
        """The global scheduler's periodic work (pool controllers, instance monitors), if due:
        the simulator's grid, every `period` seconds from the first arrival, idle or not
        (`flowyard.cluster.ticks`)."""
        self.core.tick_due(self.now())

    def _tick_delay(self) -> float | None:
        return self.core.ticks.delay(self.now())

    def poll(self) -> list:
        """What a serving loop calls while nothing runs: the periodic ticks go on."""
        self._periodic()
        return []

    def _finished(self, results) -> None:
        for st in results:
            self.sessions.finished(st)
            if self.timeline is not None:
                self.timeline.finished(st)

    # -- ClusterView (the global scheduler reads the runtime through the core) --------------
    def instances(self, role=None):
        return self.instance_ids(role)

    def now(self) -> float:
        raise NotImplementedError

    def snapshots(self) -> list[InstanceSnapshot]:
        raise NotImplementedError

    def prefix_hit_rate(self) -> float:
        return 0.0

    @property
    def accepting(self) -> bool:
        """Some instance can take a new request (health checks read this)."""
        return True

    def instance_states(self) -> list[dict]:
        """Each instance as /health shows it."""
        return [{"instance": i, "role": self.policy.roles[i].value, "state": "serving", "running": s.num_running,
                 "waiting": s.num_waiting, "kv_usage": round(s.kv_usage, 4)} for i, s in enumerate(self.snapshots())]

    @property
    def decisions(self) -> DecisionLog | None:
        return self.core.log

    @property
    def num_waiting(self) -> int:
        return sum(s.num_waiting for s in self.snapshots())

    @property
    def num_running(self) -> int:
        return sum(s.num_running for s in self.snapshots())

    @property
    def kv(self) -> KVUsage:
        snaps = self.snapshots()
        return KVUsage(sum(s.kv_usage for s in snaps) / len(snaps), self.prefix_hit_rate(),
                       *self.prefix_counts())

    def prefix_counts(self) -> tuple[int, int]:
        """(queries, hits) of the prefix caches, in prompt tokens (0, 0 where not known)."""
        return 0, 0
