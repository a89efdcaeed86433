"""benchmarks/real_cluster.py's pieces: SLOs and workloads scaled to the engine's profile, one
point in the simulator and on a real `flowyard serve`, the ranking statistic and the verdicts."""

from __future__ import annotations

import json
import statistics
import sys
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import real_cluster_fit as rcf  # noqa: E402
import real_cluster_lib as rc  # noqa: E402
from helpers_models import make_tiny_model  # noqa: E402

from flowyard.costmodel.profiled import ProfiledCostModel  # noqa: E402
from flowyard.engine.engine_config import EngineConfig  # noqa: E402
from flowyard.engine.llm_engine import LLMEngine  # noqa: E402
from flowyard.engine.profiler import default_grid, run_profile, save_profile  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    pytest.importorskip("transformers")
    tmp = tmp_path_factory.mktemp("rc")
    d, _ = make_tiny_model(tmp, "llama")
    engine = LLMEngine.from_path(str(d), EngineConfig(dtype="float32"))
    prof = run_profile(engine.runner, grid=default_grid(quick=True), repeats=1, name="tiny")
    prof["kv_capacity_tokens"] = engine.kv.capacity_tokens
    path = tmp / "profile.json"
    save_profile(prof, path)
    return d, path, ProfiledCostModel(str(path))


def test_slos_and_workloads_come_from_the_engines_profile(tiny):
    _, _, cost = tiny
    slos = rc.engine_slos(cost)
    assert slos.tpot >= 0.1 and [int(x.split(":")[0]) for x in slos.spec.split(",")] == [0, 512, 1024]
    w = rc.make_workload("code-long", 12, slos, cost)
    reqs = w.workload.requests
    assert len(reqs) == 12 and max(r.prompt_len for r in reqs) <= 1536 and max(r.target_output for r in reqs) <= 48
    assert all(r.slo.tpot == slos.tpot and r.slo.ttft is not None for r in reqs)
    assert w.base_rate > 0 and w.guess > 0 and 0 < w.fixed_rate < w.guess


@pytest.mark.parametrize("policy", ["vllm", "flowyard", "distserve"])
def test_a_simulated_point(tiny, policy):
    _, _, cost = tiny
    slos = rc.engine_slos(cost)
    w = rc.make_workload("conv-mixed", 8, slos, cost)
    p = rc.sim_point(w, w.fixed_rate, policy, cost, shared_device=True)
    assert p["completed"] == 8 and 0 <= p["attainment"] <= 1 and p["ttft_p50"] > 0


def test_kendall_tau_and_verdicts_cannot_pass_on_nothing():
    assert rc.kendall_tau([1, 2, 3], [10, 20, 30]) == 1 and rc.kendall_tau([1, 2, 3], [3, 2, 1]) == -1
    zero = {"real": {k: 0.0 for k in ("ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90")}}
    zero["sim"] = dict(zero["real"])
    rows = [{"executor": "local", "workload": "w", "policy": p, "real_goodput": 0.0, "sim_goodput": 0.0, **zero}
            for p in ("vllm", "distserve", "flowyard")]
    text = "\n".join(rc.verdicts(rows))
    assert "1.2× on one workload: met" not in text and "0.7 per workload: met" not in text
    assert "within 20 % of every real value its bracket allows: 0 of 3" in text and "P50 within 15 %: 0 of" in text
    rows[2]["real_goodput"], rows[0]["real_goodput"], rows[1]["real_goodput"] = 1.3, 1.0, 0.5
    for r, s in zip(rows, (1.0, 0.4, 1.2)):
        r["sim_goodput"] = s
    text = "\n".join(rc.verdicts(rows, expected=3))
    assert "w 1.30×–1.30×" in text and "1.2× on one workload: met" in text
    assert "w 1.00 over 3 of 3 pairs" in text and "0.7 per workload: met" in text


def _row(policy, lo, fail, sim):
    """A real search that met the SLOs at `lo` and missed them at `fail` (None: never missed)."""
    curve = [[lo, 1.0]] + ([[fail, 0.5]] if fail is not None else [])
    zero = {k: 1.0 for k in ("ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90")}
    return {"executor": "local", "workload": "w", "policy": policy, "real_goodput": lo, "real_curve": curve,
            "sim_goodput": sim, "real": zero, "sim": dict(zero)}


