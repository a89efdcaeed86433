"""DynaServe's virtual-batch predictor (§4.1): one instance's future as a timeline of passes.

The global scheduler must price each probe of its split search in microseconds, so it does
not replay an instance's queue per probe. Each instance keeps a timeline of virtual passes
(struct-of-arrays: prefill tokens, decode count and context, active requests, duration, end
time) built FCFS under the runtime's constraints: a token budget per pass, a per-request
chunk cap, at most `max_seqs` active requests, every active decode advancing one token per
pass. A new segment is FCFS-last, so it never changes what earlier work gets in a pass: it
only takes the passes' free budget and adds its tokens to them, which makes them longer.

- `probe` prices that delta in O(log n): prefix sums of free budget say where its prefill
  lands, prefix sums of per-pass marginal costs (sampled from the cost model when the pass
  was priced) say how much longer those passes get, and closed forms price what runs after
  the timeline ends (solo prefill chunks, solo decodes).
- `commit` applies it: adds the tokens to the affected passes, re-prices exactly those with
  one vectorised cost-model call, and appends the tail (lone decodes priced in closed form).
  Passes already executed (end <= now) drop off as time goes on: the paper's reuse of the
  executed prefix.

The passes and their prefix sums are stored by `PassTimeline` (dynaserve/passes.py).

Approximations (documented, measured in tests/test_dynaserve.py against the simulator): a
segment's decode tokens do not take budget back from earlier prefills in the same pass, and an
idle gap (a segment waiting for KV from its other instance) stays idle in the timeline.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from flowyard.core.plan import BatchShape
from flowyard.costmodel.base import CostModel
from flowyard.policies.dynaserve.passes import DC, DUR, END, MDEC, MPF, NA, ND, PA, PK, PS, PT, PassTimeline

_PROBE_TOKENS = 64  # prefill tokens added to a pass to sample its per-token marginal cost


@dataclass(frozen=True, slots=True)
class Segment:
    """Work of one micro-request on one instance.

    prefill: tokens computed before the segment's first sample (0: decode only)
    decode: decode passes after that; history: tokens whose KV exists before the segment
    (the first segment's tokens, for a second segment); ready: earliest start (a second
    segment waits for the first one's KV)."""

    prefill: int
    decode: int
    history: int = 0
    ready: float = 0.0


@dataclass(frozen=True, slots=True)
class Estimate:
    """When the segment ends and when the instance has finished everything, with it."""

    seg_end: float
    total_end: float


class _Placement(NamedTuple):
    """Where a segment lands (see `_place`): first pass j, last prefill pass kp and its
    tokens x_last, first decode pass a and m decodes in the timeline, what is left for
    the tail (rem_p, rem_d), how much longer the timeline gets (delta), and when it is ready."""

    j: int
    kp: int
    x_last: float
    a: int
    m: int
    rem_p: int
    rem_d: int
    delta: float
    ready: float


class VirtualBatch(PassTimeline):
    """One instance's pass timeline priced by `cost`: probe and commit segments on it."""

    def __init__(self, cost: CostModel, token_budget: int, max_seqs: int, chunk_cap: int) -> None:
        self.cost = cost
        super().__init__(token_budget, max_seqs, chunk_cap)
        self._fit()

    # -- cost-model constants for the closed forms ---------------------------------------
    def _t(self, **f: Any) -> float:
        return float(self.cost.step_time(BatchShape(**f)))

    def _fit(self) -> None:
        """Slopes of the cost model sampled once: what a probe needs beyond per-pass marginals."""
        big = 4096.0
        d1, d2 = self._t(decode_seqs=1, decode_ctx=1), self._t(decode_seqs=1, decode_ctx=1 + big)
        self.q_dec = max(0.0, (d2 - d1) / big)  # per token of decode context
        self.sd0 = d1 - self.q_dec  # a lone decode at context 0
        g = float(_PROBE_TOKENS)  # the marginals `_price` samples, for a lone-decode pass
        self.md_solo = self._t(decode_seqs=2, decode_ctx=2) - d1
        self.mp_solo = (self._t(prefill_tokens=g, prefill_seqs=0, prefill_kv=g, decode_seqs=1, decode_ctx=1) - d1) / g
        c, h = float(self.cap), float(self.cap) / 2
        t1, t2 = self._t(prefill_tokens=c, prefill_seqs=1, prefill_kv=c), self._t(prefill_tokens=h, prefill_seqs=1, prefill_kv=h)
        self.sp = max(0.0, (t1 - t2) / (c - h)) if c > h else 0.0  # per prefill token
        self.s0 = t1 - self.sp * c  # per solo chunk
        pairs = c * big
        ta = self._t(prefill_tokens=c, prefill_seqs=1, prefill_kv=c, prefill_attn=pairs)
        self.q_attn = max(0.0, (ta - t1) / pairs)  # per causal query-key pair

    def solo_prefill(self, tokens: int, history: int) -> float:
        """Seconds for `tokens` prompt tokens alone, in chunks of the cap, after `history`."""
        if tokens <= 0:
            return 0.0
        r = float(tokens)
        return (math.ceil(r / self.cap) * self.s0 + self.sp * r
                + self.q_attn * (r * history + r * r / 2 + r / 2))

    def solo_decode(self, steps: int, ctx0: int) -> float:
        """Seconds for `steps` lone decodes, the first at context ctx0."""
        if steps <= 0:
            return 0.0
        m = float(steps)
        return m * self.sd0 + self.q_dec * (m * ctx0 + m * (m - 1) / 2)

    def _price(self, sl: slice, marginals: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(duration, decode marginal, prefill per-token marginal) of the passes in `sl`, in
        one vectorised cost-model call over the passes and their two perturbed copies; without
        `marginals` the old ones are kept (one more token barely moves them)."""
        M = self.M
        idle = self.idle[sl] if self._idle_end > sl.start else None  # None: no idle pass here
        cols = M[PT:DC + 1, sl]  # pt, ps, pa, pk, nd, dc: BatchShape's field order
        n = cols.shape[1]
        if not n:
            return np.zeros(0), np.zeros(0), np.zeros(0)
        if not marginals:
            t = np.asarray(self.cost.step_time(BatchShape(*cols)))
            return t if idle is None else np.where(idle, M[DUR, sl], t), M[MDEC, sl], M[MPF, sl]
        g = float(_PROBE_TOKENS)
        x = np.tile(cols, 3)  # the passes, one more decode in each, g more prefill tokens in each
        x[PT, 2 * n:] += g
        x[PK, 2 * n:] += g
        x[ND:DC + 1, n:2 * n] += 1.0
        t = np.broadcast_to(np.asarray(self.cost.step_time(BatchShape(*x)), float), (3 * n,)).reshape(3, n)
        if idle is None:
            return t[0], t[1] - t[0], (t[2] - t[0]) / g
        dur = np.where(idle, M[DUR, sl], t[0])
        return dur, np.where(idle, 0.0, t[1] - t[0]), np.where(idle, 0.0, (t[2] - t[0]) / g)

    def seed_decodes(self, remaining: np.ndarray, ctx: float, now: float) -> None:
        """Cold start on an empty timeline: requests already decoding at mean context ctx, with
        these remaining decode passes each; they run together and drop out as they finish."""
        assert not self.n, "seed_decodes needs an empty timeline"
        rem = np.sort(np.asarray(remaining, dtype=float))
        steps = int(rem[-1]) if len(rem) else 0
        if steps <= 0:
            return
        t = np.arange(steps, dtype=float)
        nd = len(rem) - np.searchsorted(rem, t, side="right").astype(float)
        self._reserve(steps)
        block = self.M[:, :steps]
        block[:] = 0.0
        block[ND], block[DC], block[NA] = nd, nd * (ctx + t), nd
        self.idle[:steps] = False
        self.n, self._dn, self._idle_end = steps, 0, 0
        sl = slice(0, steps)
        block[DUR], block[MDEC], block[MPF] = self._price(sl)
        block[END] = now + np.cumsum(block[DUR])
        self._derive()

    # -- probe and commit -----------------------------------------------------------------
    def _place(self, seg: Segment, now: float) -> _Placement:
        """Where `seg` would run if appended FCFS-last now; shared by probe and commit."""
        n = self.n
        ready = now if now > seg.ready else seg.ready  # max(seg.ready, now)
        j0 = int(self.start[:n].searchsorted(ready, side="left"))
        p, d, h = seg.prefill, seg.decode, seg.history
        j = n
        if j0 < n:  # the first open pass from j0 on: room for a prompt chunk, or for a decode
            rest = (self.room_pf if p > 0 else self.room)[j0:n]
            i = int(rest.argmax())
            if rest[i]:
                j = j0 + i
        if j >= n:
            return _Placement(j, -1, 0.0, j, 0, p, d, 0.0, ready)
        cfree, cmpf = self.C[0], self.C[1]
        kp, x_last, a, rem_p, delta = -1, 0.0, j, p, 0.0
        if p > 0:
            avail = cfree[n] - cfree[j]
            placed = min(float(p), avail)
            if avail >= p:
                kp = int(cfree[:n + 1].searchsorted(cfree[j] + p, side="left")) - 1
                x_last = p - (cfree[kp] - cfree[j])
                delta += cmpf[kp] - cmpf[j] + self.M[MPF, kp] * x_last
                rem_p, a = 0, kp + 1
            else:
                kp = n - 1
                delta += cmpf[n] - cmpf[j]
                x_last, rem_p, a = float(self.free[kp]), int(p - avail), n
            delta += self.q_attn * (placed * h + placed * placed / 2 + placed / 2)
        m, rem_d = 0, d
        if rem_p == 0:
            m = max(0, min(d, n - a))
            if m:
                c0 = h + p + 1
                cmdec = self.C[2]
                delta += cmdec[a + m] - cmdec[a] + self.q_dec * (m * (c0 - 1) + m * (m - 1) / 2)
            rem_d = d - m
        return _Placement(j, kp, x_last, a, m, rem_p, rem_d, float(delta), ready)

    def _estimate(self, seg: Segment, pl: _Placement, now: float) -> Estimate:
        n = self.n
        if pl.j >= n:  # after everything: the segment runs alone from when it is ready
            t0 = max(pl.ready, float(self.M[END, n - 1]) if n else now)
            t = t0 + self.solo_prefill(seg.prefill, seg.history) + self.solo_decode(seg.decode, seg.history + seg.prefill + 1)
            return Estimate(t, t)
        last_end = float(self.M[END, n - 1]) + pl.delta
        rem_p, rem_d = pl.rem_p, pl.rem_d
        if rem_p or rem_d:
            done = seg.prefill - rem_p
            tail = (self.solo_prefill(rem_p, seg.history + done)
                    + self.solo_decode(rem_d, seg.history + seg.prefill + 1 + (seg.decode - rem_d)))
            return Estimate(last_end + tail, last_end + tail)
        k = pl.a + pl.m - 1 if pl.m else pl.kp
        if k < 0:  # an empty segment (no prefill, no decode): the timeline's last pass, as
            k = n - 1  # the reference's end[-1]; M has spare columns past n, so never M[:, -1]
        return Estimate(float(self.M[END, k]) + pl.delta, last_end)

    def probe(self, seg: Segment, now: float) -> Estimate:
        return self._estimate(seg, self._place(seg, now), now)

    def commit(self, seg: Segment, now: float) -> Estimate:
        """Add `seg` to the timeline; returns its estimate (as `probe` would have)."""
        self._compact(now)
        pl = self._place(seg, now)
        if seg.prefill <= 0 and seg.decode <= 0:
            return Estimate(pl.ready, self.finish_time(now))
        est = self._estimate(seg, pl, now)
        n, j, M = self.n, pl.j, self.M
        h = seg.history
        last = j - 1
        if j < n:
            if seg.prefill > 0:
                kp = pl.kp
                x = self.free[j:kp + 1].copy()
                x[-1] = pl.x_last
                hk = h + x.cumsum() - x
                pos = x > 0
                M[PT, j:kp + 1] += x
                M[PS, j:kp + 1] += pos
                M[PA, j:kp + 1] += x * (hk + (x + 1) / 2)
                M[PK, j:kp + 1] += np.where(pos, hk + x, 0.0)
                last = kp
            a, m = pl.a, pl.m
            if m:
                c0 = h + seg.prefill + 1
                M[ND, a:a + m] += 1
                M[DC, a:a + m] += c0 + np.arange(m)
                last = a + m - 1
            last = max(last, j)
            M[NA, j:last + 1] += 1
            sl = slice(j, last + 1)
            dur = M[DUR, sl]
            old = dur.copy()
            dur[:] = self._price(sl, marginals=False)[0]
            shift = (dur - old).cumsum()
            M[END, sl] += shift
            M[END, last + 1:n] += shift[-1]
        self._append_tail(seg, pl)
        self._derive(min(j, n))
        return est

    def _append_tail(self, seg: Segment, pl: _Placement) -> None:
        """Passes the segment runs after the current timeline ends (alone, one after another),
        after an idle gap if it is ready only later."""
        n = self.n
        if pl.j >= n:
            rem_p, rem_d, hist = seg.prefill, seg.decode, seg.history
        else:
            rem_p, rem_d = pl.rem_p, pl.rem_d
            hist = seg.history + seg.prefill - rem_p
        if not rem_p and not rem_d:
            return
        t0 = float(self.M[END, n - 1]) if n else pl.ready
        rows: list[tuple] = []  # in _COLS order
        gap = pl.ready > t0
        if gap:  # waits for its KV: an idle gap
            rows.append((0, 0, 0, 0, 0, 0, 0, pl.ready - t0, 0, 0, 0))
        while rem_p > 0:
            x = min(self.cap, rem_p)
            rows.append((x, 1, x * (hist + (x + 1) / 2), hist + x, 0, 0, 1, 0, 0, 0, 0))
            hist, rem_p = hist + x, rem_p - x
        c0 = seg.history + seg.prefill + 1 + (seg.decode - rem_d)
        r = len(rows)
        end = n + r + rem_d
        self._reserve(end)
        M = self.M
        self.idle[n:end] = False
        if gap:
            self.idle[n], self._idle_end = True, n + 1
        if r:
            M[:, n:n + r] = np.array(rows, dtype=float).T
        dec = M[:, n + r:end]  # lone decodes, priced in closed form
        dec[:] = 0.0
        dec[ND], dec[NA], dec[DC] = 1.0, 1.0, c0 + np.arange(rem_d, dtype=float)
        dec[DUR] = self.sd0 + self.q_dec * dec[DC]
        dec[MDEC], dec[MPF] = self.md_solo, self.mp_solo
        self.n = end
        if r:
            head = slice(n, n + r)
            M[DUR, head], M[MDEC, head], M[MPF, head] = self._price(head)
        M[END, n:end] = t0 + M[DUR, n:end].cumsum()
