"""Workloads: loaders on the real bundled traces and on broken files, arrivals, transforms."""

from __future__ import annotations

import gzip
import shutil
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flowyard.core.request import SLO
from flowyard.workloads import (
    DEFAULT_RATE,
    TRACE_NAMES,
    UnknownTraceError,
    Workload,
    WorkloadError,
    assign_tasks,
    build_requests,
    clip,
    detect_format,
    gamma_arrivals,
    load_file,
    load_trace,
    multi_turn_sessions,
    parse_slo_by_length,
    poisson_arrivals,
    retime,
    scale_rate,
    slo_by_length,
    slo_by_task,
    trace_file,
    with_slo,
)

_CACHE: dict[str, Workload] = {}


def bundled(name: str) -> Workload:
    """Each bundled trace is loaded once per test session (they take ~0.1 s each)."""
    if name not in _CACHE:
        _CACHE[name] = load_trace(name)
    return _CACHE[name]


def check_invariants(w: Workload) -> None:
    assert [r.id for r in w.requests] == list(range(len(w)))
    t = w.arrivals()
    if len(t):
        assert t[0] == 0.0
        assert np.all(np.diff(t) >= 0)
        assert w.duration == t[-1]


def synthetic(gaps: list[float], lens: list[tuple[int, int]] | None = None) -> Workload:
    lens = lens or [(100 + 7 * i, 10 + i) for i in range(len(gaps))]
    t = np.concatenate([[0.0], np.cumsum(gaps[1:])]) if gaps else np.zeros(0)
    reqs = build_requests(t, [p for p, _ in lens], [o for _, o in lens])
    return Workload("synthetic", reqs)


# --------------------------------------------------------------------------- real traces

