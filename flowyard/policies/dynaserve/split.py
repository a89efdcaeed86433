"""DynaServe's global scheduler (Alg. 1, §4.1): split every request into at most two
micro-requests and balance the two instances' predicted finishing times.

For each request the scheduler picks the next pair (A, B) of the unified pool round robin,
predicts its output length D̂ (margin included), and searches the split point s = ρ·N over
N = P + D̂ by a bounded bisection on ρ: start at ρ0 = P/N (pure PD disaggregation), predict
T_A and T_B, the times at which A and B have finished all their work including the new
segment (virtual-batch predictor, `dynaserve/vbatch.py`), move ρ towards the less loaded side,
stop when |T_A - T_B| <= tolerance or after K probes. The probe kept is the one with the
smallest makespan max(T_A, T_B) (the balance point), the request's own finish breaking ties.
ρ < P/N sends part of the prompt to B; ρ > P/N keeps some decode tokens on A; a segment
shorter than `min_segment` tokens is folded into the other one (no split at all: colocation).

Each instance's assigned-work view is the timeline of the segments committed to it, advanced
by the clock (executed passes drop off). Snapshots calibrate it: when the real instance is
idle, or its queued prompt tokens or decoding requests drift far from the view (lengths were
mispredicted, steps ran slower than priced), the view is re-seeded from the snapshot (the same
path that seeds it at cold start) plus the second segments still waiting for their KV.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from flowyard.core.request import Request, RequestState
from flowyard.costmodel.base import CostModel
from flowyard.policies.framework.capabilities import Capabilities
from flowyard.policies.framework.contracts import ClusterView, GlobalScheduler, InstanceSnapshot, Role
from flowyard.policies.dynaserve.local_batch import LocalConfig, ProfileTable
from flowyard.policies.dynaserve.lengths import LengthPredictor
from flowyard.policies.dynaserve.vbatch import Estimate, Segment, VirtualBatch


@dataclass(frozen=True, slots=True)
class DynaServeConfig:
    """Knobs of `dynaserve` (PolicyOptions.dynaserve). Lengths: "empirical" or "oracle"
    predictor, its margin, and an injected multiplicative error (factor, log-normal sigma)."""

    max_probes: int = 6  # K
    tolerance_s: float = 0.02  # |T_A - T_B| that ends the search
    tbt_slo: float = 0.1  # Alg. 2's step-time target (and the virtual passes' token budget)
    # Steps aim at this share of the SLO. A micro-request's hand-off waits for the destination's
    # step in flight and then for its next one, about 1.5 steps: at 0.9 those gaps overran the
    # SLO (P99 TBT 123 ms on Azure Code at 6 req/s); at 0.675 P99 stays ~68 ms with the same
    # throughput (flowyard reproduce dynaserve, Qwen2.5-14B on 2 A100).
    step_headroom: float = 0.675
    chunk_cap: int = 1024  # per-request prefill tokens in one step
    max_num_seqs: int = 256
    min_segment: int = 32  # shorter segments are folded into the other instance's
    split: bool = True  # False: never split (Alg. 2 batching on round-robin pairs only)
    # False: keep the split search but drop Alg. 2's step budget: every step takes a fixed
    # `chunk_cap` prefill tokens plus its decodes (Fig. 11's "without SLO-aware batching"); the
    # virtual passes of the split search then assume that budget too
    slo_batching: bool = True
    chunked_kv: bool = True  # simulator: push the first segment's KV chunk by chunk
    resync_interval_s: float = 0.25  # at most one snapshot re-seed per instance this often
    lengths: str = "empirical"
    length_margin: int = 20
    length_prior: float = 256.0
    length_error: float = 1.0
    length_sigma: float = 0.0
    # a micro-request's second segment that finds no KV on its destination this long is
    # recomputed there instead (the pair's deadlock breaker; dynaserve.local_batch.LocalConfig)
    migration_patience_s: float = 0.5

    def __post_init__(self) -> None:
        if self.max_probes < 1 or self.tolerance_s < 0 or not self.tbt_slo > 0:
            raise ValueError("max_probes >= 1, tolerance_s >= 0 and tbt_slo > 0 required")

    def local(self) -> LocalConfig:
        return LocalConfig(tbt_slo=self.tbt_slo, headroom=self.step_headroom, chunk_cap=self.chunk_cap,
                           migration_patience_s=self.migration_patience_s,
                           fixed_prefill=None if self.slo_batching else self.chunk_cap)


@dataclass(slots=True)
class SplitDecision:
    """One request's plan: it starts on `first`; split = (s, B) or None; the probes tried as
    (ρ, s, T_A, T_B, the request's own predicted finish)."""

    a: int
    b: int
    prompt: int
    predicted: int
    s: int
    first: int
    split: tuple[int, int] | None
    probes: list[tuple[float, int, float, float, float]] = field(default_factory=list)


class DynaServeRouter(GlobalScheduler):
    name = "dynaserve"

    def __init__(self, cost: CostModel, lengths: LengthPredictor, cfg: DynaServeConfig = DynaServeConfig()) -> None:
        self.cost, self.lengths, self.cfg = cost, lengths, cfg
        self.capabilities = Capabilities(chunked_kv=cfg.chunked_kv, learns=True)
        self.token_budget = (max(cfg.chunk_cap // 4, ProfileTable(cost, cfg.local()).budget(0, 0.0))
                             if cfg.slo_batching else cfg.chunk_cap)
        self.views: dict[int, VirtualBatch] = {}
        self._future: dict[int, list[tuple[float, Segment]]] = {}
        self._synced: dict[int, float] = {}
        self._next = 0
        self._dbar = float(cfg.length_prior)  # mean predicted output: re-seeding unknown requests
        self.last: SplitDecision | None = None
        self.reseeds = 0

    def on_finished(self, state: RequestState, now: float) -> None:
        """The length predictor learns from every finished request, wherever it ran (the
        executors report them; on Ray the local schedulers live in other processes)."""
        self.lengths.observe(state.req, state.num_output)

    def view(self, i: int) -> VirtualBatch:
        v = self.views.get(i)
        if v is None:
            v = self.views[i] = VirtualBatch(self.cost, self.token_budget, self.cfg.max_num_seqs, self.cfg.chunk_cap)
        return v

    # -- GlobalScheduler --------------------------------------------------------------------
    def dispatch(self, req: Request, view: ClusterView, now: float) -> tuple[int | None, tuple[int, int] | None]:
        """Alg. 1 on the next round-robin pair: the instance the request starts on and its
        split point, decided (and committed to the pair's virtual batches) together."""
        ids = list(view.instances(Role.MIXED)) or list(view.instances())
        a = ids[self._next % len(ids)]
        b = ids[(self._next + 1) % len(ids)]
        self._next += 1
        d = self.decide(req, a, b, view, now)
        return d.first, d.split

    def route(self, req: Request, view: ClusterView, now: float) -> int | None:
        return self.dispatch(req, view, now)[0]

    def split(self, req: Request, dst: int, view: ClusterView, now: float) -> tuple[int | None, tuple[int, int] | None]:
        """As a splitter part (`compose.Composed`): a dispatcher chose A = dst (round robin in
        the paper); B is the instance after it, and Alg. 1 decides the start and the split."""
        ids = list(view.instances(Role.MIXED)) or list(view.instances())
        b = ids[(ids.index(dst) + 1) % len(ids)]
        d = self.decide(req, dst, b, view, now)
        return d.first, d.split

    # -- Alg. 1 -------------------------------------------------------------------------------
    def segments(self, P: int, D: int, s: int, now: float) -> tuple[Segment | None, Segment | None]:
        """(α on A, β on B) for split point s over N = P + D (β.ready set later)."""
        if s <= 0:
            return None, Segment(P, D - 1, 0, now)
        if s >= P + D - 1:
            return Segment(P, D - 1, 0, now), None
        if s < P:
            return Segment(s, 0, 0, now), Segment(P - s, D - 1, s, now)
        return Segment(P, s - P, 0, now), Segment(0, D - 1 - (s - P), s, now)

    def _fold(self, s: int, P: int, D: int) -> int:
        """Snap a split that leaves either side less than min_segment tokens to no split."""
        N = P + D
        if s < self.cfg.min_segment:
            return 0
        if N - 1 - s < self.cfg.min_segment:
            return N
        return s

    def _estimate(self, a: int, b: int, P: int, D: int, s: int, now: float) -> tuple[float, float, float]:
        """(T_A, T_B, when the request itself would finish) for split point s."""
        va, vb = self.view(a), self.view(b)
        alpha, beta = self.segments(P, D, s, now)
        if alpha is None:
            eb = vb.probe(beta, now)  # type: ignore[arg-type]
            return va.finish_time(now), eb.total_end, eb.seg_end
        ea = va.probe(alpha, now)
        if beta is None:
            return ea.total_end, vb.finish_time(now), ea.seg_end
        eb = vb.probe(Segment(beta.prefill, beta.decode, beta.history, ea.seg_end), now)
        return ea.total_end, eb.total_end, eb.seg_end

    def decide(self, req: Request, a: int, b: int, view: ClusterView, now: float) -> SplitDecision:
        P = req.prompt_len
        D = max(1, self.lengths.predict(req))
        self._dbar = 0.95 * self._dbar + 0.05 * D
        N = P + D
        if a == b or not self.cfg.split:
            self._sync(a, view, now)
            d = SplitDecision(a, b, P, D, N, a, None)
        else:
            self._sync(a, view, now)
            self._sync(b, view, now)
            d = SplitDecision(a, b, P, D, 0, a, None)
            lo, hi, rho = 0.0, 1.0, P / N
            for _ in range(self.cfg.max_probes):
                s = self._fold(int(round(rho * N)), P, D)
                ta, tb, end = self._estimate(a, b, P, D, s, now)
                d.probes.append((rho, s, ta, tb, end))
                if abs(ta - tb) <= self.cfg.tolerance_s:
                    break
                if ta > tb:
                    hi = rho
                else:
                    lo = rho
                rho = (lo + hi) / 2
            d.s = self._best(d.probes)
            d = self._chosen(d, P, D)
        self._commit(d, now)
        self.last = d
        return d

    def _best(self, probes: list[tuple[float, int, float, float, float]]) -> int:
        """The probe with the smallest makespan max(T_A, T_B) (at the balance point when T_A
        grows and T_B shrinks with ρ); among those within tolerance of it, the one whose request
        finishes first (a split that only delays the request's second half is no gain)."""
        span = min(max(p[2], p[3]) for p in probes)
        close = [p for p in probes if max(p[2], p[3]) <= span + max(self.cfg.tolerance_s, 1e-3)]
        return min(close, key=lambda p: (p[4], max(p[2], p[3])))[1]

    def _chosen(self, d: SplitDecision, P: int, D: int) -> SplitDecision:
        """Hook for tests and ablations: the decision about to be committed."""
        s, N = d.s, P + D
        if s <= 0:
            d.first, d.split = d.b, None
        elif s >= N - 1:
            d.first, d.split = d.a, None
        else:
            d.first, d.split = d.a, (s, d.b)
        return d

    def _commit(self, d: SplitDecision, now: float) -> None:
        alpha, beta = self.segments(d.prompt, d.predicted, d.s if d.a != d.b else d.prompt + d.predicted, now)
        if d.split is None:  # whole on `first`
            self.view(d.first).commit(alpha or beta, now)  # type: ignore[arg-type]
            return
        ea: Estimate = self.view(d.a).commit(alpha, now)  # type: ignore[arg-type]
        beta = Segment(beta.prefill, beta.decode, beta.history, ea.seg_end)  # type: ignore[union-attr]
        self.view(d.b).commit(beta, now)
        if beta.ready > now:
            self._future.setdefault(d.b, []).append((beta.ready, beta))

    # -- calibration from snapshots --------------------------------------------------------------
    def _sync(self, i: int, view: ClusterView, now: float) -> None:
        v = self.view(i)
        fut = [f for f in self._future.get(i, ()) if f[0] > now]
        self._future[i] = fut
        snap = view.snapshot(i)
        busy = snap.num_requests > 0
        if not busy and not fut:
            if v.finish_time(now) > now:
                v.reset()
            return
        if now - self._synced.get(i, -np.inf) < self.cfg.resync_interval_s:
            return
        self._synced[i] = now
        w_v = v.prefill_left(now) - sum(seg.prefill for _, seg in fut)
        w_r = snap.waiting_tokens
        d_v, d_r = v.decoding_at(now), snap.num_decoding + snap.num_migrating_in
        if (abs(w_v - w_r) > max(2 * self.token_budget, 0.5 * max(w_v, w_r))
                or abs(d_v - d_r) > max(8, 0.5 * max(d_v, d_r))):
            self._reseed(i, snap, fut, now)

    def _reseed(self, i: int, snap: InstanceSnapshot, fut: list[tuple[float, Segment]], now: float) -> None:
        """Rebuild instance i's view from its snapshot (cold-start seeding): running decodes
        with remaining lengths spread uniformly up to the mean predicted output, queued and
        partial prompts with a mean-length output each, then the segments still in transit."""
        self._synced[i] = now
        self.reseeds += 1
        v = self.view(i)
        v.reset()
        partial = snap.num_running - snap.num_decoding
        queue = snap.prefill_queue
        n_dec = snap.num_decoding + snap.num_migrating_in
        if n_dec:
            ctx = max(1.0, (snap.running_tokens - sum(c + u for c, u in queue[:partial])) / max(1, snap.num_decoding))
            rem = np.ceil((np.arange(n_dec) + 0.5) / n_dec * self._dbar)
            v.seed_decodes(rem, ctx, now)
        dbar = max(1, int(self._dbar) - 1)
        for c, u in queue:
            v.commit(Segment(u, dbar, c, now), now)
        for ready, seg in fut:
            v.commit(seg, now)
