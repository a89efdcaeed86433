"""Llama/Qwen2-family decoder whose forward pass is a sequence of operator steps.

`CausalLM.forward_steps` is a generator: it yields after every operator (qkv_proj, attn,
o_proj, gate_up_proj, down_proj) of every layer and finally returns the logits of the rows
that sample. A caller may stop pulling between any two operators and resume later; all
intermediate state lives in the generator's frame, so nothing is recomputed. That one shape
gives FlowPrefill its preemption points, `flowyard profile` its per-operator timings, and the
simulator a cost model with the same operator names.
"""

from __future__ import annotations

import functools
import os
from typing import Generator, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from flowyard.engine.attention import AttentionBatch, paged_attention, write_kv
from flowyard.engine.config import ModelConfig
from flowyard.core.padding import RowPadding
from flowyard.engine import skinny_gemm
from flowyard.engine.gemv_kernel import gemv_bf16

LAYER_OPS = ("qkv_proj", "attn", "o_proj", "gate_up_proj", "down_proj")
PER_ROW_DOWN_MAX = 4  # decode batches up to this size get per-row down_proj GEMMs (see _down)


def _mkldnn_bf16() -> bool:
    try:
        return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


# GEMMs with at least this many rows may run in float32 (see large_gemm_f32).
F32_MIN_ROWS = 128


@functools.cache
def large_gemm_f32() -> bool:
    """Whether this CPU multiplies large bfloat16 GEMMs faster by widening both sides to
    float32 (MKL) than with oneDNN's bfloat16 kernel. Without AMX, Sapphire Rapids runs
    oneDNN bf16 at about 165 GFLOP/s and MKL fp32 at 300 (the bf16 dot-product instruction
    has no more throughput there than an fp32 FMA), so a 256-token prefill's linears cost
    1.5x less in float32 even with the weights widened on every call; a Zen 4 or an AMX
    part is the other way round. Measured once per process on a prefill-sized GEMM, best of
    three each way, since flags alone do not tell. FLOWYARD_LARGE_GEMM=bf16|f32 decides
    instead. Accumulation is float32 either way; only the summation order differs."""
    forced = os.environ.get("FLOWYARD_LARGE_GEMM", "auto")
    if forced not in ("auto", "bf16", "f32"):
        raise ValueError(f"FLOWYARD_LARGE_GEMM must be auto, bf16 or f32, got {forced!r}")
    if forced != "auto" or not PackedLinear.available:
        return forced == "f32"
    x, w = torch.randn(256, 576).bfloat16(), torch.randn(1536, 576).bfloat16()
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 32)
    bf16 = skinny_gemm.best_seconds(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))
    f32 = skinny_gemm.best_seconds(lambda: F.linear(x.float(), w.float()).bfloat16())
    return f32 < 0.8 * bf16


class PackedLinear:
    """F.linear with oneDNN-blocked copies of bfloat16 weights, made once and reused.

    F.linear hands oneDNN a plain (N, K) weight, which it re-blocks on every call: about a
    quarter of the CPU time of a 32-row decode's matmuls and over a third of a one-row one
    (measured on the 2-core Zen 4 VM). `mkldnn._linear_pointwise` on a weight reordered once
    runs the same kernels on the same blocking, so the bits are the same (checked for 1 to
    2,048 rows in tests/test_engine_speed_paths.py); the price is a second copy of the
    weights (about 270 MB for SmolLM2 in bfloat16). float32 is left alone: its F.linear goes
    through MKL, which rounds differently from oneDNN. An entry is used only for the very
    weight tensor it was made from, at the same version (in-place loads bump it).
    With `large_f32` (the engine sets it where `large_gemm_f32()` measured it faster),
    calls of F32_MIN_ROWS rows or more widen input and weight to float32 instead.
    With `small_gemv` (the engine sets it where the kernel compiled, except in `exact` mode),
    bfloat16 calls the gemv_bf16 C kernel supports (1 to 4 rows) go to it
    (flowyard/engine/gemv_kernel.py), which streams the weight at close to memory bandwidth
    where oneDNN reaches about half of it; it rounds once from float32, not bit-equal to oneDNN.
    """

    available = _mkldnn_bf16()

    def __init__(self) -> None:
        self._cache: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}  # id -> (weight, version, packed)
        # Set by the engine (not in `exact` mode): GEMMs of F32_MIN_ROWS+ rows run in float32.
        self.large_f32 = False
        # Set by the engine (not in `exact` mode): bf16 calls of 1..4 rows use gemv_bf16.
        self.small_gemv = False
        # Set by the engine (not in `exact` mode): float32 calls of a few rows run as W @ x^T
        # where that measured faster (engine/skinny_gemm.py).
        self.skinny_mm = False
        # Set by the engine with skinny_mm: the rows those products are padded to, if any.
        self.row_padding: RowPadding | None = None

    def clear(self) -> None:
        self._cache.clear()

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.small_gemv and gemv_bf16.supports(x, weight, bias):
            return gemv_bf16(x, weight, bias)
        if self.skinny_mm and skinny_gemm.supports(x, weight):
            return skinny_gemm.linear(x, weight, bias, self.row_padding)
        if weight.dtype != torch.bfloat16 or not self.available or x.requires_grad or x.dim() != 2:
            return F.linear(x, weight, bias)
        if self.large_f32 and x.shape[0] >= F32_MIN_ROWS:
            return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).bfloat16()
        version = -1 if weight.is_inference() else weight._version  # inference tensors keep none
        hit = self._cache.get(id(weight))
        if hit is None or hit[0] is not weight or hit[1] != version:
            hit = (weight, version, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 32))
            self._cache[id(weight)] = hit
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), hit[2], bias, "none", [], "")


