"""Mean and percentiles of a stream of float64 values, equal to numpy's on the whole array.

A run's TBT statistics cover every gap between consecutive output tokens: a million requests
make about two hundred million of them. `np.mean` and `np.percentile` need them in one array,
a second copy of every token time. Here the values come in batches (`batches()` yields them in
array order, and may be called again), and the results are the very floats numpy returns on
the concatenation, not approximations:

- the mean replays numpy's pairwise summation: `np.add.reduce` on a contiguous float64 array
  splits it in halves (rounded down to a multiple of 8) down to blocks of at most 128, which it
  sums with 8 accumulators; the block sums are computed batch by batch as the values arrive and
  combined in the same tree (`tests/test_exact_stats.py` checks it against numpy);
- the percentiles use numpy's default (linear) method: the two order statistics around each
  virtual index, found by a radix selection over the values' bit patterns (a histogram per
  pass, narrowing each wanted rank to one bin, until the bins are small enough to keep), then
  numpy's interpolation formula.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

Batches = Callable[[], Iterable[np.ndarray]]
BLOCK = 128  # numpy's PW_BLOCKSIZE
BITS = 16  # key bits resolved per selection pass (a histogram of 2**BITS counts per wanted bin)
KEEP = 1 << 21  # values of the wanted bins kept for an exact final selection


class PairwiseSum:
    """np.add.reduce of `n` float64 values fed in order (`feed`), bit for bit."""

    def __init__(self, n: int) -> None:
        self.n = n
        # the split tree, level by level: (size of each node, which nodes are blocks)
        self._levels: list[tuple[np.ndarray, np.ndarray]] = []
        lo, size = np.zeros(1, np.int64), np.array([n], np.int64)
        leaf_lo: list[np.ndarray] = []
        leaf_size: list[np.ndarray] = []
        while len(size):
            leaf = size <= BLOCK
            self._levels.append((size, leaf))
            leaf_lo.append(lo[leaf])
            leaf_size.append(size[leaf])
            s, start = size[~leaf], lo[~leaf]
            half = s // 2
            half -= half % 8
            lo = np.empty(2 * len(s), np.int64)
            size = np.empty(2 * len(s), np.int64)
            lo[0::2], lo[1::2] = start, start + half
            size[0::2], size[1::2] = half, s - half
        los, sizes = np.concatenate(leaf_lo), np.concatenate(leaf_size)
        order = np.argsort(los, kind="stable")
        self._leaf_rank = np.empty(len(los), np.int64)  # leaf (in level order) -> position by offset
        self._leaf_rank[order] = np.arange(len(los))
        self._lo, self._size = los[order], sizes[order]
        self._end = self._lo + self._size
        self._sums = np.empty(len(los))
        self._next = 0  # first leaf not yet summed
        self._fed = 0
        self._buf = np.empty(0)  # values fed but not yet in a summed leaf; starts at leaf _next

    def feed(self, values: np.ndarray) -> None:
        values = np.asarray(values, dtype=np.float64)
        self._fed += len(values)
        if self._fed > self.n:
            raise ValueError(f"fed {self._fed} values, expected {self.n}")
        buf = np.concatenate((self._buf, values)) if len(self._buf) else values
        first = self._next
        last = int(np.searchsorted(self._end, self._fed, side="right"))  # leaves now complete
        if last > first:
            base = int(self._lo[first])
            lo, size = self._lo[first:last] - base, self._size[first:last]
            for s in np.unique(size):
                pick = np.flatnonzero(size == s)
                rows = sliding_window_view(buf, int(s))[lo[pick]]  # the blocks of size s, copied once
                self._sums[first + pick] = _block_sums(rows)
            self._next = last
            buf = buf[int(self._end[last - 1]) - base:]
        self._buf = buf.copy() if buf.base is not None else buf

    def total(self) -> float:
        if self._fed != self.n:
            raise ValueError(f"fed {self._fed} values, expected {self.n}")
        if self.n == 0:
            return 0.0
        sums = self._sums[self._leaf_rank]  # leaf sums in level order
        used = len(sums)
        below: np.ndarray | None = None
        for size, leaf in reversed(self._levels):
            vals = np.empty(len(size))
            k = int(leaf.sum())
            vals[leaf] = sums[used - k:used]
            used -= k
            if below is not None:
                vals[~leaf] = below[0::2] + below[1::2]
            below = vals
        assert below is not None
        return float(np.float64(0.0) + below[0])


def _block_sums(rows: np.ndarray) -> np.ndarray:
    """numpy's pairwise_sum of each row of at most BLOCK values (8 accumulators)."""
    m, s = rows.shape
    if s < 8:
        res = np.zeros(m)
        for i in range(s):
            res += rows[:, i]
        return res
    r = rows[:, :8].copy()
    full = s - s % 8
    for i in range(8, full, 8):
        r += rows[:, i:i + 8]
    res = ((r[:, 0] + r[:, 1]) + (r[:, 2] + r[:, 3])) + ((r[:, 4] + r[:, 5]) + (r[:, 6] + r[:, 7]))
    for i in range(full, s):
        res += rows[:, i]
    return res


