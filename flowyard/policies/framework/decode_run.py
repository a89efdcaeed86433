"""Multi-step decode runs: how far ahead a decode-only plan may reserve KV.

A simulator folds a decode-only plan into one event of up to `max_repeats` steps; the
reservation must match what stepping one at a time would hold, or the runs would evict
cached prefixes early (the blocks they reserve are taken from the cache's free queue).
"""

from __future__ import annotations

from flowyard.core.kvcache import KVCacheManager, cdiv
from flowyard.core.request import RequestState


def reserve_run(kv: KVCacheManager, decodes: list[RequestState], max_repeats: int, max_model_len: int) -> int:
    """Longest decode-only run (<= max_repeats) of `decodes` whose KV fits now; reserves it.
    Never past the first decode's known end (max_tokens, or the trace's length in the
    simulator, which stops the run there anyway) nor a micro-request's split point: blocks
    reserved beyond would be trimmed again, and taking them evicts cached prefixes that one
    step at a time would keep."""
    bs = kv.block_size
    cap = max_repeats
    for d in decodes:
        cap = min(cap, max_model_len - d.seq_len)
        if d.req.max_tokens is not None or d.req.output_len is not None:
            cap = min(cap, d.remaining_output)
        if d.split_at is not None and d.num_computed < d.split_at:
            cap = min(cap, d.split_at - d.num_computed)
    free = kv.num_free_blocks
    ctx = [(d.num_computed, kv.num_held(d.id)) for d in decodes]
    lo, hi = 1, max(cap, 1)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if sum(max(0, cdiv(c + mid, bs) - h) for c, h in ctx) <= free:
            lo = mid
        else:
            hi = mid - 1
    if lo > 1:
        for d in decodes:
            kv.allocate(d.id, d.num_computed + lo)
    return lo
