"""The engine's fast paths against the straightforward computation they replace.

Each fast path (one gather per layer into a reused buffer, length-bucketed exact decode
attention, sign-folded RoPE, in-place RMSNorm, pre-blocked oneDNN weights, per-row down_proj
for small exact batches, batched fresh prompts) must give the reference's bits, or, for
`grouped` attention, its values within bfloat16 rounding.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flowyard.engine.attention import AttentionBatch, PrefillSeq, decode_attention, paged_attention, plan_decode
from flowyard.engine.model import PackedLinear

BS, KVH, H, D = 16, 3, 9, 64


def _paged(lens: list[int], dtype: torch.dtype, seed: int = 0):
    """A random paged cache holding sequences of the given lengths in shuffled blocks."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // BS) for n in lens]
    num_blocks = sum(need) + 3
    cache = torch.randn(2, num_blocks, BS, KVH, D, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(perm[at:at + n])
        at += n
    width = max(need)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    q = torch.randn(len(lens), H, D, generator=g).to(dtype)
    return cache, tables, padded, q


def _reference(q, cache, tables, lens):
    """What transformers computes for each sequence alone: (1, H, 1, D) against exactly its keys."""
    out = []
    for b, (t, n) in enumerate(zip(tables, lens)):
        k = cache[0][t].flatten(0, 1)[:n].transpose(0, 1).unsqueeze(0)
        v = cache[1][t].flatten(0, 1)[:n].transpose(0, 1).unsqueeze(0)
        out.append(F.scaled_dot_product_attention(q[b:b + 1].unsqueeze(2), k, v, enable_gqa=True).view(H, D))
    return torch.stack(out)


LENS = [37, 40, 33, 95, 16, 17, 47, 130, 128, 1, 44]  # several share len // 16, out of order


@torch.inference_mode()
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_exact_decode_attention_is_bitwise_each_sequence_alone(dtype):
    cache, tables, padded, q = _paged(LENS, dtype)
    batch = AttentionBatch(torch.empty(0), torch.empty(0), decode_block_tables=padded,
                           decode_ctx_lens=torch.tensor(LENS))
    got = decode_attention(q, cache, batch)
    assert torch.equal(got, _reference(q, cache, tables, LENS))
    plan = batch.decode_gather
    assert plan.order is not None
    if dtype == torch.bfloat16:
        assert len(plan.groups) < len(LENS)  # sequences with equal len // 16 shared a call
    assert torch.equal(decode_attention(q, cache, batch), got)  # the reused buffer, layer 2


@torch.inference_mode()
def test_grouped_decode_attention_matches_reference_within_rounding():
    cache, tables, padded, q = _paged(LENS, torch.bfloat16, seed=1)
    batch = AttentionBatch(torch.empty(0), torch.empty(0), decode_block_tables=padded,
                           decode_ctx_lens=torch.tensor(LENS), grouped_decode=True)
    got = decode_attention(q, cache, batch)
    ref = _reference(q, cache, tables, LENS)
    assert batch.decode_gather.order is None and len(batch.decode_gather.groups) == 1
    assert torch.allclose(got.float(), ref.float(), atol=2e-2, rtol=2e-2)


@torch.inference_mode()
def test_equal_fresh_prompts_share_one_sdpa_call_bitwise():
    lens = [24, 24, 24, 9, 24, 24]
    g = torch.Generator().manual_seed(2)
    t = sum(lens)
    q, k, v = (torch.randn(t, h, D, generator=g).bfloat16() for h in (H, KVH, KVH))
    prefills, row = [], 0
    for n in lens:
        prefills.append(PrefillSeq(row, n, 0, torch.zeros(2, dtype=torch.long)))
        row += n
    batch = AttentionBatch(torch.arange(t), torch.empty(0), prefills, num_prefill_tokens=t)
    got = paged_attention(q, k, v, torch.zeros(2, 8, BS, KVH, D).bfloat16(), batch)
    for s in prefills:
        r = slice(s.row, s.row + s.n)
        ref = F.scaled_dot_product_attention(q[r].transpose(0, 1)[None], k[r].transpose(0, 1)[None],
                                             v[r].transpose(0, 1)[None], is_causal=True, enable_gqa=True)
        assert torch.equal(got[r], ref[0].transpose(0, 1))


def test_plan_without_padding_needs_no_mask():
    plan = plan_decode(torch.zeros(4, 2, dtype=torch.long), torch.tensor([20, 20, 20, 20]), 10,
                       torch.bfloat16, exact=True)
    assert plan.mask is None and plan.order is None and plan.groups == [(0, 4, 20)]
    assert plan.index.tolist() == [0] * 8 + [10] * 8  # K blocks, then the same blocks' V


@torch.inference_mode()
def test_rope_and_rmsnorm_match_transformers_formulas_bitwise():
    from flowyard.engine.config import ModelConfig
    from flowyard.engine.model import CausalLM

    cfg = ModelConfig(arch="llama", hidden_size=128, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=64,
                      intermediate_size=256, vocab_size=32, rms_norm_eps=1e-5)
    model = CausalLM(cfg, max_positions=512).to(torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(300, 3, 64, generator=g) * 4).bfloat16()
    pos = torch.randint(0, 512, (300,), generator=g)
    cos, sin = model.rope.tables(pos, torch.bfloat16)
    emb = torch.cat([torch.outer(pos.float(), cfg.rope_inv_freq().float())] * 2, -1)
    hf_cos, hf_sin = emb.cos().unsqueeze(1).bfloat16(), emb.sin().unsqueeze(1).bfloat16()
    rotate_half = torch.cat((-x[..., 32:], x[..., :32]), -1)
    assert torch.equal(model.rope.rotate(x, cos, sin), x * hf_cos + rotate_half * hf_sin)

    h = (torch.randn(300, 128, generator=g) * 3).bfloat16()
    w = torch.randn(128, generator=g).bfloat16()
    hf = h.float()
    hf = w * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    assert torch.equal(model._rms(h, w), hf)


@torch.inference_mode()
def test_module_apply_reaches_every_submodule():
    # RotaryEmbedding's static `apply` (now `rotate`) shadowed nn.Module.apply, so
    # model.apply(fn), which calls apply(fn) on each child, raised a TypeError
    from flowyard.engine.config import ModelConfig
    from flowyard.engine.model import CausalLM, RotaryEmbedding

    cfg = ModelConfig(arch="llama", hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=64,
                      intermediate_size=256, vocab_size=32, rms_norm_eps=1e-5)
    model = CausalLM(cfg, max_positions=64)
    seen: list[str] = []
    model.apply(lambda m: seen.append(type(m).__name__))
    assert seen.count("DecoderLayer") == 2 and RotaryEmbedding.__name__ in seen
    assert [type(m).__name__ for m in model.decoder_layers()] == ["DecoderLayer"] * 2


def test_per_row_down_proj_is_the_one_row_gemm():
    from flowyard.engine.model import CausalLM

    g = torch.Generator().manual_seed(0)
    w = (torch.randn(576, 1536, generator=g) * 0.05).bfloat16()
    act = torch.randn(4, 1536, generator=g).bfloat16()
    alone = torch.cat([F.linear(act[r:r + 1], w) for r in range(4)])
    model = CausalLM.__new__(CausalLM)
    torch.nn.Module.__init__(model)
    model.linear = PackedLinear()
    assert torch.equal(model._down(act, w, per_row=True), alone)
    assert torch.equal(model._down(act, w, per_row=False), F.linear(act, w))


@pytest.mark.skipif(not PackedLinear.available, reason="no oneDNN bfloat16 on this CPU")
@pytest.mark.parametrize("k,n,bias", [(576, 960, True), (576, 3072, False), (1536, 576, False), (576, 4000, False)])
def test_packed_linear_is_bitwise_f_linear(k, n, bias):
    g = torch.Generator().manual_seed(k + n)
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()  # a normal tensor, like the model's
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    with torch.inference_mode():
        _check_packed(PackedLinear(), g, w, b)


def _check_packed(lin, g, w, b):
    k = w.shape[1]
    for m in (1, 2, 3, 5, 32, 33, 200, 2048):
        x = (torch.randn(m, k, generator=g) * 2).bfloat16()
        assert torch.equal(lin(x, w, b), F.linear(x, w, b)), m
    assert torch.equal(lin(x[7:8], w, b), F.linear(x[7:8], w, b))  # a one-row view
    w.mul_(2)  # an in-place load: the blocked copy must follow
    assert torch.equal(lin(x, w, b), F.linear(x, w, b)) and len(lin._cache) == 1


@pytest.mark.skipif(not PackedLinear.available, reason="no oneDNN bfloat16 on this CPU")
def test_large_f32_gemms_round_like_bf16_and_leave_small_ones_bitwise():
    """large_f32 (CPUs where fp32 GEMMs beat oneDNN bf16): from F32_MIN_ROWS rows the product
    is the float32 one rounded once, so within a bfloat16 ulp of oneDNN's; fewer rows keep
    oneDNN's bits."""
    from flowyard.engine.model import F32_MIN_ROWS

    g = torch.Generator().manual_seed(3)
    w = (torch.randn(960, 576, generator=g) * 0.05).bfloat16()
    b = torch.randn(960, generator=g).bfloat16()
    lin = PackedLinear()
    lin.large_f32 = True
    with torch.inference_mode():
        for m in (1, 32, F32_MIN_ROWS - 1, F32_MIN_ROWS, 300):
            x = torch.randn(m, 576, generator=g).bfloat16()
            got, ref = lin(x, w, b), F.linear(x, w, b)
            exact = (F.linear(x.float(), w.float(), b.float())).bfloat16()
            if m < F32_MIN_ROWS:
                assert torch.equal(got, ref), m
            else:
                assert torch.equal(got, exact), m
                assert torch.allclose(got.float(), ref.float(), rtol=1e-2, atol=1e-2), m


def test_engine_uses_large_f32_gemms_except_in_exact_mode(monkeypatch):
    from flowyard.engine import model as model_mod
    from flowyard.engine.engine_config import EngineConfig
    from flowyard.engine.llm_engine import LLMEngine

    monkeypatch.setenv("FLOWYARD_LARGE_GEMM", "f32")
    model_mod.large_gemm_f32.cache_clear()
    try:
        fast = LLMEngine.from_path(None, EngineConfig(dtype="bfloat16"))
        assert fast.model.linear.large_f32 is True  # forced: on every CPU, native bfloat16 or not
        exact = LLMEngine.from_path(None, EngineConfig(dtype="bfloat16", attention="exact"))
        assert exact.model.linear.large_f32 is False
        f32 = LLMEngine.from_path(None, EngineConfig(dtype="float32"))
        assert f32.model.linear.large_f32 is False
        monkeypatch.setenv("FLOWYARD_LARGE_GEMM", "fast")
        model_mod.large_gemm_f32.cache_clear()
        with pytest.raises(ValueError, match="FLOWYARD_LARGE_GEMM must be auto, bf16 or f32, got 'fast'"):
            model_mod.large_gemm_f32()
    finally:
        model_mod.large_gemm_f32.cache_clear()


def test_engine_uses_small_gemv_except_in_exact_mode(monkeypatch):
    """Decode linears of 1..4 bfloat16 rows go to the gemv_bf16 C kernel where it compiled,
    never in exact mode (its point is oneDNN's bits) nor in float32; FLOWYARD_GEMV_KERNEL=0
    turns it off."""
    from flowyard.engine import gemv_kernel
    from flowyard.engine.engine_config import EngineConfig
    from flowyard.engine.llm_engine import LLMEngine

    fast = LLMEngine.from_path(None, EngineConfig(dtype="bfloat16"))
    assert fast.model.linear.small_gemv is gemv_kernel.gemv_bf16.available()
    exact = LLMEngine.from_path(None, EngineConfig(dtype="bfloat16", attention="exact"))
    assert exact.model.linear.small_gemv is False
    f32 = LLMEngine.from_path(None, EngineConfig(dtype="float32"))
    assert f32.model.linear.small_gemv is False
    monkeypatch.setenv("FLOWYARD_GEMV_KERNEL", "0")
    monkeypatch.setattr(gemv_kernel, "gemv_bf16", gemv_kernel.GemvKernel())  # not loaded yet
    import flowyard.engine.llm_engine as llm_engine
    monkeypatch.setattr(llm_engine, "gemv_bf16", gemv_kernel.gemv_bf16)
    off = LLMEngine.from_path(None, EngineConfig(dtype="bfloat16"))
    assert off.model.linear.small_gemv is False


@pytest.fixture(scope="module")
def smol_bf16():
    from flowyard.engine.engine_config import EngineConfig
    from flowyard.engine.llm_engine import LLMEngine

    # No prefix caching: a cache hit prefills the rest of a prompt against gathered history,
    # which rounds differently from prefilling it whole (as the first run did).
    return LLMEngine.from_path(None, EngineConfig(dtype="bfloat16", attention="exact", enable_prefix_caching=False))


def _decode_logits(engine, prompts, steps):
    """Logits of every step for every prompt, run together through engine.step()."""
    from flowyard.engine.sampling import SamplingParams

    rec: dict[int, list[torch.Tensor]] = {}
    execute = engine.runner.execute

    def recording(plan):
        logits, samplers = execute(plan)
        for s, row in zip(samplers, logits):
            rec.setdefault(s.id, []).append(row.clone())
        return logits, samplers

    engine.runner.execute = recording
    try:
        engine.generate(prompts, SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True))
    finally:
        engine.runner.execute = execute
    return [rec[k] for k in sorted(rec)]


