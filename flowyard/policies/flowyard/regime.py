"""The regime controller's pricing for `flowyard` (issue 16): colocated, or Arrow's pools at
which split.

Every option is priced by the one number that decides goodput: the **load scale** it can
sustain, i.e. by how much the recent arrival rate could grow before the option's first
bottleneck saturates. Two resources can saturate:

- **prefill**: prompt tokens per second the option prefills against the arrival rate times the
  mean new prompt (λ·L);
- **decode**: decodes its steps can hold within the TPOT SLO against the decodes the cluster
  holds in steady state (`steady`, Little's law).

Disaggregated with P prefill instances: P·L/TTFT-hat(L) against λ·L, and (N − P)·n_max against
the decodes, where n_max is the largest decode-only batch whose step fits the TPOT SLO at the
decodes' mean context (the cost model). Colocated: each instance carries N-th of the decodes
plus the largest prefill budget that keeps the step within the SLO (DynaServe's Alg. 2), so
prefill and decode compete for the same steps; its scale is the largest x for which the
budgets left by x times the decodes still prefill x·λ·L. When the TPOT SLO does not bind (a
full chunk fits beside the decodes) colocation costs nothing and wins outright. Its scale is
also bounded where the prefill speed left to one prompt beside x times the decodes becomes
too slow for the prompts' TTFT SLOs (their mean tokens / TTFT SLO over `ttft_share` of it),
and, for prompts longer than a chunk, where a step with the local scheduler's prefill floor
beside the decodes no longer fits the TPOT SLO.

The split that maximises the scale wins (ties: colocated, then the current split), which is
Arrow's elastic pools sized by price instead of per-request flips: decode-heavy loads (long
outputs, tight TPOT) get more decode instances, prefill-heavy ones more prefill instances.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

from flowyard.core.plan import BatchShape
from flowyard.costmodel.base import CostModel
from flowyard.policies.arrow.router import ArrowRouter

INF = float("inf")


@dataclass(frozen=True, slots=True)
class Load:
    """What the controller observed: cluster size, arrivals and the decodes' state."""

    instances: int
    rate: float  # arrivals per second (recent)
    length: float  # mean new prompt tokens of recent arrivals
    decodes: float  # decodes held in steady state
    ctx: float  # mean context of running requests (tokens)
    tpot: float  # the tightest recent TPOT SLO (s)
    urgency: float  # mean of new prompt tokens / TTFT SLO over recent arrivals (tokens/s)


@dataclass(frozen=True, slots=True)
class Choice:
    regime: str  # "colocated" or "disaggregated"
    n_prefill: int  # prefill instances (disaggregated); 0 when colocated
    scores: dict[int, float]  # load scale of every option: 0 = colocated, P = P prefill instances


