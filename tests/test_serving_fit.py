"""Serving terms of a profile: what a served step adds to the forward pass the profile prices
(flowyard.costmodel.serving), fitted on a timeline and applied by ProfiledCostModel."""

from __future__ import annotations

import json

import numpy as np
import pytest

from flowyard.cli import main
from flowyard.cluster.timeline import Timeline
from flowyard.core.plan import BatchShape
from flowyard.core.request import Request
from flowyard.costmodel.base import LAYER_OPS
from flowyard.costmodel.link import Link
from flowyard.costmodel.profiled import ProfiledCostModel, ProfileError
from flowyard.costmodel.serving import ServingTerms, fit_serving, fit_serving_files, served_steps
from flowyard.policies.registry import PolicyOptions, build_policy
from flowyard.sim.cluster import Topology
from flowyard.sim.simulator import Simulator

_FIELDS = ("prefill_tokens", "prefill_seqs", "prefill_attn", "prefill_kv", "decode_seqs", "decode_ctx")


def _profile(serving: dict | None = None) -> dict:
    """A synthetic engine: GEMMs linear in tokens, attention in its features, 2 layers."""
    samples = []
    for n in (16, 64, 256, 1024):
        for shape in (BatchShape.of([(0, n)], []), BatchShape.of([], [n] * 4), BatchShape.of([(0, n)], [200] * 2)):
            t = shape.tokens
            times = {op: 2e-4 + 3e-6 * t for op in LAYER_OPS}
            times["attn"] = 1e-4 + 1e-9 * shape.prefill_attn + 2e-8 * shape.decode_ctx
            times["step_other"] = 5e-4 + 1e-6 * t
            samples.append({"shape": {f: getattr(shape, f) for f in _FIELDS}, "times": times})
    prof = {"num_layers": 2, "kv_bytes_per_token": 512, "samples": samples, "engine_overhead_s": 1e-3}
    if serving is not None:
        prof["serving"] = serving
    return prof


def _served_timeline(served: ProfiledCostModel) -> dict:
    """Two instances taking turns on one device, clocked by `served`: what a served run's
    timeline looks like when serving adds exactly `served.serving` to every step."""
    reqs = [Request(id=i, arrival=0.05 * i, prompt_len=100 + 37 * (i % 9), output_len=12 + i % 7) for i in range(40)]
    link = Link(1e12)
    policy = build_policy("vllm", PolicyOptions(num_instances=2, max_num_seqs=8, predictor=served))
    tl = Timeline()
    Simulator(reqs, policy, served, Topology(1, link, link), shared_device=True, timeline=tl).run()
    return tl.to_chrome()


def test_served_profile_prices_rows_steps_and_scale():
    terms = {"scale": 1.25, "row_s": 2e-3, "step_s": 1e-3, "frontend_s": 0.015}
    plain, served = ProfiledCostModel(_profile()), ProfiledCostModel(_profile(terms))
    for shape in (BatchShape.of([(0, 300)], []), BatchShape.of([], [500] * 5), BatchShape.of([(0, 64)], [90] * 3)):
        rows = shape.prefill_seqs + shape.decode_seqs
        assert served.step_time(shape) == pytest.approx(1.25 * plain.step_time(shape) + 2e-3 * rows + 1e-3)
        # FlowPrefill's operator boundaries end where the step does
        assert served.op_boundaries(shape)[-1] == pytest.approx(served.step_time(shape))
    assert served.frontend_latency() == 0.015 and plain.frontend_latency() == 0.0


def test_fit_recovers_the_terms_a_served_run_had():
    truth = ServingTerms(scale=1.3, row_s=1.5e-3, step_s=0.8e-3)
    served = ProfiledCostModel(_profile(truth.to_dict()))
    trace = _served_timeline(served)
    assert len(served_steps(trace)) > 50
    fit = fit_serving(ProfiledCostModel(_profile()), trace, fitted_on="sim")
    assert fit.scale == pytest.approx(1.3, rel=0.02)
    assert fit.row_s == pytest.approx(1.5e-3, rel=0.05)
    assert fit.step_s == pytest.approx(0.8e-3, abs=2e-4)
    assert fit.median_error_before > 0.2 and fit.median_error_after < 0.01


