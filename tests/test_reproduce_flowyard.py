"""`flowyard reproduce flowyard --quick` (issue 16): the suite runs, its report and JSON come from
the run, and its verdicts cannot pass on values that are not there."""

from __future__ import annotations

import json
import math

import pytest

from flowyard.experiments.common import Threshold
from flowyard.experiments.flowyard_suite import (FLOWYARD, QUICK, Row, Search, best_other, ratio_to_best,
                                                 target_of)
from flowyard.experiments.flowyard_suite_report import summary, verdict


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    from flowyard.experiments import run_experiment

    out = tmp_path_factory.mktemp("results")
    path = run_experiment("flowyard", out, quick=True, allow_dirty=True)
    return out, path


def test_quick_suite_writes_a_report_from_the_run(quick):
    out, path = quick
    text = path.read_text()
    data = json.loads((out / "flowyard" / "results.json").read_text())
    rows = data["rows"]
    assert len(rows) == len(QUICK.workloads) * len(QUICK.slos)
    for r in rows:
        assert set(r["policies"]) == {FLOWYARD, *QUICK.others}
        assert r["policies"][FLOWYARD]["points"], "flowyard was simulated on every row"
        # the table shows this run's numbers
        gp = r["policies"][FLOWYARD]["goodput_rps"]
        assert gp is not None and f"{gp:.2f}" in text
    assert any(r["ablations"] for r in rows)
    assert (out / "flowyard" / "ratio.png").stat().st_size > 0
    assert f"on {data['summary']['met']} of {data['summary']['total']} rows" in text
    assert "flowyard reproduce flowyard" in text and "--quick" in text


def _row(workload: str, slo: str, goodputs: dict[str, float]) -> Row:
    def s(v: float) -> Search:
        return Search(Threshold(v, never_met=v == 0), {})

    return Row(workload, slo, 10, 1.0, {p: s(v) for p, v in goodputs.items()})


def test_verdicts_follow_the_numbers_and_zero_never_passes():
    r = _row("azure-code", "tight", {FLOWYARD: 9.8, "vllm": 10.0, "arrow": 4.0})
    assert best_other(r) == ("vllm", 10.0) and math.isclose(ratio_to_best(r), 0.98)
    assert target_of(r) == 0.97 and verdict(ratio_to_best(r), target_of(r)) == "met"
    assert verdict(ratio_to_best(_row("azure-code", "tight", {FLOWYARD: 9.0, "vllm": 10.0})), 0.97) == "not met"
    assert target_of(_row("hybrid", "loose", {})) == 1.2 and target_of(_row("arxiv", "bylen", {})) == 1.2
    zeros = _row("hybrid", "bylen", {FLOWYARD: 0.0, "vllm": 0.0})
    assert math.isnan(ratio_to_best(zeros)) and verdict(ratio_to_best(zeros), 1.2) == "not measured"
    # a baseline that never meets the target cannot make a ratio either way
    assert verdict(ratio_to_best(_row("hybrid", "bylen", {FLOWYARD: 3.0, "vllm": 0.0})), 1.2) == "not measured"


def test_summary_counts_rows():
    class R:
        rows = [_row("hybrid", "bylen", {FLOWYARD: 13.0, "vllm": 10.0}),
                _row("azure-code", "loose", {FLOWYARD: 9.0, "vllm": 10.0})]

    s = summary(R)  # type: ignore[arg-type]
    assert s["met"] == 1 and s["floor_met"] == 1 and s["total"] == 2
