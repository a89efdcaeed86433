"""Llama/Qwen2-family decoder whose forward pass is a sequence of operator steps.

`CausalLM.forward_steps` is a generator: it yields after every operator (qkv_proj, attn,
o_proj, gate_up_proj, down_proj) of every layer and finally returns the logits of the rows
that sample. A caller may stop pulling between any two operators and resume later; all
intermediate state lives in the generator's frame, so nothing is recomputed. That one shape
gives FlowPrefill its preemption points, `flowyard profile` its per-operator timings, and the
simulator a cost model with the same operator names.
"""

from __future__ import annotations

from typing import Generator

import torch
import torch.nn.functional as F
from torch import nn

from flowyard.engine.attention import AttentionBatch, paged_attention, write_kv
from flowyard.engine.config import ModelConfig

LAYER_OPS = ("qkv_proj", "attn", "o_proj", "gate_up_proj", "down_proj")


class RotaryEmbedding(nn.Module):
    """Hugging Face's non-interleaved RoPE (rotate_half), with a precomputed cos/sin table."""

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, cfg.rope_inv_freq().float())
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows for this step's positions, in the model dtype (once per forward)."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: (tokens, heads, head_dim)."""
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin


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

    # -- weights -----------------------------------------------------------------------
    @torch.no_grad()
    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Load Hugging Face-named tensors, fusing q/k/v and gate/up. Consumes `weights`
        (pops each tensor) so the caller's copy can be freed as we go."""
        take = weights.pop
        self.embed.weight.copy_(take("model.embed_tokens.weight"))
        for i, layer in enumerate(self.layers):
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
        so bfloat16 runs round exactly as transformers does."""
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), w, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return w * xf.to(x.dtype)

    def forward_steps(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBatch,
        kv_cache: torch.Tensor,
    ) -> Generator[tuple[int, str], None, torch.Tensor]:
        """Run the decoder one operator at a time, yielding (layer, op) after each.

        input_ids/positions: (T,) for the whole flattened batch; kv_cache: (layers, 2,
        blocks, block_size, kv_heads, head_dim). Returns logits for attn.sample_rows.
        """
        cfg = self.cfg
        nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h = self.embed(input_ids)
        residual = h
        cos, sin = self.rope.tables(positions, h.dtype)
        for i, layer in enumerate(self.layers):
            x = self._rms(residual, layer.input_norm)
            qkv = layer.qkv(x)
            # RoPE on q and k in one go: they are adjacent heads of the fused projection.
            qk = self.rope.apply(qkv[:, : layer.q_size + layer.kv_size].view(-1, nh + nkv, hd), cos, sin)
            q, k = qk[:, :nh], qk[:, nh:]
            v = qkv[:, layer.q_size + layer.kv_size:].view(-1, nkv, hd)
            yield i, "qkv_proj"
            write_kv(kv_cache[i], k, v, attn.slot_mapping)
            o = paged_attention(q, k, v, kv_cache[i], attn)
            yield i, "attn"
            residual = residual + layer.o_proj(o.reshape(-1, nh * hd))
            yield i, "o_proj"
            gate, up = layer.gate_up(self._rms(residual, layer.post_norm)).chunk(2, dim=-1)
            act = F.silu(gate) * up
            yield i, "gate_up_proj"
            residual = residual + layer.down(act)
            yield i, "down_proj"
        last = self._rms(residual[attn.sample_rows], self.norm)
        weight = self.embed.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(last, weight).float()

    @torch.inference_mode()
    def forward(self, input_ids, positions, attn, kv_cache) -> torch.Tensor:
        """Run all operators to the end (no preemption)."""
        gen = self.forward_steps(input_ids, positions, attn, kv_cache)
        while True:
            try:
                next(gen)
            except StopIteration as stop:
                return stop.value