def test_exact_bf16_small_batches_are_bitwise_each_sequence_alone(smol_bf16):
    """Up to PER_ROW_DOWN_MAX decodes, a batch gives every sequence the logits it gets alone
    (which is what transformers computes for it: equal lengths mod 16 share SDPA calls)."""
    prompts = [list(range(100, 137)), list(range(200, 238)), list(range(300, 350)), list(range(400, 417))]
    together = _decode_logits(smol_bf16, prompts, 20)
    for p, rows in zip(prompts, together):
        alone = _decode_logits(smol_bf16, [p], 20)[0]
        assert all(torch.equal(a, b) for a, b in zip(alone, rows))


def test_token_budget_defaults_by_device_and_rejects_nonsense():
    """A CPU step of 512 tokens prefills about as fast as a bigger one and ends sooner."""
    from flowyard.engine.engine_config import EngineConfig, default_token_budget
    from flowyard.engine.llm_engine import LLMEngine

    assert default_token_budget("cpu") == 512 and default_token_budget("cuda") == 2048
    e = LLMEngine.from_path(None, EngineConfig())
    assert e.scheduler.config.max_num_batched_tokens == 512
    e = LLMEngine.from_path(None, EngineConfig(max_num_batched_tokens=100))
    assert e.scheduler.config.max_num_batched_tokens == 100
    with pytest.raises(ValueError, match="max_num_batched_tokens must be at least 1, got 0"):
        EngineConfig(max_num_batched_tokens=0)