def test_fitting_a_profile_that_already_has_terms_is_refused():
    served = ProfiledCostModel(_profile({"scale": 1.2}))
    with pytest.raises(ValueError, match="counted twice"):
        fit_serving(served, _served_timeline(served), fitted_on="x")


def test_a_timeline_without_shapes_is_a_clear_error():
    old = {"traceEvents": [{"ph": "X", "cat": "step", "name": "decode", "ts": i * 1e4, "dur": 9e3,
                            "args": {"prefill_tokens": 0, "decode_seqs": 1, "steps": 1}} for i in range(20)]}
    with pytest.raises(ValueError, match="batch shapes"):
        fit_serving(ProfiledCostModel(_profile()), old, fitted_on="old")


@pytest.mark.parametrize("block", [{"scale": 0}, {"row_s": -1.0}, {"scale": "fast"}, ["not", "a", "dict"]])
def test_a_malformed_serving_block_is_a_profile_error(block):
    with pytest.raises(ProfileError, match="serving"):
        ProfiledCostModel(_profile(block))  # type: ignore[arg-type]


def test_cli_fits_a_timeline_into_a_new_profile(tmp_path, capsys):
    base, tl, out = tmp_path / "p.json", tmp_path / "tl.json", tmp_path / "served.json"
    base.write_text(json.dumps(_profile()))
    tl.write_text(json.dumps(_served_timeline(ProfiledCostModel(_profile({"scale": 1.1, "row_s": 1e-3})))))
    assert main(["profile", "--serving-timeline", str(tl), "--from", str(base), "--out", str(out)]) == 0
    assert "per sampled row" in capsys.readouterr().out
    got = ProfiledCostModel(str(out)).serving
    assert got.scale == pytest.approx(1.1, rel=0.02) and got.fitted_on == str(tl)
    # refitting from the served profile drops its block first instead of counting it twice
    again = fit_serving_files(out, tl, tmp_path / "again.json")
    assert again.scale == pytest.approx(got.scale)


def test_cli_errors_say_what_is_missing(tmp_path, capsys):
    assert main(["profile", "--serving-timeline", str(tmp_path / "tl.json"), "--out", str(tmp_path / "o.json")]) != 0
    assert "--from" in capsys.readouterr().err
    (tmp_path / "p.json").write_text(json.dumps(_profile()))
    assert main(["profile", "--serving-timeline", str(tmp_path / "missing.json"), "--from", str(tmp_path / "p.json"),
                 "--out", str(tmp_path / "o.json")]) != 0
    assert "not a readable JSON" in capsys.readouterr().err


def test_steps_of_separate_processes_take_their_own_gaps():
    """Ray actors step at once: a step's serving-loop gap is to its own instance's next step,
    not to whichever instance steps next."""
    shape = {"prefill_tokens": 0.0, "prefill_seqs": 0, "prefill_attn": 0.0, "prefill_kv": 0.0,
             "decode_seqs": 2, "decode_ctx": 400.0, "graphed": False}
    ev = [{"ph": "X", "cat": "step", "name": "decode", "pid": pid, "ts": 11e3 * i + 4e3 * pid, "dur": 10e3,
           "args": {"steps": 1, "shape": shape}} for i in range(10) for pid in (0, 1)]
    steps = served_steps({"traceEvents": ev})
    assert len(steps) == 20
    assert [round(s.seconds, 4) for s in steps[:-2]] == [0.011] * 18  # 10 ms step + 1 ms own gap


def test_a_held_scale_fits_only_the_loop_terms():
    """One process: the instances take turns on the profiled thread, so the scale is held at 1
    and the per-row and per-step terms carry what serving adds."""
    truth = ServingTerms(scale=1.0, row_s=1.5e-3, step_s=0.8e-3)
    served = ProfiledCostModel(_profile(truth.to_dict()))
    fit = fit_serving(ProfiledCostModel(_profile()), _served_timeline(served), fitted_on="sim", scale=1.0)
    assert fit.scale == 1.0
    assert fit.row_s == pytest.approx(1.5e-3, rel=0.05) and fit.step_s == pytest.approx(0.8e-3, abs=2e-4)
    # held where the run had another scale, the loop terms take up what they can, never negative
    off = fit_serving(ProfiledCostModel(_profile()), _served_timeline(ProfiledCostModel(_profile({"scale": 1.3}))),
                      fitted_on="sim", scale=1.0)
    assert off.scale == 1.0 and min(off.row_s, off.step_s) >= 0 and off.median_error_after > 0