def _keys(values: np.ndarray) -> np.ndarray:
    """Unsigned integers in the order of the floats (-0.0 just below 0.0; no NaN expected)."""
    bits = np.ascontiguousarray(values, dtype=np.float64).view(np.int64)
    return np.where(bits < 0, ~bits, bits | np.int64(-(1 << 63))).view(np.uint64)


def order_statistics(batches: Batches, n: int, ranks: Sequence[int]) -> np.ndarray:
    """The values at 0-based `ranks` of the sorted concatenation of `batches()` (n values)."""
    ranks = [int(r) for r in ranks]
    if any(not 0 <= r < n for r in ranks):
        raise ValueError(f"ranks {ranks} out of range for {n} values")
    shift = 64
    prefix = {r: 0 for r in ranks}  # the key bits above `shift` every wanted value has
    within = dict((r, r) for r in ranks)  # its rank among the values with that prefix
    count = {r: n for r in ranks}  # how many values have that prefix
    while shift > 0 and max(count.values()) > KEEP:
        width = min(BITS, shift)
        shift -= width
        wanted = sorted(set(prefix.values()))
        hist = {p: np.zeros(1 << width, np.int64) for p in wanted}
        for batch in batches():
            k = _keys(batch)
            top = k >> np.uint64(shift + width) if shift + width < 64 else np.zeros(len(k), np.uint64)
            for p in wanted:
                sel = k[top == np.uint64(p)] if shift + width < 64 else k
                low = (sel >> np.uint64(shift)) & np.uint64((1 << width) - 1)
                hist[p] += np.bincount(low.astype(np.int64), minlength=1 << width)
        for r in ranks:
            cum = np.cumsum(hist[prefix[r]])
            b = int(np.searchsorted(cum, within[r], side="right"))
            before = int(cum[b - 1]) if b else 0
            prefix[r], within[r], count[r] = (prefix[r] << width) | b, within[r] - before, int(cum[b]) - before
    if shift == 0:  # every bit is known: the keys are the values
        return np.array([_value(prefix[r]) for r in ranks])
    wanted = sorted(set(prefix.values()))
    kept: dict[int, list[np.ndarray]] = {p: [] for p in wanted}
    for batch in batches():
        vals = np.ascontiguousarray(batch, dtype=np.float64)
        top = _keys(vals) >> np.uint64(shift)
        for p in wanted:
            kept[p].append(vals[top == np.uint64(p)])
    sorted_kept = {p: np.sort(np.concatenate(v)) for p, v in kept.items()}
    return np.array([sorted_kept[prefix[r]][within[r]] for r in ranks])


def _value(key: int) -> float:
    k = np.array([key], np.uint64).view(np.int64)
    bits = np.where(k < 0, k & np.int64((1 << 63) - 1), ~k)
    return float(bits.view(np.float64)[0])


def percentiles(batches: Batches, n: int, q: Sequence[float]) -> np.ndarray:
    """np.percentile(concatenation, q) (linear method) for n >= 1 values."""
    quantiles = np.true_divide(np.asarray(q, dtype=np.float64), 100)
    virtual = (n - 1) * quantiles
    prev = np.floor(virtual)
    nxt = prev + 1
    above = virtual >= n - 1
    prev[above] = -1
    nxt[above] = -1
    prev_i, next_i = prev.astype(np.intp), nxt.astype(np.intp)
    gamma = np.asanyarray(virtual - prev_i, dtype=virtual.dtype)
    ranks = sorted({int(i) % n for i in np.concatenate((prev_i, next_i))})
    found = dict(zip(ranks, order_statistics(batches, n, ranks)))
    a = np.array([found[int(i) % n] for i in prev_i])
    b = np.array([found[int(i) % n] for i in next_i])
    diff = b - a  # numpy's _lerp
    out = np.add(a, diff * gamma)
    np.subtract(b, diff * (1 - gamma), out=out, where=gamma >= 0.5)
    return out