class RegimePricer:
    def __init__(self, cost: CostModel, ttft_hat: Callable[[float], float], *, chunk: int = 2048,
                 headroom: float = 0.9, decode_headroom: float = 0.97, ttft_share: float = 0.3,
                 max_num_seqs: int = 256, amortised: bool = True, mean_headroom: float = 0.95,
                 min_prefill: int = 64, comfort: float = 1.5, rescue: bool = False) -> None:
        self.cost, self.ttft_hat, self.chunk, self.amortised = cost, ttft_hat, chunk, amortised
        self.headroom, self.decode_headroom, self.ttft_share = headroom, decode_headroom, ttft_share
        self.max_num_seqs, self.mean_headroom, self.min_prefill = max_num_seqs, mean_headroom, min_prefill
        self.comfort, self.rescue = comfort, rescue
        self.kv_tokens, self.kv_headroom = cost.kv_capacity_tokens(), 0.8
        self._budgets: dict[tuple[float, int, int, int], int] = {}
        self._decodes: dict[tuple[float, int], int] = {}

    # -- cost-model look-ups (cached by bucket) --------------------------------------------------
    def _time(self, p: int, h: int, n: int, ctx: float) -> float:
        return float(self.cost.step_time(BatchShape.chunk(h, p, n, ctx * n)))

    def budget(self, limit: float, n: int, ctx: float, history: int) -> int:
        """Largest prefill tokens (to 16) a step with n decodes at mean context ctx, on a prompt
        with `history` tokens computed, may carry within `limit` seconds."""
        key = (limit, n, int(ctx) >> 6, int(history) >> 9)
        hit = self._budgets.get(key)
        if hit is None:
            c, h = float((key[2] + 1) << 6), key[3] << 9
            lo, hi = 0, self.chunk
            if self._time(hi, h, n, c) <= limit:
                lo = hi
            while hi - lo > 16:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if self._time(mid, h, n, c) <= limit else (lo, mid)
            if len(self._budgets) > 8192:
                self._budgets.clear()
            hit = self._budgets[key] = lo
        return hit

    def decode_capacity(self, limit: float, ctx: float) -> int:
        """Largest decode-only batch whose step fits `limit` at mean context ctx (0: none)."""
        key = (limit, int(ctx) >> 6)
        hit = self._decodes.get(key)
        if hit is None:
            c = float((key[1] + 1) << 6)
            lo, hi = 0, self.max_num_seqs
            if self._time(0, 0, hi, c) <= limit:
                lo = hi
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if self._time(0, 0, mid, c) <= limit else (lo, mid)
            if len(self._decodes) > 4096:
                self._decodes.clear()
            hit = self._decodes[key] = lo
        return hit

    def _kv_seqs(self, ctx: float) -> float:
        """Decodes at mean context ctx whose KV fits `kv_headroom` of one instance's cache."""
        return self.kv_headroom * self.kv_tokens / max(1.0, ctx)

    def colocated_rate(self, limit: float, per: int, ctx: float, length: float, pieces: int = 4) -> float:
        """Prompt tokens/s one colocated instance prefills with `per` decodes in every step of
        `limit` seconds: the mean prompt cut into budget-sized chunks, each budget priced at
        the history its chunk starts from (later chunks attend to more, so they are smaller;
        the rate is the harmonic mean over the prompt, not the middle chunk's budget)."""
        part = length / pieces
        steps = 0.0
        for k in range(pieces):
            b = self.budget(limit, per, ctx, int(k * part))
            if b <= 0:
                return 0.0
            steps += part / b
        return length / (steps * limit)

    # -- the options ------------------------------------------------------------------------------
    def colocated_binds(self, load: Load) -> bool:
        """Whether the TPOT SLO leaves colocated steps less than a full chunk of prefill."""
        per = -(-int(load.decodes) // max(1, load.instances))
        return self.budget(load.tpot * self.headroom, per, load.ctx, 0) < self.chunk

    def colocated_scale(self, load: Load) -> float:
        if self.amortised:
            return self._amortised_scale(load)
        n, limit = load.instances, load.tpot * self.headroom
        demand = load.rate * load.length
        per = load.decodes / n

        def rate(x: float) -> float:
            return n * self.colocated_rate(limit, -(-int(x * per) // 1), load.ctx, load.length)

        now = rate(1.0)
        if now <= 0 or load.urgency > self.ttft_share * now / n:
            return 0.0  # the mean prompt in budget-sized chunks would take most of its TTFT SLO
        return _largest(lambda x: rate(x) >= x * demand, demand)

    def _amortised_scale(self, load: Load) -> float:
        """Colocated steps whose budgets spend the decodes' banked TPOT slack (the local
        scheduler's `slack`): TPOT is a mean, so prefill may take a share f of an instance's
        time as long as its decode steps t_d(n) stretched by 1 / (1 - f) stay within the SLO.
        f = the instance's share of lambda x L over its prefill rate L / TTFT-hat(L)."""
        n, limit = load.instances, load.tpot * self.mean_headroom
        c_p = load.length / max(1e-9, self.ttft_hat(load.length))  # prompt tokens/s of one instance
        per = load.decodes / n

        def t_d(x: float, prefill: int = 0) -> float:
            return self._time(prefill, 0, max(1, -(-int(x * per) // 1)), load.ctx)

        # Prompts longer than a chunk keep some prefill in flight on a busy instance nearly all
        # the time, so a decode that has banked no slack yet sees run after run of steps with
        # at least the local scheduler's floor of prefill tokens: those must fit the SLO too.
        # (Short prompts pass in a step or two; banked slack then covers them.)
        floor = self.min_prefill if load.length > self.chunk else 0

        def fits(x: float) -> bool:
            f = x * load.rate * load.length / (n * c_p)
            return (f < 1 and t_d(x) <= (1 - f) * limit and x * per <= self._kv_seqs(load.ctx)
                    and (not floor or t_d(x, floor) <= load.tpot * self.headroom) and prompt_in_time(x))

        def prompt_in_time(x: float) -> bool:
            """The prefill speed left beside x times the decodes (their spare time, or the
            local scheduler's floor of `min_prefill` tokens a step when they leave none) takes
            at most `ttft_share` of the mean prompt's TTFT SLO. A condition on the scale, not a
            veto at the current load: near saturation it lowers colocation's score smoothly
            instead of dropping it to 0 the moment the decodes fill the steps. With the local
            scheduler's TTFT rescue a prompt that needs it runs at full speed, and `f` above
            prices what that costs the decodes."""
            if self.rescue:  # an urgent prompt gets full chunks, paid for by the decodes' slack
                return load.urgency <= self.ttft_share * c_p
            speed = max(c_p * (1 - t_d(x) / limit), self.min_prefill / limit)
            return load.urgency <= self.ttft_share * speed

        return _largest(fits, load.rate * load.length + load.decodes)

    def split_scale(self, load: Load, n_prefill: int) -> float:
        demand = load.rate * load.length
        pre = INF if demand <= 0 else n_prefill * load.length / max(1e-9, self.ttft_hat(load.length)) / demand
        cap = min(self.decode_capacity(load.tpot * self.decode_headroom, load.ctx), self._kv_seqs(load.ctx))
        dec = INF if load.decodes <= 0 else (load.instances - n_prefill) * cap / load.decodes
        return min(pre, dec)

    def choose(self, load: Load, current: int = 0, margin: float = 0.05, switch_margin: float = 0.25) -> Choice:
        """The best option (module docstring); `current` (0: colocated, else its split) keeps
        its place unless another scores `margin` better, or `switch_margin` better when it
        changes the regime (colocated <-> disaggregated moves every running decode's home, so
        a near tie must not flap), and never while its own scale is at least `comfort` (far
        from saturating, nothing is lost by staying; lulls in the arrivals price anything)."""
        if load.instances < 2 or not self.colocated_binds(load):
            return Choice("colocated", 0, {0: INF})
        if load.rate <= 0:  # nothing arrives: nothing to route differently
            return Choice("colocated" if current == 0 else "disaggregated", current, {})
        scores = {0: self.colocated_scale(load)}
        for p in range(1, load.instances):
            scores[p] = self.split_scale(load, p)
        best = max(scores, key=lambda k: (scores[k], k == 0))
        if current in scores:
            m = margin if (best == 0) == (current == 0) else switch_margin
            if scores[best] <= scores[current] * (1 + m) or scores[current] >= self.comfort:
                best = current  # a near tie, or the current option is far from saturating
        return Choice("colocated" if best == 0 else "disaggregated", best, scores)


def _largest(fits: Callable[[float], bool], demand: float) -> float:
    """Largest load scale x (to 1/256 of a doubling; at most 64) with fits(x); inf without demand."""
    if demand <= 0:
        return INF
    lo, hi = 0.0, 1.0
    while fits(hi) and hi < 64:
        lo, hi = hi, hi * 2
    for _ in range(8):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def rate(times: deque[float], now: float, window: float) -> float:
    """Events per second among `times` over the last `window` seconds before `now`."""
    if len(times) < 2:
        return 0.0
    if now - times[0] <= window:  # all of them: the first one only starts the clock
        return (len(times) - 1) / max(1e-9, now - times[0])
    return sum(1 for t in reversed(times) if t >= now - window) / window


class MonitorFlips(ArrowRouter):
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
