"""PLA-Serve §2.1: closed-form compute-memory boundaries, their fit, and the roofline's split."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import LinearCost
from flowyard.core.plan import BatchShape
from flowyard.costmodel import RooflineCostModel, get_hardware
from flowyard.costmodel.base import LAYER_OPS, with_error
from flowyard.costmodel.profiled import ProfiledCostModel
from flowyard.policies.pla.boundary import (LengthModel, classify, fit_length_model,
                                            samples_from_cost_model)

LENGTHS = np.unique(np.round(np.geomspace(1, 8192, 40)))
HISTORIES = [0, 256, 1024, 4096, 16384, 32768]


def brute_boundary(m: LengthModel, H: float) -> float:
    """sup{L >= 0: T_comp <= T_mem} by bisection (g is a convex quadratic with g(0) <= 0)."""
    g = lambda L: m.t_comp(L, H) - m.t_mem(L, H)  # noqa: E731
    hi = 1.0
    while g(hi) <= 0:
        hi *= 2
    lo = 0.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if g(mid) <= 0 else (lo, mid)
    return lo


exp = lambda lo, hi: st.floats(lo, hi).map(lambda e: 10.0**e)  # noqa: E731
params = st.builds(LengthModel, alpha=exp(-12, -8), beta=exp(-7, -4), gamma_w=exp(-7, -4),
                   gamma_r=exp(-9, -6), gamma_0=st.one_of(st.just(0.0), exp(-5, -2)))


@settings(max_examples=200, deadline=None)
@given(m=params, H=st.one_of(st.just(0.0), exp(0, 6)))
def test_closed_form_matches_brute_force(m: LengthModel, H: float) -> None:
    b = m.reprefill_boundary(H)
    assert math.isfinite(b) and b >= 0
    assert b == pytest.approx(brute_boundary(m, H), rel=1e-7, abs=1e-6)
    if b > 1e-3:  # memory-bound just below, compute-bound just above
        assert m.t_mem(0.99 * b, H) > m.t_comp(0.99 * b, H)
    assert m.t_comp(1.01 * b + 1e-3, H) > m.t_mem(1.01 * b + 1e-3, H)


@settings(max_examples=100, deadline=None)
@given(m=params)
def test_paper_formulas_and_monotone_approach_to_saturation(m: LengthModel) -> None:
    p = dataclasses.replace(m, gamma_0=0.0)
    assert p.prefill_boundary() == pytest.approx(max(0.0, (p.gamma_w - p.beta) / p.alpha),
                                                 rel=1e-9, abs=1e-9)
    H = np.geomspace(1, 1e9, 60)
    for model in (m, p):
        b = model.reprefill_boundary(H)
        d = np.diff(b)
        sat = model.saturation
        # L_m(H) moves monotonically toward gamma_r/(2 alpha) and never crosses it.
        if model.prefill_boundary() <= sat:
            assert (d >= -1e-9 * sat).all() and (b <= sat * (1 + 1e-9)).all()
        else:
            assert (d <= 1e-9 * b[:-1]).all() and (b >= sat * (1 - 1e-9)).all()
    # The paper's case (gamma_0 = 0, gamma_w - beta < gamma_r / 2): grows toward saturation.
    if p.gamma_w - p.beta < p.gamma_r / 2:
        assert (np.diff(p.reprefill_boundary(H)) >= -1e-12).all()


def test_paper_reprefill_formula_verbatim() -> None:
    m = LengthModel(alpha=1e-9, beta=2e-5, gamma_w=5e-6, gamma_r=4e-8)
    for H in (1.0, 1024.0, 16384.0):
        k = 2 * m.alpha * H + m.beta - m.gamma_w
        paper = max(0.0, (-k + math.sqrt(k * k + 4 * m.alpha * m.gamma_r * H)) / (2 * m.alpha))
        assert m.reprefill_boundary(H) == pytest.approx(paper, rel=1e-6)
    assert m.prefill_boundary() == 0.0  # gamma_w <= beta: prefills always compute-bound
    v = m.reprefill_boundary(np.array([0, 1024, 16384]))
    assert v.shape == (3,) and v[0] == 0.0 and v[2] > v[1] > 0
    assert m.t_comp(np.array([1, 2]), 3).shape == (2,)


def _samples(m: LengthModel, rng=None, noise=0.0) -> np.ndarray:
    L, H = (g.ravel() for g in np.meshgrid(LENGTHS, HISTORIES, indexing="ij"))
    tc, tm = m.t_comp(L, H), m.t_mem(L, H)
    if rng is not None:
        tc = tc * (1 + noise * rng.standard_normal(tc.shape))
        tm = tm * (1 + noise * rng.standard_normal(tm.shape))
    return np.column_stack([L, H, tc, tm])


H100_LIKE = LengthModel(alpha=7.8e-10, beta=2.08e-5, gamma_w=5.1e-6, gamma_r=4.4e-8, gamma_0=5e-3)


@settings(max_examples=50, deadline=None)
@given(m=params)
def test_fit_recovers_noiseless(m: LengthModel) -> None:
    fits = [fit_length_model(_samples(m))]
    if m.gamma_0 == 0:
        fits.append(fit_length_model(_samples(m), mem_intercept=False))
    for f in fits:
        for name in ("alpha", "beta", "gamma_w", "gamma_r", "gamma_0"):
            assert getattr(f, name) == pytest.approx(getattr(m, name), rel=1e-6, abs=1e-12)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fit_recovers_noisy(seed: int) -> None:
    """2 % multiplicative noise on both curves (runtime samples are never exact)."""
    f = fit_length_model(_samples(H100_LIKE, np.random.default_rng(seed), 0.02))
    for name in ("alpha", "beta", "gamma_w", "gamma_r", "gamma_0"):
        assert getattr(f, name) == pytest.approx(getattr(H100_LIKE, name), rel=0.1)
    H = np.array([0, 1024, 4096, 16384])
    assert f.reprefill_boundary(H) == pytest.approx(H100_LIKE.reprefill_boundary(H), rel=0.05)


# -- the roofline ------------------------------------------------------------------------


def test_split_brackets_step_time_and_is_vectorised() -> None:
    cm = RooflineCostModel("llama-3-8b", "h100", tp=2)
    for H, L in [(0, 1), (0, 512), (4096, 64), (16384, 4096)]:
        s = BatchShape.of([(H, L)], [])
        tc, tm = cm.compute_memory_split(s)
        assert isinstance(tc, float) and 0 < tc and 0 < tm
        assert max(tc, tm) <= cm.step_time(s) <= tc + tm + 5e-3  # sum of max per op
    Ls = np.array([1.0, 512.0, 4096.0])
    vec = cm.compute_memory_split(BatchShape(prefill_tokens=Ls, prefill_seqs=1,
                                             prefill_attn=Ls * (100 + (Ls + 1) / 2),
                                             prefill_kv=Ls + 100))
    for i, L in enumerate(Ls):
        one = cm.compute_memory_split(BatchShape.of([(100, int(L))], []))
        assert vec[0][i] == pytest.approx(one[0]) and vec[1][i] == pytest.approx(one[1])


def _fit(hw: str, method: str = "auto", cost=None) -> LengthModel:
    cost = cost or RooflineCostModel("llama-3-8b", hw)
    return fit_length_model(samples_from_cost_model(cost, LENGTHS, HISTORIES, method=method))


# llama-3-8b, TP 1 (split method): prefill, re-prefill at 1K/4K/16K, saturation.
#   h100      317  291  235  140  28   (AI* = 295)
#   h200      203  187  154   94  20   (AI* = 206)
#   a100-80g  170  163  146  107  30   (AI* = 153)
@pytest.mark.parametrize("hw", ["h100", "h200", "a100-80g"])
def test_roofline_boundaries_plausible(hw: str) -> None:
    m = _fit(hw)
    spec = get_hardware(hw)
    ridge = spec.peak_flops / spec.mem_bw
    pre = m.prefill_boundary()
    # The paper: the transition sits at 150-512 tokens, near AI* (GEMM intensity ~ L).
    assert math.isfinite(pre) and 150 <= pre <= 512
    assert 0.8 * ridge <= pre <= 1.3 * ridge
    re = m.reprefill_boundary(np.array([1024, 4096, 16384]))
    assert np.isfinite(re).all() and (re > 0).all()
    # Long histories: memory-bound up to a few dozen tokens (the saturation), from above.
    assert 10 <= m.saturation <= 60
    assert pre > re[0] > re[1] > re[2] > m.saturation
    assert m.reprefill_boundary(1e9) == pytest.approx(m.saturation, rel=0.01)
    # The fitted boundary is where the roofline's own two sides cross.
    for H, b in [(0, pre), (4096, re[1])]:
        L = np.arange(1, 2048, dtype=float)
        tc, tm = RooflineCostModel("llama-3-8b", hw).compute_memory_split(
            BatchShape(prefill_tokens=L, prefill_seqs=1, prefill_attn=L * (H + (L + 1) / 2),
                       prefill_kv=H + L))
        assert abs(L[np.argmax(tc > tm)] - b) <= 2
    # Paper-literal T_mem (KV traffic only, no weight stream): prefills never memory-bound.
    assert dataclasses.replace(m, gamma_0=0.0).prefill_boundary() == 0.0


def test_more_bandwidth_lowers_the_boundary_and_scale_does_not_move_it() -> None:
    h100, h200 = _fit("h100"), _fit("h200")
    assert h200.prefill_boundary() < h100.prefill_boundary()
    slow = _fit("h100", cost=with_error(RooflineCostModel("llama-3-8b", "h100"), 1.3))
    assert slow.alpha == pytest.approx(1.3 * h100.alpha)
    assert slow.prefill_boundary() == pytest.approx(h100.prefill_boundary())


def _profile_of(cm: RooflineCostModel) -> dict:
    """A `flowyard profile`-style dict measured on the roofline instead of the engine."""
    rows = []
    for L in [1, 16, 64, 128, 256, 384, 512, 768, 1024, 2048, 4096]:
        for H in [0, 1024, 4096, 16384]:
            s = BatchShape.of([(H, L)], [])
            t = {k: float(v) for k, v in cm.layer_op_times(s).items() if k in LAYER_OPS}
            t["step_other"] = float(sum(cm.step_overhead(s).values()))
            rows.append({"shape": dataclasses.asdict(s), "times": t})
    return {"num_layers": cm.num_layers, "kv_bytes_per_token": cm.kv_bytes_per_token(),
            "samples": rows}


@pytest.mark.parametrize("hw", ["h100", "h200"])
def test_floor_fallback_close_to_split(hw: str) -> None:
    """No split available: the memory-floor fallback lands within 35 % of the exact split
    for H <= 16K, on the roofline itself and on a ProfiledCostModel fitted to it. Observed
    (roofline, H = 0 / 16K): h100 297 / 157 vs 317 / 140; h200 239 / 123 vs 203 / 94."""
    cm = RooflineCostModel("llama-3-8b", hw)
    exact = _fit(hw)
    H = np.array([0, 1024, 4096, 16384])
    for cost in (cm, ProfiledCostModel(_profile_of(cm))):
        approx = _fit(hw, "floor", cost)
        assert approx.reprefill_boundary(H) == pytest.approx(exact.reprefill_boundary(H), rel=0.35)


def test_classify() -> None:
    m = _fit("h100")
    pre, re16 = m.prefill_boundary(), m.reprefill_boundary(16384)
    assert classify(math.floor(pre), 0, m) == "short"
    assert classify(math.ceil(pre), 0, m) == "long"
    assert classify(200, 0, m) == "short" and classify(200, 16384, m) == "long"
    assert classify(math.floor(re16), 16384, m) == "short"
    assert classify(math.ceil(re16), 16384, m) == "long"
    assert classify(np.int64(8), np.int64(100), m) == "short"


# -- bad input ---------------------------------------------------------------------------


def test_bad_input_errors() -> None:
    with pytest.raises(ValueError, match="alpha must be > 0"):
        LengthModel(0.0, 1e-5, 1e-6, 1e-8)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="beta"):
            LengthModel(1e-9, bad, 1e-6, 1e-8)
    with pytest.raises(ValueError, match="H must be"):
        H100_LIKE.reprefill_boundary(-1)
    good = _samples(H100_LIKE)
    cases = [
        (good[:, :3], "rows"), (good[:4], "at least 5 samples"),
        (np.where(np.isnan(good), 0, good) * [1, 1, np.nan, 1], "NaN"),
        (good * [1, 1, -1, 1], "negative t_comp"),
        (good[good[:, 1] == 0], "no sample has H > 0"),
        (good[good[:, 0] == 64], "same L"),
        (np.column_stack([LENGTHS, 2 * LENGTHS, LENGTHS, LENGTHS]), "collinear"),
        (np.column_stack([np.zeros(6), np.arange(6), np.zeros(6), np.ones(6)]), "L > 0"),
    ]
    for samples, msg in cases:
        with pytest.raises(ValueError, match=msg):
            fit_length_model(samples)
    with pytest.raises(ValueError, match="no quadratic growth"):  # compute linear in L
        fit_length_model(good * [1, 1, 0, 1] + np.outer(good[:, 0], [0, 0, 1e-5, 0]))
    with pytest.raises(ValueError, match="no compute_memory_split"):
        samples_from_cost_model(LinearCost(), LENGTHS, HISTORIES, method="split")
    with pytest.raises(ValueError, match="method"):
        samples_from_cost_model(LinearCost(), LENGTHS, HISTORIES, method="exact")
    with pytest.raises(ValueError, match="L >= 1"):
        samples_from_cost_model(LinearCost(), [0, 5], HISTORIES)
    for args, msg in [((0, 0), "prompt_len must be >= 1"), ((5, -1), "history_len"),
                      ((2.5, 0), "integer"), ((True, 0), "integer")]:
        with pytest.raises(ValueError, match=msg):
            classify(*args, H100_LIKE)
