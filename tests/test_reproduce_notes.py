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
    # "up to 2x" is the paper's best case: our best must reach 2x / 1.5; no gain is no reproduction
    assert band_verdict([1.0, 1.1], None, 2.0).startswith("not reproduced: below")
    assert band_verdict([1.0, 1.9], None, 2.0).startswith("reproduced (ours 1.0×–1.9×; band 1.3×–3× for the best; "
                                                       "median 1.45×, best 1.90×, 1 of 2 cells above 1×)")
    assert band_verdict([0.1, 5.0], 1.0, 2.0).startswith("not reproduced: partly outside")
    for bad in (0.0, [0.0, 0.0], [1.0, math.nan], [], -1.0, math.inf):
        assert band_verdict(bad, 1.0, 2.0).startswith("not measured")
    with pytest.raises(ValueError):
        band_verdict(1.0, 3.0, 2.0)


@given(st.floats(0.01, 100), st.floats(0.01, 100), st.floats(1.0, 3.0))
def test_band_verdict_is_reproduced_exactly_inside_the_band(x, paper, band):
    v = band_verdict(x, paper, paper, band)
    right_side = not ((paper > 1 and x <= 1) or (paper < 1 and x >= 1))  # a gain needs a gain
    inside = paper / band <= x <= paper * band and right_side
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
    assert "FlowPrefill's ratio over it (1.5×): reproduced (ours 1.5×; band 1.3×–3× for the best)" in near
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


# ------------------------------------------------------------------------------- PLA-Serve

def _pla(gain: float):
    """A PLA-Serve result where every PLA variant is `gain` better than the PD baselines (RPS up,
    TTFT and violations down); gain 0 with all numbers zero is a run that measured nothing."""
    from flowyard.experiments.pla_serve import DISTILL, FIG6, FIG7, QUICK, CLPoint, Results

    def pt(label: str, c: int) -> CLPoint:
        if gain == 0:
            return CLPoint(*([0.0] * 11), depth=0.0, short_tokens=0.0, prefill_busy=0.0, decode_busy=0.0)
        k = 1 + gain if "PLA" in label and "disaggregation only" not in label else 1.0
        return CLPoint(rps=2.0 * c * k, ttft_mean=0.5 / k, ttft_p90=1.0 / k, violation=0.3 / k,
                       short_mean=0.2 / k, short_p90=0.3, long_mean=0.9 * k, long_p90=1.5, hit_rate=0.5 * k / 2,
                       makespan=100 / k, window=50, depth=1.0 + gain, short_tokens=70 / k,
                       prefill_busy=0.2, decode_busy=0.8)

    cur = lambda labels, cs: {lab: [(c, pt(lab, c)) for c in cs] for lab in labels}  # noqa: E731
    return Results(QUICK, 0, 1000.0,
                   workloads={"fig6 1P": {"requests": 300, "sessions": 75, "first_turn_new_mean": 300.0},
                              "fig6 8P": {"short_share": 0.8, "long_token_share": 0.6}},
                   fig6={cl: cur([lab for lab in FIG6 if cl == "8P" or "spatial" not in lab], (4, 32))
                         for cl in ("1P", "8P")},
                   fig7={"1P": cur(FIG7, (32,)), "8P": cur(FIG7, (64,))},
                   distill={t: {lab: pt(lab, 16) for lab in DISTILL} for t in ("azure-conv", "sharegpt")},
                   wall_s=1.0, tally=Tally(runs=3, events=10))


def _pla_report(res, out: Path) -> str:
    from flowyard.experiments.pla_serve_report import write_report

    return write_report(res, out, command="test").read_text(encoding="utf-8")


def _row(md: str, claim: str) -> str:
    return md.split(f"\n| {claim} |")[1].split("\n")[0]


