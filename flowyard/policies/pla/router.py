"""PLA-Serve's spatial disaggregation: short and long prefill pools and the instance-pressure
controller that moves instances between them (PLA-Serve §3.2, Alg. 2).

Each request goes to the pool of its class (short when its new tokens are below the
compute-memory boundary L_m at its history, §2.1) and, inside the pool, to the instance with
the least queued prompt work. Every control period Δt the controller measures each
instance's pressure

    ψ_k = α·q_k + β·e_k − γ·u_k

with q_k its backlog (seconds of queued prefill, predicted), e_k its SLA deviation (share of
the requests it finished in the period that missed their TTFT deadline) and u_k its spare
capacity (idle share of the period), aggregates each pool robustly (P90), and, outside a
cool-down, moves one instance from the calmer pool to the pressed one when
P_s > (1 + τ)·P_l (or the reverse), never leaving a pool below n_min. Instances keep serving
what is already in their queues; only new requests follow the new pools.

Session affinity (on unless `PLAConfig.affinity_tolerance` is None): a later turn of a
conversation re-prefills on its cached history only on the instance that holds it, so the
router remembers where each session's last turn went and how much of the prompt it left
there. A re-prefill is classified by the tokens it would really compute at home (L = prompt -
cached, short when L < L_m^re-prefill(H = cached), §2.1). The alternative, the least-loaded
instance of the pool of the whole uncached prompt, is where the turn goes without its cache.
The turn goes home when home is in either of those two pools (a short re-prefill whose
history sits in the long pool stays there: elsewhere it would be a long recompute in the long
pool anyway, and its instance serves it through Q_s), unless home is clearly worse: its
predicted backlog plus the cached fill exceeds the alternative's backlog plus the full fill
by more than the tolerance. Only the earlier turns' prompts count as cached (a PD prefill
instance never sees the replies, which decode elsewhere); the instance itself still
classifies by what its cache really holds.

Our reading of u: the paper calls it GPU utilisation, but with ψ falling as u rises a busy
pool would look calmer than an idle one and the controller would move instances towards the
idle pool (we saw it oscillate that way). Read as spare capacity (1 − busy share), −γu makes
an idle pool give up an instance first, which is what the surrounding text describes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from flowyard.core.request import Request
from flowyard.costmodel.base import CostModel
from flowyard.policies.framework.capabilities import Capabilities
from flowyard.policies.framework.contracts import ClusterView, InstanceSnapshot, Role
from flowyard.policies.pla.selector import is_short
from flowyard.policies.pla.affinity import SessionHomes, cached_prefix
from flowyard.policies.pla.boundary import LengthModel
from flowyard.policies.framework.pools import Pools


@dataclass(frozen=True, slots=True)
class ControllerConfig:
    period: float = 1.0  # Δt, seconds
    cooldown: float = 5.0  # T_cool
    hysteresis: float = 0.25  # τ
    min_pool: int = 1  # n_min
    alpha: float = 1.0  # per second of backlog
    beta: float = 1.0  # per unit of late share
    gamma: float = 0.5  # per unit of spare capacity (idle share)
    quantile: float = 90.0  # the robust aggregator A(): P90
    short_share: float = 0.5  # initial share of prefill instances in the short pool

    def __post_init__(self) -> None:
        if self.period <= 0 or self.cooldown < 0 or self.hysteresis < 0 or self.min_pool < 1:
            raise ValueError("controller period must be positive; cooldown, hysteresis >= 0; min_pool >= 1")
        if not 0 <= self.short_share <= 1 or not 0 <= self.quantile <= 100:
            raise ValueError("short_share must be in [0, 1] and quantile in [0, 100]")


MAX_SESSIONS = 1 << 17  # sessions whose home the router remembers (least recent forgotten)


def _entry(view: ClusterView) -> list[int]:
    """Instances a new request may start on: the prefill instances, or all of them in mix mode."""
    return list(view.instances(Role.PREFILL)) or list(view.instances(Role.MIXED))


class PLARouter:
    """PLA-Serve's global parts over one pool model: the dispatcher (class pools, session
    affinity) and, with spatial pools, the pressure controller (`tick`, every `period`)."""

    capabilities = Capabilities(has_pools=True)

    def __init__(self, lengths: LengthModel, predictor: CostModel,
                 controller: ControllerConfig | None = None, spatial: bool = True,
                 boundary: int | None = None, affinity: float | None = None) -> None:
        self.lengths, self.boundary = lengths, boundary
        self.predictor, self.affinity = predictor, affinity
        self.sessions = SessionHomes(MAX_SESSIONS)  # where each session's last turn went
        self.controller = controller or ControllerConfig()
        self.spatial = spatial
        self.period = self.controller.period if spatial else None
        self.pools: Pools | None = None
        self._per_token = predictor.prefill_time(2048) / 2048  # backlog tokens -> seconds
        self._last: dict[int, tuple[float, int, int]] = {}  # instance -> (busy_s, late, done)
        self._last_move = float("-inf")
        self._last_tick: float | None = None

    def _init_pools(self, view: ClusterView) -> Pools:
        ids = _entry(view)
        n_s = min(len(ids) - 1, max(1, round(len(ids) * self.controller.short_share))) if len(ids) > 1 else 0
        self.pools = Pools.split(ids, [("short", n_s), ("long", len(ids) - n_s)])
        return self.pools

    def _pool(self, short: bool, view: ClusterView) -> list[int]:
        pools = self.pools or self._init_pools(view)
        members = pools.members("short" if short else "long")
        if self.spatial and members and pools.members("long" if short else "short"):
            return members
        return _entry(view)

    def route(self, req: Request, view: ClusterView, now: float) -> int | None:
        if self.affinity is None or req.session is None:  # by the declared history
            ids = self._pool(is_short(req, self.lengths, self.boundary), view)
            return min(ids, key=lambda i: (view.snapshot(i).waiting_tokens, i))
        pick = self._route_turn(req, view)
        self.sessions.remember(req.session, pick, req.prompt_len)
        return pick

    def _route_turn(self, req: Request, view: ClusterView) -> int:
        """A turn of a session: home if it holds the history, sits in a pool this turn may go
        to and is not clearly worse; else the least-loaded instance of the pool of the whole
        (uncached) prompt."""
        cold = self._pool(is_short(replace(req, history_len=0), self.lengths, self.boundary), view)
        alt = min(cold, key=lambda i: (view.snapshot(i).waiting_tokens, i))
        home = self.sessions.home(req.session) if req.session is not None and req.history_len else None
        if home is None or home[0] not in _entry(view):
            return alt
        inst, held = home
        snap = view.snapshot(inst)
        cached = cached_prefix(min(held, req.history_len), req.prompt_len, snap.block_size)
        if cached <= 0:
            return alt
        if inst != alt:
            warm = self._pool(is_short(replace(req, history_len=cached), self.lengths, self.boundary), view)
            if inst not in warm and inst not in cold:
                self.sessions.away()  # home has moved to a pool serving neither fill
                return alt
            t_home = snap.waiting_tokens * self._per_token + self.predictor.prefill_time(
                req.prompt_len - cached, cached)
            t_alt = (view.snapshot(alt).waiting_tokens * self._per_token
                     + self.predictor.prefill_time(req.prompt_len))
            return self.sessions.choose(inst, alt, t_home, t_alt, self.affinity or 0.0)
        self.sessions.stayed()  # home is also the least-loaded pick
        return inst

    # -- Alg. 2 ----------------------------------------------------------------------------------
    def _pressure(self, s: InstanceSnapshot, dt: float) -> float:
        c = self.controller
        busy0, late0, done0 = self._last.get(s.instance, (0.0, 0, 0))
        self._last[s.instance] = (s.busy_s, s.slo_late, s.slo_done)
        done = s.slo_done - done0
        e = (s.slo_late - late0) / done if done else 0.0
        u = 1.0 - min(1.0, (s.busy_s - busy0) / dt) if dt > 0 else 0.0  # spare capacity
        q = s.waiting_tokens * self._per_token
        return c.alpha * q + c.beta * e - c.gamma * u

    def tick(self, view: ClusterView, now: float) -> None:
        pools = self.pools or self._init_pools(view)
        dt = now - self._last_tick if self._last_tick is not None else self.controller.period
        self._last_tick = now
        short, long_ = pools.members("short"), pools.members("long")
        psi = {i: self._pressure(view.snapshot(i), dt) for i in short + long_}
        if not short or not long_:
            return
        c = self.controller
        p_s = float(np.percentile([psi[i] for i in short], c.quantile))
        p_l = float(np.percentile([psi[i] for i in long_], c.quantile))
        if now - self._last_move < c.cooldown:
            return
        if _exceeds(p_s, p_l, c.hysteresis) and len(long_) > c.min_pool:
            pools.move(min(long_, key=lambda i: psi[i]), "short", now)
            self._last_move = now
        elif _exceeds(p_l, p_s, c.hysteresis) and len(short) > c.min_pool:
            pools.move(min(short, key=lambda i: psi[i]), "long", now)
            self._last_move = now


def _exceeds(a: float, b: float, tau: float) -> bool:
    """a > (1 + τ)·b, read as a margin of τ·|b| so that it still means "clearly larger" when
    pressures are negative (ψ subtracts utilisation)."""
    return a - b > tau * abs(b) + 1e-12
