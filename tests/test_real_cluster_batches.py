"""benchmarks/real_cluster_batches.py: the pieces that read a run's timelines and the clock slope."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import real_cluster_batches as rcb  # noqa: E402


def _event(pid: int, ts_us: float, dur_us: float, prefill: int = 0, decodes: int = 0, steps: int = 1) -> dict:
    return {"ph": "X", "pid": pid, "tid": 0, "ts": ts_us, "dur": dur_us,
            "args": {"prefill_tokens": prefill, "decode_seqs": decodes, "steps": steps}}


def test_steps_are_split_by_instance_and_kind():
    trace = {"traceEvents": [_event(0, 0, 900_000, prefill=512), _event(1, 0, 70_000, decodes=2),
                             _event(1, 70_000, 240_000, decodes=3, steps=3),  # a simulator's decode run
                             {"ph": "X", "pid": 1_000_001, "tid": 0, "ts": 0, "dur": 5, "args": {}}]}
    got = rcb.by_instance(trace)
    assert sorted(got) == [0, 1]
    rows = rcb.step_rows("real", got)
    assert rows == [("real", 0, "prefill", 1, "0.9", "900.0", "0.00", "0"),
                    ("real", 1, "decode", 4, "0.3", "80.0", "2.75", "3")]


def test_the_slope_says_how_much_the_clock_is_amplified():
    speeds = [0.8, 0.9, 1.0]
    assert rcb.slope(speeds, speeds) == pytest.approx((1.0, 1.0))
    cubed = [s ** 3 for s in speeds]
    overall, steep = rcb.slope(speeds, cubed)
    assert overall == pytest.approx(3.0) and steep == pytest.approx(3.0)
    jump = [1.0, 1.0, 1.5]  # flat, then a step: the steepest pair shows it, the overall hides half
    overall, steep = rcb.slope(speeds, jump)
    assert steep == pytest.approx(math.log(1.5) / math.log(1 / 0.9)) and overall < steep
    with pytest.raises(ValueError):
        rcb.slope([1.0], [1.0])


def test_a_dir_that_is_not_a_finished_run_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        rcb.main(["--work", str(tmp_path), "--out", str(tmp_path / "r.md")])
    assert "not a finished real_cluster.py run" in capsys.readouterr().err
