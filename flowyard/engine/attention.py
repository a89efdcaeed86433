"""Attention over a paged KV cache, in plain PyTorch (SDPA underneath).

The cache of one layer is a tensor (2, num_blocks, block_size, kv_heads, head_dim); a token
at position p of a sequence lives in block block_table[p // block_size], slot p % block_size.
New keys/values are scattered into their slots first; attention then reads each sequence's
context through its block table. Prefill slices run one SDPA call each (fresh prompts use the
just-computed K/V directly); all decodes run as one batched SDPA call over gathered blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillSeq:
    """Rows [row, row + n) of the flat batch are positions [start, start + n) of a sequence."""

    row: int
    n: int
    start: int
    block_table: torch.Tensor  # (blocks,) long


@dataclass(slots=True)
class AttentionBatch:
    slot_mapping: torch.Tensor  # (T,) flat cache slot of every new token
    sample_rows: torch.Tensor  # rows whose logits are needed
    prefills: list[PrefillSeq] = field(default_factory=list)
    num_prefill_tokens: int = 0
    decode_block_tables: torch.Tensor | None = None  # (B, max_blocks) long, padded with 0
    decode_ctx_lens: torch.Tensor | None = None  # (B,) tokens in context incl. the new one
    decode_mask: torch.Tensor | None = None  # (B, 1, 1, max_blocks * block_size) bool
    grouped_decode: bool = False  # see paged_attention

    def finalize(self, block_size: int) -> None:
        """Precompute what every layer would otherwise rebuild (the decode padding mask)."""
        if self.decode_block_tables is not None and self.decode_mask is None:
            b, width = self.decode_block_tables.shape
            keys = torch.arange(width * block_size)
            self.decode_mask = (keys.unsqueeze(0) < self.decode_ctx_lens.unsqueeze(1)).view(b, 1, 1, -1)


def write_kv(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Scatter this step's keys/values (T, kv_heads, head_dim) into their cache slots."""
    flat = cache.view(2, -1, *cache.shape[-2:])
    flat[0].index_copy_(0, slots, k.to(cache.dtype))
    flat[1].index_copy_(0, slots, v.to(cache.dtype))


def _gather(cache_kv: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """(length, kv_heads, head_dim) of one sequence's K or V, read through its block table."""
    return cache_kv[table].flatten(0, 1)[:length]


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, batch: AttentionBatch
) -> torch.Tensor:
    """q: (T, heads, head_dim); k, v: this step's (T, kv_heads, head_dim). Returns (T, heads, hd)."""
    out = torch.empty_like(q) if batch.prefills else None
    for s in batch.prefills:
        rows = slice(s.row, s.row + s.n)
        qs = q[rows].transpose(0, 1).unsqueeze(0)  # (1, H, n, D)
        if s.start == 0:
            ks, vs = k[rows], v[rows]
            mask, causal = None, True
        else:
            ctx = s.start + s.n
            ks, vs = _gather(cache[0], s.block_table, ctx), _gather(cache[1], s.block_table, ctx)
            qpos = torch.arange(s.start, ctx).unsqueeze(1)
            mask, causal = torch.arange(ctx).unsqueeze(0) <= qpos, False
        o = F.scaled_dot_product_attention(
            qs, ks.transpose(0, 1).unsqueeze(0).to(q.dtype), vs.transpose(0, 1).unsqueeze(0).to(q.dtype),
            attn_mask=mask, is_causal=causal, enable_gqa=True,
        )
        out[rows] = o.squeeze(0).transpose(0, 1)
    if batch.decode_block_tables is not None:
        # All decodes in one SDPA call over their gathered blocks (padding masked out).
        start = batch.num_prefill_tokens
        tables = batch.decode_block_tables
        b, kvh, hd = tables.shape[0], cache.shape[-2], cache.shape[-1]
        kv = cache[:, tables].flatten(2, 3).transpose(2, 3).to(q.dtype)  # (2, B, kvH, L, D)
        if batch.grouped_decode:
            # The query heads sharing a KV head ride together as that head's query rows:
            # several times faster on CPU, but the kernel then rounds some outputs 1 ulp
            # differently from one-row-per-head SDPA (what transformers runs).
            qd = q[start:].view(b, kvh, -1, hd)
            o = F.scaled_dot_product_attention(qd, kv[0], kv[1], attn_mask=batch.decode_mask)
        else:
            qd = q[start:].unsqueeze(2)  # (B, H, 1, D): bitwise what transformers computes
            o = F.scaled_dot_product_attention(qd, kv[0], kv[1], attn_mask=batch.decode_mask,
                                               enable_gqa=True)
        if out is None:
            return o.reshape(b, -1, hd)
        out[start:] = o.reshape(b, -1, hd)
    return out