def test_a_two_rate_search_is_a_bracket_not_a_point():
    # as measured: real met at 0.45 and missed at 1.13; the simulator says 0.90 (inside)
    r = _row("vllm", 0.45, 1.13, 0.90)
    assert rc.bracket(r) == (0.45, 1.13) and rc.distance(0.90, *rc.bracket(r)) == 0
    assert rc.verdicts([r])[2].endswith("0 of 1 cells; off by more than 20 %: 0; undecided (bracket too wide): 1")
    assert rc.bracket(_row("x", 0.8, None, 1.0))[1] == float("inf")
    from real_cluster_verdicts import sim_vs_real

    assert sim_vs_real(1.0, 0.9, 1.1) == "within" and sim_vs_real(1.0, 0.5, 0.8) == "off"
    assert sim_vs_real(1.0, 1.3, 2.0) == "off" and sim_vs_real(1.0, 0.5, 2.0) == "undecided"


def test_overlapping_brackets_order_nothing_and_decide_no_ratio():
    rows = [_row("vllm", 0.45, 1.13, 0.9), _row("flowprefill", 0.81, 2.03, 1.6), _row("flowyard", 0.63, 1.58, 1.3)]
    text = "\n".join(rc.verdicts(rows))
    assert "no pair ordered" in text and "0.7 per workload: undecided" in text
    assert "1.2× on one workload: undecided (brackets too wide)" in text
    rows[2] = _row("flowyard", 2.5, 3.0, 2.6)  # above every other bracket by more than 1.2x
    text = "\n".join(rc.verdicts(rows, expected=3))
    assert "1.2× on one workload: met" in text and "over 2 of 3 pairs" in text
    # the measured case: flowyard against vllm alone is no verdict on "the best other policy"
    text = "\n".join(rc.verdicts([rows[0], rows[2]], expected=7))
    assert "(over 1 of 6 others)" in text and "met only over the policies measured so far" in text
    assert "1.2× on one workload: met" not in text


def test_a_real_point_against_flowyard_serve(tiny):
    d, path, cost = tiny
    slos = rc.engine_slos(cost)
    w = rc.make_workload("conv-mixed", 3, slos, cost)
    w = rc.RealWorkload(w.name, rc.cap_lengths(w.workload, 12, 4), w.base_rate, w.guess, w.fixed_rate)
    log = path.parent / "serve.log"
    with rc.Server("flowyard", "local", path, str(d), log) as url:
        p = rc.real_point(url, w, 2.0, slos, calibrate=False)  # the tiny model's context is 256
        again = rc.real_point(url, w, 2.0, slos, calibrate=False)  # the same prompts once more ...
        with urllib.request.urlopen(url + "/metrics") as r:
            metrics = r.read().decode()
    assert p["completed"] == again["completed"] == 3 and 0 <= p["attainment"] <= 1
    hits = [float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("vllm:prefix_cache_hits")]
    assert hits and sum(hits) == 0  # ... found nothing cached: every point pays its prefills


def test_the_simulated_table_names_flowyard_over_the_best_other(tiny):
    from real_cluster import sim_table

    _, _, cost = tiny
    loose, tight = rc.engine_slos(cost, 8.0), rc.engine_slos(cost, 4.0)
    assert loose.tpot >= tight.tpot
    ws = {"conv-short": rc.make_workload("conv-short", 6, loose, cost)}
    assert max(r.prompt_len for r in ws["conv-short"].workload.requests) <= 512
    table = sim_table(ws, ["vllm", "flowyard"], cost, "local").splitlines()
    assert table[0].startswith("| executor | workload | vllm | flowyard |") and len(table) == 3
    cells = [c.strip() for c in table[2].strip("|").split("|")]
    assert cells[:2] == ["local", "conv-short"] and (cells[-1] == "—" or cells[-1].endswith("×"))


def test_a_search_whose_guess_is_too_high_steps_down_and_still_brackets():
    """The measured failure: a simulator guess twice too high made the real search miss at its
    lowest rate and report 0 after one point. Now it steps down while evaluations remain."""
    from real_cluster import search

    calls: list[float] = []

    def attainment(rate: float) -> float:
        calls.append(rate)
        return 1.0 if rate <= 0.7 else 0.5

    res = search(attainment, guess=6.0, evals=4, policy="p")
    assert 0 < res.goodput <= 0.7 and not res.never_met
    assert len(calls) == len(set(calls)) <= 4  # no rate measured twice, within the budget
    assert [r for r, _ in res.curve] == sorted(calls)
    assert search(lambda r: 0.0, guess=6.0, evals=3, policy="p").goodput == 0.0
    calls.clear()
    assert search(lambda r: calls.append(r) or (1.0 if r <= 5.0 else 0.0), guess=6.0, evals=4, policy="p").goodput >= 3.0
    assert len(calls) == 4  # a guess in range: the budget is the plain search's


