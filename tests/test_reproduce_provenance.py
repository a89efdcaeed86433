"""Provenance of reports: a checkout with uncommitted source changes is refused unless allowed, and
then the report's first line says so; every report and results.json records revision, command,
seeds, machine, wall time and the cost-model settings of the SimConfig (any calibration or
profile field, including ones added later). Runs on throwaway git repositories, no simulation."""

from __future__ import annotations

import dataclasses
import json
import subprocess

import pytest

from flowyard.cli import main
from flowyard.experiments import provenance
from flowyard.experiments.provenance import (DIRTY_LINE, DirtyTreeError, begin, cost_model_settings, git_state,
                                             recording)
from flowyard.experiments.report import Report


def _git(root, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True, text=True).stdout


@pytest.fixture
def repo(tmp_path):
    root = tmp_path / "checkout"
    (root / "flowyard").mkdir(parents=True)
    (root / "docs").mkdir()
    (root / "flowyard" / "m.py").write_text("x = 1\n")
    (root / "docs" / "r.md").write_text("report\n")
    _git(root, "init", "-q")
    _git(root, "add", ".")
    _git(root, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "-m", "init")
    return root


def test_a_clean_checkout_records_its_revision(repo):
    rev = _git(repo, "rev-parse", "HEAD").strip()
    (repo / "docs" / "r.md").write_text("a regenerated report is not source\n")
    p = begin("flowyard reproduce x", (0,), root=repo)
    assert p.revision == rev and not p.dirty and p.first_line() == ""


def test_a_benchmarks_report_counts_its_scripts_as_source_but_not_its_results(repo):
    from flowyard.experiments.report import source_revision

    rev = _git(repo, "rev-parse", "HEAD").strip()[:7]
    (repo / "benchmarks" / "results").mkdir(parents=True)
    (repo / "benchmarks" / "results" / "r.md").write_text("a result is not source\n")
    assert source_revision(repo).startswith(rev) and "uncommitted" not in source_revision(repo)
    (repo / "benchmarks" / "b.py").write_text("print(1)\n")
    assert source_revision(repo).endswith(" + uncommitted changes")


@pytest.mark.parametrize("change", ["modify", "untracked"])
def test_uncommitted_source_is_refused_unless_allowed(repo, change):
    if change == "modify":
        (repo / "flowyard" / "m.py").write_text("x = 2\n")
    else:
        (repo / "flowyard" / "new.py").write_text("y = 1\n")
    assert git_state(repo).dirty
    with pytest.raises(DirtyTreeError, match="--allow-dirty"):
        begin("cmd", root=repo)
    p = begin("cmd", root=repo, allow_dirty=True)
    assert p.first_line().startswith(DIRTY_LINE) and "uncommitted" in p.first_line()


def test_reports_open_with_the_warning_and_record_everything(repo, tmp_path):
    (repo / "flowyard" / "m.py").write_text("x = 3\n")
    p = begin("flowyard reproduce demo --quick --allow-dirty", (0, 1, 2), allow_dirty=True, root=repo).finish()
    with recording(p):
        rep = Report(tmp_path / "out", "demo")
        rep.add("# Demo", "body")
        rep.write_json({"numbers": [1, 2]})
        md = rep.write().read_text(encoding="utf-8")
    assert md.splitlines()[0].startswith(DIRTY_LINE) and "made from uncommitted code" in md.splitlines()[0].lower()
    section = md.split("## Provenance")[1]
    for text in ("`flowyard reproduce demo --quick --allow-dirty`", "| seeds | 0, 1, 2 |", "| wall time |",
                 "calibration = ", p.revision + " + uncommitted changes", "| machine |"):
        assert text in section, text
    data = json.loads((tmp_path / "out" / "demo" / "results.json").read_text(encoding="utf-8"))
    assert data["numbers"] == [1, 2]
    rec = data["provenance"]
    assert rec["revision"] == p.revision and rec["seeds"] == [0, 1, 2] and rec["dirty"]
    assert rec["command"] == p.command and rec["wall_s"] is not None and rec["machine"]["cpus"]
    assert "calibration" in rec["cost_model"]


def test_a_report_written_outside_a_run_still_records_revision_and_machine(tmp_path):
    rep = Report(tmp_path, "loose")
    rep.add("# Loose")
    md = rep.write().read_text(encoding="utf-8")
    assert "## Provenance" in md and "| machine |" in md and "not recorded" in md


def test_cost_model_fields_are_read_from_the_config_by_name():
    from flowyard.sim.run import SimConfig

    assert cost_model_settings()["calibration"] == SimConfig().calibration

    from flowyard.costmodel.engines import DEFAULT_ENGINE_PROFILE

    assert cost_model_settings()["engine_profile"] == DEFAULT_ENGINE_PROFILE  # None resolved to its name

    @dataclasses.dataclass
    class WithProfile:  # a field another change adds to SimConfig is recorded with no change here
        model: str = "m"
        calibration: str = "published"
        engine_profile: str | None = "eager-2023"
        profile: str | None = "smol-cpu.json"

    assert cost_model_settings(WithProfile()) == {"calibration": "published", "engine_profile": "eager-2023",
                                                  "profile": "smol-cpu.json"}


def test_reproduce_refuses_a_dirty_checkout_before_running(repo, tmp_path, monkeypatch, capsys):
    (repo / "flowyard" / "m.py").write_text("x = 4\n")
    monkeypatch.setattr(provenance, "SOURCE_ROOT", repo)
    assert main(["reproduce", "flowprefill", "--quick", "--quiet", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "uncommitted changes" in err and "--allow-dirty" in err
    assert not (tmp_path / "o" / "flowprefill.md").exists()


def test_the_next_report_reads_the_dirty_revision_back(repo, tmp_path):
    (repo / "flowyard" / "m.py").write_text("x = 5\n")
    p = begin("cmd", allow_dirty=True, root=repo)
    with recording(p):
        for _ in range(2):
            rep = Report(tmp_path, "again")
            rep.add("# Again")
            rep.changes()
            md = rep.write().read_text(encoding="utf-8")
    assert f"({p.revision[:7]} + uncommitted changes)" in md.split("## What changed")[1]
