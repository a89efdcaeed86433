"""float32 linears of a few rows as W @ x^T (engine/skinny_gemm.py): the same product as
F.linear up to summation order, taken only for float32 calls of a few rows, and chosen by the
engine outside `exact` mode."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flowyard.engine import skinny_gemm
from flowyard.engine.model import PackedLinear


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 16, skinny_gemm.MAX_ROWS])
@pytest.mark.parametrize("bias", [False, True])
def test_transposed_product_is_f_linear_up_to_summation_order(rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(16_384, 576, generator=g) * 0.05
    b = torch.randn(16_384, generator=g) if bias else None
    x = torch.randn(rows, 576, generator=g)
    got, ref = skinny_gemm.linear(x, w, b), F.linear(x, w, b)
    assert got.shape == ref.shape and got.is_contiguous() and got.dtype == torch.float32
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_packed_linear_takes_it_only_for_float32_calls_of_a_few_rows():
    g = torch.Generator().manual_seed(0)
    lin = PackedLinear()
    lin.skinny_mm = True
    w = torch.randn(300, 64, generator=g)
    few, many = torch.randn(3, 64, generator=g), torch.randn(skinny_gemm.MAX_ROWS + 1, 64, generator=g)
    assert skinny_gemm.supports(few, w)
    assert torch.equal(lin(few, w), skinny_gemm.linear(few, w))
    # everything else stays F.linear, bit for bit
    assert not skinny_gemm.supports(many, w) and torch.equal(lin(many, w), F.linear(many, w))
    assert not skinny_gemm.supports(few.bfloat16(), w.bfloat16())
    assert not skinny_gemm.supports(few[0], w)  # 1-D input
    lin.skinny_mm = False
    assert torch.equal(lin(few, w), F.linear(few, w))


def test_engine_chooses_it_for_float32_outside_exact_mode(monkeypatch):
    from flowyard.engine.engine_config import EngineConfig
    from flowyard.engine.llm_engine import LLMEngine

    monkeypatch.setenv("FLOWYARD_SKINNY_GEMM", "mm")
    skinny_gemm.transposed_faster.cache_clear()
    try:
        assert LLMEngine.from_path(None, EngineConfig(dtype="float32")).model.linear.skinny_mm is True
        assert LLMEngine.from_path(None, EngineConfig(dtype="float32", attention="exact")).model.linear.skinny_mm is False
        assert LLMEngine.from_path(None, EngineConfig(dtype="bfloat16")).model.linear.skinny_mm is False
        monkeypatch.setenv("FLOWYARD_SKINNY_GEMM", "linear")
        skinny_gemm.transposed_faster.cache_clear()
        assert LLMEngine.from_path(None, EngineConfig(dtype="float32")).model.linear.skinny_mm is False
        monkeypatch.setenv("FLOWYARD_SKINNY_GEMM", "fast")
        skinny_gemm.transposed_faster.cache_clear()
        with pytest.raises(ValueError, match="FLOWYARD_SKINNY_GEMM must be auto, linear or mm, got 'fast'"):
            skinny_gemm.transposed_faster()
    finally:
        skinny_gemm.transposed_faster.cache_clear()


def test_greedy_tokens_are_the_same_either_way():
    """vLLM's test of a kernel change: the same greedy tokens (float32 engine, embedded model)."""
    from flowyard.engine.engine_config import EngineConfig
    from flowyard.engine.llm_engine import LLMEngine
    from flowyard.engine.sampling import SamplingParams

    engine = LLMEngine.from_path(None, EngineConfig(dtype="float32", enable_prefix_caching=False))
    prompts = [[1, 504, 3458, 314, 260], [1, 9690, 28, 2365, 1097, 1345, 3025], [1, 504, 1208, 282]]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    runs = []
    for on in (False, True):
        engine.model.linear.skinny_mm = on
        runs.append([out.new_token_ids for out in engine.generate(prompts, params)])
    assert runs[0] == runs[1]