def test_step_report_reads_a_served_timeline_and_prices_its_steps(tmp_path):
    """real_cluster_steps.py reads the steps a server's --timeline recorded (a decode run spread
    into its steps), prices each batch, counts only short gaps as time between steps, and
    tallies each kind of step."""
    import numpy as np

    from conftest import LinearCost
    from real_cluster_steps import gaps_while_busy, kv_moves, real_steps, step_mix, step_ratios

    from flowyard.costmodel.serving import server_ttfts

    from flowyard.cluster.timeline import Timeline
    from flowyard.core.plan import PrefillSlice, StepPlan
    from flowyard.core.request import Request, RequestState

    st = RequestState(Request(id=0, arrival=0.0, prompt_len=100, output_len=8))
    pre, dec = StepPlan(prefills=[PrefillSlice(st, 0, 100)]), StepPlan(decodes=[st])
    tl = Timeline()
    tl.step(0, 0.0, 0.5, pre)
    tl.step(0, 0.5001, 0.7001, dec, steps=2)  # a decode run of two steps
    tl.step(1, 5.0, 5.1, dec)  # after an idle while: not a gap between steps
    st.first_token_time, st.finish_time = 0.5, 0.7001
    tl.finished(st)
    tl.write(tmp_path / "tl.json")
    assert server_ttfts(json.loads((tmp_path / "tl.json").read_text())) == [pytest.approx(0.5)]
    steps = real_steps(tmp_path / "tl.json")
    assert [round(s[1], 6) for s in steps] == [0.5, 0.1, 0.1, 0.1]
    assert [round(s[4], 4) for s in steps] == [0.0, 0.5001, 0.6001, 5.0]
    assert gaps_while_busy(steps) == pytest.approx(1e-4, abs=1e-6)
    mix = step_mix(steps)
    assert mix["prefill"] == (1, pytest.approx(0.5), 100, 0) and mix["decode"][0] == 3
    assert mix["decode"][1] == pytest.approx(0.3)
    tl.transfer(0, 0, 1, 0.5, 0.51)
    assert kv_moves(tl.to_chrome()) == 1
    ratios = step_ratios(steps, LinearCost(), decode_ctx=100.0)
    assert all(np.isfinite(v).all() and min(v) > 0 for v in ratios.values())
    # a lone step is priced at the batch shape the timeline recorded (here the decode's own
    # context), a decode run's steps, which carry none, at the context given
    assert steps[3][5] is not None and steps[1][5] is None
    from real_cluster_fixed import timeline_speed

    speed, prompt, decode = timeline_speed(tmp_path / "tl.json", LinearCost(), 100.0)  # the run's own speed
    assert prompt == pytest.approx(statistics.median(ratios["prefill"]), abs=1e-3)
    assert decode == pytest.approx(statistics.median(ratios["decode"]), abs=1e-3)
    assert speed == pytest.approx((prompt * decode) ** 0.5, abs=1e-3)
    from flowyard.core.plan import BatchShape
    alone = step_ratios(steps[3:], LinearCost(), decode_ctx=9999.0)["decode"][0]
    assert alone == pytest.approx(0.1 / float(LinearCost().step_time(BatchShape(**steps[3][5]))), rel=1e-3)
    assert step_ratios(steps[1:2], LinearCost(), decode_ctx=9999.0)["decode"][0] < alone


def test_machine_speed_compares_two_profiles_of_the_same_steps(tiny, tmp_path):
    """Each policy is simulated with a profile made just before its runs; the row records how
    much dearer its steps were than under the SLOs' profile, so drift is not read as policy."""
    import json

    from real_cluster import machine_speed

    _, path, cost = tiny
    assert machine_speed(cost, cost) == 1.0
    slow = json.loads(path.read_text())
    for sample in slow["samples"]:  # the same steps, each operator twice as long
        sample["times"] = {k: 2 * v for k, v in sample["times"].items()}
    slow["engine_overhead_s"] = 2 * slow.get("engine_overhead_s", 0.0)
    doubled = tmp_path / "slow.json"
    doubled.write_text(json.dumps(slow))
    assert machine_speed(ProfiledCostModel(str(doubled)), cost) == pytest.approx(2.0, rel=0.05)


