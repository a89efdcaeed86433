"""DynaServe's virtual-batch predictor against its frozen pre-optimisation reference
(tests/vbatch_reference.py): random sequences of commits, probes, resets, cold-start seeds
and queries, with time moving on, must give the same answers bit for bit. The storage
changed (preallocated pass matrix, in-place prefix sums, compaction by copy), the arithmetic
must not: DynaServe's decisions, and so the simulation, depend on every last bit."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from conftest import LinearCost
from flowyard.costmodel import make_cost_model
from flowyard.policies.dynaserve.vbatch import Segment, VirtualBatch
from vbatch_reference import VirtualBatch as Reference

COSTS = {"roofline": make_cost_model("llama-3-8b", "h100"), "linear": LinearCost()}

segment = st.builds(lambda p, d, h, wait: (p, d, h, wait),
                    st.integers(0, 3000), st.integers(0, 400), st.integers(0, 2000),
                    st.sampled_from([0.0, 0.0, 0.01, 0.3]))
op = st.one_of(
    st.tuples(st.just("commit"), segment), st.tuples(st.just("probe"), segment),
    st.tuples(st.just("advance"), st.floats(0.0, 0.5)), st.tuples(st.just("reset"), st.none()),
    st.tuples(st.just("seed"), st.lists(st.integers(1, 300), min_size=1, max_size=40)))


def same(a, b) -> None:
    assert (a.seg_end, a.total_end) == (b.seg_end, b.total_end)


def check_queries(fast: VirtualBatch, ref: Reference, now: float) -> None:
    assert fast.passes == ref.passes
    np.testing.assert_array_equal(fast.end, ref.end)
    assert fast.finish_time(now) == ref.finish_time(now)
    assert fast.prefill_left(now) == ref.prefill_left(now)
    assert fast.decoding_at(now) == ref.decoding_at(now)


@settings(max_examples=60, deadline=None)
@given(cost=st.sampled_from(sorted(COSTS)), budget=st.sampled_from([64, 256, 2048]),
       max_seqs=st.sampled_from([2, 16, 256]), cap=st.sampled_from([32, 512]),
       ops=st.lists(op, min_size=1, max_size=40))
def test_virtual_batch_matches_its_reference(cost, budget, max_seqs, cap, ops):
    args = (COSTS[cost], budget, max_seqs, cap)
    fast, ref = VirtualBatch(*args), Reference(*args)
    now = 0.0
    for kind, arg in ops:
        if kind in ("commit", "probe"):
            p, d, h, wait = arg
            seg = Segment(p, d, h, now + wait)
            same(getattr(fast, kind)(seg, now), getattr(ref, kind)(seg, now))
        elif kind == "advance":
            now += arg
        elif kind == "reset":
            fast.reset(), ref.reset()
        elif fast.passes == 0:  # seed: only on an empty timeline
            rem = np.array(arg, dtype=float)
            fast.seed_decodes(rem, 700.0, now), ref.seed_decodes(rem, 700.0, now)
        check_queries(fast, ref, now)


@pytest.mark.parametrize("cost", sorted(COSTS))
def test_long_timelines_grow_and_compact_like_the_reference(cost):
    """Past the preallocated 256 passes (the buffers grow) and past 256 executed passes (the
    timeline compacts): a steady stream of requests over a minute of simulated time."""
    rng = np.random.default_rng(7)
    fast, ref = VirtualBatch(COSTS[cost], 512, 64, 512), Reference(COSTS[cost], 512, 64, 512)
    now = 0.0
    for _ in range(300):
        now += float(rng.exponential(0.2))
        seg = Segment(int(rng.integers(1, 4000)), int(rng.integers(0, 500)), 0, now + float(rng.choice([0.0, 0.05])))
        for s in (seg, Segment(seg.prefill // 2, seg.decode, seg.prefill // 2, now)):
            same(fast.probe(s, now), ref.probe(s, now))
        same(fast.commit(seg, now), ref.commit(seg, now))
        check_queries(fast, ref, now)
    assert fast.M.shape[1] > 256  # the buffers grew


@pytest.mark.parametrize("cost", sorted(COSTS))
def test_probing_an_empty_segment_reads_the_timelines_last_pass(cost):
    """Found by hypothesis in CI: a probe with neither prefill nor decode read the spare
    column past the timeline (M[:, -1], 0.0) instead of its last pass, as the reference does."""
    args = (COSTS[cost], 64, 2, 32)
    fast, ref = VirtualBatch(*args), Reference(*args)
    for seg in (Segment(0, 0, 0, 0.0), Segment(0, 0, 0, 0.0), Segment(0, 1, 0, 0.0)):
        same(fast.commit(seg, 0.0), ref.commit(seg, 0.0))
    empty = Segment(0, 0, 0, 0.0)
    same(fast.probe(empty, 0.0), ref.probe(empty, 0.0))
    assert fast.probe(empty, 0.0).seg_end > 0
