"""The pass timeline under DynaServe's virtual-batch predictor (dynaserve/vbatch.py): one
instance's future passes as columns of numbers, and the prefix sums and open masks that let
a probe place a segment in O(log n).

Storage: the columns live in one preallocated matrix (a row per column, a column per pass)
and the derived values in preallocated buffers, so a commit updates slices in place instead
of concatenating a dozen arrays, and a probe reads them without allocating. A commit makes
about a hundred numpy calls (half of them the cost model's) on ~130 passes, so their count,
not the passes, is its cost. Buffers double when full; executed passes are dropped by
copying the rest to the front (`_compact`), at the same moments as before this storage, so
the prefix sums restart from the same passes and every answer stays the same to the bit.
"""

from __future__ import annotations

import numpy as np

# Rows of the pass matrix: prefill tokens, prefill slices, causal pairs, prefill KV reads, decode
# count, decode context, active requests, duration, end time, decode and prefill marginals.
_COLS = ("pt", "ps", "pa", "pk", "nd", "dc", "na", "dur", "end", "mdec", "mpf")
PT, PS, PA, PK, ND, DC, NA, DUR, END, MDEC, MPF = range(len(_COLS))


class PassTimeline:
    """Passes under a token budget per pass, a per-request chunk cap and `max_seqs` active
    requests; what each pass costs is the subclass's business (`VirtualBatch`)."""

    def __init__(self, token_budget: int, max_seqs: int, chunk_cap: int) -> None:
        if token_budget < 1 or max_seqs < 1 or chunk_cap < 1:
            raise ValueError("token budget, max_seqs and chunk cap must be positive")
        self.budget, self.max_seqs = token_budget, max_seqs
        self.cap = min(chunk_cap, token_budget)
        self._alloc(256)
        self.reset()

    # -- storage --------------------------------------------------------------------------
    def _alloc(self, cap: int) -> None:
        """Buffers for `cap` passes: the pass matrix, the idle flags, and what `_derive` keeps
        (start times, free budget, prefix sums C = (free, marginal prefill cost, decode
        marginal) with C[:, i] summing passes < i, and the open masks)."""
        self.M = np.zeros((len(_COLS), cap))
        self.idle = np.zeros(cap, dtype=bool)
        self.start, self.free = np.zeros(cap), np.zeros(cap)
        self.C = np.zeros((3, cap + 1))
        self.room, self.room_pf = np.zeros(cap, dtype=bool), np.zeros(cap, dtype=bool)

    def _reserve(self, size: int) -> None:
        """Room for `size` passes (doubling), keeping the passes and their derived values."""
        cap = self.M.shape[1]
        if size <= cap:
            return
        old, n, dn = self.__dict__.copy(), self.n, self._dn
        self._alloc(max(size, 2 * cap))
        self.M[:, :n], self.idle[:n] = old["M"][:, :n], old["idle"][:n]
        for c in ("start", "free", "room", "room_pf"):
            getattr(self, c)[:dn] = old[c][:dn]
        self.C[:, :dn + 1] = old["C"][:, :dn + 1]

    def reset(self) -> None:
        """Forget every pass (the instance is idle)."""
        self.n = self._dn = self._idle_end = 0
        self._derive()

    @property
    def passes(self) -> int:
        return self.n

    @property
    def end(self) -> np.ndarray:
        """End time of each pass (a view)."""
        return self.M[END, :self.n]

    def finish_time(self, now: float) -> float:
        """When the instance has finished all committed work (now if it already has)."""
        return max(now, float(self.M[END, self.n - 1])) if self.n else now

    def _done(self, now: float) -> int:
        """Passes executed by `now`."""
        return int(self.M[END, :self.n].searchsorted(now, side="right"))

    def prefill_left(self, now: float) -> float:
        """Prompt tokens in passes not yet executed at `now`."""
        return float(self.M[PT, self._done(now):self.n].sum())

    def decoding_at(self, now: float) -> int:
        k = self._done(now)
        return int(self.M[ND, k]) if k < self.n else 0

    def _derive(self, k: int = 0) -> None:
        """Prefix sums and open masks that make a probe O(log n), recomputed from pass k on
        (passes before k kept their times, free budget, marginals and open state)."""
        n, M = self.n, self.M
        k = min(k, self._dn, n)
        self._dn = n
        idle = self.idle[k:n] if self._idle_end > k else None  # None: no idle pass from k on
        np.subtract(M[END, k:n], M[DUR, k:n], out=self.start[k:n])
        free = self.free[k:n]
        np.subtract(self.budget, M[PT, k:n], out=free)
        free -= M[ND, k:n]
        np.maximum(free, 0.0, out=free)  # np.clip(free, 0, cap) without its dispatch cost
        np.minimum(free, self.cap, out=free)
        if idle is not None:
            free[idle] = 0.0
        block = self.C[:, k + 1:n + 1]
        block[0], block[2] = free, M[MDEC, k:n]
        np.multiply(M[MPF, k:n], free, out=block[1])
        block.cumsum(axis=1, out=block)
        if k:
            block += self.C[:, k:k + 1]
        # passes a decode-only segment may join / a prompt may start in
        room, room_pf = self.room[k:n], self.room_pf[k:n]
        np.less(M[NA, k:n], self.max_seqs, out=room)
        if idle is not None:
            room &= ~idle
        np.greater(free, 0.0, out=room_pf)
        room_pf &= room

    def _compact(self, now: float) -> None:
        k = self._done(now)
        if k and (k >= 256 or 2 * k >= self.n):
            n = self.n
            self.M[:, :n - k] = self.M[:, k:n]
            self.idle[:n - k] = self.idle[k:n]
            self.n, self._dn, self._idle_end = n - k, 0, max(0, self._idle_end - k)
            self._derive()