def test_added_rates_narrow_a_bracket_and_a_lucky_point_cannot_raise_it():
    import json

    import real_cluster_points as pts

    assert pts.parse_add_rates("flowprefill=1.9/2.0, flowyard=2.3") == {"flowprefill": [1.9, 2.0], "flowyard": [2.3]}
    for bad in ("flowprefill", "=1.9", "flowprefill=fast", "flowprefill=-1", "", "x=nan"):
        with pytest.raises(ValueError, match="add-rates"):
            pts.parse_add_rates(bad)
    # the rule gives every committed search's own goodput back
    for d in ("real_cluster_conv_short", "real_cluster_conv_short_ray"):
        for r in json.loads((ROOT / "benchmarks/results" / d / "rows.json").read_text()):
            assert pts.goodput_of(r["real_curve"]) == pytest.approx(r["real_goodput"]), (d, r["policy"])
    row = {"executor": "local", "workload": "w", "policy": "p", "real_goodput": 1.46,
           "real_curve": [[0.58, 1.0], [1.46, 1.0], [2.19, 0.83]]}
    pts.add_point(row, 1.9, 0.75, "abc1234", 1.02)  # a miss inside the bracket narrows it
    assert rc.bracket(row) == (1.46, 1.9) and row["added"][0]["revision"] == "abc1234"
    pts.add_point(row, 3.0, 1.0, "abc1234", 1.02)  # a met rate above a miss raises nothing
    assert row["real_goodput"] == 1.46
    pts.add_point(row, 1.46, 0.5, "abc1234", 1.02)  # the same rate missed once: a miss there
    assert rc.bracket(row) == (0.58, 1.46)
    assert any("1.900 req/s → 75%" in line for line in pts.added_note([row]))


def test_served_terms_clock_the_simulator_while_policies_predict_with_the_plain_profile(tiny):
    """--fit-serving: the fitted terms slow the simulated steps (the testbed) and nothing else."""
    _, path, cost = tiny
    served = ProfiledCostModel({**json.loads(path.read_text()), "serving": {"scale": 1.5, "row_s": 0.002}})
    slos = rc.engine_slos(cost)
    w = rc.make_workload("conv-mixed", 8, slos, cost)
    plain = rc.sim_point(w, w.fixed_rate, "vllm", cost, shared_device=True)
    slow = rc.sim_point(w, w.fixed_rate, "vllm", served, shared_device=True, predictor=cost)
    assert slow["completed"] == plain["completed"] == 8
    assert slow["tpot_p50"] > 1.4 * plain["tpot_p50"] and slow["ttft_p50"] > plain["ttft_p50"]


