"""float32 vocabulary projections as W @ x^T (engine/vocab_gemm.py): the same product as
F.linear up to summation order, taken only for vocabulary-sized float32 calls of a few rows,
and chosen by the engine outside `exact` mode."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flowyard.engine import vocab_gemm
from flowyard.engine.model import PackedLinear


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 16, vocab_gemm.MAX_ROWS])
@pytest.mark.parametrize("bias", [False, True])
def test_transposed_product_is_f_linear_up_to_summation_order(rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(vocab_gemm.MIN_OUT, 576, generator=g) * 0.05
    b = torch.randn(vocab_gemm.MIN_OUT, generator=g) if bias else None
    x = torch.randn(rows, 576, generator=g)
    got, ref = vocab_gemm.linear(x, w, b), F.linear(x, w, b)
    assert got.shape == ref.shape and got.is_contiguous() and got.dtype == torch.float32
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_packed_linear_takes_it_only_for_vocabulary_sized_float32_calls_of_a_few_rows():
    g = torch.Generator().manual_seed(0)
    lin = PackedLinear()
    lin.vocab_mm = True
    vocab = torch.randn(vocab_gemm.MIN_OUT, 64, generator=g)
    layer = torch.randn(vocab_gemm.MIN_OUT - 1, 64, generator=g)
    few, many = torch.randn(3, 64, generator=g), torch.randn(vocab_gemm.MAX_ROWS + 1, 64, generator=g)
    assert vocab_gemm.supports(few, vocab)
    assert torch.equal(lin(few, vocab), vocab_gemm.linear(few, vocab))
    # everything else stays F.linear, bit for bit
    assert not vocab_gemm.supports(few, layer) and torch.equal(lin(few, layer), F.linear(few, layer))
    assert not vocab_gemm.supports(many, vocab) and torch.equal(lin(many, vocab), F.linear(many, vocab))
    assert not vocab_gemm.supports(few.bfloat16(), vocab.bfloat16())
    assert not vocab_gemm.supports(few[0], vocab)  # 1-D input


def test_engine_chooses_it_for_float32_outside_exact_mode(monkeypatch):
    from flowyard.engine.engine_config import EngineConfig
    from flowyard.engine.llm_engine import LLMEngine

    monkeypatch.setenv("FLOWYARD_VOCAB_GEMM", "mm")
    vocab_gemm.transposed_faster.cache_clear()
    try:
        assert LLMEngine.from_path(None, EngineConfig(dtype="float32")).model.linear.vocab_mm is True
        assert LLMEngine.from_path(None, EngineConfig(dtype="float32", attention="exact")).model.linear.vocab_mm is False
        assert LLMEngine.from_path(None, EngineConfig(dtype="bfloat16")).model.linear.vocab_mm is False
        monkeypatch.setenv("FLOWYARD_VOCAB_GEMM", "linear")
        vocab_gemm.transposed_faster.cache_clear()
        assert LLMEngine.from_path(None, EngineConfig(dtype="float32")).model.linear.vocab_mm is False
        monkeypatch.setenv("FLOWYARD_VOCAB_GEMM", "fast")
        vocab_gemm.transposed_faster.cache_clear()
        with pytest.raises(ValueError, match="FLOWYARD_VOCAB_GEMM must be auto, linear or mm, got 'fast'"):
            vocab_gemm.transposed_faster()
    finally:
        vocab_gemm.transposed_faster.cache_clear()


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
        engine.model.linear.vocab_mm = on
        runs.append([out.new_token_ids for out in engine.generate(prompts, params)])
    assert runs[0] == runs[1]
