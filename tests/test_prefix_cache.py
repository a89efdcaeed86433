"""Prefix caching: hits on shared prefixes, LRU eviction, conservation under random use."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from flowyard.core.prefix_cache import PrefixCachingKVManager
from flowyard.core.request import Request, RequestState


def state(rid, tokens, out=4):
    return RequestState(Request(rid, 0.0, prompt_len=len(tokens), output_len=out, prompt_tokens=tuple(tokens)))


def compute(kv, st):
    """What a scheduler does: match, allocate the rest, compute, register."""
    st.num_computed = kv.match_prefix(st)
    hit = st.num_computed
    assert kv.allocate(st.id, st.seq_len)
    st.num_computed = st.seq_len
    kv.register(st)
    return hit


def test_shared_prefix_hits_and_leaves_one_token_to_compute():
    kv = PrefixCachingKVManager(num_blocks=32, block_size=4)
    a = state(1, list(range(18)))
    assert compute(kv, a) == 0
    kv.free(a.id)
    b = state(2, list(range(16)) + [99, 98, 97])  # shares 4 full blocks
    assert compute(kv, b) == 16
    same = state(3, list(range(16)))  # identical prompt: last block is recomputed
    assert compute(kv, same) == 12
    assert kv.hit_rate > 0


def test_blocks_shared_between_live_requests_are_not_freed_early():
    kv = PrefixCachingKVManager(num_blocks=16, block_size=4)
    a, b = state(1, list(range(12))), state(2, list(range(12)) + [5])
    compute(kv, a)
    compute(kv, b)
    shared = set(kv.block_table(1)) & set(kv.block_table(2))
    assert len(shared) == 3
    kv.free(1)
    assert all(blk in kv.block_table(2) for blk in shared)
    kv.free(2)
    assert kv.num_free_blocks == 16 and not kv.leaked()


def test_least_recently_freed_is_evicted_first():
    kv = PrefixCachingKVManager(num_blocks=4, block_size=4)
    old, new = state(1, [1] * 8 + [0]), state(2, [2] * 8 + [0])
    compute(kv, old), kv.free(1)
    compute(kv, new), kv.free(2)
    filler = state(3, [7] * 7)  # takes 2 blocks: must evict the old request's first
    assert compute(kv, filler) == 0
    kv.free(3)
    assert compute(kv, state(4, [2] * 8 + [0])) == 8
    kv.free(4)
    assert compute(kv, state(5, [1] * 8 + [0])) == 0


def test_trace_block_hashes_hit_like_tokens():
    kv = PrefixCachingKVManager(num_blocks=64, block_size=16)
    mk = lambda rid, hashes, n: RequestState(Request(rid, 0.0, prompt_len=n, output_len=1,
                                                     block_hashes=tuple(hashes), hash_block_size=64))
    first = mk(1, [10, 11, 12], 190)
    compute(kv, first), kv.free(1)
    again = mk(2, [10, 11, 13], 190)
    assert compute(kv, again) == 128  # two shared 64-token hash blocks


prompts = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=30), min_size=1, max_size=12)


@settings(max_examples=100, deadline=None)
@given(prompts=prompts, blocks=st.integers(8, 40), frees=st.lists(st.booleans(), max_size=12))
def test_reference_counts_and_conservation(prompts, blocks, frees):
    kv = PrefixCachingKVManager(num_blocks=blocks, block_size=4)
    live = []
    for i, toks in enumerate(prompts):
        st_ = state(i, toks)
        st_.num_computed = kv.match_prefix(st_)
        if not kv.allocate(st_.id, st_.seq_len):
            kv.free(st_.id)
            continue
        st_.num_computed = st_.seq_len
        kv.register(st_)
        live.append(st_.id)
        if i < len(frees) and frees[i]:
            kv.free(live.pop(0))
        held = {b for r in live for b in kv.block_table(r)}
        assert len(held) + kv.num_free_blocks == blocks
    for r in live:
        kv.free(r)
    assert kv.num_free_blocks == blocks and not kv.leaked()


def test_turns_of_a_session_without_tokens_share_their_prompt_blocks():
    """Trace requests of a multi-turn session (no token ids) hit the previous turn's prompt, and
    peek_prefix predicts the hit without attaching anything."""
    kv = PrefixCachingKVManager(num_blocks=64, block_size=4)
    t0 = RequestState(Request(1, 0.0, prompt_len=22, output_len=5, session="s7"))
    assert compute(kv, t0) == 0
    kv.free(t0.id)
    t1 = RequestState(Request(2, 9.0, prompt_len=40, output_len=3, session="s7", turn=1, history_len=27))
    other = RequestState(Request(3, 9.0, prompt_len=40, output_len=3, session="s8"))
    assert kv.peek_prefix(t1) == 20 and kv.num_free_blocks == 64
    assert compute(kv, t1) == 20  # the 5 full blocks of turn 0's prompt
    assert compute(kv, other) == 0


def test_a_session_turn_also_hits_the_previous_reply():
    """The next turn's prompt holds the previous prompt and reply: the reply's full blocks are
    found too (bug: only the previous prompt's blocks were keyed, so replies were recomputed)."""
    kv = PrefixCachingKVManager(num_blocks=64, block_size=4)
    t0 = RequestState(Request(1, 0.0, prompt_len=22, output_len=5, session="s7"))
    compute(kv, t0)
    assert kv.allocate(t0.id, 27)
    t0.num_computed = 27  # five decode steps later
    kv.register(t0)
    kv.free(t0.id)
    t1 = RequestState(Request(2, 9.0, prompt_len=40, output_len=3, session="s7", turn=1, history_len=27))
    assert compute(kv, t1) == 24  # six full blocks: 22 prompt + 2 reply tokens