def test_refix_measures_every_fixed_point_again_with_more_requests(tiny, tmp_path, monkeypatch):
    """`--refix N`: real and simulated fixed-rate points on the first N requests, searches kept."""
    import argparse
    import contextlib

    import real_cluster_more as more

    _, path, cost = tiny
    (tmp_path / "profile-local.json").write_text(path.read_text())
    old = {"attainment": 1.0, "ttft_p50": 9.0, "ttft_p90": 9.0, "tpot_p50": 9.0, "tpot_p90": 9.0, "completed": 3}
    rows = [{"executor": "local", "policy": p, "workload": "conv-mixed", "real_goodput": 1.0, "sim_goodput": 1.0,
             "real_curve": [[1.0, 1.0], [2.0, 0.5]], "sim_curve": [[1.0, 1.0]], "fixed_rate": 0.5, "real": old,
             "sim": old, "revision": "abc"} for p in ("vllm", "flowyard")]
    meta = {"slo_factor": 4.0, "machine": "x", "command": "c", "requests_per_point": 3,
            "slos": {"tpot_s": 0.1, "ttft_by_length": "0:1"}}
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    sent = []
    monkeypatch.setattr(more, "Server", lambda *a, **k: contextlib.nullcontext("http://x"))
    class Check:  # the machine's speed before each point, and by kind of step
        last_drift = None

        def __call__(self) -> float:
            self.last_drift = (1.3, 1.1)
            return 1.2

    monkeypatch.setattr(more, "SpeedCheck", lambda *a, **k: Check())

    def served(url, w, rate, slos):  # the real run: its requests' states (the simulator's, 0.25 s TTFT each)
        sent.append((len(w.workload.requests), rate))
        states = rc.sim_states(w, rate, "vllm", cost, True)
        for st in states:
            st.first_token_time = st.req.arrival + 0.25
            st.token_times[0][0] = st.first_token_time
        return states

    monkeypatch.setattr(more, "real_states", served)
    args = argparse.Namespace(work_dir=str(tmp_path), refix=7, executors="local,ray", model=None,
                              out=str(tmp_path / "report.md"))
    more.refix(args)
    got = json.loads((tmp_path / "rows.json").read_text())
    assert sent == [(7, 0.5), (7, 0.5)]
    assert all(r["real"]["ttft_p50"] == pytest.approx(0.25) and r["sim"]["completed"] == 7
               and r["fixed_speed"] == 1.2 for r in got)
    assert all(r["fixed_drift"] == [1.3, 1.1] and "fixed_runs" not in r for r in got)
    assert all(r["fixed_checks"] == [[1.2, 1.3, 1.1]] * 2 for r in got)  # before and after the point
    assert [r["real_curve"] for r in got] == [r["real_curve"] for r in rows]  # the searches are kept
    report = (tmp_path / "report.md").read_text()
    assert "3 requests per point (7 at the fixed rate)" in report
    assert "measured again with 7 requests (`--refix`) at " in report  # with the revision and time it ran
    sent.clear()
    more.refix(argparse.Namespace(**{**vars(args), "fixed_repeats": 2}))  # each point served twice
    got = json.loads((tmp_path / "rows.json").read_text())
    assert sent == [(7, 0.5)] * 4 and all(len(r["fixed_runs"]) == 2 and len(r["fixed_checks"]) == 3 for r in got)
    assert all(r["real"]["completed"] == 14 for r in got)  # the runs' requests pooled
    report = (tmp_path / "report.md").read_text()
    assert "| real runs |" in report and "with 7 requests (`--refix`), served 2 times, at " in report
    servers, speeds = [], iter([[1.1, 1.2, 1.0], [1.3, 1.3, 1.3]] * 2)
    import real_cluster_observed as ro

    monkeypatch.setattr(more, "Server", lambda *a, **k: servers.append(a[0]) or contextlib.nullcontext("http://x"))
    monkeypatch.setattr(rc, "timeline_states", lambda srv, tl, w, rate, slos: served(None, w, rate, slos))
    monkeypatch.setattr(ro, "timeline_speed", lambda tl, cost, ctx: next(speeds))
    more.refix(argparse.Namespace(**{**vars(args), "fixed_repeats": 2, "observed_speed": True}))
    got = json.loads((tmp_path / "rows.json").read_text())
    assert servers == ["vllm", "vllm", "flowyard", "flowyard"]  # a fresh server, with a timeline, per run
    assert all(r["observed_speeds"] == [[1.1, 1.2, 1.0], [1.3, 1.3, 1.3]] and r["sim_observed"]["completed"] == 14
               for r in got)
    assert all(r["sim_loro"]["completed"] == 14 for r in got)  # each run at the other's speeds too
    report = (tmp_path / "report.md").read_text()
    assert "speed served steps ran at" in report and "leave one run out): P50 within 15 %" in report
    with pytest.raises(SystemExit, match="at least 2"):
        more.refix(argparse.Namespace(**{**vars(args), "refix": 1}))


