"""The machine's speed before each real point (benchmarks/real_cluster_speed.py): what it
measures, and how the simulator's clock, the served-step fit and --resim use it."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))

import numpy as np  # noqa: E402
import real_cluster_fixed as rf  # noqa: E402
import real_cluster_lib as rc  # noqa: E402
import real_cluster_speed as rs  # noqa: E402
import real_cluster_verdicts as rv  # noqa: E402

from flowyard.core.plan import BatchShape  # noqa: E402
from flowyard.core.request import Request, RequestState, Status  # noqa: E402
from flowyard.costmodel.profiled import ProfiledCostModel  # noqa: E402

RUN = Path(__file__).parent.parent / "benchmarks/results/real_cluster_64"
SHAPES = (BatchShape.chunk(0, 384), BatchShape(decode_seqs=4, decode_ctx=2000),
          BatchShape.chunk(0, 64, decode_seqs=3, decode_ctx=900))


def _profile() -> Path:
    return RUN / "profile-local.json"


def test_the_reference_steps_are_samples_of_a_quick_profile_and_a_missing_one_is_named(tmp_path):
    prof = json.loads(_profile().read_text())
    ref = rs.profiled_reference(prof)
    assert len(ref) == len(rs.REFERENCE) and min(ref) > 0
    assert ref[0] > ref[1]  # the 512-token prefill costs more than the 128-token one
    prof["samples"] = [s for s in prof["samples"] if s["shape"]["prefill_tokens"] != 128]
    with pytest.raises(ValueError, match="no sample of the reference step"):
        rs.profiled_reference(prof)


def test_speed_is_the_geometric_mean_of_measured_over_profiled():
    assert rs.speed_of([2.0, 0.5], [1.0, 1.0]) == 1.0  # each kind of step counts alike
    assert rs.speed_of([1.1, 2.2, 0.11], [1.0, 2.0, 0.1]) == 1.1
    for bad in (([], []), ([1.0], [0.0]), ([1.0, 2.0], [1.0])):
        with pytest.raises(ValueError, match="positive times"):
            rs.speed_of(*bad)


def test_the_clock_at_a_speed_prices_every_step_that_much_dearer_and_policies_keep_the_plain_profile():
    plain = ProfiledCostModel(str(_profile()))
    assert rc.served_clock(_profile(), None, plain) is plain  # no fit, speed 1: the plain profile itself
    slow = rc.served_clock(_profile(), None, plain, 1.25)
    fit = {"scale": 1.0, "row_s": 0.001, "step_s": 0.0005, "frontend_s": 0.01, "export_s": 0.002, "gap_s": 0.0004}
    served, served_slow = rc.served_clock(_profile(), fit, plain), rc.served_clock(_profile(), fit, plain, 1.25)
    for s in SHAPES:
        assert float(slow.step_time(s)) == pytest.approx(1.25 * float(plain.step_time(s)), rel=1e-9)
        assert float(served_slow.step_time(s)) == pytest.approx(1.25 * float(served.step_time(s)), rel=1e-9)
    assert served_slow.frontend_latency() == pytest.approx(0.0125) and served_slow.kv_export_time() == pytest.approx(0.0025)
    with pytest.raises(ValueError, match="positive"):
        rs.at_speed(fit, 0.0)


def test_terms_fitted_on_a_slow_run_are_stored_at_the_profiles_speed_and_scaled_back_per_point():
    fit = {"scale": 1.1, "row_s": 0.0011, "step_s": 0.00055, "frontend_s": 0.011, "gap_s": 0.00044,
           "workload": "conv-short", "steps": 40}
    stored = rs.normalized(fit, 1.1)
    assert stored["speed"] == 1.1 and stored["scale"] == pytest.approx(1.0) and stored["row_s"] == pytest.approx(0.001)
    assert stored["workload"] == "conv-short" and stored["steps"] == 40  # not times: untouched
    back = rs.at_speed(stored, 1.1)
    assert all(back[k] == pytest.approx(fit[k]) for k in ("scale", "row_s", "step_s", "frontend_s", "gap_s"))


def test_a_rows_simulated_search_runs_at_the_median_speed_of_its_real_points():
    assert rs.row_speed({}) == 1.0  # rows measured before the checks: the profile's speed
    assert rs.row_speed({"real_speeds": [[1.0, 1.02], [2.0, 1.20], [1.5, 1.05]]}) == 1.05
    assert rs.speed_cell({}) == "—"
    assert rs.speed_cell({"real_speeds": [[1.0, 1.02], [2.0, 1.2]], "fixed_speed": 0.98}) == "0.98–1.20×"


def test_the_check_times_the_reference_steps_on_the_engine_the_profile_describes(tmp_path):
    """On the embedded model: four positive step times, and a profile whose steps all took
    twice as long reads the same measurement as half the speed."""
    pytest.importorskip("gguf")
    check = rs.SpeedCheck(_profile(), threads=1, repeats=1)
    measured = check.measure()
    assert len(measured) == 4 and min(measured) > 0 and measured[0] > measured[1]
    prof = json.loads(_profile().read_text())
    for sample in prof["samples"]:
        sample["times"] = {k: 2 * v for k, v in sample["times"].items()}
    (tmp_path / "slow.json").write_text(json.dumps(prof))
    other = check.against(tmp_path / "slow.json")
    assert other._runner is check._runner  # the same engine, loaded once
    assert rs.speed_of(measured, other.profiled) == pytest.approx(rs.speed_of(measured, check.profiled) / 2, rel=0.01)


def test_resim_clocks_each_row_at_its_recorded_speeds(tmp_path):
    """A row whose real points ran on a machine 1.5x slower is simulated on that machine: its
    simulated goodput falls and its fixed point's TTFT grows against the same row at speed 1."""
    import real_cluster_more as more

    (tmp_path / "profile-local.json").write_text(_profile().read_text())
    point = {"attainment": 1.0, "ttft_p50": 1.0, "ttft_p90": 1.0, "tpot_p50": 1.0, "tpot_p90": 1.0, "completed": 3}
    row = {"executor": "local", "policy": "vllm", "workload": "conv-mixed", "real_goodput": 1.0, "sim_goodput": 0.0,
           "real_curve": [[1.0, 1.0], [2.0, 0.5]], "sim_curve": [], "fixed_rate": 0.5, "real": point, "sim": point,
           "revision": "abc"}
    rows = [row, {**row, "policy": "distserve"}, {**row, "real_speeds": [[1.0, 1.5], [2.0, 1.5]], "fixed_speed": 1.5},
            {**row, "policy": "distserve", "real_speeds": [[1.0, 1.5], [2.0, 1.5]], "fixed_speed": 1.5}]
    meta = {"slo_factor": 4.0, "machine": "x", "command": "c", "requests_per_point": 16, "fixed_requests": 8,
            "slos": {"tpot_s": 0.1, "ttft_by_length": "0:1.03,512:2.51,1024:4.42"}}
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    more.resim(argparse.Namespace(work_dir=str(tmp_path), executors="local", out=str(tmp_path / "report.md")))
    got = json.loads((tmp_path / "rows.json").read_text())
    for fast, slow in ((got[0], got[2]), (got[1], got[3])):
        assert 0 < slow["sim_goodput"] < fast["sim_goodput"]
        assert slow["sim"]["ttft_p50"] > 1.3 * fast["sim"]["ttft_p50"]
    assert "| 1.50× |" in (tmp_path / "report.md").read_text()


