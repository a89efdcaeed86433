"""`flowyard`'s colocated dispatch from score-ordered indexes: the same pick as reading every
instance's snapshot (`FlowyardRouter._colocated_pick`), without reading most of them.

The scan picks, among the instances whose predicted prefill delay d keeps the prompt's TTFT
within its limit (d + own prefill <= limit, d <= best delay + tolerance), the least
(decode step with the prompt added, d, id). When some instance has an empty prefill queue the
best delay is 0, so an instance qualifies only with d <= tolerance; its decode step
f(n, ctx + prompt) depends on its decode count n (fixed inside a multi-step decode run: the run
ends at the first finish) and its context ctx (which only grows inside a run), and the roofline
step time is non-decreasing in ctx for a fixed n. So the index orders instances by (n, ctx,
id) as of their last change (ctx then a lower bound), and the search reads, group by group of
equal n, only the instances whose lower bound could still beat the best found: an exact
answer, re-reading a handful of snapshots instead of all of them.

Where the shortcut does not hold (no instance with an empty prefill queue, a prompt whose own
prefill alone breaks the limit, another queue order or dispatch rule, stale snapshots) the
caller scans as before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from flowyard.core.plan import BatchShape
from flowyard.core.request import Request
from flowyard.policies.framework.contracts import ClusterView, InstanceSnapshot
from flowyard.policies.framework.slack import deadline

if TYPE_CHECKING:
    from flowyard.policies.flowyard.router import FlowyardRouter

# From this many instances the dispatch reads indexes; below it the scan (cheap, and the
# reference the index must equal) runs.
INDEX_MIN = 32


def _load_key(s: InstanceSnapshot) -> tuple[int, int]:
    """(decodes held, context held) once everything on the instance decodes."""
    return (s.num_running + s.num_waiting + s.num_migrating_in,
            s.running_tokens + s.waiting_tokens + s.incoming_tokens)


def _queued(s: InstanceSnapshot) -> bool:
    return bool(s.prefill_queue)


def indexed_pick(router: "FlowyardRouter", req: Request, view: ClusterView, cands: list[int],
                 now: float) -> int | None:
    """The scan's pick from the indexes, or None where the caller must scan (module docstring)."""
    cfg = router.cfg
    ranked = getattr(view, "ranked", None)
    if (ranked is None or len(cands) < INDEX_MIN or cfg.dispatch != "decode" or cfg.order != "s-edf"
            or not cfg.delay_ahead):
        return None
    ids = lambda: cands  # noqa: E731  (colocated: every instance, a fixed set)
    queued = ranked("flowyard:queued", _queued, ids)
    first = queued.least_key()
    if first is None or first[0]:
        return None  # every instance queues prefill work: the best delay needs them all
    ttft = req.slo.ttft if req.slo.ttft is not None else cfg.ttft_slo
    own = router.arrow.ttft(max(1, req.prompt_len - req.history_len))
    limit = 2 * cfg.ttft_share * ttft
    if not own <= limit:
        return None  # no instance qualifies: the scan's fallback (least delay)
    tol = 0.0 + cfg.delay_tolerance * ttft  # best delay (0.0) + tolerance, as the scan sums it
    due = deadline(req)
    ahead, chunk = router.arrow.ttft.delay_ahead, cfg.chunk
    prompt = req.prompt_len
    order = ranked("flowyard:load", _load_key, ids).ordered()
    # the first member of each group of equal n: its key bounds the whole group's step from below
    starts, pos, total = [], 0, len(order)
    while pos < total:
        starts.append(pos)
        pos = order.bisect_left(((order[pos][0][0] + 1, -1), -1))
    heads = [order[p][0] for p in starts]
    bounds = np.asarray(router.predictor.step_time(BatchShape(
        decode_seqs=np.array([n + 1 for n, _ in heads], dtype=np.int64),
        decode_ctx=np.array([float(c + prompt) for _, c in heads]))))
    best: tuple[float, float, int] | None = None
    for g in np.argsort(bounds, kind="stable"):
        if best is not None and bounds[g] > best[0]:
            break  # the groups left are bounded above the best
        pos = starts[g]
        end = starts[g + 1] if g + 1 < len(starts) else total
        while pos < end:
            (n, c), i = order[pos]
            low = router._decode_step_nc(n + 1, c + prompt)
            if best is not None and low > best[0]:
                break  # members after this one hold at least as much context
            if best is not None and (low, 0.0, i) >= best:
                # this one cannot win; neither can the rest with the same key (larger ids) when
                # the best already has no delay
                pos = order.bisect_left(((n, c + 1), -1)) if best[1] == 0.0 and low == best[0] else pos + 1
                continue
            s = view.snapshot(i)  # the current state (commits a decode run up to now)
            d = ahead(s, chunk, due, now) if s.prefill_queue else 0.0
            if d + own <= limit and d <= tol:
                now_key = _load_key(s)
                step = low if now_key == (n, c) else router._decode_step_nc(now_key[0] + 1, now_key[1] + prompt)
                key = (step, d, i)
                if best is None or key < best:
                    best = key
            pos += 1
    return best[2] if best is not None else None


KV_HEADROOM = 0.9  # share of an instance's KV cache consolidation fills before spilling over


def consolidated(req: Request, view: ClusterView, cands: list[int], max_seqs: float) -> list[int]:
    """On a shared device (`FlowyardRouter`'s `consolidate`): the first of `cands` whose KV
    cache holds what it runs and receives plus this prompt within `KV_HEADROOM`, with fewer
    than `max_seqs` running; all of them when none does, for the usual colocated pick to spread
    the overflow. Its queue does not count: queued prompts hold no KV yet, and the device, not
    the instance, is what they wait for, so a second queue would only add steps."""
    for i in cands:
        s = view.snapshot(i)
        held = s.running_tokens + s.incoming_tokens + req.prompt_len
        if held <= KV_HEADROOM * s.kv_total_blocks * s.block_size and s.num_running + s.num_migrating_in < max_seqs:
            return [i]
    return cands