def test_resim_searches_every_simulated_goodput_again_and_keeps_the_real_points(tmp_path):
    """`--resim`: the simulated goodput resolved to SIM_TOL with the row's profile; every real
    point, curve and fixed-rate measurement stays as it was measured. The profile is a committed
    one of the embedded model, so the search is the same on a busy machine."""
    import argparse

    import real_cluster as script
    import real_cluster_more as more

    run = Path(__file__).parent.parent / "benchmarks/results/real_cluster_64"
    measured = run / "profile-local.json"
    (tmp_path / "profile-local.json").write_text(measured.read_text())
    (tmp_path / "profile-local-vllm.json").write_text(measured.read_text())  # the row's own (--reprofile)
    timeline = "fit-serving-local-conv-short-vllm.json"  # the run's served-step fit, refitted on its timeline
    (tmp_path / timeline).write_text((run / timeline).read_text())
    fit = {"scale": 9.0, "row_s": 0.5, "step_s": 0.0, "frontend_s": 0.012, "fitted_on": "x", "steps": 1,
           "median_error_before": 0.0, "median_error_after": 0.0, "workload": "conv-short", "policy": "vllm", "rate": 1}
    old = {"attainment": 1.0, "ttft_p50": 9.0, "ttft_p90": 9.0, "tpot_p50": 9.0, "tpot_p90": 9.0, "completed": 3}
    rows = [{"executor": "local", "policy": "vllm", "workload": "conv-mixed", "real_goodput": 1.0, "sim_goodput": 0.0,
             "real_curve": [[1.0, 1.0], [2.0, 0.5]], "sim_curve": [], "fixed_rate": 0.5, "real": old, "sim": old,
             "revision": "abc", "profile": "profile-local-vllm.json"}]
    meta = {"slo_factor": 4.0, "machine": "x", "command": "c", "requests_per_point": 24, "fixed_requests": 8,
            "slos": {"tpot_s": 0.1, "ttft_by_length": "0:1"}, "serving": {"local": fit}}
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    more.resim(argparse.Namespace(work_dir=str(tmp_path), executors="local", out=str(tmp_path / "report.md")))
    (got,) = json.loads((tmp_path / "rows.json").read_text())
    assert got["sim_goodput"] > 0 and got["sim_tol"] == script.SIM_TOL
    ok = max(r for r, a in got["sim_curve"] if a >= 0.9)
    above = [r for r, a in got["sim_curve"] if r > ok and a < 0.9]
    assert above and min(above) - ok <= script.SIM_TOL * min(above) + 1e-9  # resolved to the tolerance
    assert got["real_curve"] == rows[0]["real_curve"] and got["real"] == old  # real points kept
    assert got["sim"] != old and got["sim"]["completed"] == 8  # the simulated fixed-rate point again
    refit = json.loads((tmp_path / "meta.json").read_text())["serving"]["local"]
    assert refit["scale"] == 1.0 and refit["row_s"] < 0.1 and refit["frontend_s"] == 0.012  # not the 9x put in
    assert refit["row_s"] > 0  # one process: the scale is held and serving's cost is in the loop terms
    assert json.loads((tmp_path / "serving-local.json").read_text()) == refit
    report = (tmp_path / "report.md").read_text()
    assert "to within 2%" in report and "`--resim`" in report
    assert "(held: the instances take turns on one thread)" in report
    with pytest.raises(SystemExit, match="no rows"):
        more.resim(argparse.Namespace(work_dir=str(tmp_path), executors="ray", out=str(tmp_path / "r.md")))


def test_points_added_to_a_run_are_judged_by_the_slos_its_requests_carried():
    """An earlier run's SLOs come from its meta.json, not from this revision's price of its
    profile (a better attention model moves every TTFT SLO); per executor since `slos_by`."""
    cost = ProfiledCostModel(str(Path(__file__).parent.parent / "benchmarks/results/real_cluster_64/profile-local.json"))
    own = rc.engine_slos(cost, 4.0)
    stored = {"tpot_s": 0.5, "ttft_by_length": "0:3"}
    rows = [{"executor": "ray"}]
    assert rc.run_slos({"slo_factor": 4.0, "slos": stored}, rows, "ray", cost) == rc.EngineSLOs(0.5, "0:3")
    both = rows + [{"executor": "local"}]  # an old two-executor run stored only its last executor's
    assert rc.run_slos({"slo_factor": 4.0, "slos": stored}, both, "ray", cost) == own
    by = {"slo_factor": 4.0, "slos": stored, "slos_by": {"local": {"tpot_s": 0.2, "ttft_by_length": "0:1"}}}
    assert rc.run_slos(by, both, "local", cost) == rc.EngineSLOs(0.2, "0:1")


