"""`flowyard reproduce`: the quick FlowPrefill study end to end, its CLI errors, and the shared
search/report helpers of `flowyard.experiments.common`."""

from __future__ import annotations

import json
import math

import pytest

from flowyard.cli import main
from flowyard.experiments.common import (Scenario, Tally, md_table, ratio, run_point, threshold_search)


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("results")
    assert main(["reproduce", "flowprefill", "--quick", "--out", str(out), "--quiet", "--allow-dirty"]) == 0
    return out


def test_quick_run_writes_markdown_and_figures(quick_report):
    md = (quick_report / "flowprefill.md").read_text(encoding="utf-8")
    figs = quick_report / "flowprefill"
    pngs = sorted(p.name for p in figs.glob("*.png"))
    assert pngs == ["fig10_priority.png", "fig11_budget.png", "fig12_blocking.png", "fig15_chunk.png",
                    "fig16_colocation.png", "fig17_qwen3-30b-a3b.png", "fig9_llama-3-8b.png"]
    for name in pngs:
        data = (figs / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
        assert f"(flowprefill/{name})" in md  # linked from the report
    data = json.loads((figs / "results.json").read_text())
    assert data["e2e"][0]["model"] == "llama-3-8b" and data["e2e"][0]["goodput"]["FlowPrefill"]["curve"]
    moe = data["fig17"]  # Fig. 17, the MoE model
    assert moe["model"] == "qwen3-30b-a3b" and moe["tp"] == 2 and moe["goodput"]["DistServe-CP2K"]["curve"]
    assert "## Mixture of experts: Qwen3-30B-A3B (Fig. 17)" in md and "| Fig. 17: goodput vs DistServe-CP2K |" in md
    coloc = data["colocation"]["attainment"]
    assert set(coloc) == {"FlowPrefill (colocated)", "vLLM-CP2K"}
    assert all(len(v["ttft"]) == len(v["tbt"]) == len(data["colocation"]["rates_rps"]) for v in coloc.values())


def test_fig16_verdict_is_computed_from_the_run(quick_report):
    """The headline's Fig. 16 row is the verdict of the attainment the run measured; swapping the
    systems (a loss at every rate) is never reproduced."""
    import dataclasses

    from flowyard.experiments.flowprefill_coloc import BASELINE, FP, QUICK_COLOC, run_colocation, tbt_verdict

    md = (quick_report / "flowprefill.md").read_text(encoding="utf-8")
    c = run_colocation(dataclasses.replace(QUICK_COLOC, rate_fracs=(0.3,)), 60, 0, Tally(), None)
    assert set(c.curves) == {FP, BASELINE} and all(0 <= x <= 1 for x in c.attainment(FP, "tbt"))
    row = next(line for line in md.splitlines() if line.startswith("| Fig. 16 colocated"))
    assert row.split(" | ")[-1].rstrip(" |").startswith(("reproduced", "not reproduced", "not measured"))
    swapped = dataclasses.replace(c, curves={FP: c.curves[BASELINE], BASELINE: c.curves[FP]})
    if c.ratios("tbt") and all(r >= 1 for r in c.ratios("tbt")):
        assert not tbt_verdict(swapped).startswith("reproduced")


def test_report_has_tables_paper_numbers_and_provenance(quick_report):
    md = (quick_report / "flowprefill.md").read_text(encoding="utf-8")
    for header in ("| claim (FlowPrefill …) | paper | ours | ours vs paper |",
                   "| system | goodput (req/s) | FlowPrefill / system | min SLO scale | system / FlowPrefill |",
                   "| priority | goodput (req/s) | min SLO scale |", "| chunk | goodput (req/s) | vs no chunking |",
                   "| model | op: n | op mean (ms) |", "| budget |"):
        assert header in md, header
    for paper in ("4.7×–5.6×", "up to 2.0×", "up to 4.5×", "1.5×–2.3×", "2.1×–3.1×", "< 4.5 ms", "3.5×–4.2×"):
        assert paper in md, paper
    assert f"`flowyard reproduce flowprefill --out {quick_report} --quick --allow-dirty`" in md
    assert "s of wall time" in md and "Quick mode" in md
    assert "## Where and why ours differ" in md and "TTFT SLO attainment" in md
    # Figs. 3 and 4 from the cost model; the other unreproduced figures each with a reason
    assert "## Figs. 3 and 4: lone prefills priced by the cost model" in md and "**Fig. 3**" in md
    gone = md.split("Figures not reproduced, and why")[1]
    for fig in ("Fig. 13", "Fig. 14", "Fig. 17"):
        assert fig in gone, fig
    assert "**Fig. 16**" not in gone and "## PD colocation: TTFT and TBT attainment (Fig. 16)" in md
    assert "## What changed since the previous report" in md
    for system in ("FlowPrefill", "DistServe", "DistServe-CP2K", "DistServe-CP8K", "vLLM-CP2K (colocated)"):
        assert f"| {system} |" in md


def test_unknown_experiment_exits_2_listing_valid_ones(capsys):
    assert main(["reproduce", "nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("flowyard: error: unknown experiment 'nope'") and "flowprefill" in err
    assert len(err.splitlines()) == 1


def test_reproduce_all_runs_every_experiment_in_turn_with_the_same_flags(monkeypatch, tmp_path, capsys):
    import flowyard.experiments as experiments

    calls = []

    def fake(name, out, **kw):
        calls.append((name, out, kw["quick"], kw["seed"], kw["command"]))
        return tmp_path / f"{name}.md"

    monkeypatch.setattr(experiments, "run_experiment", fake)
    assert main(["reproduce", "all", "--quick", "--seed", "2", "--out", str(tmp_path), "--quiet"]) == 0
    assert [c[0] for c in calls] == list(experiments.EXPERIMENTS)
    assert all(c[1] == str(tmp_path) and c[2] and c[3] == 2 for c in calls)
    assert calls[1][4].startswith("flowyard reproduce pla-serve --out ")  # each report records its own command
    assert "valid experiments" not in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["reproduce", "flowprefill", "--seed", "x"], "expected an integer, got 'x'"),
    (["reproduce", "flowprefill", "--seed", "-1"], "expected an integer >= 0"),
    (["reproduce", "flowprefill", "--fast"], "unrecognized arguments: --fast"),
    (["reproduce"], "the following arguments are required: NAME"),
])
def test_bad_flags_exit_2_with_a_clear_message(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_out_that_is_a_file_is_a_clear_error(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    assert main(["reproduce", "flowprefill", "--quick", "--out", str(f), "--quiet", "--allow-dirty"]) == 1
    assert "is not a directory" in capsys.readouterr().err


# -- shared helpers --------------------------------------------------------------------------

def test_threshold_search_max_finds_the_crossing_and_keeps_the_curve():
    f = lambda r: 1.0 if r <= 3.3 else 0.5  # noqa: E731
    t = threshold_search(f, [1, 2, 4, 8], 0.9, find="max", tol=0.01)
    assert 3.3 * 0.99 <= t.value <= 3.3 and not t.capped and not t.never_met
    assert [x for x, _ in t.curve][:2] == [1, 2] and (8, 0.5) in t.curve


def test_threshold_search_on_an_empty_grid_is_a_clear_error():
    # it used to get as far as doubling None (a TypeError from deep inside the search)
    with pytest.raises(ValueError, match="at least one point"):
        threshold_search(lambda x: 1.0, [], 0.9)


def test_threshold_search_min_and_the_edges():
    f = lambda k: 1.0 if k >= 0.7 else 0.0  # noqa: E731
    t = threshold_search(f, [0.5, 1, 2], 0.9, find="min", tol=0.01)
    assert 0.7 <= t.value <= 0.7 * 1.01
    capped = threshold_search(lambda r: 1.0, [1, 2], find="max", extend=2)
    assert capped.capped and capped.value == 8 and capped.text().startswith(">=")
    never = threshold_search(lambda k: 0.0, [1, 2], find="min", extend=2)
    assert never.never_met and math.isinf(never.value) and never.text() == "not met"
    below = threshold_search(lambda r: 1.0 if r < 0.3 else 0.0, [1, 2], find="max", tol=0.01)
    assert 0.25 <= below.value < 0.3  # retreats below the grid, then bisects
    with pytest.raises(ValueError):
        threshold_search(f, [1], find="mid")


def test_ratio_and_tables():
    assert ratio(4, 2) == 2 and math.isinf(ratio(1, 0)) and math.isnan(ratio(0, 0))
    assert md_table(["a", "b"], [[1, 2]]) == "| a | b |\n|---|---|\n| 1 | 2 |"


def test_a_point_is_deterministic_and_memoised():
    from flowyard.costmodel import make_cost_model
    from flowyard.sim.run import SimConfig
    from flowyard.workloads.multitask import qwentrace_like

    cfg = SimConfig(model="llama-3-8b", hardware="a800", instances=2, prefill_instances=1)
    cost = make_cost_model("llama-3-8b", "a800")
    w = qwentrace_like(80, rate=1.0, seed=3)
    a = run_point(cfg.replace(policy="flowprefill", rate_scale=4.0), w, cost)
    b = run_point(cfg.replace(policy="flowprefill", rate_scale=4.0), w, cost)
    assert (a.attainment, a.ttft_p99, a.blocking) == (b.attainment, b.ttft_p99, b.blocking)
    tally = Tally()
    sc = Scenario("8b", cfg, w, cost, tally=tally)
    assert sc.base_rate == pytest.approx(1.0)
    p = sc.point("flowprefill", 4.0)
    assert sc.point("flowprefill", 4.0) is p and tally.runs == 1
    assert p.attainment == a.attainment and set(p.by_task) <= {"text", "image", "search", "file"}