class RotaryEmbedding(nn.Module):
    """Hugging Face's non-interleaved RoPE (rotate_half), with a precomputed cos/sin table.

    The sin table is stored with its first half negated, so that rotate_half's negation
    rides in the table: x2 * -sin == -x2 * sin bit for bit (IEEE rounding is sign-symmetric),
    one elementwise kernel fewer per layer than `cat((-x2, x1)) * sin`.
    """

    cos: torch.Tensor  # buffers (register_buffer), typed for the checker
    sin: torch.Tensor

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, cfg.rope_inv_freq().float())
        emb = torch.cat([freqs, freqs], dim=-1)
        half = emb.shape[-1] // 2
        sin = emb.sin()
        sin[:, :half].neg_()
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/signed-sin rows for this step's positions, in the model dtype (once per forward)."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: (tokens, heads, head_dim); sin as returned by `tables` (first half negated)."""
        half = x.shape[-1] // 2
        swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
        return (x * cos).add_(swapped.mul_(sin))


class DecoderLayer(nn.Module):
    """Weights of one layer, fused the vLLM way: one qkv matmul, one gate+up matmul."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * d, cfg.num_kv_heads * d
        self.input_norm = nn.Parameter(torch.ones(h))
        self.qkv = nn.Linear(h, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, h, bias=cfg.o_proj_bias)
        self.post_norm = nn.Parameter(torch.ones(h))
        self.gate_up = nn.Linear(h, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, h, bias=False)


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope = RotaryEmbedding(cfg, max_positions or cfg.max_position_embeddings)
        self.eps = cfg.rms_norm_eps
        self.linear = PackedLinear()

    def _apply(self, fn, recurse: bool = True):  # .to() / .float() replace the weights
        self.linear.clear()
        return super()._apply(fn, recurse)

    def decoder_layers(self) -> Iterator[DecoderLayer]:
        """`layers` with their type (an nn.ModuleList yields plain Modules)."""
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            yield layer

    # -- weights -----------------------------------------------------------------------
    @torch.no_grad()
    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Load Hugging Face-named tensors, fusing q/k/v and gate/up. Consumes `weights`
        (pops each tensor) so the caller's copy can be freed as we go."""
        self.linear.clear()
        take = weights.pop
        self.embed.weight.copy_(take("model.embed_tokens.weight"))
        for i, layer in enumerate(self.decoder_layers()):
            p = f"model.layers.{i}."
            layer.input_norm.copy_(take(p + "input_layernorm.weight"))
            layer.post_norm.copy_(take(p + "post_attention_layernorm.weight"))
            qkv = [take(p + f"self_attn.{n}_proj.weight") for n in "qkv"]
            layer.qkv.weight.copy_(torch.cat(qkv, 0))
            if layer.qkv.bias is not None:
                layer.qkv.bias.copy_(torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"], 0))
            layer.o_proj.weight.copy_(take(p + "self_attn.o_proj.weight"))
            if layer.o_proj.bias is not None:
                layer.o_proj.bias.copy_(take(p + "self_attn.o_proj.bias"))
            gate_up = [take(p + f"mlp.{n}_proj.weight") for n in ("gate", "up")]
            layer.gate_up.weight.copy_(torch.cat(gate_up, 0))
            layer.down.weight.copy_(take(p + "mlp.down_proj.weight"))
        self.norm.copy_(take("model.norm.weight"))
        if self.lm_head is not None:
            self.lm_head.weight.copy_(take("lm_head.weight"))
        weights.pop("lm_head.weight", None)  # tied: the embedding serves
        if weights:
            raise ValueError(f"unexpected weights: {sorted(weights)[:5]}")

    # -- forward -------------------------------------------------------------------------
    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """RMSNorm computed in float32 and scaled in the model dtype, in Hugging Face's order,
        so bfloat16 runs round exactly as transformers does (in-place where HF allocates)."""
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), w, self.eps)
        xf = x.float()
        scale = xf.pow(2).mean(-1, keepdim=True).add_(self.eps).rsqrt_()
        return xf.mul_(scale).to(x.dtype).mul_(w)

    def _down(self, act: torch.Tensor, weight: torch.Tensor, per_row: bool) -> torch.Tensor:
        """down_proj. oneDNN multiplies a single bfloat16 row (transformers' decode) with
        another kernel than several rows, and for K = intermediate_size that kernel rounds
        about one row in twelve 1 ulp differently; so with per_row each decode row gets its
        own one-row GEMM, which keeps small `exact` batches bit-equal to transformers running
        every sequence alone. At larger batches that would cost a GEMV per row and layer, so
        they use the batched kernel (see benchmarks/results/engine_cpu.md)."""
        if per_row:
            return torch.cat([self.linear(act[r:r + 1], weight) for r in range(act.shape[0])])
        return self.linear(act, weight)

    def forward_steps(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBatch,
        kv_cache: torch.Tensor,
    ) -> Generator[tuple[int, str], None, torch.Tensor]:
        """Run the decoder one operator at a time, yielding (layer, op) after each.

        input_ids/positions: (T,) for the whole flattened batch; kv_cache: (layers, 2,
        blocks, block_size, kv_heads, head_dim). Returns logits for attn.sample_rows.
        Linear layers are called through `self.linear` (PackedLinear), not the modules: that
        skips module dispatch and, in bfloat16, oneDNN's per-call weight re-blocking.
        """
        cfg = self.cfg
        nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        linear = self.linear
        residual = F.embedding(input_ids, self.embed.weight)
        # See _down: a few exact bfloat16 decodes get transformers' one-row GEMM each.
        per_row = (not attn.grouped_decode and not attn.paged_decode and not attn.num_prefill_tokens and residual.dtype == torch.bfloat16
                   and 1 < residual.shape[0] <= PER_ROW_DOWN_MAX)
        cos, sin = self.rope.tables(positions, residual.dtype)
        for i, layer in enumerate(self.decoder_layers()):
            qkv = linear(self._rms(residual, layer.input_norm), layer.qkv.weight, layer.qkv.bias)
            # RoPE on q and k in one go: they are adjacent heads of the fused projection.
            qk = self.rope.rotate(qkv[:, : layer.q_size + layer.kv_size].view(-1, nh + nkv, hd), cos, sin)
            q, k = qk[:, :nh], qk[:, nh:]
            v = qkv[:, layer.q_size + layer.kv_size:].view(-1, nkv, hd)
            yield i, "qkv_proj"
            write_kv(kv_cache[i], k, v, attn.slot_mapping)
            o = paged_attention(q, k, v, kv_cache[i], attn)
            yield i, "attn"
            residual = residual + linear(o.reshape(-1, nh * hd), layer.o_proj.weight, layer.o_proj.bias)
            yield i, "o_proj"
            gate_up = linear(self._rms(residual, layer.post_norm), layer.gate_up.weight)
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.silu(gate).mul_(up)  # contiguous, as the linear wants; the product in place
            yield i, "gate_up_proj"
            residual = residual + self._down(act, layer.down.weight, per_row)
            yield i, "down_proj"
        last = self._rms(residual[attn.sample_rows], self.norm)
        weight = self.embed.weight if self.lm_head is None else self.lm_head.weight
        return linear(last, weight).float()

    @torch.inference_mode()
    def forward(self, input_ids, positions, attn, kv_cache) -> torch.Tensor:
        """Run all operators to the end (no preemption)."""
        gen = self.forward_steps(input_ids, positions, attn, kv_cache)
        while True:
            try:
                next(gen)
            except StopIteration as stop:
                return stop.value
