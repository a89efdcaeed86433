"""FlowPrefill from the command line: simulate reports preemptions; serve refuses bad setups."""

from __future__ import annotations

import json

from flowyard.cli import main


def test_simulate_flowprefill_reports_preemption_blocking(tmp_path, capsys):
    out = tmp_path / "fp.json"
    rc = main(["simulate", "--trace", "azure-code", "--policy", "flowprefill", "--instances", "2",
               "--duration", "120", "--rate-scale", "3", "--ttft-slo-by-length", "0:0.3,2048:2,8192:6",
               "--predictor-error", "1.2", "--quiet", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["policy"] == "flowprefill" and data["completed"] == data["requests"]
    assert data["config"]["predictor_error"] == 1.2
    if "preemption_blocking_ms" in data:
        assert data["preemption_blocking_ms"]["max"] < 50
        assert "preemptions:" in capsys.readouterr().out


def test_serve_flowprefill_refuses_bad_shapes_and_unpredictable_models(capsys):
    # (flowprefill runs on Ray too now: tests/test_ray_policies.py)
    assert main(["serve", "--policy", "flowprefil", "--instances", "2", "--ray"]) == 2
    assert "valid policies" in capsys.readouterr().err  # checked before any actor starts
    assert main(["serve", "--policy", "flowprefill", "--instances", "2", "--model", "/nonexistent.gguf"]) == 2
    assert "--profile" in capsys.readouterr().err
    assert main(["serve", "--policy", "flowprefill", "--instances", "1"]) == 2
    assert "prefill and one decode" in capsys.readouterr().err
