"""Published points as data, engine profiles, the fit and its leave-one-source-out validation."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import numpy as np
import pytest

from flowyard.cli import main
from flowyard.core.plan import BatchShape
from flowyard.costmodel import DEFAULT_CALIBRATION, make_cost_model
from flowyard.costmodel import cli_validate
from flowyard.costmodel.engines import (DEFAULT_ENGINE_PROFILE, engine_profile_names, engine_profiles,
                                        get_engine_profile)
from flowyard.costmodel.fit import (current_fit, evaluate, evaluate_fit, fittable, generation_ms,
                                    predict, summary)
from flowyard.costmodel.refit import _loss, cross_validate, fit_points
from flowyard.costmodel.hardware import calibrated, get_hardware
from flowyard.costmodel.published import point_from_dict, published_points
from flowyard.costmodel.replay import replay
from flowyard.costmodel.roofline import RooflineCostModel


def test_at_least_80_points_from_6_families_with_exact_provenance():
    pts = published_points()
    assert len(pts) >= 80
    assert len({p.name for p in pts}) == len(pts)
    assert len({p.family for p in pts}) >= 6
    for p in pts:
        assert p.source.strip() and p.family and p.engine in engine_profile_names(), p.name
        assert p.measured > 0 or p.is_range, p.name
        if ":" in p.source.split()[0] and "@" in p.source and not p.source.startswith("http"):
            assert re.search(r"@[0-9a-f]{40}", p.source), p.name  # repo:path@full commit
        # held back to check us: never fitting or validation data
        assert "TensorRT-LLM" not in p.source and "performance.md" not in p.source, p.name
        assert "lmdeploy" not in p.source.lower(), p.name
    # what the issue asks the data to cover
    assert {"a100-80g", "h100", "h200"} <= {p.hardware for p in pts}
    assert {1, 2, 4} <= {p.tp for p in pts}
    assert {"prefill", "decode", "mixed", "serving"} <= {p.group for p in pts}
    assert any(p.group == "decode" and sum(c for c, _ in p.decodes) >= 32 for p in pts)
    assert any(ctx >= 8192 for p in pts for _, ctx in p.decodes)
    assert {"vllm-v0", "vllm-v1", "eager-2023"} <= {p.engine for p in pts}


def test_derivations_are_computed_from_the_published_numbers():
    by = {p.name: p for p in published_points()}
    tbt = by["dynaserve T1 disagg decode P2048 D512"]
    assert tbt.decodes == ((round(2.56 * 512 * 47.0 / 1e3), 2048 + 256),)
    mixed = by["dynaserve T1 coloc mixed P8192 D32"]
    (count, _), = mixed.decodes
    assert mixed.prefills == ((3072, 2048 - count),) and mixed.group == "mixed"
    cpu = by["vidur cpu overhead llama-2-7b TP2 batch 8"]
    assert cpu.measured == pytest.approx(0.17852956265976133 + 1.1560390481233447
                                         + 0.38098288669810126 + 0.67909066777825)


def test_a_bad_point_is_a_clear_error():
    with pytest.raises(ValueError, match="'x'.*missing or bad field"):
        point_from_dict({"name": "x", "kind": "step", "family": "f"})
    with pytest.raises(ValueError, match="unknown kind"):
        point_from_dict({"name": "y", "kind": "nope"})
    with pytest.raises(ValueError, match="metric"):
        point_from_dict({"name": "z", "kind": "serving", "metric": "p42"})
    # a batch entry that is not a (history, tokens) / (count, context) pair used to pass through
    # as a longer tuple and fail (or mislead) later, where the shape is built
    with pytest.raises(ValueError, match="prefills: each entry needs two numbers"):
        point_from_dict({"name": "w", "kind": "step", "measured": 1.0, "prefills": [[0, 128, 5]]})
    with pytest.raises(ValueError, match="decodes: each entry needs two numbers"):
        point_from_dict({"name": "v", "kind": "step", "measured": 1.0, "decodes": [[8]]})


def test_predictions_are_computed_not_constant():
    rows = evaluate("vidur", serving=False)
    preds = np.array([r.predicted for r in rows if not r.point.is_range])
    assert len(set(np.round(preds, 9))) > len(preds) // 2
    p = next(r.point for r in rows if r.point.kind == "step" and not r.point.is_range)
    slow = predict(p, get_hardware(p.hardware))
    fast = predict(p, replace(get_hardware(p.hardware), mem_bw=2 * get_hardware(p.hardware).mem_bw))
    assert fast < slow


def test_generation_is_one_prefill_then_lockstep_decodes():
    cm = make_cost_model("llama-3.1-8b", "h100")
    total = cm.step_time(BatchShape.of([(0, 32)] * 8, []))
    total += sum(cm.step_time(BatchShape.of([], [32 + k] * 8)) for k in range(1, 128))
    assert generation_ms(cm, 8, 32, 128) == pytest.approx(1e3 * total)


def test_engine_profiles_are_named_fitted_on_their_own_sources_and_default_to_vllm_v1():
    assert DEFAULT_ENGINE_PROFILE == "vllm-v1" == get_engine_profile().name
    pts = published_points()
    for name, prof in engine_profiles().items():
        assert prof.fitted_on, name
        for fam in prof.fitted_on:  # each family it rests on measured that stack
            assert any(p.family == fam and p.engine == name for p in pts), (name, fam)
    eager, v1 = (make_cost_model("llama-3-8b", "a100-80g", engine_profile=e)
                 for e in ("eager-2023", "vllm-v1"))
    shape = BatchShape.of([], [1024] * 64)
    assert eager.step_time(shape) > v1.step_time(shape)  # eager pays its CPU every step
    assert make_cost_model("llama-3-8b", "a100-80g").step_time(shape) == v1.step_time(shape)
    with pytest.raises(ValueError, match="unknown engine profile 'fast'.*vllm-v1"):
        make_cost_model("llama-3-8b", "h100", engine_profile="fast")
    # 'vidur' keeps its assumed host terms whatever the profile
    assert calibrated(get_hardware("h100"), "vidur", engine="eager-2023") is get_hardware("h100")


def test_default_calibration_is_the_validated_one():
    from flowyard.sim.run import SimConfig

    assert DEFAULT_CALIBRATION == "published" == SimConfig().calibration
    shape = BatchShape.of([(0, 512)], [1024] * 8)
    for hw in ("a100-80g", "h100", "h200", "cpu"):
        a = make_cost_model("llama-3-8b", hw).step_time(shape)
        assert a == make_cost_model("llama-3-8b", hw, calibration="published").step_time(shape)
    assert calibrated(get_hardware("cpu"), "published") is get_hardware("cpu")
    # the stored fit is the one `calibrated` serves
    fit = current_fit()
    assert calibrated(get_hardware("a100-80g")) == fit.hardware("a100-80g", DEFAULT_ENGINE_PROFILE)


def test_kernel_only_terms_stay_out_of_the_simulator():
    hw = get_hardware("a100-80g")
    assert calibrated(hw).params.attn_causal_extra == 0.0
    assert calibrated(hw, "published", "vidur-profile").params.attn_causal_extra > 0.0
    pts = published_points()
    assert {p.kernel for p in pts if p.kind.startswith("attn_")} == {"vidur-profile"}
    assert {p.kernel for p in pts if not p.kind.startswith("attn_")} == {""}


def test_unknown_calibration_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown calibration 'fast'.*vidur, published"):
        make_cost_model("llama-3-8b", "h100", calibration="fast")


def _small() -> list:
    """A few points of four families, enough for a fit in well under a second."""
    pts = fittable(published_points())
    keep = {"dynaserve", "vllm-ci", "musgrave-blog", "inferencebench"}
    return [p for p in pts if p.family in keep] + [p for p in pts if p.kind == "cpu_overhead"][:3]


def test_fit_lowers_its_loss_from_the_prior():
    pts = _small()
    fit = fit_points(pts, iters=40, restarts=1)
    prior = fit_points(pts, iters=0, restarts=0)
    assert _loss(list(zip(pts, [r.predicted for r in evaluate_fit(fit, pts)]))) < \
        _loss(list(zip(pts, [r.predicted for r in evaluate_fit(prior, pts)])))
    assert set(fit.fitted_on) == {"vllm-v0", "vllm-v1", "eager-2023"}


def test_cross_validation_never_prices_a_family_with_a_fit_that_saw_it():
    pts = _small()
    rows, folds, unchecked = cross_validate(pts, iters=20, restarts=1)
    for fam, fold in folds.items():
        assert all(fam not in fams for fams in fold.fitted_on.values())
    # Vidur's CPU rows alone define eager-2023: held out, no fold can check them
    assert {p.family for p in unchecked} == {"vidur"}
    assert {r.point.name for r in rows} | {p.name for p in unchecked} == {p.name for p in pts}
    assert summary(rows)["points"] == len(rows)


def test_stored_calibration_fits_the_step_level_points():
    rows = evaluate(serving=False)
    s = summary(rows)
    assert s["median_abs_error"] <= 0.10
    mixed = [r for r in rows if r.point.group == "mixed"]
    assert mixed and max(abs(r.error) for r in mixed) <= 0.15  # mixed steps: the sum of parts holds


def test_a_serving_run_is_replayed_in_the_simulator():
    p = next(p for p in published_points() if p.kind == "serving" and p.metric == "tpot_p50")
    small = replace(p, workload={**p.workload, "num_requests": 40}, name=p.name + " (40)")
    hw = calibrated(get_hardware(p.hardware))
    fast = replace(hw, mem_bw=2 * hw.mem_bw)
    slow_ms, fast_ms = (replay(small, RooflineCostModel(p.model, h, p.tp)) for h in (hw, fast))
    assert 0 < fast_ms < slow_ms


def test_validate_cli_headline_is_cross_validated(tmp_path, capsys, monkeypatch):
    pts = _small()
    monkeypatch.setattr(cli_validate, "published_points", lambda: pts)
    monkeypatch.setattr(cli_validate, "cross_validate",
                        lambda p, workers=1: cross_validate(p, iters=10, restarts=1))
    out = tmp_path / "v.json"
    assert main(["validate", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    cv_at, ins_at = text.index("cross-validated (leave one source out)"), text.index("in-sample (published)")
    assert cv_at < ins_at and "by kind" in text and "by source" in text
    data = json.loads(out.read_text())
    assert {"cross_validated", "in_sample"} <= set(data)
    assert len(data["in_sample"]["points"]) == len(pts)
    assert main(["validate", "--no-cv", "--engine-profile", "eager-2023", "--json", "-"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert "cross_validated" not in doc and doc["engine_profile"] == "eager-2023"


def test_simulate_records_its_engine_profile_and_calibration(tmp_path):
    runs = {}
    for prof in (None, "eager-2023"):
        out = tmp_path / f"{prof}.json"
        args = ["simulate", "--trace", "azure-conv", "--num-requests", "20", "--quiet", "--json", str(out)]
        assert main(args + (["--engine-profile", prof] if prof else [])) == 0
        runs[prof] = json.loads(out.read_text())
    assert runs[None]["config"]["engine_profile"] == "vllm-v1"
    assert runs["eager-2023"]["config"]["engine_profile"] == "eager-2023"
    assert runs[None]["config"]["calibration"] == "published"
    assert runs["eager-2023"]["tpot"]["mean"] > runs[None]["tpot"]["mean"]
    with pytest.raises(SystemExit):  # argparse names the valid profiles
        main(["simulate", "--engine-profile", "nope", "--num-requests", "5"])


def test_reproduce_runs_its_experiment_under_the_profile_and_restores_the_default(monkeypatch, tmp_path):
    import flowyard.experiments as experiments
    from flowyard.costmodel.engines import ENV_VAR

    seen = {}

    def fake(name, out, quick, seed, command, log, allow_dirty=False):
        seen.update(profile=get_engine_profile().name, command=command)
        return tmp_path / "r.md"

    monkeypatch.setattr(experiments, "run_experiment", fake)
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert main(["reproduce", "dynaserve", "--quick", "--quiet", "--engine-profile", "vllm-v0"]) == 0
    assert seen["profile"] == "vllm-v0" and "--engine-profile vllm-v0" in seen["command"]
    assert get_engine_profile().name == DEFAULT_ENGINE_PROFILE  # the process default is back


def test_a_fixed_shape_run_is_replayed_on_its_cluster():
    """DynaServe's Table 1 colocated runs: every request one shape, Poisson arrivals at the
    published throughput, two replicas behind a round-robin router, 2048-token chunks."""
    d = {"name": "shape run", "family": "f", "engine": "vllm-v0", "kind": "serving", "metric": "tbt_p50",
         "model": "qwen2.5-14b", "hardware": "a100-80g", "tp": 1, "measured": 40.0, "unit": "ms", "source": "s",
         "workload": {"shape": [1024, 64], "rate": 3.0, "num_requests": 80, "instances": 2,
                      "scheduler": "round-robin", "chunk": 512}}
    p = point_from_dict(d)
    cm = RooflineCostModel(p.model, calibrated(get_hardware(p.hardware)), 1)
    from flowyard.costmodel.replay import _config
    from flowyard.sim.run import simulate

    cfg = _config(p, 1)
    assert (cfg.instances, cfg.policy, cfg.chunk_size, cfg.rate) == (2, "round-robin", 512, 3.0)
    summary, _ = simulate(cfg, cost_model=cm)
    assert summary.requests == 80 and summary.input_tokens == 80 * 1024
    assert replay(p, cm) == pytest.approx(1e3 * summary.tbt["p50"]) and replay(p, cm) > 0
    with pytest.raises(ValueError, match="one of a trace, a shape or lengths"):
        point_from_dict({**d, "workload": {**d["workload"], "trace": "sharegpt"}})
    with pytest.raises(ValueError, match="workload lengths must be"):
        point_from_dict({**d, "workload": {"lengths": [[5, 0]], "rate": 1.0, "num_requests": 1}})
    exact = point_from_dict({**d, "workload": {"lengths": [[300, 20], [7, 90]], "rate": 1e6, "num_requests": 2}})
    s2, _ = simulate(_config(exact, 1), cost_model=cm)
    assert (s2.requests, s2.input_tokens, s2.output_tokens) == (2, 307, 110)
    with pytest.raises(ValueError, match="workload shape must be"):
        point_from_dict({**d, "workload": {**d["workload"], "shape": [1024, 0]}})


def test_a_family_that_fits_only_the_frontend_is_held_out_of_its_own_fold():
    """Bug: a family with no step points (SGLang's serving runs) was priced with the all-points
    fit, whose frontend latency its own lone-request TTFTs had fitted."""
    pts = _small()
    sg = next(p for p in published_points() if p.family == "sglang-bench" and p.metric == "ttft_p50"
              and p.workload["rate"] == 4 and p.hardware == "a100-80g")
    sg = replace(sg, workload={**sg.workload, "num_requests": 30}, name=sg.name + " (30)")
    rows, folds, _ = cross_validate(pts + [sg], iters=5, restarts=1)
    assert "sglang-bench" not in folds["sglang-bench"].fitted_on.get("frontend:vllm-v1", ())
    assert "sglang-bench" in folds["dynaserve"].fitted_on.get("frontend:vllm-v1", ())


def test_a_profile_fits_its_all_reduce_latency_only_on_its_own_tensor_parallel_runs():
    """vLLM V0's stacks (CUDA graphs, custom all-reduce) ran TP 4 in the points: their fitted
    all-reduce latency undercuts the NCCL latency Vidur's eager profiles measured; a profile
    without tensor-parallel step points keeps the GPU's."""
    from flowyard.costmodel.hardware import H100_PARAMS

    fit = current_fit()
    pts = fittable(published_points())
    for e, terms in fit.engines.items():
        has_tp = any(p.tp > 1 for p in pts if p.engine == e and p.kind in ("step", "generation"))
        assert ("ar_latency_s" in terms) == (has_tp and bool(fit.fitted_on.get(e))), e
    ar = fit.engines["vllm-v0"]["ar_latency_s"]
    assert 0 < ar < H100_PARAMS.ar_latency_s
    assert calibrated(get_hardware("h100"), engine="vllm-v0").params.ar_latency_s == pytest.approx(ar)
    assert calibrated(get_hardware("h100"), engine="vllm-v1").params.ar_latency_s == H100_PARAMS.ar_latency_s


def test_a_multi_step_engine_pays_its_host_terms_once_per_k_steps():
    """vLLM 0.6's --num-scheduler-steps 10: scheduling and input preparation once per ten
    steps, so under an engine with milliseconds of host time per step the replayed TPOT falls,
    and by no more than that host time."""
    from flowyard.costmodel.replay import multi_step

    d = {"name": "ms run", "family": "f", "engine": "vllm-v0", "kind": "serving", "metric": "tpot_p50",
         "model": "llama-3-8b", "hardware": "h100", "tp": 1, "measured": 8.0, "unit": "ms", "source": "s",
         "workload": {"lengths": [[50, 60]] * 8, "rate": 1e6, "num_requests": 8, "scheduler": "prefill-first"}}
    one = point_from_dict(d)
    ten = point_from_dict({**d, "name": "ms run 10", "workload": {**d["workload"], "scheduler_steps": 10}})
    hw = current_fit().hardware("h100", "vllm-v0")
    cm = RooflineCostModel(one.model, hw, 1)
    host_ms = 1e3 * (hw.params.step_overhead_s + 8 * hw.params.seq_overhead_s)
    assert 0.8 * host_ms < replay(one, cm) - replay(ten, cm) < host_ms
    assert multi_step(hw, 1) is hw and multi_step(hw, 10).params.step_overhead_s == hw.params.step_overhead_s / 10
    for bad in (0, "10", 2.5):
        with pytest.raises(ValueError, match="scheduler_steps must be a whole number"):
            point_from_dict({**d, "workload": {**d["workload"], "scheduler_steps": bad}})


def test_golden_section_finds_a_minimum():
    from flowyard.costmodel.refit import golden

    assert golden(lambda x: (x - 0.3) ** 2, -2.0, 2.0, iters=30) == pytest.approx(0.3, abs=1e-4)


def test_a_profile_without_tensor_parallel_steps_fits_its_all_reduce_on_burst_tpots():
    """Without vLLM CI's TP4 latency runs, vllm-v0 has no tensor-parallel step: its all-reduce
    latency comes from Lambda's TP 2-8 TPOTs of ten prompts sent at once; with them it stays the
    steps' (and no burst TPOT is a fit input)."""
    from flowyard.costmodel.refit import burst_tpots, fit_ar_latency

    pts = published_points()
    bursts = burst_tpots(pts)
    assert bursts and all(p.tp > 1 and p.metric == "tpot_p50" for p in bursts)
    assert {p.family for p in bursts} == {"lambda-bench"}  # open-loop runs at a finite rate are not bursts
    fit = current_fit()
    assert "ar:vllm-v0" not in fit.fitted_on and "ar_latency_s" in fit.engines["vllm-v0"]
    assert fit_ar_latency(fit, pts) == fit  # the steps fitted it: kept
    v0 = {k: v for k, v in fit.engines["vllm-v0"].items() if k != "ar_latency_s"}
    no_tp_steps = replace(fit, engines=fit.engines | {"vllm-v0": v0})
    fold = fit_ar_latency(no_tp_steps, pts)
    assert fold.fitted_on["ar:vllm-v0"] == ("lambda-bench",)
    assert 1e-6 <= fold.engines["vllm-v0"]["ar_latency_s"] <= 1e-4
    assert "ar:vllm-v1" not in fold.fitted_on  # no burst TPOT of its stacks
