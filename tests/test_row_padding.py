"""Small GEMMs padded to a multiple of 8 rows (core/padding.py, engine/skinny_gemm.py): the
engine pads them, its profile records the rule, and the cost model prices the padded rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, strategies as st

from flowyard.core.padding import RowPadding
from flowyard.core.plan import BatchShape
from flowyard.costmodel.base import LAYER_OPS
from flowyard.costmodel.profiled import GEMM_OPS, ProfiledCostModel, ProfileError
from flowyard.engine import skinny_gemm

PAD = RowPadding(((6, 32, 8),))


@given(st.integers(1, 200))
def test_rows_round_up_only_inside_the_padded_range(n):
    m = PAD.rows(n)
    if 6 <= n <= 32:
        assert m % 8 == 0 and n <= m < n + 8
    else:
        assert m == n
    assert list(PAD.rows(np.array([n, n]))) == [m, m]  # elementwise on arrays


def test_row_counts_never_fall_as_rows_grow():
    """Budget searches bisect on step time: more tokens must never multiply fewer rows."""
    rows = [PAD.rows(n) for n in range(1, 100)]
    assert all(b >= a for a, b in zip(rows, rows[1:]))


def test_the_engines_rule_pads_three_rows_to_four_and_seven_to_32_to_multiples_of_8():
    rule = skinny_gemm.ROW_PADDING
    assert [rule.rows(n) for n in range(1, 10)] == [1, 2, 4, 4, 5, 6, 8, 8, 16]
    assert rule.rows(31) == 32 and rule.rows(33) == 33
    # a profile made before 3 rows were padded records the one-range form
    assert RowPadding.from_dict({"multiple": 8, "pad_from": 7, "max_rows": 32}) == RowPadding(((7, 32, 8),))
    assert RowPadding.from_dict(rule.to_dict()) == rule


@pytest.mark.parametrize("bad", [{"multiple": 8, "pad_from": 6, "max_rows": 30}, {"multiple": 0, "pad_from": 1, "max_rows": 4},
                                 {"multiple": 8.5, "pad_from": 6, "max_rows": 32}, {"rows": 8}, [8],
                                 {"ranges": [[7, 32, 8], [3, 4, 4]]}, {"ranges": [[3, 4]]}, {"ranges": [3, 4, 4]}])
def test_a_malformed_rule_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="row padding"):
        RowPadding.from_dict(bad)


@pytest.mark.parametrize("rows", [1, 5, 6, 7, 13, 15, 17, 31, 32])
def test_padded_product_is_f_linear_up_to_summation_order(rows):
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(3072, 576, generator=g) * 0.05, torch.randn(3072, generator=g)
    x = torch.randn(rows, 576, generator=g)
    got = skinny_gemm.linear(x, w, b, padding=PAD)
    assert got.shape == (rows, 3072) and got.is_contiguous()
    assert torch.allclose(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_engine_pads_where_the_switch_says(monkeypatch):
    from flowyard.engine.engine_config import EngineConfig
    from flowyard.engine.llm_engine import LLMEngine

    monkeypatch.setenv("FLOWYARD_SKINNY_GEMM", "mm")
    try:
        for switch, want in (("on", skinny_gemm.ROW_PADDING), ("off", None)):
            monkeypatch.setenv("FLOWYARD_SKINNY_PAD", switch)
            skinny_gemm.transposed_faster.cache_clear()
            skinny_gemm.padding_faster.cache_clear()
            assert LLMEngine.from_path(None, EngineConfig(dtype="float32")).model.linear.row_padding == want
        # no skinny products, nothing to pad
        assert LLMEngine.from_path(None, EngineConfig(dtype="bfloat16")).model.linear.row_padding is None
        monkeypatch.setenv("FLOWYARD_SKINNY_PAD", "yes")
        skinny_gemm.padding_faster.cache_clear()
        with pytest.raises(ValueError, match="FLOWYARD_SKINNY_PAD must be auto, off or on, got 'yes'"):
            skinny_gemm.padding_faster()
    finally:
        skinny_gemm.transposed_faster.cache_clear()
        skinny_gemm.padding_faster.cache_clear()


def test_greedy_tokens_are_the_same_padded_or_not():
    """vLLM's test of a kernel change: the same greedy tokens, with batches of 1 to 7 streams."""
    from flowyard.engine.engine_config import EngineConfig
    from flowyard.engine.llm_engine import LLMEngine
    from flowyard.engine.sampling import SamplingParams

    engine = LLMEngine.from_path(None, EngineConfig(dtype="float32", enable_prefix_caching=False))
    engine.model.linear.skinny_mm = True
    prompts = [[1, 504, 3458 + i, 314, 260 + 7 * i] for i in range(7)]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    runs = []
    for pad in (None, PAD):
        engine.model.linear.row_padding = pad
        runs.append([out.new_token_ids for out in engine.generate(prompts, params)])
    assert runs[0] == runs[1]


