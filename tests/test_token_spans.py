"""`token_spans` (summarize's per-request token aggregates) gives the same values whatever its
batch size, and the same as reading each request's tokens one by one."""

import numpy as np
import pytest

from flowyard.core.token_spans import token_spans


def _requests(seed: int) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    reqs = []
    for _ in range(40):
        kind = rng.integers(0, 4)
        if kind == 0:  # no tokens (a chunk-less request, or an empty chunk)
            reqs.append([] if rng.integers(0, 2) else [np.empty(0)])
            continue
        n = 1 if kind == 1 else int(rng.integers(2, 30))
        t = np.cumsum(rng.random(n)) + rng.random() * 100
        cuts = np.sort(rng.integers(0, n, size=int(rng.integers(0, 4))))
        reqs.append(np.split(t, cuts))
    return reqs


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_same_as_per_request_and_any_batch(seed: int) -> None:
    reqs = _requests(seed)
    chunks = [c for r in reqs for c in r]
    nchunks = [len(r) for r in reqs]
    ref_gaps = []
    for r in reqs:
        t = np.concatenate(r) if r else np.empty(0)
        ref_gaps.extend(np.diff(t))
    for batch in (1, 3, 7, 1000):
        s = token_spans(chunks, nchunks, batch=batch)
        for k, r in enumerate(reqs):
            t = np.concatenate(r) if r else np.empty(0)
            assert s.n[k] == len(t)
            if len(t):
                assert s.first[k] == t[0] and s.last[k] == t[-1]
            else:
                assert np.isnan(s.first[k]) and np.isnan(s.last[k])
            if len(t) >= 2:
                assert s.max_gap[k] == np.diff(t).max()
            else:
                assert np.isnan(s.max_gap[k])
        assert s.gaps.tolist() == ref_gaps


def test_bad_batch_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="batch"):
        token_spans([], [], batch=0)


def test_compact_keeps_the_times_in_one_array_of_its_own() -> None:
    from flowyard.core.request import Request, RequestState

    shared = np.arange(10.0)
    st = RequestState(Request(id=0, arrival=0.0, prompt_len=4, output_len=5))
    st.record_tokens(shared[:2])
    st.record_tokens(shared[5:8])
    before = st.all_token_times().tolist()
    st.compact()
    assert len(st.token_times) == 1 and st.token_times[0].base is None
    assert st.all_token_times().tolist() == before and st.num_output == 5


def test_streamed_summary_equals_the_kept_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """A run with more gaps than KEEP_GAPS streams them (`exact_stats`); its summary is the
    same, float for float, as when they are kept in one array."""
    from flowyard.core import token_spans as ts
    from flowyard.core.metrics import summarize
    from flowyard.sim.run import SimConfig, build_simulator

    states = build_simulator(SimConfig(trace="azure-conv", duration=60.0, instances=2)).run().states
    kept = summarize(states).to_dict()
    monkeypatch.setattr(ts, "KEEP_GAPS", 0)
    spans = ts.token_spans([c for s in states for c in s.token_times], [len(s.token_times) for s in states])
    assert spans.kept is None and spans.n_gaps > 1000
    assert summarize(states).to_dict() == kept