def test_drift_by_kind_of_step_clocks_prompt_steps_and_decodes_apart(tmp_path):
    """The check's drift splits its reference steps into prompt-bearing ones and the decode
    step; a row's simulated clock then prices each kind at its own speed, and rows measured
    before drift checks keep the one speed."""
    import numpy as np

    from real_cluster_lib import served_clock

    from flowyard.core.plan import BatchShape
    from flowyard.costmodel.profiled import ProfiledCostModel

    profiled = [1.0, 0.2, 0.1, 0.3]  # REFERENCE: prefill 512, prefill 128, decode, mixed
    measured = [1.3, 0.26, 0.1, 0.39]  # prompt steps 1.3x slower, decodes as profiled
    assert rs.drift_of(measured, profiled) == (1.3, 1.0)
    assert rs.speed_of(measured, profiled) == pytest.approx(1.3 ** 0.75, abs=1e-3)
    assert rs.row_drift({"real_speeds": [[1.0, 1.2]]}) is None
    row = {"real_speeds": [[1.0, 1.2], [2.0, 1.1]], "real_drifts": [[1.0, 1.4, 1.0], [2.0, 1.2, 1.1], [3.0, 1.3, 1.2]]}
    assert rs.row_drift(row) == (1.3, 1.1)
    assert "(p 1.30, d 1.10)" in rs.speed_cell(row)
    path = _profile()
    plain = ProfiledCostModel(str(path))
    clock = served_clock(path, None, plain, 1.25, (1.3, 1.1))
    prefill, decode = BatchShape.chunk(0, 256), BatchShape(decode_seqs=4, decode_ctx=4 * 300)
    assert float(clock.step_time(prefill)) == pytest.approx(1.3 * float(plain.step_time(prefill)), rel=1e-6)
    assert float(clock.step_time(decode)) == pytest.approx(1.1 * float(plain.step_time(decode)), rel=1e-6)
    run = BatchShape(decode_seqs=np.array([4, 4]), decode_ctx=np.array([1200.0, 1204.0]))
    assert np.allclose(clock.step_time(run), 1.1 * np.asarray(plain.step_time(run)))
    one = served_clock(path, None, plain, 1.25)  # no drift recorded: every step at the one speed
    assert float(one.step_time(prefill)) == pytest.approx(1.25 * float(plain.step_time(prefill)), rel=1e-6)


