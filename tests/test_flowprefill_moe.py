"""FlowPrefill Fig. 17 (Qwen3-30B-A3B, MoE): the quick run, its SLO row, and verdicts that follow
the measured ratios (a loss is never "reproduced")."""

from __future__ import annotations

import dataclasses
import math

import pytest

from flowyard.experiments.common import Report, Tally, Threshold
from flowyard.experiments.flowprefill import QUICK, MODELS, ModelResult
from flowyard.experiments.flowprefill_moe import MOE_SETTINGS, MoEResult, run_moe
from flowyard.experiments.flowprefill_moe_report import moe_json, moe_ratios, moe_section
from flowyard.experiments.report import verdict_rows


@pytest.fixture(scope="module")
def quick_moe() -> MoEResult:
    return run_moe(QUICK, 0, Tally(), None)


def test_quick_run_measures_every_system_on_the_moe_model(quick_moe):
    m = quick_moe.result
    assert m.model == "qwen3-30b-a3b" and quick_moe.systems == MOE_SETTINGS["quick"].systems
    assert set(m.goodput) == set(m.min_slo) == set(quick_moe.systems)
    assert all(t.value > 0 and t.curve for t in m.goodput.values())
    assert quick_moe.slo_model in {name for name, _, _ in MODELS}  # a Table 2 row
    caps = quick_moe.capacities
    assert quick_moe.slo_model == min((n for n, _, _ in MODELS), key=lambda n: abs(math.log(caps[n] / caps[m.model])))
    assert 3.3e9 < quick_moe.active_params < 3.4e9 < 30e9 < quick_moe.total_params
    r = moe_ratios(quick_moe)
    assert set(r) == {"DistServe-CP2K"} and all(math.isfinite(v) for v in r["DistServe-CP2K"].values())


def test_unknown_settings_are_a_clear_error():
    with pytest.raises(ValueError, match="unknown Fig. 17 settings 'huge'"):
        run_moe(dataclasses.replace(QUICK, moe="huge"), 0, Tally(), None)


def _moe(goodput_ratio: float, slo_ratio: float, edf: bool = False) -> MoEResult:
    names = ("FlowPrefill", "DistServe-CP2K", "DistServe-CP8K") + (("CP2K, EDF per chunk",) if edf else ())
    gp = {n: Threshold(2.0 * (goodput_ratio if n == "FlowPrefill" else 1.0), curve=[(1.0, 0.95), (4.0, 0.5)])
          for n in names}
    ms = {n: Threshold(0.5 * (1.0 if n == "FlowPrefill" else slo_ratio), curve=[(0.5, 0.9), (1.0, 0.95)])
          for n in names}
    return MoEResult(ModelResult("qwen3-30b-a3b", "Qwen3-30B-A3B TP2", 4.0, 2.0, gp, ms), names, 100,
                     "llama-3-8b", {"llama-3-8b": 5.0, "qwen3-30b-a3b": 4.0}, 30_500_000_000, 3_350_000_000)


@pytest.mark.parametrize("g,s,goodput_verdict,slo_verdict", [
    (1.5, 2.0, "reproduced", "reproduced"),
    (0.9, 0.8, "not reproduced: the other way", "not reproduced: the other way"),
    (7.0, 4.5, "not reproduced: above", "not reproduced: above"),
])
def test_verdicts_follow_the_measured_ratios(tmp_path, g, s, goodput_verdict, slo_verdict):
    rep = Report(tmp_path, "flowprefill")
    moe_section(_moe(g, s), rep)
    rows = verdict_rows("\n\n".join(rep.parts))
    got = {k.split(":")[1].split()[0]: v for k, v in rows.items() if "EDF" not in k}
    assert got["goodput"].startswith(goodput_verdict) and got["tighter"].startswith(slo_verdict)
    assert len(rows) == 2  # the EDF-per-chunk reading only when it ran
    assert (tmp_path / "flowprefill" / "fig17_qwen3-30b-a3b.png").stat().st_size > 10_000
    with_edf = _moe(g, s, edf=True)
    rep = Report(tmp_path / "edf", "flowprefill")
    moe_section(with_edf, rep)
    edf_rows = {k: v for k, v in verdict_rows("\n\n".join(rep.parts)).items() if "EDF per chunk" in k}
    assert len(edf_rows) == 2 and all(v.startswith(("reproduced", "not reproduced")) for v in edf_rows.values())
    data = moe_json(_moe(g, s))
    assert data is not None and data["ratios"]["DistServe-CP2K"]["goodput"] == pytest.approx(g)