# name: (requests, dropped, mean prompt, mean output, duration s or None) from traces/README.md
EXPECTED = {
    "azure-conv": (19366, 0, 1155, 211, 3502),
    "azure-code": (8819, 0, 2048, 28, 3436),
    "azure-conv-vidur": (19366, 0, 1155, 211, 3502),
    "azure-code-vidur": (8819, 0, 2048, 28, 3436),
    "mooncake-conv": (12031, 0, 12035, 343, 3537),
    "burstgpt": (399, 1, 617, 171, 41453),
    "burstgpt-v1": (383, 17, 520, 277, 37269),
    "sharegpt": (30731, 0, 2340, 439, None),
    "arxiv": (28257, 0, 2588, 291, None),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_bundled_trace_counts_and_stats(name: str) -> None:
    n, dropped, mean_in, mean_out, duration = EXPECTED[name]
    w = bundled(name)
    check_invariants(w)
    assert (len(w), w.dropped, w.name) == (n, dropped, name)
    # README stats include BurstGPT's zero-token failure rows, which the loader drops.
    tol = 0.08 if name.startswith("burstgpt") else 0.01
    assert w.prompt_lens().mean() == pytest.approx(mean_in, rel=tol)
    assert w.output_lens().mean() == pytest.approx(mean_out, rel=tol)
    if duration is not None:
        assert w.duration == pytest.approx(duration, abs=1.0)


def test_catalog_names_and_errors(tmp_path: Path) -> None:
    for required in ("azure-code", "azure-conv", "burstgpt", "mooncake-conv", "sharegpt", "arxiv"):
        assert required in TRACE_NAMES
        assert trace_file(required).is_file()
    assert len(load_trace("AZURE-Code", num_requests=10)) == 10
    with pytest.raises(UnknownTraceError) as e:
        load_trace("no-such-trace")
    assert isinstance(e.value, ValueError)
    for name in TRACE_NAMES:
        assert name in str(e.value)
    with pytest.raises(UnknownTraceError):
        load_trace(tmp_path)  # a directory is not a trace file


def test_azure_and_vidur_agree() -> None:
    """Vidur's file is the Azure trace in relative seconds: lengths equal, times to 1e-6 s."""
    a, v = bundled("azure-conv"), bundled("azure-conv-vidur")
    assert np.array_equal(a.prompt_lens(), v.prompt_lens())
    assert np.array_equal(a.output_lens(), v.output_lens())
    assert np.max(np.abs(a.arrivals() - v.arrivals())) < 1e-6
    assert a.format == "azure" and v.format == "vidur"


def test_mooncake_hashes() -> None:
    w = bundled("mooncake-conv")
    assert all(r.hash_block_size == 512 for r in w.requests)
    assert sum(len(r.block_hashes) for r in w.requests) == 288_500
    assert all(len(r.block_hashes) * 512 >= r.prompt_len for r in w.requests)
    assert w.requests[0].block_hashes[:3] == (0, 1, 2)


def test_burstgpt_tasks_and_sessions() -> None:
    w = bundled("burstgpt")
    assert {r.task for r in w.requests} == {"ChatGPT", "GPT-4"}
    assert sum(r.session is None for r in w.requests) == 6  # API-log rows carry no session
    turns: dict[str, list[int]] = defaultdict(list)
    for r in w.requests:
        if r.session is not None:
            turns[r.session].append(r.turn)
    assert 130 <= len(turns) <= 135
    assert all(t == list(range(len(t))) for t in turns.values())
    assert any(len(t) > 3 for t in turns.values())
    v1 = bundled("burstgpt-v1")
    assert all(r.session is None and r.turn == 0 for r in v1.requests)
    assert sum(r.task == "GPT-4" for r in v1.requests) <= 80


def test_length_only_arrivals() -> None:
    w = bundled("sharegpt")
    assert w.format == "lengths"
    assert w.rate == pytest.approx(DEFAULT_RATE, rel=0.03)
    fast = load_trace("sharegpt", rate=20.0, seed=3, num_requests=5000)
    again = load_trace("sharegpt", rate=20.0, seed=3, num_requests=5000)
    assert len(fast) == 5000 and fast.rate == pytest.approx(20.0, rel=0.05)
    assert np.array_equal(fast.arrivals(), again.arrivals())
    assert np.array_equal(fast.prompt_lens(), w.prompt_lens()[:5000])  # file order kept
    bursty = load_trace("arxiv", rate=10.0, arrival="gamma", cv=3.0, num_requests=8000)
    gaps = np.diff(bursty.arrivals())
    assert gaps.std() / gaps.mean() == pytest.approx(3.0, rel=0.15)
    with pytest.raises(ValueError, match="unknown arrival process"):
        load_trace("arxiv", arrival="weibull")


def test_timed_trace_rate_and_cap() -> None:
    w = load_trace("azure-code", rate=10.0)
    assert w.rate == pytest.approx(10.0)
    assert np.array_equal(w.prompt_lens(), bundled("azure-code").prompt_lens())
    assert len(load_trace("mooncake-conv", num_requests=100)) == 100


def test_format_from_content_and_gzip(tmp_path: Path) -> None:
    src = trace_file("azure-code")
    plain = tmp_path / "looks_like.jsonl"  # misleading name: detection reads the header
    plain.write_bytes(gzip.decompress(src.read_bytes()))
    hidden_gz = tmp_path / "no_suffix"
    shutil.copy(src, hidden_gz)
    assert detect_format(plain) == detect_format(hidden_gz) == "azure"
    a, b = load_file(plain), load_file(hidden_gz)
    assert a.requests == b.requests == bundled("azure-code").requests
    assert a.name == "looks_like" and a.source == str(plain)


def test_azure_timestamp_variants(tmp_path: Path) -> None:
    p = tmp_path / "t.csv"
    p.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 23:59:59.9999999,10,1\n"
        "2023-11-17T00:00:00.5,10,1\n"
        "2023-11-17 00:00:01,10,1\n"
        "2023-11-17 01:00:01+01:00,10,1"
    )
    assert load_file(p).arrivals() == pytest.approx([0.0, 0.5000001, 1.0000001, 1.0000001], abs=1e-9)


# --------------------------------------------------------------------------- broken files

AZ = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"
VI = "arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,10,5\n"
B1 = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n5,ChatGPT,472,18,490,Conversation log\n"
B3 = (
    "Timestamp,Session ID,Elapsed time,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
    "1.0,abc,3,GPT-4,10,5,15,Conversation log\n"
)
LN = "num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio\n10,5,15,2.0\n"
MC = '{"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [0]}\n'