def _profile(padding: dict | None) -> dict:
    """Decode-only samples whose GEMMs cost what an engine that pads to 8 would show: a step of
    n rows costs the rows it multiplies."""
    samples = []
    for n in (1, 4, 8, 16, 32, 64):
        shape = BatchShape.of([], [100] * n)
        times = {op: (1e-3 * (1 + n / 8) if op in GEMM_OPS else 1e-4) for op in (*LAYER_OPS, "step_other")}
        samples.append({"shape": {f: getattr(shape, f) for f in ("prefill_tokens", "prefill_seqs", "prefill_attn",
                                                                 "prefill_kv", "decode_seqs", "decode_ctx")},
                        "times": times})
    return {"num_layers": 2, "kv_bytes_per_token": 512, "samples": samples, "gemm_row_padding": padding}


def test_the_cost_model_prices_the_rows_the_engine_multiplies():
    padded = ProfiledCostModel(_profile(PAD.to_dict()))
    plain = ProfiledCostModel(_profile(None))

    def gemm(cm, n):
        return sum(float(v) for op, v in cm.layer_op_times(BatchShape.of([], [100] * n)).items() if op in GEMM_OPS)

    assert gemm(padded, 9) == pytest.approx(gemm(padded, 16))  # 9 rows run as 16
    assert gemm(padded, 5) < gemm(padded, 6) == pytest.approx(gemm(padded, 8))  # padding starts at 6
    assert gemm(plain, 9) < gemm(plain, 16)  # an unpadded engine's rows interpolate
    # a decode run's shapes (arrays) get the same prices as one shape at a time
    run = BatchShape.of([], [100] * 9)
    ctx = np.array([100.0, 200.0])
    arr = BatchShape(run.prefill_tokens, run.prefill_seqs, run.prefill_attn, run.prefill_kv, run.decode_seqs, ctx * 9)
    assert np.allclose(padded.step_time(arr), [float(padded.step_time(BatchShape.of([], [c] * 9))) for c in ctx])
    with pytest.raises(ProfileError, match="row padding"):
        ProfiledCostModel(_profile({"multiple": "8"}))


def test_a_profile_records_the_engines_padding(tmp_path):
    pytest.importorskip("transformers")
    from helpers_models import make_tiny_model
    from flowyard.engine.engine_config import EngineConfig
    from flowyard.engine.llm_engine import LLMEngine
    from flowyard.engine.profiler import GridPoint, run_profile

    d, _ = make_tiny_model(tmp_path, "llama")
    engine = LLMEngine.from_path(str(d), EngineConfig(dtype="float32"))
    grid = [GridPoint(decode=[20] * n) for n in (1, 2, 8, 16)]
    for pad in (PAD, None):
        engine.model.linear.row_padding = pad
        prof = run_profile(engine.runner, grid=grid, repeats=1, name="tiny")
        assert prof["gemm_row_padding"] == (None if pad is None else PAD.to_dict())
        assert ProfiledCostModel(prof).row_padding == pad


def test_the_between_points_benchmark_keeps_each_samples_median_over_passes():
    """benchmarks/profile_between_points.py alternates the two profiles' passes and fits each on
    the per-operator medians of its passes."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from profile_between_points import median_profile

    passes = [_profile(None) for _ in range(3)]
    for k, p in enumerate(passes):
        for s in p["samples"]:
            s["times"] = {op: t * (1, 5, 2)[k] for op, t in s["times"].items()}
    merged = median_profile(passes)
    assert merged["passes"] == 3 and len(merged["samples"]) == len(passes[0]["samples"])
    assert merged["samples"][0]["times"] == {op: 2 * t for op, t in _profile(None)["samples"][0]["times"].items()}
    ProfiledCostModel(merged)  # still a profile