def test_pla_serve_report_follows_its_results(tmp_path):
    small, big = _pla_report(_pla(0.05), tmp_path / "a"), _pla_report(_pla(0.5), tmp_path / "b")
    mid = _pla_report(_pla(0.2), tmp_path / "c")
    # Fig. 6 RPS over PD on 1P against the paper's +20 %: +5 % is below the band, +20 % inside,
    # +50 % above it (a band with an upper bound: a gain far beyond the paper's is no reproduction)
    claim = "Fig. 6 RPS over SGLang PD, 1P, PLA, full (pla)"
    assert f"| {claim} | up to +20 % | best +5.0 %" in small
    assert "not reproduced: below (ours +5.0 %; band +13.3–30 %)" in _row(small, claim)
    assert "| reproduced (ours +20.0 %" in _row(mid, claim)
    assert "not reproduced: above (ours +50.0 %" in _row(big, claim)
    # graphs: the variants differ by 5 % vs 50 %; "add nothing" only when they do not differ
    assert "64.0 with disaggregation only (+5.0 %)" in small and "(+50.0 %)." in big
    assert "graphs add nothing" not in small + big
    assert "mean depth 1.05" in small and "almost single requests" in small
    assert "mean depth 1.50" in big
    assert "SLA-first moves the wait from short to long prompts" in small + big
    assert "Distillation is decode-bound here" in small and "4.0 turns per conversation" in small
    assert "each long-pool instance has 1.5× the tokens" in small  # 60 % of the tokens on half the instances
    assert small != big


def test_pla_serve_report_of_zeros_reproduces_nothing(tmp_path):
    text = _pla_report(_pla(0.0), tmp_path)
    assert "| reproduced |" not in text and "reproduced (" not in text
    assert "SLA-first moves the wait" not in text and "decode-bound" not in text
    assert "almost single requests" in text or "mean depth n/a" in text


# ------------------------------------------------------------------------------- structure

def _sources() -> dict[str, ast.Module]:
    return {p.stem: ast.parse(p.read_text(encoding="utf-8")) for p in sorted(EXP_DIR.glob("*.py"))}


def test_runs_are_assembled_only_by_sim_run():
    """No experiment builds a Simulator, a Topology or a cost model itself: `build_simulator`
    and `build_cost_model` (what `flowyard simulate` uses) do."""
    banned = {"Simulator", "Topology", "make_cost_model"}
    for name, tree in _sources().items():
        calls = {n.func.id if isinstance(n.func, ast.Name) else getattr(n.func, "attr", "")
                 for n in ast.walk(tree) if isinstance(n, ast.Call)}
        assert not calls & banned, (name, calls & banned)


def test_imports_go_one_way():
    """X_report may import X_notes and X, X_notes may import X; never the reverse, anywhere in the
    module (a function-level import would hide a circle)."""
    srcs = _sources()
    for x in experiments.EXPERIMENTS.values():
        stem = x.rsplit(".", 1)[1]
        order = [stem, stem + "_notes", stem + "_report"]
        for i, mod in enumerate(order):
            if mod not in srcs:
                continue
            imported = {n.module.rsplit(".", 1)[1] for n in ast.walk(srcs[mod])
                        if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("flowyard.experiments.")}
            assert not imported & set(order[i + 1:]), (mod, imported & set(order[i + 1:]))


def test_gain_verdict_has_both_bounds():
    from flowyard.experiments.report import gain_verdict

    assert gain_verdict(70.0, 33.0).startswith("not reproduced: above (ours +70.0 %; band +22–49.5 %)")
    assert gain_verdict(30.0, 33.0).startswith("reproduced") and gain_verdict(5.0, 20.0).startswith("not reproduced: below")
    assert gain_verdict(-3.0, 10.0).startswith("not reproduced: the other way")
    assert gain_verdict(math.nan, 10.0).startswith("not measured")


