"""Per-request token spans for `summarize`, computed a batch of requests at a time.

The token times of a run are stored as numpy chunks per request (`RequestState.token_times`).
`summarize` needs, per completed request, its first and last token time, its token count and
its largest gap, and, over the whole run, the mean and percentiles of every gap (TBT). Holding
every gap at once would be a second copy of all token times (a million requests: about two
hundred million gaps). Here a batch of requests is concatenated at a time; the gaps of each
batch feed numpy's pairwise sum as they come (`exact_stats.PairwiseSum`), and
`TokenSpans.gap_batches` makes them again, in the same order, for the percentile passes
(`exact_stats.percentiles`). The values are those of the one-shot computation on the
concatenated gaps, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from flowyard.core.exact_stats import PairwiseSum

# completed requests concatenated at a time: their tokens a few times over at peak (a batch's
# concatenation, gaps and the sum's or selection's scratch), so a few tens of MB
BATCH_REQUESTS = 2048
# Up to this many gaps (32 MiB) they are simply kept in one array: streaming them costs more
# time than the copy costs memory in a small run (a sweep runs thousands of those)
KEEP_GAPS = 1 << 22


@dataclass(slots=True)
class TokenSpans:
    first: np.ndarray  # first token time (NaN without tokens)
    last: np.ndarray  # last token time (NaN without tokens)
    n: np.ndarray  # tokens (int64)
    max_gap: np.ndarray  # largest gap between consecutive tokens (NaN with fewer than 2)
    n_gaps: int  # gaps inside requests, all requests together
    gap_sum: float  # their np.sum in request order (numpy's pairwise summation)
    _chunks: list[np.ndarray] = field(repr=False)
    _nchunks: list[int] = field(repr=False)
    _batch: int = field(repr=False)
    kept: np.ndarray | None = None  # every gap in one array, when there are at most KEEP_GAPS

    def gap_batches(self) -> Iterator[np.ndarray]:
        """Every gap inside a request, request after request, a batch of requests at a time."""
        if self.kept is not None:
            yield self.kept
            return
        for kept, _, _, _ in _batches(self._chunks, self._nchunks, self._batch):
            yield kept

    @property
    def gaps(self) -> np.ndarray:
        """All gaps in one array (small runs and tests; summarize streams large ones)."""
        if self.kept is not None:
            return self.kept
        parts = list(self.gap_batches())
        return np.concatenate(parts) if parts else np.empty(0)


def token_spans(chunks: list[np.ndarray], nchunks: list[int], batch: int = BATCH_REQUESTS) -> TokenSpans:
    """Spans of requests whose token chunks are `chunks`, `nchunks[r]` of them for request r."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    n = _counts(chunks, nchunks)
    m = len(n)
    first, last, max_gap = np.full(m, np.nan), np.full(m, np.nan), np.full(m, np.nan)
    n_gaps = int(np.maximum(n - 1, 0).sum())
    keep = n_gaps <= KEEP_GAPS
    total = PairwiseSum(0 if keep else n_gaps)
    gaps = np.empty(n_gaps if keep else 0)
    g = 0
    for kept, lo, hi, parts in _batches(chunks, nchunks, batch):
        f, la, mg = parts
        first[lo:hi], last[lo:hi], max_gap[lo:hi] = f, la, mg
        if keep:
            gaps[g:g + len(kept)] = kept
            g += len(kept)
        else:
            total.feed(kept)
    gap_sum = float(np.sum(gaps)) if keep else total.total()
    return TokenSpans(first, last, n, max_gap, n_gaps, gap_sum, chunks, nchunks, batch, gaps if keep else None)


def _counts(chunks: list[np.ndarray], nchunks: list[int]) -> np.ndarray:
    nch = np.asarray(nchunks, dtype=np.int64)
    clen = np.fromiter(map(len, chunks), dtype=np.int64, count=len(chunks))
    cum = np.concatenate(([0], np.cumsum(clen)))
    cend = np.cumsum(nch)
    return cum[cend] - cum[cend - nch]


def _batches(chunks: list[np.ndarray], nchunks: list[int], batch: int):
    """Per batch of requests [lo, hi): its gaps (request after request) and its requests'
    (first, last, max gap)."""
    nch = np.asarray(nchunks, dtype=np.int64)
    clen = np.fromiter(map(len, chunks), dtype=np.int64, count=len(chunks))
    cum = np.concatenate(([0], np.cumsum(clen)))
    cend = np.cumsum(nch)
    cstart = cend - nch
    n = cum[cend] - cum[cstart]
    m = len(nch)
    for lo in range(0, m, batch):
        hi = min(m, lo + batch)
        c0, c1 = int(cstart[lo]), int(cend[hi - 1])
        # token span [start, end) of each request inside the batch's concatenation; a trailing
        # NaN sentinel keeps the first/last lookups of token-less requests in range
        all_t = np.concatenate(chunks[c0:c1] + [np.full(1, np.nan)]).astype(float, copy=False)
        start = cum[cstart[lo:hi]] - cum[c0]
        end = start + n[lo:hi]
        has = n[lo:hi] > 0
        first = np.where(has, all_t[start], np.nan)
        last = np.where(has, all_t[end - 1], np.nan)
        # the gaps that straddle two requests become -inf, so a max over a request's span
        # ignores them; then they are dropped
        d = np.diff(all_t[:-1])
        del all_t
        bounds = start[has & (start > 0)] - 1
        d[bounds[bounds < len(d)]] = -np.inf
        multi = n[lo:hi] >= 2
        max_gap = np.full(hi - lo, np.nan)
        if multi.any():
            max_gap[multi] = np.maximum.reduceat(d, start[multi])
        kept = d[d != -np.inf] if len(bounds) else d
        yield kept, lo, hi, (first, last, max_gap)
