"""`flowyard reproduce pla-serve`: the quick PLA-Serve study end to end (report, figures, JSON),
and the pieces it is built from (conversations, closed-loop points, the variants)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from flowyard.cli import main
from flowyard.experiments import EXPERIMENTS
from flowyard.experiments.common import Tally
from flowyard.experiments.pla_serve import (BASELINE, FIG6, FIG7, NO_SPLIT, Runner, conversations,
                                            workload_stats)
from flowyard.policies.pla import is_short


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("results")
    assert main(["reproduce", "pla-serve", "--quick", "--out", str(out), "--quiet"]) == 0
    return out


def test_quick_run_writes_markdown_figures_and_json(quick_report):
    md = (quick_report / "pla-serve.md").read_text(encoding="utf-8")
    figs = quick_report / "pla-serve"
    pngs = sorted(p.name for p in figs.glob("*.png"))
    assert pngs == ["fig6_1P.png", "fig6_8P.png", "fig7_slo.png"]
    for name in pngs:
        data = (figs / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
        assert f"(pla-serve/{name})" in md
    data = json.loads((figs / "results.json").read_text())  # strict JSON: no NaN
    assert set(data["fig6"]) == {"1P", "8P"} and set(data["fig7"]) == {"1P", "8P"}
    assert set(data["distill"]) == {"azure-conv", "sharegpt"}
    assert "pla-spatial" not in " ".join(data["fig6"]["1P"])  # two pools need two prefill instances
    base = data["fig6"]["1P"][BASELINE]
    assert [c for c, _ in base] == [4, 32] and all(p["rps"] > 0 and 0 <= p["violation"] <= 1 for _, p in base)
    # one prefill instance: the round-robin and the load-balancing router are the same system
    f7 = data["fig7"]["1P"]

    def numbers(label):
        return [(c, {k: v for k, v in p.items() if k != "wall_s"}) for c, p in f7[label]]
    assert numbers("PD + round-robin router") == numbers("PD + load-balancing router (distserve)")


def test_report_has_the_papers_numbers_beside_ours(quick_report):
    md = (quick_report / "pla-serve.md").read_text(encoding="utf-8")
    assert "| claim (PLA-Serve §4) | paper | ours | ours vs paper |" in md
    for paper in ("up to +20 %", "up to +33 %", "−20 %", "−28 (points)", "−12 (points)", "−7.3 % (LMSys)",
                  "−8.3 % (ShareGPT)"):
        assert paper in md, paper
    for section in ("## Setup", "## Fig. 6", "## Fig. 7", "## Table 2", "## Where and why ours differ",
                    "## Issues found in the PLA policies"):
        assert section in md, section
    assert f"`flowyard reproduce pla-serve --out {quick_report} --quick`" in md
    assert "s of wall time" in md and "**Quick mode**" in md and "qwen2.5-14b" in md
    for system in ("SGLang-like PD (distserve)", "PLA, graphs only", "PLA, disaggregation only", "PLA, full (pla)",
                   "vanilla DP (vllm)", "PD + round-robin router", "PLA deadline-free (pla)"):
        assert f"| {system} |" in md, system


def test_registered_and_listed():
    assert EXPERIMENTS["pla-serve"] == "flowyard.experiments.pla_serve"


def test_unknown_experiment_lists_pla_serve(capsys):
    assert main(["reproduce", "pla-serv"]) == 2
    assert "pla-serve" in capsys.readouterr().err


def test_variants_mean_what_the_report_says():
    run = Runner(Tally(), None)
    w = conversations("sharegpt", 60, 0, output_cap=1)
    long_first = next(r for r in w.requests if r.turn == 0 and r.prompt_len > 2000)
    assert not is_short(long_first, run.lengths)  # the fitted boundary calls it long ...
    assert is_short(long_first, run.lengths, FIG6["PLA, graphs only"][1].boundary)  # ... graphs-only has no long
    assert FIG6["PLA, graphs only"][1].boundary == NO_SPLIT and FIG6["PLA, disaggregation only"][1].graphs is False
    assert FIG7["PD + round-robin router"] == ("distserve", None, True)
    # follow-ups carry their history and at most 64 new tokens; replies of one token
    later = [r for r in w.requests if r.turn > 0]
    assert later and all(r.history_len > 0 and r.prompt_len - r.history_len <= 64 + 1 for r in later)
    assert all(r.output_len == 1 and r.slo.ttft == 0.4 for r in w.requests)
    stats = workload_stats(w, run.lengths)
    assert stats["requests"] == 60 and 0 < stats["short_share"] < 1 and 0 < stats["long_token_share"] <= 1


def test_a_closed_loop_point_is_deterministic_and_sane():
    run = Runner(Tally(), None)
    w = conversations("azure-conv", 80, 1)
    a = run.point(w, FIG7["PLA (pla)"], 1, 1, 8, "pla")
    b = run.point(w, FIG7["PLA (pla)"], 1, 1, 8, "pla")
    assert dataclasses.replace(a, wall_s=0) == dataclasses.replace(b, wall_s=0) and not a.error
    assert run.tally.runs == 2
    assert a.rps > 0 and 0 < a.window <= a.makespan and 0 <= a.violation <= 1 and 0 <= a.hit_rate <= 1
    assert a.ttft_mean <= a.makespan and 1 <= a.depth and 0 <= a.graphed <= 1 and 0 < a.prefill_busy <= 1
    dp = run.point(w, FIG7["vanilla DP (vllm)"], 1, 1, 8, "dp")
    assert math.isnan(dp.depth) and dp.rps > 0  # no PLA scheduler: no short batches
