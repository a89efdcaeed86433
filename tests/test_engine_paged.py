"""The paged decode kernel (engine/paged_kernel.py): same values as its PyTorch reference for
any batch shape, no effect on the process's floating point, a clean fallback where it cannot be
built, and the engine's log-probabilities that vLLM-style closeness checks read."""

from __future__ import annotations

import pytest
import torch

from flowyard.engine import paged_kernel
from flowyard.engine.attention import AttentionBatch, decode_attention
from flowyard.engine.engine_config import EngineConfig
from flowyard.engine.llm_engine import LLMEngine
from flowyard.engine.paged_kernel import PagedKernel, paged_decode, paged_decode_reference
from flowyard.engine.sampling import SamplingParams

CASES = [  # batch, kv heads, group, head_dim, block size, context lengths
    (1, 3, 3, 64, 16, [1]), (1, 3, 3, 64, 16, [1000]), (8, 3, 3, 64, 16, [16, 1, 33, 64, 200, 17, 5, 9]),
    (5, 2, 4, 128, 8, [7, 8, 9, 100, 3]), (3, 4, 1, 32, 32, [31, 32, 33]), (2, 1, 8, 80, 4, [5, 50]),
    # the AVX-512 kernel's 16-token tiles: edges, blocks of 48, query rows taken 4 at a time (6 = 4 + 2)
    (6, 3, 3, 64, 48, [15, 16, 17, 47, 48, 130]), (4, 2, 6, 32, 16, [1, 16, 17, 100]),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("b,kvh,group,d,bs,lens", CASES)
def test_kernel_matches_reference(dtype, b, kvh, group, d, bs, lens):
    g = torch.Generator().manual_seed(b * 31 + d)
    blocks = -(-max(lens) // bs)
    cache = torch.randn(2, b * blocks + 3, bs, kvh, d, generator=g).to(dtype)
    tables = torch.randperm(b * blocks + 3, generator=g)[:b * blocks].view(b, blocks)
    q = torch.randn(b, kvh, group, d, generator=g).to(dtype)
    lens_t = torch.tensor(lens)
    assert paged_decode.supports(q, cache)
    got = paged_decode(q, cache[0], cache[1], tables, lens_t)
    ref = paged_decode_reference(q, cache[0], cache[1], tables, lens_t)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5  # one bfloat16 rounding of values ~1
    assert torch.allclose(got.float(), ref.float(), atol=tol, rtol=tol), (got.float() - ref.float()).abs().max()


def test_kernel_rescales_when_the_max_grows():
    """Later tokens score ever higher, so the one-pass kernel's running max grows tile after tile."""
    g = torch.Generator().manual_seed(7)
    cache = torch.randn(2, 40, 16, 2, 64, generator=g)
    cache[0] *= torch.linspace(0.1, 3, 40 * 16).view(40, 16, 1, 1)
    q = torch.randn(2, 2, 3, 64, generator=g)
    cache[0] += q[0].mean(1).view(1, 1, 2, 64) * torch.linspace(0, 2, 40 * 16).view(40, 16, 1, 1)
    tables, lens = torch.arange(40).view(2, 20), torch.tensor([320, 290])
    for dtype in (torch.float32, torch.bfloat16):
        got = paged_decode(q.to(dtype), cache[0].to(dtype), cache[1].to(dtype), tables, lens)
        ref = paged_decode_reference(q.to(dtype), cache[0].to(dtype), cache[1].to(dtype), tables, lens)
        tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
        assert torch.allclose(got.float(), ref.float(), atol=tol, rtol=tol), (got.float() - ref.float()).abs().max()


def test_decode_attention_paged_equals_grouped_within_rounding():
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(2, 40, 16, 3, 64, generator=g).bfloat16()
    tables = torch.arange(40).view(4, 10)
    lens = torch.tensor([160, 1, 77, 20])
    q = torch.randn(4, 9, 64, generator=g).bfloat16()
    out = {}
    for mode in ("paged", "grouped"):
        batch = AttentionBatch(slot_mapping=torch.empty(0), sample_rows=torch.empty(0), decode_block_tables=tables,
                               decode_ctx_lens=lens, paged_decode=mode == "paged", grouped_decode=mode == "grouped")
        out[mode] = decode_attention(q, cache, batch).float()
    assert torch.allclose(out["paged"], out["grouped"], atol=2e-2)


def test_loading_the_kernel_keeps_denormals():
    """Linking with -ffast-math would turn on flush-to-zero for the whole process."""
    assert paged_decode.supports(torch.zeros(1, 1, 1, 64), torch.zeros(1))
    assert (torch.tensor([1e-39]) * 1.0).item() != 0.0


def test_no_compiler_falls_back_to_gather(monkeypatch, tmp_path):
    monkeypatch.setenv("FLOWYARD_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler")
    k = PagedKernel()
    assert not k.supports(torch.zeros(1, 1, 1, 64).bfloat16(), torch.zeros(1).bfloat16())
    with pytest.raises(RuntimeError, match="no C compiler"):
        paged_kernel.build()
    monkeypatch.setenv("FLOWYARD_PAGED_KERNEL", "0")
    assert not PagedKernel().supports(torch.zeros(1, 1, 1, 64), torch.zeros(1))


def test_kernel_is_cpu_float_only():
    assert not paged_decode.supports(torch.zeros(1, 1, 1, 64, dtype=torch.float16), torch.zeros(1, dtype=torch.float16))
    assert not paged_decode.supports(torch.zeros(1, 1, 1, 512), torch.zeros(1))  # head_dim over the kernel's 256


@pytest.fixture(scope="module")
def tiny_engines(tmp_path_factory):
    from helpers_models import make_tiny_model
    d, _ = make_tiny_model(tmp_path_factory.mktemp("m"), "llama")
    return {mode: LLMEngine.from_path(str(d), EngineConfig(dtype="float32", attention=mode)) for mode in ("paged", "exact")}


def test_engine_logprobs(tiny_engines):
    e = tiny_engines["paged"]
    prompts = [[5, 17, 99, 3], list(range(30, 71))]
    outs = e.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3))
    for out in outs:
        assert len(out.logprobs) == len(out.new_token_ids) == 12
        for tok, lp in zip(out.new_token_ids, out.logprobs):
            assert tok in lp and len(lp) <= 4 and all(v <= 0 for v in lp.values())
            assert lp[tok] == max(lp.values())  # greedy picks the most likely token
    assert e.generate([[1, 2]], SamplingParams(max_tokens=2))[0].logprobs is None
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21)


def test_paged_engine_tokens_equal_exact_on_tiny_model(tiny_engines):
    """float32 on a tiny model: rounding differences are far below any logit gap."""
    prompts = [[5, 17, 99, 3, 44, 120, 7], list(range(30, 71)), [200, 201]]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    got = [o.new_token_ids for o in tiny_engines["paged"].generate(prompts, params)]
    assert got == [o.new_token_ids for o in tiny_engines["exact"].generate(prompts, params)]
