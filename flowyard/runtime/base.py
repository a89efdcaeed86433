"""What every cluster runtime shares: routing new requests with the policy's global scheduler
and the aggregate gauges the server reads (`AsyncLLMEngine` drives any of them)."""

from __future__ import annotations

from dataclasses import dataclass

from flowyard.core.request import SLO, NO_SLO, Request
from flowyard.engine.sampling import SamplingParams
from flowyard.policies.base import InstanceSnapshot
from flowyard.policies.registry import Policy


@dataclass
class KVUsage:
    """What /metrics and /health read as `kv.usage` and `kv.hit_rate` for the whole cluster."""

    usage: float
    hit_rate: float


class ClusterBase:
    policy: Policy
    _where: dict[str, int]  # request id -> instance that tracks it
    _next_tick: float | None = None  # when the global scheduler's next `tick` is due

    def _periodic(self, busy: bool) -> None:
        """The global scheduler's periodic work (pool controllers, instance monitors), on the
        schedule the simulator keeps: every `period` seconds from the first step with work,
        for as long as there is work. Called by `step`; without it Arrow's monitor flips and
        PLA-Serve's pool controller would only ever run in the simulator."""
        gs = self.policy.global_scheduler
        if gs.period is None or not busy:
            self._next_tick = None
            return
        now = self.now()
        if self._next_tick is None:
            self._next_tick = now + gs.period
        elif now >= self._next_tick:
            gs.tick(self, now)  # type: ignore[arg-type]
            self._next_tick = now + gs.period

    def _tick_delay(self) -> float | None:
        """Seconds until the next tick is due (a serving loop sleeps no longer), or None."""
        return None if self._next_tick is None else max(0.0, self._next_tick - self.now())

    def now(self) -> float:
        raise NotImplementedError

    def snapshots(self) -> list[InstanceSnapshot]:
        raise NotImplementedError

    def prefix_hit_rate(self) -> float:
        return 0.0

    def _route(self, request_id: str, prompt_ids: list[int], params: SamplingParams, slo: SLO | None) -> int:
        """The instance the global scheduler sends a new request to."""
        if request_id in self._where:
            raise ValueError(f"duplicate request id {request_id!r}")
        probe = Request(id=-1, arrival=self.now(), prompt_len=max(1, len(prompt_ids)),
                        max_tokens=params.max_tokens, slo=slo or NO_SLO)
        dst = self.policy.global_scheduler.route(probe, self, self.now())  # type: ignore[arg-type]
        if dst is None:
            raise ValueError("no instance can take this request now")
        return dst

    @property
    def num_waiting(self) -> int:
        return sum(s.num_waiting for s in self.snapshots())

    @property
    def num_running(self) -> int:
        return sum(s.num_running for s in self.snapshots())

    @property
    def kv(self) -> KVUsage:
        snaps = self.snapshots()
        return KVUsage(sum(s.kv_usage for s in snaps) / len(snaps), self.prefix_hit_rate())
