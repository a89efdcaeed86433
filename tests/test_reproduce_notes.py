"""Reports are computed from their results: the FlowPrefill and PLA-Serve write-ups built from
synthetic results with other numbers say other numbers and verdicts, a run of zeros is never
"reproduced", and the experiments assemble runs through `sim.run.build_simulator` only, with
imports going X_report -> X_notes -> X, never back."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
from hypothesis import given, strategies as st

import flowyard.experiments as experiments
from flowyard.experiments.common import Tally, Threshold, band_verdict
from flowyard.experiments.flowprefill import QUICK, SYSTEMS, ModelResult, Results

EXP_DIR = Path(experiments.__file__).parent


# ------------------------------------------------------------------------------- band verdict

def test_band_verdict_states_the_band_and_never_passes_zeros():
    assert band_verdict([1.0, 1.2], 1.0, 1.2).startswith("reproduced (ours 1.0×–1.2×; band 0.67×–1.8×)")
    assert band_verdict(4.0, None, 2.0).startswith("not reproduced: above")  # "up to 2x", widened to 3x
    assert band_verdict([0.1, 5.0], 1.0, 2.0).startswith("not reproduced: partly outside")
    for bad in (0.0, [0.0, 0.0], [1.0, math.nan], [], -1.0, math.inf):
        assert band_verdict(bad, 1.0, 2.0).startswith("not measured")
    with pytest.raises(ValueError):
        band_verdict(1.0, 3.0, 2.0)


@given(st.floats(0.01, 100), st.floats(0.01, 100), st.floats(1.0, 3.0))
def test_band_verdict_is_reproduced_exactly_inside_the_band(x, paper, band):
    v = band_verdict(x, paper, paper, band)
    inside = paper / band <= x <= paper * band
    assert v.startswith("reproduced") == inside and ("not reproduced" in v) == (not inside)


# ------------------------------------------------------------------------------- FlowPrefill

def _fp(scale: float, *, blocking_ms: float = 2.0) -> Results:
    """A FlowPrefill result whose goodput is `scale` times every baseline's (zero: nothing met)."""
    base = {n: 0.5 for n in SYSTEMS}
    good = {n: Threshold(v * (scale if n == "FlowPrefill" else 1.0) if scale else 0.0,
                         curve=[(0.5, 0.95), (1.0, 0.5)]) for n, v in base.items()}
    slo = {n: Threshold(1.0 if n == "FlowPrefill" else 1.0 + scale, curve=[(1.0, 0.9), (2.0, 0.95)])
           if scale else Threshold(math.inf, curve=[(1.0, 0.0)], never_met=True) for n in SYSTEMS}
    m = ModelResult("llama-3-8b", "Llama3-8B", 2.0, 0.5, good, slo, {"text": 0.95, "search": 0.4})
    b = blocking_ms * 1e-3 if scale else math.nan
    stats = {"count": 10 if scale else 0, "mean": b, "p99": b, "max": 3 * b, "below_4.5ms": 1.0}
    layer = {**stats, "mean": 3.8 * b if scale else math.nan}
    return Results(
        QUICK, 0, [m], priority={n: (Threshold(scale * (1.1 if n == "S-EDF" else 1.0)), Threshold(1.0))
                                 for n in ("S-EDF", "EDF", "D-EDF")},
        priority_rate=1.0, budget={n: [(1.0, 0.9, scale), (2.0, 0.9 - 0.05 * i, scale)]
                                   for i, n in enumerate(("2K", "4K", "8K", "no limit", "no batching"))},
        blocking={"llama-3-8b": {"operator": stats, "layer": layer}},
        blocking_attainment={"llama-3-8b": {"operator": 0.9, "layer": 0.9}},
        chunk={n: Threshold(scale * (2.0 if n == "4K" else 1.0)) for n in ("no chunking", "2K", "4K", "16K")},
        base_capacity=2.0, arrival_cv=1.4, task_mix={"text": (0.7, 0.2), "search": (0.3, 0.8)},
        wall_s=1.0, tally=Tally(runs=3, events=100))


def _fp_report(res: Results, out: Path) -> str:
    from flowyard.experiments.flowprefill_report import write_report

    return write_report(res, out, command="test").read_text(encoding="utf-8")


def test_flowprefill_report_follows_its_results(tmp_path):
    near = _fp_report(_fp(1.5), tmp_path / "a")  # 1.5x CP2K (paper: up to 2x), 1.5x DistServe (4.7-5.6x)
    far = _fp_report(_fp(12.0, blocking_ms=9.0), tmp_path / "b")
    assert "FlowPrefill's ratio over it (1.5×): reproduced (ours 1.5×; band 0.67×–3×)" in near
    assert "FlowPrefill's ratio over it (12.0×): not reproduced: above (ours 12.0×" in far
    assert "**DistServe (FCFS)**: ours 1.5×, not reproduced: below" in near
    assert "**DistServe (FCFS)**: ours 12.0×, reproduced (ours 12.0×; band 3.1×–8.4×)" not in far
    assert "not reproduced: above (ours 12.0×; band 3.1×–8.4×)" in far
    # verdicts of the paper's blocking bound follow the blocking times
    assert "| within (all < 4.5 ms) |" in near and "above (27.0 ms ≥ 4.5 ms)" in far
    assert "the maximum is 6.0 ms: a single operator" in near and "the maximum is 27.0 ms: a single" in far
    assert "FlowPrefill beyond capacity" not in near and "**FlowPrefill's goodput** is 0.4× C" in near
    assert "FlowPrefill beyond capacity.** FlowPrefill's goodput is 3.0× C" in far
    assert "search: 30% of the requests but 80% of the prompt tokens" in far
    assert near != far


def test_flowprefill_report_of_zeros_reproduces_nothing(tmp_path):
    text = _fp_report(_fp(0.0), tmp_path)
    assert "reproduced (" not in text and "| within" not in text
    assert "not measured (a zero or missing value)" in text and "not measured (no preemption)" in text
    assert "as in the paper" not in text
    assert "no priority variant met the target" in text and "no chunk size met the target" in text