class _Checks:
    """A speed check whose answers are given in turn: (speed, (prompt steps, decodes) or None)."""

    def __init__(self, answers) -> None:
        self.answers, self.last_drift = list(answers), None

    def __call__(self) -> float:
        speed, self.last_drift = self.answers.pop(0)
        return speed


def _states(ttfts):
    """Finished requests' states with these TTFTs (s) and a 0.1 s token gap after the first."""
    out = []
    for i, t in enumerate(ttfts):
        s = RequestState(Request(i, arrival=float(i), prompt_len=8, output_len=3))
        s.record_tokens(np.array([i + t, i + t + 0.1, i + t + 0.2]))
        s.status, s.finish_time = Status.FINISHED, i + t + 0.2
        out.append(s)
    return out


def test_the_fixed_point_is_checked_before_and_after_and_clocked_at_their_geometric_mean():
    ran, clocks = [], []
    check = _Checks([(1.0, (1.21, 1.44)), (1.44, (1.0, 1.0))])
    row = rf.fixed_row(check, lambda: ran.append(len(check.answers)) or _states([1.0]),
                       lambda sp, dr: clocks.append((sp, dr)) or _states([2.0]))
    assert ran == [1] and clocks == [(1.2, [1.1, 1.2])]  # the point runs between the two checks
    assert row["real"]["ttft_p50"] == pytest.approx(1.0) and row["sim"]["ttft_p50"] == pytest.approx(2.0)
    assert row["fixed_speed"] == 1.2 and row["fixed_drift"] == [1.1, 1.2] and "fixed_runs" not in row
    assert row["fixed_checks"] == [[1.0, 1.21, 1.44], [1.44, 1.0, 1.0]]
    assert rs.fixed_checks_cell(row) == "1.00× (p 1.21, d 1.44) → 1.44× (p 1.00, d 1.00)"
    assert rs.fixed_checks_cell({}) == "—"  # rows from before the checks bracketed the point


