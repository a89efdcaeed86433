"""The H100 steps measured by benchmarks/gpu_steps_measure.py stay priced as measured: a change
to the cost model that moves its held-out H100 error (prefill, decode and mixed steps) or its
mixed-step saving away from the measurement fails here."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_steps_compare as gsc  # noqa: E402

import pytest  # noqa: E402

FILES = sorted((ROOT / "benchmarks" / "results").glob("gpu_steps_*.json"))


@pytest.fixture(params=FILES, ids=[f.stem for f in FILES])
def DATA(request):
    return json.loads(request.param.read_text())


def test_both_hopper_gpus_were_measured():
    assert {f.stem for f in FILES} >= {"gpu_steps_h100", "gpu_steps_h200"}


def test_the_measurement_covers_every_kind_of_step(DATA):
    kinds = {gsc.kind(p) for p in DATA["points"]}
    assert {"prefill", "decode", "mixed", "prompts batched"} <= kinds
    assert all(p["graph_ms"] > 0 and p["eager_ms"] > 0 for p in DATA["points"])
    assert DATA["meta"]["device"].startswith("NVIDIA H")


def test_held_out_hopper_steps_are_priced_within_bounds(DATA):
    pred, err = gsc.errors(DATA)
    assert all(q > 0 for q in pred)
    for k in ("prefill", "decode", "mixed", "prefill with history"):
        e = [abs(x) for p, x in zip(DATA["points"], err) if gsc.kind(p) == k]
        assert e and statistics.median(e) < 0.12, k
        assert max(e) < 0.25, k


def test_a_mixed_step_saves_what_the_measurement_saves(DATA):
    pred, _ = gsc.errors(DATA)
    rows = gsc.interference(DATA["points"], pred)
    assert len(rows) >= 5
    for _, measured, predicted in rows:
        assert measured < 1.0
        assert abs(measured - predicted) < 0.06


def test_the_report_names_its_inputs(tmp_path):
    out = tmp_path / "r.md"
    gsc.main(["--out", str(out)])
    DATA = json.loads(gsc.DATA.read_text())
    text = out.read_text()
    assert DATA["meta"]["revision"] in text and "| mixed |" in text