def test_cli_holds_the_scale_when_asked_and_refuses_a_bad_one(tmp_path, capsys):
    base, tl, out = tmp_path / "p.json", tmp_path / "tl.json", tmp_path / "served.json"
    base.write_text(json.dumps(_profile()))
    tl.write_text(json.dumps(_served_timeline(ProfiledCostModel(_profile({"row_s": 1e-3})))))
    args = ["profile", "--serving-timeline", str(tl), "--from", str(base), "--out", str(out)]
    assert main(args + ["--serving-scale", "1"]) == 0
    assert ProfiledCostModel(str(out)).serving.scale == 1.0
    capsys.readouterr()
    assert main(args + ["--serving-scale", "0"]) != 0
    assert "--serving-scale must be a positive number" in capsys.readouterr().err
    assert main(["profile", "--serving-scale", "1", "--out", str(out)]) != 0
    assert "--serving-scale goes with --serving-timeline" in capsys.readouterr().err


def test_the_fit_reads_the_loops_gap_and_the_simulator_ends_steps_before_it():
    """A served step is its kernels and then the loop before the next step: the fit takes the
    median busy gap from the timeline, and the simulator keeps the instance busy through it
    while the step's tokens (and the time a policy measures) end where the gap begins."""
    served = ProfiledCostModel(_profile({"scale": 1.2, "row_s": 1e-3}))
    trace = _served_timeline(served)
    whole = fit_serving(ProfiledCostModel(_profile()), trace, fitted_on="sim")
    assert whole.gap_s == 0.0  # the simulated run has no gap between steps
    for e in trace["traceEvents"]:
        if e.get("ph") == "X" and e.get("cat") == "step":
            e["dur"] -= 3000  # the last 3 ms of each step become a gap before the next
    split = fit_serving(ProfiledCostModel(_profile()), trace, fitted_on="sim")
    assert split.gap_s == pytest.approx(3e-3, abs=1e-6)
    assert split.median_error_after < 0.05  # step + gap is still what the terms price

    gapped = ProfiledCostModel(_profile({"scale": 1.2, "row_s": 1e-3, "gap_s": 4e-3}))
    link = Link(1e12)
    runs = {}
    for name, cost in (("plain", served), ("gapped", gapped)):
        req = Request(id=0, arrival=0.0, prompt_len=200, output_len=5)
        tl = Timeline()
        res = Simulator([req], build_policy("vllm", PolicyOptions(num_instances=1, predictor=cost)), cost,
                        Topology(1, link, link), timeline=tl).run()
        runs[name] = (res.states[0], tl.steps)
    (p_st, p_steps), (g_st, g_steps) = runs["plain"], runs["gapped"]
    assert [s[1:3] for s in g_steps] == [s[1:3] for s in p_steps]  # the instance is busy just as long
    assert p_st.first_token_time == pytest.approx(p_steps[0][2])
    assert g_st.first_token_time == pytest.approx(g_steps[0][2] - 4e-3)  # its token exists before the loop
    assert g_st.finish_time == pytest.approx(p_st.finish_time - 4e-3)


def test_a_decode_run_committed_mid_way_keeps_the_gap_too():
    """A request arriving while a multi-step decode run is in flight commits the run's finished
    steps early (transport._sync): those steps' tokens come the loop's gap early as well."""
    link = Link(1e12)
    times = {}
    for name, gap in (("plain", 0.0), ("gapped", 4e-3)):
        cost = ProfiledCostModel(_profile({"scale": 1.2, "row_s": 1e-3, "gap_s": gap}))
        reqs = [Request(id=0, arrival=0.0, prompt_len=64, output_len=60),
                Request(id=1, arrival=0.05, prompt_len=64, output_len=3)]
        tl = Timeline()
        res = Simulator(reqs, build_policy("vllm", PolicyOptions(num_instances=1, predictor=cost)), cost,
                        Topology(1, link, link), timeline=tl).run()
        first = next(s for s in res.states if s.req.id == 0)
        times[name] = np.concatenate(first.token_times)
        if gap:
            assert any(args["steps"] > 1 for *_, args in tl.steps)  # a decode run, committed in pieces
    assert times["gapped"] == pytest.approx(times["plain"] - 4e-3)