def test_a_check_without_drift_brackets_the_fixed_point_by_speed_alone():
    row = rf.fixed_row(_Checks([(0.81, None), (1.0, None)]), lambda: _states([1.0]), lambda sp, dr: _states([1.0]))
    assert (row["fixed_speed"], row["fixed_drift"], row["fixed_checks"]) == (0.9, None, [[0.81], [1.0]])
    assert rs.fixed_checks_cell(row) == "0.81× → 1.00×"


def test_a_point_served_k_times_pools_its_runs_and_simulates_each_at_its_own_speed():
    """Three runs between four checks: each simulated at the mean of its two checks, P50 over
    all nine requests, and the report shows the single runs' range beside the pooled error."""
    served, clocks = iter([[1.0, 1.1, 1.2], [2.0, 2.1, 2.2], [3.0, 3.1, 3.2]]), []
    row = rf.fixed_row(_Checks([(1.0, None), (1.44, None), (1.0, None), (0.81, None)]),
                       lambda: _states(next(served)), lambda sp, dr: clocks.append(sp) or _states([2.0] * 3), 3)
    assert clocks == [1.2, 1.2, 0.9] and len(row["fixed_checks"]) == 4
    assert row["real"]["ttft_p50"] == pytest.approx(2.1) and row["real"]["completed"] == 9
    assert [r["real"]["ttft_p50"] for r in row["fixed_runs"]] == pytest.approx([1.1, 2.1, 3.1])
    assert row["fixed_speed"] == pytest.approx((1.2 * 1.2 * 0.9) ** (1 / 3), abs=1e-3)
    assert rf.runs_cell(row, "ttft_p50") == "1100–3100" and rf.runs_cell({}, "ttft_p50") == "—"
    row.update(executor="local", workload="w", policy="p", fixed_rate=0.5)
    table = "\n".join(rf.fixed_table([row]))
    assert "| real runs |" in table and "| 1100–3100 |" in table
    again = []
    rf.resimulate(row, lambda sp, dr: again.append(sp) or _states([4.0] * 3))  # --resim: each run at its speed
    assert again == [1.2, 1.2, 0.9] and row["sim"]["ttft_p50"] == pytest.approx(4.0)
    assert [r["real"]["ttft_p50"] for r in row["fixed_runs"]] == pytest.approx([1.1, 2.1, 3.1])  # kept
    with pytest.raises(ValueError, match="at least once"):
        rf.fixed_row(_Checks([]), list, lambda sp, dr: [], 0)


def test_served_step_speeds_clock_each_run_at_its_own_and_leaving_it_out_at_the_others():
    """`--observed-speed`: each run simulated at its own steps' speeds (a diagnostic) and at the
    geometric mean of the other runs' (leave one run out: no step of the run it predicts)."""
    clocks: list = []
    speeds = [[1.0, 1.0, 1.0], [1.21, 1.1, 1.331], [1.44, 1.2, 1.728]]
    row = {"executor": "local", "workload": "w", "policy": "p", "fixed_rate": 0.5,
           "real": rf.pooled([_states([1.2] * 3)]), "sim": rf.pooled([_states([1.0] * 3)])}
    rf.add_observed(row, speeds, lambda sp, dr: clocks.append((sp, dr)) or _states([sp]))
    assert [c[0] for c in clocks[:3]] == [1.0, 1.21, 1.44] and clocks[1][1] == [1.1, 1.331]
    assert clocks[3][0] == pytest.approx(1.32, abs=1e-3) and clocks[3][1] == pytest.approx([1.149, 1.517], abs=1e-3)
    assert row["sim_observed"]["ttft_p50"] == pytest.approx(1.21) and row["sim_loro"]["ttft_p50"] == pytest.approx(1.2)
    table = "\n".join(rf.fixed_table([row]))
    assert "TTFT P50 err own / others" in table and "| +1% / " in table
    assert "1.10, 1.33" in table  # each run's (p, d)
    lines = rv.verdicts([{**row, "real_goodput": 1.0, "sim_goodput": 1.0, "real_curve": [[1.0, 1.0], [2.0, 0.5]]}], 1)
    assert any("leave one run out): P50 within 15 %: 2 of 2" in line for line in lines)
    one = {k: v for k, v in row.items() if k != "sim_loro"}
    rf.add_observed(one, speeds[:1], lambda sp, dr: _states([sp]))
    assert "sim_observed" in one and "sim_loro" not in one  # a single run has no others to clock it


