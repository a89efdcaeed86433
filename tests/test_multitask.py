"""QwenTrace-like workload: fitted lengths vs FlowPrefill Table 1, SLOs vs Table 2, arrivals."""

from __future__ import annotations

import math

import numpy as np
import pytest

from flowyard.core.request import SLO
from flowyard.workloads import (
    QWENTRACE_TASKS,
    QWENTRACE_TTFT_SLO,
    fit_shifted_weibull,
    load_trace,
    qwentrace_like,
    sample_prompt_lens,
    scale_slo,
    task_length_dist,
    task_slos,
    with_slo,
)

# Tolerances on 20k samples. The mean and std are fitted exactly, so their slack is sampling
# noise (worst over 20 seeds: 2 % mean, 6 % std for image's heavy tail). P99: text and search
# are fitted exactly; image (-1.6 %) and file (+4.5 %) are the closest the family reaches.
N = 20_000
TOL_MEAN, TOL_STD, TOL_P99 = 0.05, 0.15, 0.15


@pytest.mark.parametrize("task", QWENTRACE_TASKS, ids=lambda t: t.name)
def test_sampled_lengths_match_table1(task) -> None:
    x = sample_prompt_lens(task.name, N, rng=123)
    assert x.dtype == np.int64 and x.min() >= 1 and x.max() <= 32768
    assert abs(x.mean() / task.mean - 1) < TOL_MEAN
    assert abs(x.std() / task.std - 1) < TOL_STD
    assert abs(np.percentile(x, 99) / task.p99 - 1) < TOL_P99


@pytest.mark.parametrize("task", QWENTRACE_TASKS, ids=lambda t: t.name)
def test_fit_is_exact_where_reachable(task) -> None:
    """Analytic moments: mean/std exact, P99 within 5 %, exact for text and search, loc >= 0."""
    d = task_length_dist(task.name)
    assert d.mean == pytest.approx(task.mean, rel=1e-6)
    assert d.std == pytest.approx(task.std, rel=1e-6)
    assert d.loc >= 0
    rel = 1e-4 if task.name in ("text", "search") else 0.05
    assert d.quantile(0.99) == pytest.approx(task.p99, rel=rel)


def test_fit_recovers_a_known_weibull() -> None:
    """A plain Weibull's own mean/std/P99 fit back to its shape (loc 0, same scale)."""
    c, lam = 1.7, 1000.0
    g1, g2 = math.gamma(1 + 1 / c), math.gamma(1 + 2 / c)
    mean, std = lam * g1, lam * math.sqrt(g2 - g1 * g1)
    d = fit_shifted_weibull(mean, std, lam * math.log(100) ** (1 / c))
    assert d.shape == pytest.approx(c, rel=1e-6) and d.scale == pytest.approx(lam, rel=1e-6)
    with pytest.raises(ValueError, match="p99 > mean"):
        fit_shifted_weibull(100, 50, 80)


def test_max_len_caps_lengths() -> None:
    x = sample_prompt_lens("file", 5000, rng=0, max_len=8192)
    assert x.max() == 8192
    w = qwentrace_like(2000, max_len=4096, seed=1)
    assert w.prompt_lens().max() <= 4096


def test_task_shares_and_tags_match_table1() -> None:
    w = qwentrace_like(N, arrivals="poisson", seed=5)
    tasks = [r.task for r in w.requests]
    for t in QWENTRACE_TASKS:
        share = tasks.count(t.name) / N
        assert abs(share - t.share) < 0.015, (t.name, share)
    # per-task lengths come from that task's sampler
    lens = {t.name: [r.prompt_len for r in w.requests if r.task == t.name] for t in QWENTRACE_TASKS}
    assert np.mean(lens["file"]) > 5 * np.mean(lens["text"])


@pytest.mark.parametrize("model", sorted(QWENTRACE_TTFT_SLO))
@pytest.mark.parametrize("scale", [0.5, 1.0, 2.0])
def test_slos_follow_table2(model: str, scale: float) -> None:
    w = qwentrace_like(400, model=model, slo_scale=scale, arrivals="poisson", seed=2)
    for r in w.requests:
        assert r.slo.ttft == pytest.approx(QWENTRACE_TTFT_SLO[model][r.task] * scale)
        assert r.slo.tpot is None and r.slo.tbt is None
    assert task_slos(model.upper(), scale)["search"] == SLO(ttft=QWENTRACE_TTFT_SLO[model]["search"] * scale)


