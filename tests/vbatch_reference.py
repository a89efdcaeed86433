"""Reference for tests/test_dynaserve_vbatch.py: DynaServe's virtual-batch predictor as it was
before its storage was made preallocated (flowyard/policies/dynaserve/vbatch.py at 383a239),
one numpy array per column, concatenated on every commit. The fast version must give the same
answers bit for bit; this one is kept frozen."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from flowyard.core.plan import BatchShape
from flowyard.costmodel.base import CostModel

_COLS = ("pt", "ps", "pa", "pk", "nd", "dc", "na", "dur", "end", "idle", "mdec", "mpf")
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


class VirtualBatch:
    def __init__(self, cost: CostModel, token_budget: int, max_seqs: int, chunk_cap: int) -> None:
        if token_budget < 1 or max_seqs < 1 or chunk_cap < 1:
            raise ValueError("token budget, max_seqs and chunk cap must be positive")
        self.cost, self.budget, self.max_seqs = cost, token_budget, max_seqs
        self.cap = min(chunk_cap, token_budget)
        self._fit()
        self.reset()

    # -- cost-model constants for the closed forms ---------------------------------------
    def _t(self, **f: float) -> float:
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

    # -- the timeline ---------------------------------------------------------------------
    def reset(self) -> None:
        """Forget every pass (the instance is idle)."""
        for c in _COLS:
            setattr(self, c, np.zeros(0, dtype=bool if c == "idle" else float))
        self.free, self.start = np.zeros(0), np.zeros(0)
        self.room = self.room_pf = np.zeros(0, dtype=bool)
        self._derive()

    @property
    def passes(self) -> int:
        return len(self.end)

    def finish_time(self, now: float) -> float:
        """When the instance has finished all committed work (now if it already has)."""
        return max(now, float(self.end[-1])) if len(self.end) else now

    def prefill_left(self, now: float) -> float:
        """Prompt tokens in passes not yet executed at `now`."""
        k = int(np.searchsorted(self.end, now, side="right"))
        return float(self.pt[k:].sum())

    def decoding_at(self, now: float) -> int:
        k = int(np.searchsorted(self.end, now, side="right"))
        return int(self.nd[k]) if k < len(self.nd) else 0

    def _derive(self, k: int = 0) -> None:
        """Prefix sums and next-open indices that make a probe O(log n), recomputed from pass
        k on (passes before k kept their times, free budget, marginals and open state)."""
        n = len(self.end)
        k = min(k, len(self.free), len(self.start), n)
        m = n - k
        idle = self.idle[k:]
        self.start = np.concatenate((self.start[:k], self.end[k:] - self.dur[k:]))
        free = self.budget - self.pt[k:] - self.nd[k:]
        np.clip(free, 0.0, self.cap, out=free)
        free[idle] = 0.0
        self.free = np.concatenate((self.free[:k], free))
        block = np.empty((3, m))
        block[0], block[2] = free, self.mdec[k:]
        np.multiply(self.mpf[k:], free, out=block[1])
        np.cumsum(block, axis=1, out=block)
        C = np.empty((3, n + 1))
        if k:
            C[:, :k + 1] = self.C[:, :k + 1]
            block += self.C[:, k:k + 1]
        else:
            C[:, 0] = 0.0
        C[:, k + 1:] = block
        self.C = C
        self.Cfree, self.Cmpf, self.Cmdec = C
        # passes a decode-only segment may join / a prompt may start in
        room = ~idle & (self.na[k:] < self.max_seqs)
        self.room = np.concatenate((self.room[:k], room))
        self.room_pf = np.concatenate((self.room_pf[:k], room & (free > 0)))

    @staticmethod
    def _first(mask: np.ndarray, j0: int) -> int:
        """First index >= j0 where mask holds (len(mask) if none)."""
        rest = mask[j0:]
        i = int(rest.argmax()) if len(rest) else 0
        return j0 + i if len(rest) and rest[i] else len(mask)

    def _price(self, sl: slice, marginals: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(duration, decode marginal, prefill per-token marginal) of the passes in `sl`, in
        one vectorised cost-model call over the passes and their two perturbed copies; without
        `marginals` the old ones are kept (one more token barely moves them)."""
        pt, ps, pa, pk, nd, dc = (getattr(self, c)[sl] for c in ("pt", "ps", "pa", "pk", "nd", "dc"))
        n, idle = len(pt), self.idle[sl]
        if not n:
            return np.zeros(0), np.zeros(0), np.zeros(0)
        if not marginals:
            t = self.cost.step_time(BatchShape(pt, ps, pa, pk, nd, dc))
            return np.where(idle, self.dur[sl], t), self.mdec[sl], self.mpf[sl]
        g = float(_PROBE_TOKENS)
        zero = np.zeros(n)
        one, add = zero + 1, zero + g
        shape = BatchShape(
            prefill_tokens=np.concatenate((pt, pt, pt + add)), prefill_seqs=np.tile(ps, 3),
            prefill_attn=np.tile(pa, 3), prefill_kv=np.concatenate((pk, pk, pk + add)),
            decode_seqs=np.concatenate((nd, nd + one, nd)), decode_ctx=np.concatenate((dc, dc + one, dc)))
        t = np.broadcast_to(np.asarray(self.cost.step_time(shape), float), (3 * n,)).reshape(3, n)
        dur = np.where(idle, self.dur[sl], t[0])
        return dur, np.where(idle, 0.0, t[1] - t[0]), np.where(idle, 0.0, (t[2] - t[0]) / g)

    def seed_decodes(self, remaining: np.ndarray, ctx: float, now: float) -> None:
        """Cold start on an empty timeline: requests already decoding at mean context ctx, with
        these remaining decode passes each; they run together and drop out as they finish."""
        assert not len(self.end), "seed_decodes needs an empty timeline"
        rem = np.sort(np.asarray(remaining, dtype=float))
        steps = int(rem[-1]) if len(rem) else 0
        if steps <= 0:
            return
        t = np.arange(steps, dtype=float)
        nd = len(rem) - np.searchsorted(rem, t, side="right").astype(float)
        zero = np.zeros(steps)
        cols = dict(pt=zero, ps=zero, pa=zero, pk=zero, nd=nd, dc=nd * (ctx + t), na=nd,
                    dur=zero, end=zero, idle=np.zeros(steps, dtype=bool), mdec=zero, mpf=zero)
        for c in _COLS:
            setattr(self, c, cols[c].copy())
        sl = slice(0, steps)
        self.dur[sl], self.mdec[sl], self.mpf[sl] = self._price(sl)
        self.end = now + np.cumsum(self.dur)
        self._derive()

    def _compact(self, now: float) -> None:
        k = int(np.searchsorted(self.end, now, side="right"))
        if k and (k >= 256 or 2 * k >= len(self.end)):
            for c in _COLS:
                setattr(self, c, getattr(self, c)[k:])
            self._derive()

    # -- probe and commit -----------------------------------------------------------------
    def _place(self, seg: Segment, now: float) -> dict:
        """Where `seg` would run if appended FCFS-last now; shared by probe and commit."""
        n = len(self.end)
        ready = max(seg.ready, now)
        j0 = int(np.searchsorted(self.start, ready, side="left"))
        p, d, h = seg.prefill, seg.decode, seg.history
        j = self._first(self.room_pf if p > 0 else self.room, j0) if j0 < n else n
        out = dict(j=j, kp=-1, x_last=0.0, a=j, m=0, rem_p=p, rem_d=d, delta=0.0, ready=ready)
        if j >= n:
            return out
        delta = 0.0
        if p > 0:
            avail = self.Cfree[n] - self.Cfree[j]
            placed = min(float(p), avail)
            if avail >= p:
                kp = int(np.searchsorted(self.Cfree, self.Cfree[j] + p, side="left")) - 1
                x_last = p - (self.Cfree[kp] - self.Cfree[j])
                delta += self.Cmpf[kp] - self.Cmpf[j] + self.mpf[kp] * x_last
                out.update(kp=kp, x_last=x_last, rem_p=0, a=kp + 1)
            else:
                kp = n - 1
                delta += self.Cmpf[n] - self.Cmpf[j]
                out.update(kp=kp, x_last=float(self.free[kp]), rem_p=int(p - avail), a=n)
            delta += self.q_attn * (placed * h + placed * placed / 2 + placed / 2)
        if out["rem_p"] == 0:
            a = out["a"]
            m = max(0, min(d, n - a))
            if m:
                c0 = h + p + 1
                delta += self.Cmdec[a + m] - self.Cmdec[a] + self.q_dec * (m * (c0 - 1) + m * (m - 1) / 2)
            out.update(m=m, rem_d=d - m)
        out["delta"] = float(delta)
        return out

    def _estimate(self, seg: Segment, pl: dict, now: float) -> Estimate:
        n = len(self.end)
        if pl["j"] >= n:  # after everything: the segment runs alone from when it is ready
            t0 = max(pl["ready"], float(self.end[-1]) if n else now)
            t = t0 + self.solo_prefill(seg.prefill, seg.history) + self.solo_decode(seg.decode, seg.history + seg.prefill + 1)
            return Estimate(t, t)
        last_end = float(self.end[-1]) + pl["delta"]
        rem_p, rem_d = pl["rem_p"], pl["rem_d"]
        if rem_p or rem_d:
            done = seg.prefill - rem_p
            tail = (self.solo_prefill(rem_p, seg.history + done)
                    + self.solo_decode(rem_d, seg.history + seg.prefill + 1 + (seg.decode - rem_d)))
            return Estimate(last_end + tail, last_end + tail)
        k = pl["a"] + pl["m"] - 1 if pl["m"] else pl["kp"]
        return Estimate(float(self.end[k]) + pl["delta"], last_end)

    def probe(self, seg: Segment, now: float) -> Estimate:
        return self._estimate(seg, self._place(seg, now), now)

    def commit(self, seg: Segment, now: float) -> Estimate:
        """Add `seg` to the timeline; returns its estimate (as `probe` would have)."""
        self._compact(now)
        pl = self._place(seg, now)
        if seg.prefill <= 0 and seg.decode <= 0:
            return Estimate(pl["ready"], self.finish_time(now))
        est = self._estimate(seg, pl, now)
        n, j = len(self.end), pl["j"]
        h = seg.history
        last = j - 1
        if j < n:
            if seg.prefill > 0:
                kp = pl["kp"]
                x = self.free[j:kp + 1].copy()
                x[-1] = pl["x_last"]
                hk = h + np.cumsum(x) - x
                self.pt[j:kp + 1] += x
                self.ps[j:kp + 1] += x > 0
                self.pa[j:kp + 1] += x * (hk + (x + 1) / 2)
                self.pk[j:kp + 1] += np.where(x > 0, hk + x, 0.0)
                last = kp
            a, m = pl["a"], pl["m"]
            if m:
                c0 = h + seg.prefill + 1
                self.nd[a:a + m] += 1
                self.dc[a:a + m] += c0 + np.arange(m)
                last = a + m - 1
            last = max(last, j)
            self.na[j:last + 1] += 1
            sl = slice(j, last + 1)
            old = self.dur[sl].copy()
            self.dur[sl] = self._price(sl, marginals=False)[0]
            shift = np.cumsum(self.dur[sl] - old)
            self.end[sl] += shift
            self.end[last + 1:] += shift[-1]
        self._append_tail(seg, pl, now)
        self._derive(min(j, n))
        return est

    def _append_tail(self, seg: Segment, pl: dict, now: float) -> None:
        """Passes the segment runs after the current timeline ends (alone, one after another),
        after an idle gap if it is ready only later."""
        n = len(self.end)
        if pl["j"] >= n:
            rem_p, rem_d, hist = seg.prefill, seg.decode, seg.history
        else:
            rem_p, rem_d = pl["rem_p"], pl["rem_d"]
            hist = seg.history + seg.prefill - rem_p
        if not rem_p and not rem_d:
            return
        t0 = float(self.end[-1]) if n else pl["ready"]
        rows: list[tuple] = []  # in _COLS order
        if pl["ready"] > t0:  # waits for its KV: an idle gap
            rows.append((0, 0, 0, 0, 0, 0, 0, pl["ready"] - t0, 0, True, 0, 0))
        while rem_p > 0:
            x = min(self.cap, rem_p)
            rows.append((x, 1, x * (hist + (x + 1) / 2), hist + x, 0, 0, 1, 0, 0, False, 0, 0))
            hist, rem_p = hist + x, rem_p - x
        c0 = seg.history + seg.prefill + 1 + (seg.decode - rem_d)
        head = list(zip(*rows)) if rows else [()] * len(_COLS)
        dec = {"nd": np.ones(rem_d), "na": np.ones(rem_d), "dc": c0 + np.arange(rem_d, dtype=float)}
        for c, col in zip(_COLS, head):
            dtype = bool if c == "idle" else float
            tail = dec.get(c, np.zeros(rem_d, dtype=dtype))
            setattr(self, c, np.concatenate((getattr(self, c), np.asarray(col, dtype=dtype), tail)))
        head_sl, dec_sl = slice(n, n + len(rows)), slice(n + len(rows), len(self.pt))
        self.dur[head_sl], self.mdec[head_sl], self.mpf[head_sl] = self._price(head_sl)
        self.dur[dec_sl] = self.sd0 + self.q_dec * self.dc[dec_sl]  # lone decodes: closed form
        self.mdec[dec_sl], self.mpf[dec_sl] = self.md_solo, self.mp_solo
        sl = slice(n, len(self.pt))
        self.end[sl] = t0 + np.cumsum(self.dur[sl])
