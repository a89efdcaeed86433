"""Metrics, summaries, goodput search and reports, against hand-computed numbers."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flowyard.bench.plot import plot_cdf, plot_goodput
from flowyard.bench.report import (format_goodput_table, format_table, write_goodput_json,
                                   write_json)
from flowyard.core import goodput as G
from flowyard.core import metrics as M
from flowyard.core.request import SLO, Request, RequestState, Status

_ids = iter(range(10**9))


def make(arrival: float, times, slo: SLO = SLO(), status: Status = Status.FINISHED,
         chunks: int = 1, prompt: int = 8) -> RequestState:
    t = np.asarray(times, dtype=float)
    s = RequestState(Request(next(_ids), arrival, prompt, output_len=max(len(t), 1), slo=slo))
    for part in np.array_split(t, chunks) if len(t) else []:
        s.record_tokens(part)
    s.status = status
    if status is Status.FINISHED and len(t):
        s.finish_time = float(t[-1])
    return s


# ---------------------------------------------------------------- per request

def test_hand_computed_request():
    s = make(0.0, [1.0, 1.5, 2.5])
    assert M.ttft(s) == 1.0
    assert M.tpot(s) == pytest.approx(0.75)
    np.testing.assert_allclose(M.tbt(s), [0.5, 1.0])
    assert M.e2e(s) == 2.5


def test_single_token_has_no_tpot():
    s = make(2.0, [3.0])
    assert M.ttft(s) == 1.0 and M.tpot(s) is None and len(M.tbt(s)) == 0 and M.e2e(s) == 1.0


def test_no_tokens():
    s = make(0.0, [], status=Status.WAITING)
    assert M.ttft(s) is None and M.tpot(s) is None and M.e2e(s) is None


def test_slo_exactly_at_limit_meets():
    s = make(0.1, [0.3, 0.5, 0.7], SLO(ttft=0.2, tpot=0.2, tbt=0.2))
    assert M.meets_slo(s)


def test_slo_ttft_violation():
    assert not M.meets_slo(make(0.0, [1.01, 1.02], SLO(ttft=1.0)))


def test_one_slow_gap_breaks_tbt_but_not_tpot():
    s = make(0.0, [0.1, 0.2, 0.3, 0.9, 1.0], SLO(tpot=0.25, tbt=0.2))
    assert M.tpot(s) == pytest.approx(0.225)
    assert not M.meets_slo(s)
    assert M.meets_slo(make(0.0, [0.1, 0.2, 0.3, 0.9, 1.0], SLO(tpot=0.25)))


def test_single_token_meets_tpot_tbt_vacuously():
    assert M.meets_slo(make(0.0, [0.5], SLO(ttft=1.0, tpot=0.01, tbt=0.01)))


@pytest.mark.parametrize("status", [Status.REJECTED, Status.ABORTED, Status.RUNNING])
def test_unfinished_never_meets(status):
    assert not M.meets_slo(make(0.0, [0.1, 0.2], status=status))


def test_no_slo_finished_meets():
    assert M.meets_slo(make(0.0, [5.0, 9.0]))


# ---------------------------------------------------------------- summary

def test_summarize_hand_computed():
    states = [
        make(0.0, [1.0, 1.5, 2.5], SLO(ttft=1.0)),               # meets
        make(1.0, [3.0, 3.2], SLO(ttft=1.0)),                      # ttft 2.0 > 1.0
        make(2.0, [], SLO(ttft=1.0), status=Status.REJECTED),      # rejected, in denominator
        make(2.0, [2.5, 2.6, 2.7, 4.0], SLO(tbt=0.5), chunks=2),   # 1.3 gap breaks tbt
    ]
    s = M.summarize(states, policy="p", wall_s=0.5)
    assert (s.requests, s.completed, s.rejected, s.aborted) == (4, 3, 1, 0)
    assert s.slo_attainment == 0.25
    assert s.duration_s == 4.0
    assert s.throughput_rps == 0.75
    assert s.output_tokens == 9 and s.output_tokens_per_s == 9 / 4
    assert s.token_goodput == 3 / 4
    assert s.ttft["mean"] == pytest.approx((1.0 + 2.0 + 0.5) / 3)
    assert s.ttft["p50"] == pytest.approx(1.0)
    assert s.tpot["mean"] == pytest.approx((0.75 + 0.2 + 0.5) / 3)
    gaps = [0.5, 1.0, 0.2, 0.1, 0.1, 1.3]
    assert s.tbt["mean"] == pytest.approx(np.mean(gaps))
    assert s.tbt["p99"] == pytest.approx(np.percentile(gaps, 99))
    assert s.itl == s.tbt
    assert s.e2e["p90"] == pytest.approx(np.percentile([2.5, 2.2, 2.0], 90))
    assert s.policy == "p" and s.wall_s == 0.5


def test_summarize_duration_override_and_empty():
    s = M.summarize([make(0.0, [1.0, 2.0])], duration=10.0)
    assert s.throughput_rps == 0.1 and s.output_tokens_per_s == 0.2
    e = M.summarize([])
    assert e.requests == 0 and e.slo_attainment == 0.0 and math.isnan(e.ttft["mean"])
    r = M.summarize([make(0.0, [], status=Status.REJECTED)])
    assert r.completed == 0 and r.rejected == 1 and r.to_dict()["ttft"]["p99"] is None


def test_finished_without_tokens_does_not_meet():
    states = [make(0.0, [], status=Status.FINISHED), make(0.0, [1.0, 2.0]),
              make(0.5, [], status=Status.FINISHED)]
    assert not M.meets_slo(states[0])
    s = M.summarize(states)
    assert s.completed == 3 and s.slo_attainment == pytest.approx(1 / 3)
    assert s.ttft["mean"] == 1.0 and s.tbt["mean"] == 1.0 and s.output_tokens == 2


def test_summarize_percentiles_match_numpy():
    rng = np.random.default_rng(0)
    states, ttfts, tpots, gaps = [], [], [], []
    for _ in range(300):
        a = rng.uniform(0, 100)
        n = int(rng.integers(1, 30))
        t = a + np.cumsum(rng.exponential(0.05, n))
        states.append(make(a, t, chunks=int(rng.integers(1, 4))))
        ttfts.append(t[0] - a)
        if n > 1:
            tpots.append((t[-1] - t[0]) / (n - 1))
        gaps.extend(np.diff(t))
    s = M.summarize(states)
    for got, ref in ((s.ttft, ttfts), (s.tpot, tpots), (s.tbt, gaps)):
        for k, q in M.PERCENTILES.items():
            assert got[k] == pytest.approx(np.percentile(ref, q))
        assert got["mean"] == pytest.approx(np.mean(ref))


token_lists = st.lists(st.floats(0.001, 2.0), min_size=1, max_size=20).map(
    lambda d: list(np.cumsum(d)))


@settings(max_examples=60, deadline=None)
@given(token_lists)
def test_tpot_times_gaps_is_span(times):
    s = make(0.0, times)
    if len(times) > 1:
        assert M.tpot(s) * (len(times) - 1) == pytest.approx(times[-1] - times[0])
        assert M.tbt(s).sum() == pytest.approx(times[-1] - times[0])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 5), token_lists, st.integers(1, 3),
                          st.sampled_from(list(Status)),
                          st.sampled_from([SLO(), SLO(ttft=1.0), SLO(tpot=0.5),
                                           SLO(tbt=0.6), SLO(1.5, 0.6, 0.9)])),
                min_size=1, max_size=15))
def test_summarize_attainment_agrees_with_meets_slo(rows):
    states = [make(a, np.asarray(t) + a, slo, status, chunks=c) for a, t, c, status, slo in rows]
    s = M.summarize(states)
    assert s.slo_attainment == pytest.approx(np.mean([M.meets_slo(x) for x in states]))
    done = [x for x in states if x.status is Status.FINISHED]
    gaps = np.concatenate([M.tbt(x) for x in done]) if done else np.empty(0)
    if len(gaps):
        assert s.tbt["p90"] == pytest.approx(np.percentile(gaps, 90))


def test_summarize_is_fast():
    import time

    rng = np.random.default_rng(1)
    states = []
    for i in range(80_000):
        n = 50
        t = i * 0.01 + np.cumsum(rng.exponential(0.02, n))
        states.append(make(i * 0.01, t, SLO(ttft=1.0, tbt=0.1), chunks=2))
    t0 = time.process_time()
    s = M.summarize(states)
    elapsed = time.process_time() - t0
    assert s.output_tokens == 4_000_000
    assert elapsed < 2.0  # typically ~0.3 s; loose bound for slow CI machines


# ---------------------------------------------------------------- goodput search

def step(threshold: float, calls: list | None = None):
    def f(rate: float) -> float:
        if calls is not None:
            calls.append(rate)
        return 1.0 if rate <= threshold else 0.5
    return f


@pytest.mark.parametrize("threshold", [1.3, 4.0, 7.77, 9.99])
def test_goodput_search_step(threshold):
    calls: list = []
    r = G.goodput_search(step(threshold, calls), lo=1.0, hi=10.0, tol=0.01)
    assert r.goodput <= threshold
    assert threshold - r.goodput <= 0.01 * threshold * 1.02 + 1e-12
    assert [c[0] for c in r.curve] == sorted(set(calls)) and len(calls) == len(set(calls))
    assert all((a == 1.0) == (x <= threshold) for x, a in r.curve)
    assert not r.capped and not r.never_met


def test_goodput_never_meets():
    r = G.goodput_search(lambda rate: 0.2, lo=1.0, hi=10.0)
    assert r.goodput == 0.0 and r.never_met and r.curve == [(1.0, 0.2)]


def test_goodput_always_meets_expands_to_cap():
    r = G.goodput_search(lambda rate: 1.0, lo=1.0, hi=10.0, max_hi=50.0)
    assert r.goodput == 50.0 and r.capped and "cap" in r.note
    assert [x for x, _ in r.curve] == [1.0, 10.0, 20.0, 40.0, 50.0]


def test_goodput_expands_then_bisects():
    r = G.goodput_search(step(25.0), lo=1.0, hi=10.0, tol=0.001)
    assert 25.0 * 0.999 <= r.goodput <= 25.0 and not r.capped


def test_goodput_max_evals_and_bad_args():
    r = G.goodput_search(step(3.3), lo=1.0, hi=10.0, tol=1e-9, max_evals=6)
    assert r.evals == 6 and r.goodput <= 3.3
    with pytest.raises(ValueError):
        G.goodput_search(step(1), lo=5.0, hi=1.0)


def test_serving_capacity():
    r = G.serving_capacity(lambda rate: 0.01 * rate, 0.1, lo=1.0, hi=20.0, tol=0.001)
    assert 10.0 * 0.999 <= r.goodput <= 10.0
    assert all(v == pytest.approx(0.01 * x) for x, v in r.curve)
    assert G.serving_capacity(lambda rate: math.nan, 0.1, lo=1.0, hi=2.0).never_met


# ---------------------------------------------------------------- reports and plots

def _summary() -> M.Summary:
    return M.summarize([make(0.0, [1.0, 1.5, 2.5], SLO(ttft=1.0)), make(1.0, [1.2])],
                       policy="vllm", wall_s=0.25)


def test_format_table_labels():
    text = format_table(_summary())
    assert text.splitlines()[0] == "============ Serving Benchmark Result ============"
    assert "---------------Time to First Token----------------" in text
    for label in ("Successful requests:", "Benchmark duration (s):",
                  "Request throughput (req/s):", "Output token throughput (tok/s):",
                  "SLO attainment:", "Token goodput", "Mean TTFT (ms):", "Median TTFT (ms):",
                  "P90 TTFT (ms):", "P99 TTFT (ms):", "Mean TPOT (ms):", "P99 ITL (ms):",
                  "Median E2EL (ms):"):
        assert label in text
    assert "Mean TTFT (ms):                          600.00" in text  # TTFTs 1.0 s, 0.2 s
    assert format_table(M.summarize([]))  # empty run still formats (n/a)


def test_json_round_trip(tmp_path):
    path = tmp_path / "out.json"
    write_json(_summary(), path, extra={"trace": "azure-code"})
    d = json.loads(path.read_text())
    for key in ("policy", "requests", "completed", "slo_attainment", "throughput_rps",
                "output_tokens_per_s", "wall_s"):
        assert key in d
    for key in ("ttft", "tpot", "e2e"):
        assert set(d[key]) == {"mean", "p50", "p90", "p99"}
    assert d["policy"] == "vllm" and d["trace"] == "azure-code" and d["requests"] == 2
    assert d["ttft"]["p50"] == pytest.approx(0.6)


def test_write_errors_name_path(tmp_path):
    bad = tmp_path / "missing" / "out.json"
    with pytest.raises(OSError, match="missing"):
        write_json(_summary(), bad)
    with pytest.raises(OSError, match="missing"):
        plot_goodput({}, tmp_path / "missing" / "g.png")


def _results():
    return {"vllm": G.goodput_search(step(3.0), lo=1.0, hi=8.0),
            "pla": G.goodput_search(step(5.0), lo=1.0, hi=8.0),
            "bad": G.goodput_search(lambda r: 0.0, lo=1.0, hi=8.0)}


def test_goodput_table_and_json(tmp_path):
    text = format_goodput_table(_results())
    assert "policy" in text and "vllm" in text and "never met" in text
    path = tmp_path / "g.json"
    write_goodput_json(_results(), path)
    d = json.loads(path.read_text())
    assert [r["policy"] for r in d["results"]] == ["vllm", "pla", "bad"]
    assert all({"policy", "goodput_rps", "curve"} <= set(r) for r in d["results"])
    assert d["results"][0]["curve"][0] == [1.0, 1.0]


def test_plots_write_png(tmp_path):
    g = tmp_path / "goodput.png"
    plot_goodput(_results(), g, title="test")
    c = tmp_path / "cdf.png"
    plot_cdf({"a": [make(0.0, [0.5, 0.6]), make(0.0, [0.9])], "b": np.array([0.1, 0.2])},
             c, slo=0.7)
    for p in (g, c):
        assert p.stat().st_size > 1000 and p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