def test_a_run_with_an_export_timeline_clocks_each_move_and_one_without_keeps_zero(tiny, tmp_path):
    """--fit-serving records a served timeline where requests move (fit-export-<executor>.json);
    the fitted KV export time goes into the executor's serving terms, which clock the simulator."""
    fit = {"scale": 1.0, "row_s": 0.0, "step_s": 0.0, "frontend_s": 0.0}
    assert rcf.with_export(fit, rcf.export_timeline(tmp_path, "ray"))["export_s"] == 0.0
    ev, t0, t1 = [], 0.0, 0.0
    for i in range(10):  # instance 0 hands every request to instance 1 and pays 8 ms after each
        ev.append({"ph": "X", "cat": "step", "name": "prefill", "pid": 0, "ts": t0, "dur": 50e3})
        ev.append({"ph": "i", "cat": "decision", "name": "handoff", "pid": 0, "ts": t0 + 50e3 + 100,
                   "args": {"request": i, "src": 0, "dst": 1}})
        t0 += 50e3 + 3e3 + 8e3
    for _ in range(30):
        ev.append({"ph": "X", "cat": "step", "name": "decode", "pid": 1, "ts": t1, "dur": 10e3})
        t1 += 10e3 + 3e3
    rcf.export_timeline(tmp_path, "ray").write_text(json.dumps({"traceEvents": ev}))
    got = rcf.with_export(fit, rcf.export_timeline(tmp_path, "ray"))
    assert got["export_s"] == pytest.approx(0.008) and got["export_fitted_on"].endswith("fit-export-ray.json")
    _, path, cost = tiny
    assert rc.served_clock(path, got, cost).kv_export_time() == pytest.approx(0.008)
    assert cost.kv_export_time() == 0.0  # the policies' own predictions pay nothing


def test_an_export_timeline_that_fits_nothing_is_reported_and_charges_nothing(tmp_path, capsys):
    fit = {"scale": 1.0, "row_s": 0.0, "step_s": 0.0, "frontend_s": 0.0}
    tl = rcf.export_timeline(tmp_path, "local")
    tl.write_text(json.dumps({"traceEvents": [{"ph": "X", "cat": "step", "name": "decode", "pid": 0, "ts": 0.0,
                                               "dur": 1e3}]}))
    got = rcf.with_export(fit, tl)
    assert got["export_s"] == 0.0 and "move" in got["export_unfitted"]
    assert "no KV export time" in capsys.readouterr().err


def test_drift_sensitivity_reports_each_policy_under_a_drifted_clock(tiny, tmp_path, monkeypatch):
    """drift_sensitivity.py simulates a policy with prompt-bearing steps slowed: a slower clock
    never makes its TTFT shorter, and a malformed drift is refused with what is wrong."""
    import drift_sensitivity as ds

    _, path, _ = tiny
    out = tmp_path / "drift.md"
    monkeypatch.setattr(sys, "argv", ["drift_sensitivity.py", "--profile", str(path), "--policies", "vllm",
                                      "--rates", "0.5", "--drifts", "1/1,3/1", "--requests", "6", "--out", str(out)])
    ds.main()
    text = out.read_text()
    ratio_row = [line for line in text.splitlines() if line.startswith("| `vllm`") and "×" in line][-1]
    assert ratio_row.split("|")[2].strip() == "1.00×" and float(ratio_row.split("|")[3].strip()[:-1]) >= 1.0
    assert ds.parse_drifts("1/1,1.2/1.05") == [(1.0, 1.0), (1.2, 1.05)]
    for bad in ("1.2", "a/b", "0/1"):
        with pytest.raises(ValueError, match="--drifts"):
            ds.parse_drifts(bad)


@pytest.mark.parametrize("argv, message", [(["--fixed-repeats", "0"], "--fixed-repeats must be at least 1")])
def test_flags_that_cannot_work_are_refused_with_what_is_wrong(monkeypatch, argv, message):
    """A fixed point served no times is a clear error before anything is measured."""
    import real_cluster as script

    monkeypatch.setattr(sys, "argv", ["real_cluster.py", *argv])
    with pytest.raises(SystemExit, match=message):
        script.main()