BROKEN = {
    "azure-bad-number": (AZ + "2023-11-16 18:15:47.0,abc,3\n", 3, "'ContextTokens': 'abc' is not a number"),
    "azure-negative": (AZ + "2023-11-16 18:15:47.0,12,-3\n", 3, "negative length -3"),
    "azure-bad-time": (AZ + "yesterday,12,3\n", 3, "is not a timestamp"),
    "azure-bad-date": (AZ + "2023-13-40 18:15:47.0,12,3\n", 3, "not a valid date"),
    "azure-missing-col": ("TIMESTAMP,ContextTokens\n2023-11-16 18:15:46,374\n", 1, "missing column 'generatedtokens'"),
    "azure-short-row": (AZ + "2023-11-16 18:15:47.0,12\n", 3, "expected 3 fields"),
    "azure-fraction": (AZ + "2023-11-16 18:15:47.0,12.5,3\n", 3, "not a whole token count"),
    "vidur-bad-time": (VI + "soon,10,5\n", 3, "'arrived_at': 'soon' is not a number"),
    "vidur-nan-time": (VI + "nan,10,5\n", 3, "not a finite time"),
    "vidur-negative": (VI + "1.0,-10,5\n", 3, "negative length -10"),
    "burst1-bad-number": (B1 + "45,ChatGPT,x,230,1317,Conversation log\n", 3, "'Request tokens': 'x'"),
    "burst1-missing-col": ("Timestamp,Request tokens,Response tokens\n5,1,2\n", 1, "missing column 'model'"),
    "burst3-negative": (B3 + "2.0,abc,3,GPT-4,10,-5,5,Conversation log\n", 3, "negative length -5"),
    "burst3-bad-time": (B3 + "t,abc,3,GPT-4,10,5,15,Conversation log\n", 3, "'Timestamp': 't'"),
    "lengths-bad": (LN + "ten,5,15,2.0\n", 3, "'num_prefill_tokens': 'ten' is not a number"),
    "lengths-negative": (LN + "10,-1,9,2.0\n", 3, "negative length -1"),
    "mooncake-json": (MC + '{"timestamp": 1, "input_length": \n', 2, "invalid JSON"),
    "mooncake-missing": (MC + MC + '{"timestamp": 1, "input_length": 3}\n', 3, "missing key 'output_length'"),
    "mooncake-negative": (MC + '{"timestamp": 1, "input_length": 3, "output_length": -2}\n', 2, "negative length -2"),
    "mooncake-hashes": (MC + '{"timestamp": 1, "input_length": 3, "output_length": 2, "hash_ids": 7}\n', 2, "hash_ids"),
    "mooncake-not-object": (MC + "[1, 2]\n", 2, "expected a JSON object"),
    "empty": ("", 1, "empty file"),
    "blank": ("\n  \n", 1, "empty file"),
    "header-only": ("arrived_at,num_prefill_tokens,num_decode_tokens\n", 2, "no requests"),
    "all-failed": (B1.split("\n")[0] + "\n5,ChatGPT,0,0,0,API log\n", 2, "all 1 rows dropped"),
    "unknown-header": ("time,prompt,output\n1,2,3\n", 1, "unknown trace format"),
    "forced-wrong-format": (B3, 1, "missing column 'contexttokens' for azure format"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_files_name_file_line_and_reason(case: str, tmp_path: Path) -> None:
    text, line, reason = BROKEN[case]
    p = tmp_path / f"{case}.txt"
    p.write_text(text)
    fmt = "azure" if case == "forced-wrong-format" else None
    with pytest.raises(WorkloadError) as e:
        load_file(p, fmt=fmt)
    msg = str(e.value)
    assert str(p) in msg and f"line {line}:" in msg and reason in msg, msg
    assert e.value.line == line and isinstance(e.value, ValueError)
    if case == "unknown-header":
        for fmt in ("azure", "vidur", "burstgpt", "lengths", "mooncake"):
            assert fmt in msg
    gz = tmp_path / f"{case}.gz"  # the same error through gzip
    gz.write_bytes(gzip.compress(text.encode()))
    with pytest.raises(WorkloadError, match=f"line {line}:"):
        load_file(gz, fmt=fmt)


def test_failures_dropped_not_fatal(tmp_path: Path) -> None:
    p = tmp_path / "b.csv"
    p.write_text(B1 + "6,GPT-4,0,0,0,Conversation log\n7,GPT-4,9,0,9,API log\n8,GPT-4,0,4,4,API log\n")
    w = load_file(p)
    assert (len(w), w.dropped, w.requests[0].task) == (1, 3, "ChatGPT")


# --------------------------------------------------------------------------- arrivals


@pytest.mark.parametrize("cv", [0.5, 1.0, 2.0, 4.0])
def test_arrival_processes_rate_and_cv(cv: float) -> None:
    p = poisson_arrivals(20_000, 8.0, seed=1)
    g = gamma_arrivals(20_000, 8.0, cv, seed=1)
    for t in (p, g):
        assert t[0] == 0.0 and np.all(np.diff(t) >= 0)
        assert (len(t) - 1) / t[-1] == pytest.approx(8.0, rel=0.05 * max(cv, 1.0))
    gaps = np.diff(g)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.1)
    assert np.array_equal(g, gamma_arrivals(20_000, 8.0, cv, seed=1))
    assert not np.array_equal(p, poisson_arrivals(20_000, 8.0, seed=2))
    with pytest.raises(ValueError):
        poisson_arrivals(10, 0.0)


def test_retime_keeps_lengths() -> None:
    w = clip(bundled("azure-conv"), max_requests=3000)
    r = retime(w, "poisson", 2.0, seed=4)
    check_invariants(r)
    assert np.array_equal(r.prompt_lens(), w.prompt_lens())
    assert r.rate == pytest.approx(2.0, rel=0.1)


# --------------------------------------------------------------------------- transforms

gaps_st = st.lists(st.floats(0.0, 50.0, allow_nan=False), min_size=1, max_size=60)


@settings(max_examples=60, deadline=None)
@given(gaps_st, st.floats(0.05, 20.0))
def test_scale_rate_properties(gaps: list[float], factor: float) -> None:
    w = synthetic(gaps)
    s = scale_rate(w, factor)
    check_invariants(s)
    assert s.duration == pytest.approx(w.duration / factor, rel=1e-9, abs=1e-12)
    assert np.array_equal(s.prompt_lens(), w.prompt_lens())
    assert w.requests == synthetic(gaps).requests  # input untouched


def test_scale_rate_halves_real_trace() -> None:
    w = bundled("azure-conv")
    s = scale_rate(w, 2.0)
    assert s.duration == pytest.approx(w.duration / 2)
    assert s.rate == pytest.approx(2 * w.rate)
    with pytest.raises(ValueError):
        scale_rate(w, 0)


@settings(max_examples=80, deadline=None)
@given(gaps_st, st.floats(0.0, 500.0), st.one_of(st.none(), st.floats(0.0, 500.0)),
       st.one_of(st.none(), st.integers(0, 70)))
def test_clip_properties(gaps: list[float], start: float, duration: float | None, cap: int | None) -> None:
    w = synthetic(gaps)
    c = clip(w, start, duration, cap)
    check_invariants(c)
    end = np.inf if duration is None else start + duration
    inside = [r for r in w.requests if start <= r.arrival < end]
    expect = inside if cap is None else inside[:cap]
    assert [r.prompt_len for r in c.requests] == [r.prompt_len for r in expect]
    if expect:
        assert c.duration == pytest.approx(expect[-1].arrival - expect[0].arrival)


def test_clip_real_trace() -> None:
    w = bundled("azure-conv")
    c = clip(w, start=600, duration=300)
    assert c.duration < 300 and 0.8 * 300 * w.rate < len(c) < 1.2 * 300 * w.rate
    assert len(clip(w, max_requests=50)) == 50
    assert len(clip(w, start=10_000)) == 0 and clip(w, start=10_000).duration == 0.0


def test_with_slo() -> None:
    w = with_slo(synthetic([0, 1, 2]), ttft=1.0, tpot=0.1)
    assert all(r.slo == SLO(ttft=1.0, tpot=0.1) for r in w.requests)
    w2 = with_slo(w, tpot=0.05)
    assert all(r.slo == SLO(ttft=1.0, tpot=0.05) for r in w2.requests)
    assert with_slo(w2).requests == w2.requests


def test_parse_slo_by_length() -> None:
    assert parse_slo_by_length(" 1024:2, 0:0.5 ,4096:6") == [(0, 0.5), (1024, 2.0), (4096, 6.0)]
    assert parse_slo_by_length([(0, 1), (100, 2.5)]) == [(0, 1.0), (100, 2.5)]
    for bad, why in [
        ("", "empty"), ("0:0.5,1024", "expected 'min_prompt_len:ttft_seconds'"),
        ("x:1", "not an integer"), ("0:fast", "not a number"), ("-1:1", ">= 0"),
        ("0:0", "positive"), ("0:1,0:2", "appears twice"), ("0:1:2", "expected"),
    ]:
        with pytest.raises(ValueError, match=why):
            parse_slo_by_length(bad)


def test_slo_by_length_assignment() -> None:
    lens = [(50, 5), (1023, 5), (1024, 5), (5000, 5)]
    w = with_slo(synthetic([0, 1, 1, 1], lens), tpot=0.2)
    got = slo_by_length(w, "0:0.5,1024:2,4096:6")
    assert [r.slo.ttft for r in got.requests] == [0.5, 0.5, 2.0, 6.0]
    assert all(r.slo.tpot == 0.2 for r in got.requests)
    partial = slo_by_length(w, "1000:3")  # shorter prompts keep their (absent) TTFT SLO
    assert [r.slo.ttft for r in partial.requests] == [None, 3.0, 3.0, 3.0]


def test_assign_tasks_deterministic() -> None:
    w = clip(bundled("azure-conv"), max_requests=4000)
    mix = {"chat": (3.0, SLO(ttft=1.0, tpot=0.1)), "summ": (1.0, SLO(ttft=5.0)), "never": (0.0, SLO(ttft=9.0))}
    a, b = assign_tasks(w, mix, seed=7), assign_tasks(w, mix, seed=7)
    assert [r.task for r in a.requests] == [r.task for r in b.requests]
    assert [r.task for r in assign_tasks(w, mix, seed=8).requests] != [r.task for r in a.requests]
    share = np.mean([r.task == "chat" for r in a.requests])
    assert share == pytest.approx(0.75, abs=0.03)
    assert all(r.slo == mix[r.task][1] for r in a.requests)  # type: ignore[index]
    assert np.array_equal(a.arrivals(), w.arrivals())
    with pytest.raises(ValueError):
        assign_tasks(w, {"x": (0.0, SLO(ttft=1.0))})


def test_slo_by_task_on_burstgpt() -> None:
    w = slo_by_task(bundled("burstgpt"), {"GPT-4": SLO(ttft=4.0), "ChatGPT": SLO(ttft=1.0)})
    assert all(r.slo.ttft == (4.0 if r.task == "GPT-4" else 1.0) for r in w.requests)
    only = slo_by_task(bundled("burstgpt"), {"GPT-4": SLO(ttft=4.0)}, default=SLO(tpot=0.1))
    assert {r.slo for r in only.requests} == {SLO(ttft=4.0), SLO(tpot=0.1)}


@pytest.mark.parametrize("cap", [None, 64])
def test_multi_turn_sessions(cap: int | None) -> None:
    base = clip(bundled("azure-conv"), max_requests=3000)
    w = multi_turn_sessions(base, turns_mean=4, seed=1, max_new_tokens=cap, max_prompt_len=32_768)
    again = multi_turn_sessions(base, turns_mean=4, seed=1, max_new_tokens=cap, max_prompt_len=32_768)
    check_invariants(w)
    assert len(w) == len(base) and w.requests == again.requests
    sessions: dict[str, list] = defaultdict(list)
    for r in w.requests:
        assert r.session is not None and r.prompt_len <= 32_768
        sessions[r.session].append(r)
    assert 3000 / 4 * 0.8 < len(sessions) < 3000 / 4 * 1.2
    for turns in sessions.values():
        assert [r.turn for r in turns] == list(range(len(turns)))  # arrival order = turn order
        assert turns[0].history_len == 0
        for prev, cur in zip(turns, turns[1:]):
            assert cur.history_len == prev.prompt_len + prev.output_len
            assert cur.history_len < cur.prompt_len and cur.prompt_len > prev.prompt_len
            assert cur.arrival >= prev.arrival + 0.03 * prev.output_len
            if cap is not None:
                assert cur.prompt_len - cur.history_len <= cap
    with pytest.raises(ValueError):
        multi_turn_sessions(base, turns_mean=0.5)
