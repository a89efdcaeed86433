"""`flowyard profile` → ProfiledCostModel → `flowyard simulate --profile`."""

from __future__ import annotations

import json

import pytest
import torch

from helpers_models import make_tiny_model
from flowyard.cli import main
from flowyard.core.plan import BatchShape
from flowyard.costmodel.base import LAYER_OPS
from flowyard.costmodel.profiled import ProfiledCostModel, ProfileError, nnls
from flowyard.engine.engine_config import EngineConfig
from flowyard.engine.llm_engine import LLMEngine
from flowyard.engine.profiler import (GridPoint, default_grid, grid_plan, run_profile, save_profile,
                                      scratch_runner, time_point)


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    pytest.importorskip("transformers")
    d, _ = make_tiny_model(tmp_path_factory.mktemp("p"), "llama")
    engine = LLMEngine.from_path(str(d), EngineConfig(dtype="float32"))
    prof = run_profile(engine.runner, grid=default_grid(quick=True), repeats=2, name="tiny")
    path = tmp_path_factory.mktemp("out") / "profile.json"
    save_profile(prof, path)
    return prof, path


def test_profile_has_every_operator_for_every_shape(profile):
    prof, _ = profile
    assert prof["num_layers"] == 2 and prof["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4
    for s in prof["samples"]:
        assert set(s["times"]) == {*LAYER_OPS, "step_other"}
        assert all(t >= 0 for t in s["times"].values())


def test_fitted_model_is_monotone_and_vectorised(profile):
    _, path = profile
    cm = ProfiledCostModel(path)
    small, big = BatchShape.of([(0, 64)], []), BatchShape.of([(0, 1024)], [])
    assert cm.step_time(big) > cm.step_time(small) > 0
    run = BatchShape(decode_seqs=8, decode_ctx=torch.arange(4).numpy() * 8.0 + 800)
    times = cm.step_time(run)
    assert times.shape == (4,) and (times > 0).all()
    assert cm.kv_bytes_per_token() == 512


def test_nnls_keeps_coefficients_non_negative():
    a = torch.tensor([[1.0, 1], [1, 2], [1, 3]]).numpy()
    x = nnls(a, torch.tensor([3.0, 2.0, 1.0]).numpy())  # true slope is negative
    assert (x >= 0).all()


def test_simulate_with_profile_and_bad_profiles(profile, tmp_path, capsys):
    _, path = profile
    out = tmp_path / "r.json"
    argv = ["simulate", "--profile", str(path), "--trace", "azure-conv", "--num-requests", "40",
            "--quiet", "--json", str(out)]
    assert main(argv) == 0
    assert json.loads(out.read_text())["completed"] == 40
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["simulate", "--profile", str(bad), "--num-requests", "5", "--quiet"]) == 2
    assert "not a readable JSON profile" in capsys.readouterr().err
    with pytest.raises(ProfileError, match="does not exist"):
        ProfiledCostModel(tmp_path / "missing.json")
    with pytest.raises(ProfileError, match="missing"):
        ProfiledCostModel({"num_layers": 2})


def test_a_profile_file_that_is_not_a_json_object_is_a_clear_error(tmp_path):
    path = tmp_path / "list.json"
    path.write_text("[1, 2, 3]")
    with pytest.raises(ProfileError, match="not a JSON object"):
        ProfiledCostModel(path)


def test_grid_points_cover_prefill_decode_and_mixed():
    grid = default_grid()
    assert any(p.prefill and not p.decode for p in grid)
    assert any(p.decode and not p.prefill for p in grid)
    assert any(p.decode and p.prefill for p in grid)
    assert GridPoint().prefill == []


