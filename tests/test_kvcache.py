"""KV block accounting: allocation, trimming, freeing and conservation under random use."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from flowyard.core.kvcache import KVCacheManager, cdiv
from flowyard.core.plan import BatchShape
from flowyard.costmodel import make_cost_model
from flowyard.costmodel.base import with_error


def test_allocate_grows_by_whole_blocks_and_fails_without_change():
    kv = KVCacheManager(num_blocks=4, block_size=16)
    assert kv.allocate(1, 17) and kv.num_held(1) == 2
    assert kv.allocate(1, 32) and kv.num_held(1) == 2  # still fits in two blocks
    assert not kv.allocate(2, 16 * 3)  # needs 3, only 2 free
    assert kv.num_held(2) == 0 and kv.num_free_blocks == 2
    assert len(set(kv.block_table(1))) == 2


def test_trim_and_free_return_blocks():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    kv.allocate(7, 40)
    kv.trim(7, 9)
    assert kv.num_held(7) == 3 and kv.num_free_blocks == 7
    assert kv.free(7) == 3 and kv.num_free_blocks == 10 and not kv.leaked()


def test_bad_sizes_are_rejected():
    with pytest.raises(ValueError):
        KVCacheManager(0)


ops = st.lists(
    st.tuples(st.sampled_from(["alloc", "trim", "free"]), st.integers(0, 5), st.integers(0, 200)),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(ops=ops, blocks=st.integers(1, 40), bs=st.sampled_from([1, 4, 16]))
def test_blocks_are_conserved_and_never_shared(ops, blocks, bs):
    kv = KVCacheManager(blocks, bs)
    for op, rid, tokens in ops:
        if op == "alloc":
            before = kv.num_held(rid)
            ok = kv.allocate(rid, tokens)
            assert ok or kv.num_held(rid) == before
            if ok:
                assert kv.num_held(rid) >= cdiv(tokens, bs)
        elif op == "trim":
            kv.trim(rid, tokens)
            assert kv.num_held(rid) <= max(cdiv(tokens, bs), 0) or kv.num_held(rid) == 0
        else:
            kv.free(rid)
        held = [b for r in range(6) for b in kv.block_table(r)]
        assert len(held) == len(set(held))  # no block in two tables
        assert len(held) + kv.num_free_blocks == blocks  # conservation
    for r in range(6):
        kv.free(r)
    assert kv.num_free_blocks == blocks and not kv.leaked()


def test_with_error_scales_predictions_only():
    base = make_cost_model("llama-3-8b", "h100")
    slow = with_error(base, 1.5)
    shape = BatchShape.of([(0, 1024)], [512] * 8)
    assert slow.step_time(shape) == pytest.approx(1.5 * base.step_time(shape))
    assert slow.kv_capacity_tokens() == base.kv_capacity_tokens()
    assert with_error(base, 1.0) is base