def test_closing_note_lists_the_verdicts_that_changed(tmp_path):
    from flowyard.experiments.report import Report

    head = "| claim | paper | ours | ours vs paper |\n|---|---|---|---|\n"
    (tmp_path / "x.md").write_text("# X\n\nGenerated (flowyard abc1234).\n\n" + head
                                   + "| a | 2× | 2.1× | reproduced (ours 2.1×) |\n| b | 3× | 1× | not reproduced: below |\n"
                                   + "| gone | 1× | 1× | reproduced |\n")
    rep = Report(tmp_path, "x")
    rep.add(head + "| a | 2× | 2.2× | reproduced (ours 2.2×) |\n| b | 3× | 3.1× | reproduced (ours 3.1×) |\n"
            + "| new | 1× | 1× | not measured |")
    rep.changes()
    text = rep.parts[-1]
    assert "(abc1234): 1 conclusion(s) unchanged, 3 change(s)" in text
    assert "- b: not reproduced → **reproduced** (was: not reproduced: below; now: reproduced (ours 3.1×))" in text
    from flowyard.experiments.report import conclusion

    assert conclusion("close (within 15 %)") == conclusion("reproduced (ours 1×)") == "reproduced"
    assert conclusion("same direction, smaller") == conclusion("not reproduced: the other way (x)") == "not reproduced"
    assert conclusion("higher") == "not reproduced" and conclusion("not measured (a zero)") == "not measured"
    assert "- new claim: new: not measured" in text and "- no longer a claim: gone (was: reproduced)" in text


def test_a_loss_is_never_a_reproduction_of_a_gain():
    """Arrow's SLO-aware over min-load dispatch: paper 1.1x, ours 0.97x lies inside the 1.5x
    band (0.73x-1.65x) but is a loss: never "reproduced"."""
    from flowyard.experiments.arrow_report import _verdict

    assert band_verdict(0.97, 1.1, 1.1).startswith("not reproduced: the other way")
    assert band_verdict([1.05, 1.2], 1.1, 1.3).startswith("reproduced")
    assert band_verdict(1.0, 1.1, 1.1).startswith("not reproduced: the other way")  # a tie is no gain
    assert band_verdict(1.2, 0.5, 0.8).startswith("not reproduced: the other way")  # paper: a reduction
    assert _verdict((0.97, ""), 1.1).startswith("not reproduced: the other way")
    assert _verdict((1.05, ""), 1.1).startswith("reproduced")


def test_up_to_claims_show_median_best_and_cells_beating_the_baseline():
    """DynaServe Fig 8 vs colocation: the best of 12 cells was 1.42x while 6 were below 1."""
    cells = [1.42, 1.3, 1.1, 1.05, 1.02, 1.01, 0.99, 0.95, 0.9, 0.85, 0.8, 0.7]
    v = band_verdict(cells, None, 1.91)
    assert "median 1.00×, best 1.42×, 6 of 12 cells above 1×" in v


def test_a_null_effect_is_judged_against_seed_noise():
    from flowyard.experiments.report import null_effect_verdict, seed_spread

    flat = {0: [100.0, 100.0, 100.0], 50: [98.0, 98.0, 98.0]}
    assert null_effect_verdict(flat, 0, 0.05).startswith("reproduced (-2.0 %; band ±5 %; seed spread ±0.0 % (1 s.d. "
                                                         "over 3 seeds))")
    noisy = {0: [93.0, 100.0, 107.0], 50: [91.0, 98.0, 105.0]}  # the same change under 7 % seed noise
    assert abs(seed_spread(noisy) - 0.07) < 0.002
    assert null_effect_verdict(noisy, 0, 0.05).startswith("undecided: seed noise ≥ the band")
    assert null_effect_verdict({0: [100.0, 100.0], 50: [99.0, 99.0]}, 0, 0.05).startswith("undecided: 2 seed(s)")
    assert null_effect_verdict({0: [100.0] * 3, 50: [80.0] * 3}, 0, 0.05).startswith("not reproduced: beyond ±5 %")
    for bad in ({0: [0.0] * 3, 50: [1.0] * 3}, {0: [1.0] * 3, 50: [math.nan] * 3}, {50: [1.0] * 3}):
        assert null_effect_verdict(bad, 0, 0.05).startswith("not measured")
    with pytest.raises(ValueError):
        null_effect_verdict(flat, 0, 5.0)