def test_table2_values() -> None:
    assert QWENTRACE_TTFT_SLO["llama-3-8b"] == {"text": 0.25, "image": 0.5, "search": 4.0, "file": 6.0}
    assert QWENTRACE_TTFT_SLO["qwen2.5-14b"] == {"text": 0.4, "image": 0.8, "search": 6.5, "file": 9.0}
    assert QWENTRACE_TTFT_SLO["llama-3-70b"] == {"text": 1.0, "image": 2.0, "search": 15.0, "file": 18.0}
    assert sum(t.share for t in QWENTRACE_TASKS) == pytest.approx(1.0)


@pytest.mark.parametrize("arrivals", ["azure-conv", "poisson", "gamma"])
def test_deterministic_and_rate_achieved(arrivals: str) -> None:
    a = qwentrace_like(3000, rate=7.5, arrivals=arrivals, seed=11)
    b = qwentrace_like(3000, rate=7.5, arrivals=arrivals, seed=11)
    c = qwentrace_like(3000, rate=7.5, arrivals=arrivals, seed=12)
    assert a.requests == b.requests
    assert a.requests != c.requests
    assert len(a) == 3000 and a.rate == pytest.approx(7.5, rel=1e-9)
    assert [r.id for r in a.requests] == list(range(3000)) and a.requests[0].arrival == 0.0
    assert np.all(np.diff(a.arrivals()) >= 0)
    assert set(a.output_lens()) == {16}


def test_azure_arrivals_keep_the_trace_burstiness() -> None:
    """Re-timed trace gaps are the trace's gaps, scaled: same CV, unlike Poisson's ~1."""
    t = load_trace("azure-conv").arrivals()
    gaps = np.diff(t)
    w = qwentrace_like(len(t) - 1, rate=2.0, seed=3)
    g = np.diff(w.arrivals())
    assert g.std() / g.mean() == pytest.approx(gaps.std() / gaps.mean(), rel=0.05)
    # longer than the trace: it wraps around and still hits the rate
    long = qwentrace_like(2 * len(t) + 10, rate=20.0, seed=0)
    assert long.rate == pytest.approx(20.0) and np.all(np.diff(long.arrivals()) >= 0)


def test_duration_and_output_modes() -> None:
    w = qwentrace_like(duration=100.0, rate=4.0, arrivals="gamma", cv=3.0, seed=0)
    assert len(w) == 400 and w.duration == pytest.approx(399 / 4.0)
    o = qwentrace_like(5000, output_len="azure-conv", seed=0).output_lens()
    assert len(set(o)) > 50 and o.min() >= 1
    assert set(qwentrace_like(10, output_len=64).output_lens()) == {64}
    assert len(qwentrace_like(1)) == 1


def test_scale_slo() -> None:
    w = qwentrace_like(300, arrivals="poisson", seed=4)
    s = scale_slo(w, 2.5)
    for r, q in zip(w.requests, s.requests):
        assert q.slo.ttft == pytest.approx(2.5 * r.slo.ttft) and q.task == r.task
        assert q.slo.tpot is None
    both = scale_slo(with_slo(w, tpot=0.1), 0.5)
    assert all(r.slo.tpot == pytest.approx(0.05) for r in both.requests)
    assert w.requests[0].slo.ttft in QWENTRACE_TTFT_SLO["llama-3-8b"].values()  # input untouched
    with pytest.raises(ValueError, match="SLO scale factor"):
        scale_slo(w, 0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(n=10, model="gpt-4"), "known: llama-3-8b, qwen2.5-14b, llama-3-70b"),
        (dict(n=10, rate=0), "rate must be a positive"),
        (dict(n=10, rate=float("inf")), "rate must be a positive"),
        (dict(n=10, slo_scale=-1), "slo_scale must be a positive"),
        (dict(), "exactly one of n"),
        (dict(n=10, duration=5.0), "exactly one of n"),
        (dict(n=0), "n must be an integer >= 1"),
        (dict(n=2.5), "n must be an integer >= 1"),
        (dict(duration=-1.0), "duration must be a positive"),
        (dict(n=10, arrivals="uniform"), "known: azure-conv, poisson, gamma"),
        (dict(n=10, arrivals="gamma", cv=0), "cv must be a positive"),
        (dict(n=10, output_len=0), "output_len must be an integer >= 1 or 'azure-conv'"),
        (dict(n=10, output_len="sharegpt"), "output_len must be an integer >= 1 or 'azure-conv'"),
        (dict(n=10, max_len=0), "max_len must be an integer >= 1"),
    ],
)
def test_bad_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        qwentrace_like(**kwargs)


def test_unknown_task() -> None:
    with pytest.raises(ValueError, match="known: text, image, search, file"):
        sample_prompt_lens("video", 10)