def test_observed_speed_serves_every_point_fresh_and_simulates_the_row_from_other_points_steps(tiny, tmp_path,
                                                                                                 monkeypatch):
    """`real_cluster.py --observed-speed`: each real point of a row (search rates and fixed runs)
    on its own timeline server; the row keeps every point's step speed and is simulated again
    from them, and the report says how."""
    import real_cluster_observed as ro
    import real_cluster_row as rr

    _, path, cost = tiny
    slos = rc.engine_slos(cost)
    w = rc.make_workload("conv-mixed", 6, slos, cost)
    fw = rc.fixed_workload("conv-mixed", 4, w.fixed_rate, slos, cost)
    served: list = []

    def timeline_states(srv, timeline, work, rate, slos):  # a "real" run: the simulator's, with a timeline
        served.append((srv.cmd[srv.cmd.index("--policy") + 1], len(work.workload.requests), rate))
        timeline.write_text("{}")
        return rc.sim_states(work, rate, "vllm", cost, True)

    monkeypatch.setattr(rc, "timeline_states", timeline_states)
    speeds = iter([[1.0 + 0.1 * i, 1.0, 1.0 + 0.2 * i] for i in range(20)])
    monkeypatch.setattr(ro, "timeline_speed", lambda tl, c, ctx: next(speeds))

    class Check:
        last_drift = (1.3, 1.1)

        def __call__(self) -> float:
            return 1.2

    setup = rr.RowSetup("flowyard", "local", path, cost, None, Check(), None, tmp_path, 3, 2, True)
    row = rr.measure_row(setup, "conv-mixed", w, fw, slos, None)
    rates = [r for r, _ in row["real_curve"]]
    assert [s[:2] for s in served] == [("flowyard", 6)] * len(rates) + [("flowyard", 4)] * 2  # fresh each time
    assert sorted(r for r, *_ in row["real_observed"]) == sorted(rates)
    assert len(row["fixed_runs"]) == 2 and len(row["observed_speeds"]) == 2 and "sim_loro" in row
    assert row["sim_served"]["completed"] == 4 and len(row["sim_own_curve"]) == len(rates)
    assert ("sim_goodput_served" in row) == (ro.bracket_out(row)[1] > 0)
    lines = rc.write_report([{**row, "executor": "local", "policy": "flowyard", "workload": "conv-mixed",
                              "fixed_rate": w.fixed_rate}],
                            {"machine": "x", "command": "c", "requests_per_point": 6, "slo_factor": 4.0,
                             "slos": {"tpot_s": slos.tpot, "ttft_by_length": slos.spec}},
                            tmp_path / "report.md").read_text()
    assert "## Clocked by the served steps (`--observed-speed`)" in lines
    assert "per-request, clocked at the search points' served step speeds: P50 within 15 %" in lines


def test_served_step_speeds_are_read_against_the_clock_they_scale(tiny, tmp_path):
    """A run whose steps took 1.1x what the served-step clock prices reads 1.1 against that
    clock, and that clock at 1.1 prices its steps as they ran; read against the bare profile the
    per-step serving time would be counted in the speed and then once more by the clock. `--resim`
    reads a row's speeds again from the timelines its run left."""
    import real_cluster_observed as ro
    from real_cluster_fixed import timeline_speed

    from flowyard.cluster.timeline import Timeline
    from flowyard.core.plan import PrefillSlice, StepPlan
    from flowyard.core.request import Request, RequestState

    _, path, cost = tiny
    clock = rc.served_clock(path, {"scale": 1.0, "step_s": 0.01}, cost)
    st = RequestState(Request(id=0, arrival=0.0, prompt_len=64, output_len=8))
    pre, dec = StepPlan(prefills=[PrefillSlice(st, 0, 64)]), StepPlan(decodes=[st])
    tl, t = Timeline(), 0.0
    for plan in (pre, dec, dec, dec):
        dur = 1.1 * float(clock.step_time(plan.shape()))
        tl.step(0, t, t + dur, plan)
        t += dur + 1.0  # apart: each step alone
    tl.write(tmp_path / "timeline-vllm-local-w-0.json")
    speed, prompt, decode = timeline_speed(tmp_path / "timeline-vllm-local-w-0.json", clock, 64.0)
    assert prompt == pytest.approx(1.1, abs=2e-3) and decode == pytest.approx(1.1, abs=2e-3)
    bare = timeline_speed(tmp_path / "timeline-vllm-local-w-0.json", cost, 64.0)
    assert bare[2] > decode + 0.01  # the bare profile's reading carries the serving time in it
    row = {"policy": "vllm", "executor": "local", "workload": "w", "real_observed": [[0.3, 9.0, 9.0, 9.0]]}
    assert ro.reread_speeds(row, tmp_path, clock, 64.0, 64.0)
    assert row["real_observed"][0][0] == 0.3 and row["real_observed"][0][3] == pytest.approx(1.1, abs=2e-3)
    gone = {**row, "real_observed": [[0.3, 9.0, 9.0, 9.0], [0.4, 9.0, 9.0, 9.0]]}  # a timeline missing: kept
    assert not ro.reread_speeds(gone, tmp_path, clock, 64.0, 64.0) and gone["real_observed"][1][1] == 9.0