def test_a_rows_goodput_is_clocked_by_the_served_steps_of_its_points_outside_the_bracket():
    """`--observed-speed`: the simulated goodput runs at the geometric mean of the step speeds of
    the real points that do not locate the goodput (leave the bracket out), the fixed point at
    every search point's, and each point at its own only as a diagnostic."""
    import real_cluster_observed as ro

    row = {"executor": "local", "workload": "w", "policy": "p", "fixed_rate": 0.2, "real_goodput": 0.4,
           "sim_goodput": 0.5, "real_curve": [[0.2, 1.0], [0.4, 1.0], [0.5, 0.5], [0.8, 0.2]],
           "real_observed": [[0.2, 1.0, 1.0, 1.0], [0.4, 9.0, 9.0, 9.0], [0.5, 9.0, 9.0, 9.0],
                             [0.8, 1.21, 1.1, 1.331]],
           "real": rf.pooled([_states([1.2] * 3)]), "sim": rf.pooled([_states([1.0] * 3)])}
    clock, n = ro.bracket_out(row)
    assert n == 2 and clock == pytest.approx([1.1, 1.049, 1.154], abs=1e-3)  # 0.4 and 0.5 left out
    searched, fixed, own = [], [], []

    class Found:
        goodput, curve = 0.42, [[0.42, 0.9]]

    ro.add_served_clock(row, lambda sp, dr: searched.append([sp, *dr]) or Found(),
                        lambda r, sp, dr: own.append((r, sp)) or 0.75,
                        lambda sp, dr: fixed.append(sp) or _states([1.3] * 3))
    assert searched == [clock] and row["sim_goodput_served"] == 0.42 and row["served_clock_points"] == 2
    assert own == [(0.2, 1.0), (0.4, 9.0), (0.5, 9.0), (0.8, 1.21)] and row["sim_own_curve"][0] == [0.2, 0.75]
    assert fixed == [pytest.approx((9.0 * 9.0 * 1.21) ** 0.25, abs=1e-3)]  # every search point's speed
    assert row["sim_served"]["ttft_p50"] == pytest.approx(1.3)
    section = "\n".join(ro.served_section([row]))
    assert "0.400 – 0.500" in section and "| 0.420 | +0% |" in section and "(2 points)" in section
    assert "0.50: 50% (9.00, 9.00)" in section and "0.40: 75%" in section
    lines = rv.verdicts([row], 1)
    assert any("leave the bracket out): simulated goodput within 20 % of every real value its bracket allows: "
               "1 of 1 cells; off by more than 20 %: 0; undecided (bracket too wide): 0" in line for line in lines)
    assert any("clocked at the search points' served step speeds: P50 within 15 %: 2 of 2" in line for line in lines)
    alone = {**row, "real_observed": row["real_observed"][1:3]}  # only the bracket's own points: no clock
    ro.add_served_clock(alone, lambda sp, dr: Found(), lambda r, sp, dr: 1.0, lambda sp, dr: _states([1.0]))
    assert "sim_goodput_served" not in alone and ro.bracket_out(alone) == (None, 0)
    assert "| — | — | — |" in "\n".join(ro.served_section([alone]))
