"""Arrow (arrow.txt §5): SLO-aware request dispatch and instance flipping over stateless
instances.

Every instance is `Role.MIXED` and runs the plain `BatchScheduler` (decodes first, then chunked
prefill; migrations FCFS), so any instance can prefill and decode at any time. What it is *for*
is its pool (`arrow.pools.ElasticPools`): P, D, P→D or D→P. The global scheduler

- dispatches prefills (Alg. 1): the P instance with the least predicted queueing delay (TTFT
  predictor, Eq. 1-2) if the request's TTFT SLO holds there, else the best D→P instance, else,
  when decode load is low, flips a decode instance to prefill (Alg. 3) and sends it there;
  else the P instance anyway;
- dispatches decodes when a prefill ends (Alg. 2, through `route_decode`): the prefill instance
  itself if it has meanwhile been flipped to D or P→D (no KV move), else the D (then P→D)
  instance with the fewest running tokens if it stays under Max Running Tokens and its token
  interval under the TPOT threshold, else flips a prefill instance to decode (Alg. 4);
- runs the instance monitor every `period` (`arrow.monitor`): the average token interval of
  decoding instances over the TPOT threshold for `monitor_periods` ticks in a row flips a
  prefill instance to decode; an idle prefill instance flips to decode while decode is busy;
  and (ours, `unstrand`) a P→D instance whose queued prompts would miss the TTFT threshold
  flips back towards prefill when decode can spare it; the monitor does not touch an instance
  flipped less than `flip_cooldown` ago (no P→D→P cycle every tick).

Overload rule (§5.5): flipping towards prefill requires low decode load; flipping towards decode
checks nothing, so under overload instances drift to decode and admitted requests finish.

"Decode load" ρ is one number: the larger of (running tokens on the decode side / the Max
Running Tokens of the instances counted) and (the worst token interval of a decoding instance /
the TPOT threshold). It is "low" when ρ, counted without one decode instance (the one Alg. 3
would take), is at most `decode_low`; "busy" when ρ ≥ `decode_busy`.

Ablations (Fig. 8): mode "minload" (min-load dispatch on a static split, no flips) and "rr"
(round robin on a static split).
"""

from __future__ import annotations

from dataclasses import dataclass

from flowyard.cluster.index import INDEX_MIN
from flowyard.core.request import Request, RequestState
from flowyard.costmodel.base import CostModel
from flowyard.policies.arrow.pools import (DECODE_SIDE, PREFILL_SIDE, ElasticPools, Pool, QuadraticTTFT,
                                           max_running_tokens)
from flowyard.policies.arrow.monitor import InstanceMonitor
from flowyard.policies.framework.capabilities import Capabilities
from flowyard.policies.framework.contracts import ClusterView, GlobalScheduler, InstanceSnapshot

MODES = ("slo", "minload", "rr")


@dataclass(frozen=True, slots=True)
class ArrowConfig:
    mode: str = "slo"  # "slo": Arrow; "minload", "rr": the static-split ablations of Fig. 8
    num_prefill: int | None = None  # initial P pool; the rest start in D (default half)
    ttft_slo: float = 3.0  # TTFT threshold for requests without a TTFT SLO (s)
    tpot_slo: float = 0.1  # TPOT threshold for requests without a TPOT SLO (s)
    period: float = 0.5  # monitor period (s)
    monitor_periods: int = 2  # ticks in a row with token interval over TPOT before a flip to D
    decode_low: float = 0.5  # ρ at or below this: Alg. 1 may take a decode instance
    decode_busy: float = 0.8  # ρ at or above this: idle prefill instances flip to decode
    chunk_size: int = 2048  # the instances' token budget (the predictor profiles chunked prefill)
    max_num_seqs: int = 256
    mean_context: int = 1024  # decode batch assumed to hold T / mean_context sequences (MRT)
    kv_headroom: float = 0.9  # share of KV capacity Max Running Tokens may fill
    max_profile_len: int = 131_072  # longest prompt the TTFT predictor is fitted on
    unstrand: bool = True  # the monitor flips P→D instances holding stranded prompts back (ours)
    flip_cooldown: float = 1.0  # s (2 periods): the monitor leaves instances flipped this recently

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"arrow mode must be one of {MODES}, got {self.mode!r}")
        if not (self.period > 0 and self.ttft_slo > 0 and self.tpot_slo > 0 and self.monitor_periods >= 1):
            raise ValueError("period, SLO thresholds and monitor_periods must be positive")
        if self.flip_cooldown < 0:
            raise ValueError("flip_cooldown must be >= 0")
        if not 0 <= self.decode_low <= self.decode_busy:
            raise ValueError("need 0 <= decode_low <= decode_busy")