def test_gemm_curve_never_falls_with_more_tokens():
    """A noisy profile (the 1,024-token GEMMs measured faster than the 64-token ones, as on a
    loaded CPU) still gives a step time that does not fall as tokens grow: budget searches
    bisect on it."""
    from flowyard.costmodel.profiled import GEMM_OPS
    samples = []
    for n, gemm in ((16, 1e-3), (64, 4e-3), (256, 3e-3), (1024, 2e-3), (2048, 6e-3)):
        shape = BatchShape.of([(0, n)], [])
        times = {op: (gemm if op in GEMM_OPS else 1e-4 * (1 + n / 1024)) for op in (*LAYER_OPS, "step_other")}
        samples.append({"shape": {f: getattr(shape, f) for f in ("prefill_tokens", "prefill_seqs", "prefill_attn",
                                                                 "prefill_kv", "decode_seqs", "decode_ctx")},
                        "times": times})
    cm = ProfiledCostModel({"num_layers": 2, "kv_bytes_per_token": 512, "samples": samples})
    steps = [float(cm.step_time(BatchShape.of([(0, n)], []))) for n in range(16, 4096, 16)]
    assert all(b >= a for a, b in zip(steps, steps[1:]))


def _engine_calls(fn) -> set[tuple[str, str]]:
    """The flowyard.engine functions (file, name) that run inside fn(): the code path."""
    import os
    import sys

    calls: set[tuple[str, str]] = set()

    def tracer(frame, event, arg):
        if event == "call":
            path = frame.f_code.co_filename
            if f"{os.sep}flowyard{os.sep}engine{os.sep}" in path and not path.endswith("profiler.py"):
                calls.add((os.path.basename(path), frame.f_code.co_name))

    sys.setprofile(tracer)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


# the entry points differ by design: the engine runs a plan to the end (`execute`, the model's
# `forward` draining its own generator); the profiler drives the operator generator itself
ENTRY = {("runner.py", "execute"), ("runner.py", "forward_steps"), ("model.py", "forward")}


@pytest.mark.parametrize("attention", ["paged", "grouped", "exact"])
def test_the_profiler_runs_the_engines_code_path(tmp_path, attention):
    """For the same batch shape, the profiler and the engine call the same engine code (kernels,
    attention path, batch preparation): a profile cannot silently time something else again (it
    once timed the gather-based decode attention while the engine ran the paged kernel)."""
    pytest.importorskip("transformers")
    d, _ = make_tiny_model(tmp_path, "llama")
    engine = LLMEngine.from_path(str(d), EngineConfig(dtype="float32", attention=attention))
    point = GridPoint(prefill=[(16, 24)], decode=[40, 70, 9])
    plan = grid_plan(point, engine.runner.kv, engine.model.cfg.vocab_size)
    real = _engine_calls(lambda: engine.runner.execute(plan))
    scratch = scratch_runner(engine.runner, 64)
    profiled = _engine_calls(lambda: time_point(scratch, point, repeats=1))
    assert real - ENTRY and real - ENTRY == profiled - ENTRY - {("profiler.py", "grid_plan")}
    assert scratch.kv.num_used_blocks == 0  # the scratch KV is handed back


def test_passes_keep_each_operators_median_over_the_passes(tmp_path, monkeypatch):
    """A slow minute on a shared machine skews one pass, not the profile: with three passes a
    point's operator times are the median of the three passes' times."""
    import flowyard.engine.profiler as prof

    d, _ = make_tiny_model(tmp_path, "llama")
    engine = LLMEngine.from_path(str(d), EngineConfig(dtype="float32"))
    grid = default_grid(quick=True)[:2]
    seen = iter([1.0, 5.0, 100.0, 2.0, 3.0, 4.0])  # pass 1: points a, b; pass 2: a, b; pass 3: a, b
    monkeypatch.setattr(prof, "time_point", lambda runner, point, repeats: {"qkv_proj": next(seen)})
    out = run_profile(engine.runner, grid=grid, repeats=1, passes=3, name="tiny")
    assert [s["times"]["qkv_proj"] for s in out["samples"]] == [3.0, 4.0]  # medians of (1, 100, 3), (5, 2, 4)
    assert out["passes"] == 3 and out["repeats"] == 1
    with pytest.raises(ValueError, match="passes"):
        run_profile(engine.runner, grid=grid, passes=0)


def test_grid_prices_small_chunks_over_long_histories():
    """The attention fit needs more than one history shape to tell the cost per cached token
    from the cost per causal pair (a 56-token chunk over 900 cached tokens was priced at twice
    its served time, and DynaServe's budgets fell to their floor in the simulator)."""
    for quick in (True, False):
        small = {h for p in default_grid(quick=quick) for h, n in p.prefill if h > 0 and n <= 64}
        assert len(small) >= 2 and max(small) >= 1024
