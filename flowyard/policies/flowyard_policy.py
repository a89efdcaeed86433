"""`flowyard`: the four designs composed into one policy (issue 16).

Every instance is stateless (`Role.MIXED`, Arrow §5.2), so whether the cluster runs colocated or
disaggregated is a decision of the global scheduler, not of the deployment, and it can change
while the cluster runs. The parts:

- **Regime controller (ours).** Disaggregation pays only when decodes sharing a step with
  prefill would miss their TPOT SLO and the prefill it displaces is worth more on instances of
  its own. Every `period` the controller prices both regimes with the cost model (`wanted`):
  the prefill tokens/s of colocated steps held within the tightest recent TPOT SLO (DynaServe's
  TBT budget) against those of N/2 prefill-only instances, for the observed decode load and
  mean prompt. Loose TPOT, short prompts or long outputs keep the cluster colocated (vLLM's
  data-parallel deployment, with the parts below); otherwise it splits into Arrow's pools. The
  switch needs `patience` ticks in a row either way (no flapping).
- **Disaggregated regime: Arrow's pools.** Half the instances in P, half in D (`arrow.ArrowRouter`
  over the shared pool model, zero-wait: a flip is bookkeeping on stateless instances), with
  Arrow's minimal-load dispatch (`pools="minload"`, Fig. 8). Arrow's per-request SLO-aware flips
  and monitor (`pools="slo"`) are off by default: on 4 instances under a 25 ms TPOT they
  drifted to 1P3D (an idle prefill instance flips to decode while decode is busy; decode at
  that TPOT never looks "low" enough to flip one back) and lost up to 2.2× goodput in
  development runs (BurstGPT, arXiv at 25 ms TPOT); the regime switch is the elastic move kept.
- **Colocated regime: least predicted prefill delay.** A new request goes to the instance
  with the least predicted queueing delay (Arrow's quadratic TTFT predictor over its prefill
  queue, stretched by the decodes that share its steps), then the fewest running tokens.
- **Session affinity (PLA-Serve §3.3).** In both regimes a session's later turn goes back to
  the instance that holds its history (its KV is cached there) unless that instance's predicted
  delay plus the cached fill is worse than the best alternative plus the full fill by more than
  `affinity` seconds.
- **Local scheduling** (`flowyard_local`): FlowPrefill's S-EDF queue order and DynaServe's
  TBT-bounded step budgets on every instance.

`mode` "colocated" or "disaggregated" pins the regime (ablations); the other knobs switch the
other parts off one at a time (`flowyard reproduce flowyard` measures what each earns).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from flowyard.core.plan import BatchShape
from flowyard.core.request import Request, RequestState
from flowyard.costmodel.base import CostModel
from flowyard.policies.arrow import ArrowConfig, ArrowRouter
from flowyard.policies.arrow_pools import PREFILL_SIDE
from flowyard.policies.base import ClusterView

MODES = ("auto", "colocated", "disaggregated")
MAX_SESSIONS = 65536


@dataclass(frozen=True, slots=True)
class FlowyardConfig:
    mode: str = "auto"  # "auto": the regime controller decides; else pinned
    pools: str = "minload"  # Arrow's dispatch in the disaggregated regime: "minload", or "slo" (with flips)
    dispatch_flips: bool = True  # Arrow's Alg. 1/2 may flip an instance per request; False: the monitor only
    order: str = "s-edf"  # local queue order (FlowPrefill); "fcfs" ablates it
    tbt_budget: bool = True  # DynaServe's TBT-bounded step budgets; False: a fixed chunk
    affinity: float | None = 0.05  # session affinity tolerance (s); None: off
    chunk: int = 2048  # most prefill tokens in one step
    period: float = 0.5  # controller period (s)
    flip_cooldown: float = 1.0  # Arrow's monitor leaves instances flipped this recently (s)
    patience: int = 2  # ticks in a row before the regime switches
    ttft_slo: float = 3.0  # thresholds for requests without SLOs (Arrow's defaults)
    tpot_slo: float = 0.1
    headroom: float = 0.9  # share of the TPOT SLO a colocated step may use
    ttft_share: float = 0.3  # colocated chunks of the mean prompt may take this share of its TTFT SLO
    max_num_seqs: int = 256

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"flowyard mode must be one of {MODES}, got {self.mode!r}")
        if self.chunk < 1 or self.patience < 1 or not self.period > 0:
            raise ValueError("chunk, patience and period must be positive")


class _MonitorFlips(ArrowRouter):
    """Arrow's router whose dispatch (Alg. 1, 2) never flips an instance: only the monitor
    does, every period, from the decode side's token interval and idle prefill instances.
    On a small cluster a flip per infeasible request swings half the cluster at a time."""

    _dispatching = False

    def route(self, req, view, now):
        self._dispatching = True
        try:
            return super().route(req, view, now)
        finally:
            self._dispatching = False

    def route_decode(self, state, src, view, now):
        self._dispatching = True
        try:
            return super().route_decode(state, src, view, now)
        finally:
            self._dispatching = False

    def try_move_decode_to_prefill(self, view, now):
        return None if self._dispatching else super().try_move_decode_to_prefill(view, now)

    def try_move_prefill_to_decode(self, view, now, only=None):
        return None if self._dispatching else super().try_move_prefill_to_decode(view, now, only)


class FlowyardRouter:
    """Dispatcher, decode router and controller of `flowyard` (module docstring)."""

    routes_mixed = True  # asked where every MIXED prefill decodes (stay, or Arrow's Alg. 2)

    def __init__(self, predictor: CostModel, cfg: FlowyardConfig | None = None, name: str = "flowyard") -> None:
        self.cfg = c = cfg or FlowyardConfig()
        self.predictor = predictor
        self.arrow = (ArrowRouter if c.dispatch_flips else _MonitorFlips)(predictor, ArrowConfig(mode=c.pools, ttft_slo=c.ttft_slo, tpot_slo=c.tpot_slo, chunk_size=c.chunk,
                                                        max_num_seqs=c.max_num_seqs, flip_cooldown=c.flip_cooldown),
                                 name)
        self.regime = "disaggregated" if c.mode == "disaggregated" else "colocated"
        self.period: float | None = c.period if c.mode != "colocated" else None
        self.switches: list[tuple[float, str]] = []  # (time, regime switched to)
        self.homes: OrderedDict[str, int] = OrderedDict()
        self.sent_home = self.sent_away = 0
        self._tpots: deque[float] = deque(maxlen=256)  # TPOT SLOs of recent arrivals
        self._prompts: deque[int] = deque(maxlen=256)  # their new (uncached) prompt tokens
        self._ttfts: deque[float] = deque(maxlen=256)  # their TTFT SLOs
        self.estimates: list[tuple[float, float]] = []  # (colocated, disaggregated) prefill tokens/s per tick
        self._votes = 0  # consecutive ticks that disagreed with the regime
        self._budget_cache: dict[tuple[float, int, int], int] = {}

    @property
    def pools(self):
        return self.arrow.pools

    # -- dispatch ----------------------------------------------------------------------------
    def route(self, req: Request, view: ClusterView, now: float) -> int | None:
        if req.slo.tpot is not None:
            self._tpots.append(req.slo.tpot)
        self._prompts.append(req.prompt_len - req.history_len)
        if req.slo.ttft is not None:
            self._ttfts.append(req.slo.ttft)
        if self.regime == "disaggregated":
            pick = self.arrow.route(req, view, now)
            cands = self.arrow.pools.members(*PREFILL_SIDE) if self.arrow.pools is not None else []
        else:
            cands = list(view.instances())
            pick = min(cands, key=lambda i: self._load(view, i))
        pick = self._affine(req, view, pick, cands)
        if req.session is not None and pick is not None:
            self.homes[req.session] = pick
            self.homes.move_to_end(req.session)
            if len(self.homes) > MAX_SESSIONS:
                self.homes.popitem(last=False)
        return pick

    def _load(self, view: ClusterView, i: int) -> tuple[float, int, int]:
        s = view.snapshot(i)
        return (self.arrow.delay(s), s.running_tokens + s.incoming_tokens, i)

    def _affine(self, req: Request, view: ClusterView, pick: int | None, cands: list[int]) -> int | None:
        """A later turn of a session to its home, unless home is clearly worse (PLA-Serve)."""
        if self.cfg.affinity is None or req.session is None or not req.history_len or pick is None:
            return pick
        home = self.homes.get(req.session)
        if home is None or home == pick or home not in cands:
            return pick
        h, p = view.snapshot(home), view.snapshot(pick)
        cached = min(req.history_len, req.prompt_len - 1) // h.block_size * h.block_size
        t_home = self.arrow.delay(h) + self.arrow.ttft.remaining(cached, req.prompt_len - cached)
        t_pick = self.arrow.delay(p) + self.arrow.ttft(req.prompt_len)
        if t_home > t_pick + self.cfg.affinity:
            self.sent_away += 1
            return pick
        self.sent_home += 1
        return home

    def route_decode(self, state: RequestState, src: int, view: ClusterView, now: float) -> int:
        if self.regime == "colocated":
            return src  # decode where it prefilled: no KV moves
        return self.arrow.route_decode(state, src, view, now)

    # -- the regime controller ---------------------------------------------------------------
    def _budget(self, limit: float, n: int, ctx: float, history: int) -> int:
        """Largest prefill tokens (to 16) a step with n decodes at mean context ctx, on a prompt
        with `history` tokens computed, may carry within `limit` seconds (the cost model)."""
        key = (limit, n, int(ctx) >> 6, history >> 9)
        if key not in self._budget_cache:
            c, h = float(((int(ctx) >> 6) + 1) << 6), (history >> 9) << 9

            def fits(p: int) -> bool:
                shape = BatchShape(prefill_tokens=p, prefill_seqs=1 if p else 0, prefill_attn=p * (h + (p + 1) / 2),
                                   prefill_kv=h + p, decode_seqs=n, decode_ctx=c * n)
                return float(self.predictor.step_time(shape)) <= limit

            lo, hi = 0, self.cfg.chunk
            if fits(hi):
                lo = hi
            while hi - lo > 16:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if fits(mid) else (lo, mid)
            if len(self._budget_cache) > 4096:
                self._budget_cache.clear()
            self._budget_cache[key] = lo
        return self._budget_cache[key]

    def wanted(self, view: ClusterView) -> str:
        """The regime that serves prefill faster while decodes hold the tightest recent TPOT SLO.

        Colocated: every instance runs steps of its share of the decodes plus the largest
        prefill budget that keeps the step within the SLO (DynaServe's Alg. 2 budget, priced by
        the cost model at the mean prompt's middle chunk), one step per SLO period: N x budget /
        SLO prompt tokens per second. Disaggregated: N/2 prefill instances prefill whole prompts
        at full chunks (L / TTFT-hat(L) each) while N/2 decode instances hold all the decodes,
        which must still fit the SLO. Colocated when the TPOT SLO does not bind at all (loose
        TPOT), when it serves prefill at least as fast (short prompts, long outputs), or when
        the decode half could not hold the SLO anyway."""
        if not self._tpots:
            return "colocated"
        snaps = [view.snapshot(i) for i in view.instances()]
        n_inst = len(snaps)
        decodes = sum(s.num_decoding for s in snaps)
        running = sum(s.num_running for s in snaps)
        ctx = sum(s.running_tokens for s in snaps) / running if running else 0.0
        limit = min(self._tpots) * self.cfg.headroom
        if n_inst < 2 or self._budget(limit, -(-decodes // n_inst), ctx, 0) >= self.cfg.chunk:
            return "colocated"
        length = max(1.0, sum(self._prompts) / len(self._prompts)) if self._prompts else float(self.cfg.chunk)
        mid = self._budget(limit, -(-decodes // n_inst), ctx, int(length) // 2)
        coloc = n_inst * mid / limit
        ttft = sum(self._ttfts) / len(self._ttfts) if self._ttfts else self.cfg.ttft_slo
        if mid <= 0 or length / mid * limit > self.cfg.ttft_share * ttft:
            coloc = 0.0  # the mean prompt, cut into budget-sized chunks, would take most of its TTFT SLO
        n_p = n_inst // 2
        dis = n_p * length / max(1e-9, self.arrow.ttft(length))
        self.estimates.append((coloc, dis))
        if coloc >= dis or self._budget(limit, -(-decodes // (n_inst - n_p)), ctx, 0) <= 0:
            return "colocated"
        return "disaggregated"

    def tick(self, view: ClusterView, now: float) -> None:
        if self.cfg.mode == "auto":
            want = self.wanted(view)
            self._votes = self._votes + 1 if want != self.regime else 0
            if self._votes >= self.cfg.patience:
                self.regime, self._votes = want, 0
                self.switches.append((now, want))
        if self.regime == "disaggregated" and self.arrow.period is not None:
            self.arrow.tick(view, now)  # Arrow's monitor (creates the pools on first use)


def flowyard_policy(name: str, o) -> "Policy":
    """Assemble `flowyard` (registry entry): MIXED instances under a `Composed` global scheduler
    whose dispatcher, decode router and controller are one `FlowyardRouter`."""
    from flowyard.policies.compose import Composed
    from flowyard.policies.base import Role
    from flowyard.policies.flowyard_local import flowyard_scheduler
    from flowyard.policies.local import BatchConfig
    from flowyard.policies.registry import Policy

    if o.predictor is None:
        raise ValueError(f"{name} needs a predictor (PolicyOptions.predictor) for its regime controller, "
                         "TTFT predictor and step budgets")
    cfg = o.flowyard or FlowyardConfig(chunk=o.chunk_size or 2048, max_num_seqs=o.max_num_seqs)
    router = FlowyardRouter(o.predictor, cfg, name)
    gs = Composed(name, router, decode_router=router, controllers=[router] if router.period is not None else [])
    predictor = o.predictor

    def local(instance, role, kv, batch):
        return flowyard_scheduler(instance, role, kv, predictor, chunk=cfg.chunk, order=cfg.order,
                                  tbt_budget=cfg.tbt_budget, max_num_seqs=batch.max_num_seqs,
                                  max_model_len=batch.max_model_len, max_repeats=batch.max_repeats)

    batch = BatchConfig(max_num_batched_tokens=cfg.chunk, max_num_seqs=cfg.max_num_seqs)
    return Policy(name, gs, [Role.MIXED] * o.num_instances, {Role.MIXED: batch}, {Role.MIXED: local})