class ArrowRouter(InstanceMonitor, GlobalScheduler):
    """Arrow's dispatcher (Alg. 1), decode router (Alg. 2) and monitor (controller) in one
    object, because all three read and flip the same pools; `arrow_policy` composes it."""

    # routes where MIXED prefills decode (as a whole scheduler and as a decode-router part)
    capabilities = Capabilities(routes_mixed=True, has_pools=True)

    def __init__(self, predictor: CostModel, config: ArrowConfig | None = None, name: str = "arrow") -> None:
        self.cfg = c = config or ArrowConfig()
        self.name = name
        self.predictor = predictor
        self.period = c.period if c.mode == "slo" else None
        kv = predictor.kv_capacity_tokens()
        self.ttft = QuadraticTTFT.fit(predictor, c.chunk_size, min(kv, c.max_profile_len))
        self._kv_tokens = kv
        self._mrt: dict[float, int] = {}
        self.pools: ElasticPools | None = None
        self._tpot = c.tpot_slo  # TPOT threshold of the monitor: the latest request's
        self._ttft = c.ttft_slo  # TTFT threshold of the monitor: the latest request's
        self._over = 0  # consecutive ticks with decode token interval over the threshold
        self._start: float | None = None
        self._last_tick: float | None = None
        self._rr = [0, 0]
        self._indexed: dict[str, int] = {}  # index name -> pools.version its members follow

    # -- helpers ---------------------------------------------------------------------------
    def max_running_tokens(self, tpot: float) -> int:
        if tpot not in self._mrt:
            c = self.cfg
            self._mrt[tpot] = max_running_tokens(self.predictor, tpot, self._kv_tokens, c.max_num_seqs,
                                                 c.mean_context, c.kv_headroom)
        return self._mrt[tpot]

    def delay(self, s: InstanceSnapshot) -> float:
        return self.ttft.queue_delay(s, self.cfg.chunk_size)

    @staticmethod
    def interval(s: InstanceSnapshot) -> float:
        """Recent token interval; an instance that decodes nothing now interferes with nothing."""
        return s.token_interval if s.num_decoding else 0.0

    def decode_load(self, snaps: list[InstanceSnapshot], tpot: float, spare: int = 0) -> float:
        """ρ of the decode side `snaps`, as if `spare` of them were given away."""
        m = len(snaps) - spare
        if m <= 0:
            return float("inf")
        tokens = sum(_load(s) for s in snaps) / (m * max(1, self.max_running_tokens(tpot)))
        worst = max((self.interval(s) for s in snaps), default=0.0) / tpot
        return max(tokens, worst)

    def _refresh(self, view: ClusterView, now: float) -> ElasticPools:
        """Create the pools on first use; let drained transitional instances settle (the
        monitor ticks on every executor's tick grid, `flowyard.cluster.ticks`)."""
        if self.pools is None:
            ids = list(view.instances())
            p = self.cfg.num_prefill if self.cfg.num_prefill is not None else max(1, len(ids) // 2)
            self.pools = ElasticPools.split(ids, p)
            self._start = now
        pools = self.pools
        for i in pools.members(Pool.P2D, Pool.D2P):
            pools.settle(i, view.snapshot(i), now)
        return pools

    def _argmin(self, ids: list[int], key, home: Pool | None = None) -> int | None:
        """Lowest key; ties go first to instances whose initial pool was `home` (a flip sends
        a borrowed instance back where it came from), then to the lowest id."""
        start = self.pools.home if self.pools is not None else {}
        return min(ids, key=lambda i: (key(i), home is not None and start.get(i) is not home, i)) if ids else None

    def _least_delay(self, view: ClusterView, pool: Pool) -> tuple[float, int] | None:
        """(predicted queueing delay, instance) of the pool's least-delay instance, ties to the
        lowest id (a delay changes only when the instance's queue does)."""
        return self._least(view, pool, self.delay)

    def _least(self, view: ClusterView, pool: Pool, score) -> tuple[float, int] | None:
        """(score, instance) of the pool's lowest-scored instance, ties to the lowest id: from
        the executor's index if it keeps one (`flowyard.cluster.index`; a decode load grows
        during decode runs, so it is read as a growing score), else from every member's
        snapshot."""
        pools = self.pools
        assert pools is not None
        ranked = getattr(view, "ranked", None)
        if ranked is None or pools.count(pool) < INDEX_MIN:  # a scan is cheaper for a few
            return min(((score(view.snapshot(i)), i) for i in pools.members(pool)), default=None)
        name = f"{self.name}:{getattr(score, '__name__', 'score')}:{pool.value}:{id(self)}"
        idx = ranked(name, score)
        if self._indexed.get(name) != pools.version:  # follow the pool's membership after flips
            idx.set_members(pools.members(pool))
            self._indexed[name] = pools.version
        return idx.least_growing() if score is _load else idx.least_key()

    def _round_robin(self, ids: list[int], k: int) -> int:
        pick = ids[self._rr[k] % len(ids)]
        self._rr[k] += 1
        return pick

    # -- Alg. 3 and 4 ----------------------------------------------------------------------
    def try_move_decode_to_prefill(self, view: ClusterView, now: float) -> int | None:
        pools = self.pools
        assert pools is not None
        d, p2d = pools.members(Pool.D), pools.members(Pool.P2D)
        if len(d) + len(p2d) <= 1:
            return None
        p = self._argmin(p2d or d, lambda i: view.snapshot(i).running_tokens, home=Pool.P)
        assert p is not None
        pools.flip_to_prefill(p, view.snapshot(p), now)
        return p

    def try_move_prefill_to_decode(self, view: ClusterView, now: float, only: list[int] | None = None) -> int | None:
        pools = self.pools
        assert pools is not None
        p, d2p = pools.members(Pool.P), pools.members(Pool.D2P)
        if len(p) + len(d2p) <= 1:
            return None
        cand = only if only is not None else (d2p or p)
        d = self._argmin(cand, lambda i: self.delay(view.snapshot(i)), home=Pool.D)
        if d is not None:
            pools.flip_to_decode(d, view.snapshot(d), now)
        return d

    # -- Alg. 1: prefill dispatch ----------------------------------------------------------
    def pool_moves(self) -> list[tuple[float, int, str, str]]:
        """Every move of an instance between Arrow's four pools (flips and their settling)."""
        if self.pools is None:
            return []
        return self.pools.logged()

    def route(self, req: Request, view: ClusterView, now: float) -> int | None:
        pools = self._refresh(view, now)
        if req.slo.tpot is not None:
            self._tpot = req.slo.tpot
        if req.slo.ttft is not None:
            self._ttft = req.slo.ttft
        if self.cfg.mode == "rr":
            return self._round_robin(pools.members(*PREFILL_SIDE), 0)
        k1, k2 = self._least_delay(view, Pool.P), self._least_delay(view, Pool.D2P)
        t1, t2 = (k1[1] if k1 else None), (k2[1] if k2 else None)
        if self.cfg.mode == "minload":
            return t1 if t1 is not None else t2
        budget = (req.slo.ttft if req.slo.ttft is not None else self.cfg.ttft_slo) - (now - req.arrival)
        need = self.ttft(req.prompt_len)
        for k in (k1, k2):
            if k is not None and k[0] + need <= budget:
                return k[1]
        tpot = req.slo.tpot if req.slo.tpot is not None else self.cfg.tpot_slo
        side = [view.snapshot(i) for i in pools.members(*DECODE_SIDE)]
        if self.decode_load(side, tpot, spare=1) <= self.cfg.decode_low:
            t3 = self.try_move_decode_to_prefill(view, now)
            if t3 is not None:
                return t3
        if t1 is not None or t2 is not None:
            return t1 if t1 is not None else t2
        return self._argmin(list(view.instances()), lambda i: self.delay(view.snapshot(i)))

    # -- Alg. 2: decode dispatch -----------------------------------------------------------
    def route_decode(self, state: RequestState, src: int, view: ClusterView, now: float) -> int:
        pools = self._refresh(view, now)
        if pools.of.get(src) in DECODE_SIDE:
            return src  # its prefill instance now decodes: no KV to move
        if self.cfg.mode == "rr":
            return self._round_robin(pools.members(*DECODE_SIDE), 1)
        k1, k2 = self._least(view, Pool.D, _load), self._least(view, Pool.P2D, _load)
        t1, t2 = (k1[1] if k1 else None), (k2[1] if k2 else None)
        tokens = {k[1]: k[0] for k in (k1, k2) if k is not None}
        if self.cfg.mode == "minload":
            return t1 if t1 is not None else (t2 if t2 is not None else src)
        tpot = state.req.slo.tpot if state.req.slo.tpot is not None else self.cfg.tpot_slo
        mrt = self.max_running_tokens(tpot)
        for t in (t1, t2):
            if t is None:
                continue
            s = view.snapshot(t)
            cap = min(mrt, int(s.kv_total_blocks * s.block_size * self.cfg.kv_headroom))
            if _load(s) + state.seq_len <= cap and self.interval(s) <= tpot:
                return t
        t3 = self.try_move_prefill_to_decode(view, now)
        if t3 is not None:
            return t3
        cands = [t for t in (t1, t2) if t is not None]
        return min(cands, key=lambda t: (tokens[t], t)) if cands else src


def _load(s: InstanceSnapshot) -> int:
    """Decode load of an instance: running tokens plus those queued to migrate in. Counting
    only running requests hides an instance at its batch limit, whose arrivals pile up in its
    migration queue while its running tokens stay flat (it would keep looking least loaded)."""
    return s.running_tokens + s.incoming_tokens
