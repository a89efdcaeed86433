"""Per-request token spans for `summarize`, computed a batch of requests at a time.

The token times of a run are stored as numpy chunks per request (`RequestState.token_times`).
`summarize` needs, per completed request, its first and last token time, its token count and
its largest gap, and, over the whole run, every gap (TBT percentiles). Concatenating every
request's chunks at once holds a second copy of all token times, then their gaps, then the gaps
again without the ones that straddle two requests: a million requests' tokens three times
over. Here a batch of requests is concatenated at a time and its gaps are written into one
preallocated array, so the peak is the stored tokens plus one copy of the gaps. The values,
and their order, are the same as the one-shot computation's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BATCH_REQUESTS = 8192  # completed requests concatenated at a time (their tokens, three times, at peak)


@dataclass(slots=True)
class TokenSpans:
    first: np.ndarray  # first token time (NaN without tokens)
    last: np.ndarray  # last token time (NaN without tokens)
    n: np.ndarray  # tokens (int64)
    max_gap: np.ndarray  # largest gap between consecutive tokens (NaN with fewer than 2)
    gaps: np.ndarray  # every gap inside a request, request after request


def token_spans(chunks: list[np.ndarray], nchunks: list[int], batch: int = BATCH_REQUESTS) -> TokenSpans:
    """Spans of requests whose token chunks are `chunks`, `nchunks[r]` of them for request r."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    nch = np.asarray(nchunks, dtype=np.int64)
    clen = np.fromiter(map(len, chunks), dtype=np.int64, count=len(chunks))
    cum = np.concatenate(([0], np.cumsum(clen)))
    cend = np.cumsum(nch)
    cstart = cend - nch
    n = cum[cend] - cum[cstart]
    m = len(nch)
    first, last, max_gap = np.full(m, np.nan), np.full(m, np.nan), np.full(m, np.nan)
    gaps = np.empty(int(np.maximum(n - 1, 0).sum()))
    g = 0
    for lo in range(0, m, batch):
        hi = min(m, lo + batch)
        c0, c1 = int(cstart[lo]), int(cend[hi - 1])
        # token span [start, end) of each request inside the batch's concatenation; a trailing
        # NaN sentinel keeps the first/last lookups of token-less requests in range
        all_t = np.concatenate(chunks[c0:c1] + [np.full(1, np.nan)]).astype(float, copy=False)
        start = cum[cstart[lo:hi]] - cum[c0]
        end = start + n[lo:hi]
        has = n[lo:hi] > 0
        first[lo:hi] = np.where(has, all_t[start], np.nan)
        last[lo:hi] = np.where(has, all_t[end - 1], np.nan)
        # the gaps that straddle two requests become -inf, so a max over a request's span
        # ignores them; then they are dropped
        d = np.diff(all_t[:-1])
        del all_t
        bounds = start[has & (start > 0)] - 1
        d[bounds[bounds < len(d)]] = -np.inf
        multi = n[lo:hi] >= 2
        if multi.any():
            max_gap[lo:hi][multi] = np.maximum.reduceat(d, start[multi])
        kept = d[d != -np.inf] if len(bounds) else d
        gaps[g:g + len(kept)] = kept
        g += len(kept)
    assert g == len(gaps)
    return TokenSpans(first, last, n, max_gap, gaps)
