"""Attention over a paged KV cache, in plain PyTorch (SDPA underneath).

The cache of one layer is a tensor (2, num_blocks, block_size, kv_heads, head_dim); a token
at position p of a sequence lives in block block_table[p // block_size], slot p % block_size.
New keys/values are scattered into their slots first; attention then reads each sequence's
context through its block table. Prefill slices run one SDPA call each (fresh prompts use the
just-computed K/V directly, adjacent ones of equal length batched in one call). Decodes read
their blocks in place by default (`paged` mode: the C kernel in paged_kernel.py, one pass over
the KV bytes). The gather modes copy all decodes' blocks with one gather per layer and run
batched SDPA calls over it: one call in `grouped` mode (also paged's fallback where the kernel
cannot run), one per group of sequences that round alike in `exact` mode, which is bitwise what
transformers computes (see DecodeGather).

Decode cost on a small CPU is dominated by fixed per-call overheads, so everything that does
not depend on the layer (the flat gather index, the additive padding mask, the grouping, the
gather buffer) is built once per step by the first layer and reused by the others."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from flowyard.engine.paged_kernel import paged_decode, raw


@dataclass(slots=True)
class PrefillSeq:
    """Rows [row, row + n) of the flat batch are positions [start, start + n) of a sequence."""

    row: int
    n: int
    start: int
    block_table: torch.Tensor  # (blocks,) long


@dataclass(slots=True)
class DecodeGather:
    """Per-step decode attention plan, built by the first layer and reused by the others.

    index: rows of the layer cache viewed as (2 * num_blocks, block_size * kv_heads *
    head_dim): the K blocks of every sequence (in `order`), then the same blocks' V, so one
    `index_select` (a row memcpy) reads a whole layer; advanced indexing on the block
    dimension was several times slower. buf: that gather's destination, reused by all layers.
    groups: (first row, end row, keys) of each SDPA call, rows in `order`; mask: additive
    (0 / -inf) padding mask in the query dtype over the sorted rows, None when no group
    needs one. order: decode rows sorted by group, None when already in order.

    Why groups: CPU SDPA sums a row's softmax denominator SOFTMAX_LANES (16 with AVX-512)
    at a time with a fast exp, then the tail of `keys % 16` scores one by one with std::exp.
    Padding a sequence to a longer batch moves its tail into the vector part and changes its
    rounding, so `exact` batches only sequences whose contexts share `len // 16` (bfloat16,
    checked bitwise in tests/test_engine_speed_paths.py; in float32 the GEMMs depend on the
    length as well, so only equal lengths share a call).
    """

    index: torch.Tensor
    groups: list[tuple[int, int, int]]
    mask: torch.Tensor | None
    order: torch.Tensor | None
    buf: torch.Tensor | None = None


def _softmax_lanes() -> int:
    """float32 lanes of the CPU SDPA kernel's vector loop (see DecodeGather); 1 if unknown."""
    return {"AVX512": 16, "AVX2": 8}.get(torch.backends.cpu.get_cpu_capability(), 1)


SOFTMAX_LANES = _softmax_lanes()


def plan_decode(tables: torch.Tensor, lens: torch.Tensor, num_blocks: int, dtype: torch.dtype,
                exact: bool) -> DecodeGather:
    """Build the step's DecodeGather (see there) from padded block tables and context lengths."""
    lens_l = lens.tolist()
    n = len(lens_l)
    if not exact:
        keys = [0] * n
    elif dtype == torch.bfloat16:
        keys = [c // SOFTMAX_LANES for c in lens_l]
    else:
        keys = lens_l
    rows = sorted(range(n), key=keys.__getitem__)
    order = None
    if rows != list(range(n)):
        order = torch.tensor(rows)
        tables = tables[order]
        lens_l, keys = [lens_l[r] for r in rows], [keys[r] for r in rows]
    groups, start = [], 0
    for i in range(1, n + 1):
        if i == n or keys[i] != keys[start]:
            groups.append((start, i, max(lens_l[start:i])))
            start = i
    flat = tables.flatten()
    index = torch.cat([flat, flat + num_blocks])
    mask = None
    if any(min(lens_l[lo:hi]) < width for lo, hi, width in groups):
        keep = torch.arange(max(lens_l)).unsqueeze(0) < torch.tensor(lens_l).unsqueeze(1)
        mask = torch.zeros(keep.shape, dtype=dtype).masked_fill_(~keep, float("-inf")).view(n, 1, 1, -1)
    return DecodeGather(index, groups, mask, order)


@dataclass(slots=True)
class AttentionBatch:
    slot_mapping: torch.Tensor  # (T,) flat cache slot of every new token
    sample_rows: torch.Tensor  # rows whose logits are needed
    prefills: list[PrefillSeq] = field(default_factory=list)
    num_prefill_tokens: int = 0
    decode_block_tables: torch.Tensor | None = None  # (B, max_blocks) long, padded with 0
    decode_ctx_lens: torch.Tensor | None = None  # (B,) tokens in context incl. the new one
    decode_mask: torch.Tensor | None = None  # unused since DecodeGather; kept for callers
    grouped_decode: bool = False  # see paged_attention
    paged_decode: bool = False  # decodes read their blocks in place (paged_kernel), the default
    decode_gather: DecodeGather | None = None  # built by the first layer, see DecodeGather

    def finalize(self, block_size: int) -> None:
        """Kept for callers that build batches by hand: the per-step decode state is now
        built lazily by the first layer (`gather_plan`), which knows the cache's shape."""

    def gather_plan(self, cache: torch.Tensor, dtype: torch.dtype) -> DecodeGather:
        """The step's DecodeGather for a layer cache shaped like `cache` (built once)."""
        if self.decode_gather is None:
            tables, lens = self.decode_block_tables, self.decode_ctx_lens
            assert tables is not None and lens is not None, "a decode plan for a batch without decodes"
            self.decode_gather = plan_decode(tables, lens, cache.shape[1],
                                             dtype, exact=not (self.grouped_decode or self.paged_decode))
        return self.decode_gather


def write_kv(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Scatter this step's keys/values (T, kv_heads, head_dim) into their cache slots."""
    flat = raw(cache).view(2, -1, *cache.shape[-2:])
    flat[0].index_copy_(0, slots, raw(k.to(cache.dtype)))
    flat[1].index_copy_(0, slots, raw(v.to(cache.dtype)))


def _gather(cache_kv: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """(length, kv_heads, head_dim) of one sequence's K or V, read through its block table."""
    return raw(cache_kv)[table].flatten(0, 1)[:length].view(cache_kv.dtype)


def gather_decode_kv(cache: torch.Tensor, plan: DecodeGather) -> torch.Tensor:
    """(2, B, kv_heads, max_blocks * block_size, head_dim) K/V of all decodes (rows in the
    plan's order): a strided view of one flat gather. SDPA's CPU kernel reads K/V through
    strides (it works on the (B, L, heads, D) layout itself), so the view costs no copy."""
    rows = raw(cache).view(2 * cache.shape[1], -1)
    if plan.buf is None:
        plan.buf = rows.index_select(0, plan.index)
    else:
        torch.index_select(rows, 0, plan.index, out=plan.buf)
    b = plan.groups[-1][1]
    return plan.buf.view(cache.dtype).view(2, b, -1, cache.shape[-2], cache.shape[-1]).transpose(2, 3)


def decode_attention(q: torch.Tensor, cache: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
    """q: (B, heads, head_dim) of the decode rows. Returns (B, heads, head_dim)."""
    b, h, hd = q.shape
    if batch.paged_decode and paged_decode.supports(q, cache):
        kvh = cache.shape[-2]
        tables, lens = batch.decode_block_tables, batch.decode_ctx_lens
        assert tables is not None and lens is not None, "decode attention for a batch without decodes"
        o = paged_decode(q.view(b, kvh, h // kvh, hd), cache[0], cache[1], tables, lens)
        return o.view(b, h, hd)
    plan = batch.gather_plan(cache, q.dtype)  # the gather path (also paged's fallback)
    kv = gather_decode_kv(cache, plan).to(q.dtype)
    if plan.order is not None:
        q = q.index_select(0, plan.order)
    if batch.grouped_decode or batch.paged_decode:
        # The query heads sharing a KV head ride together as that head's query rows: several
        # times faster on CPU, but the kernel then rounds some outputs 1 ulp differently from
        # one-row-per-head SDPA (what transformers runs).
        kvh = kv.shape[2]
        width = plan.groups[0][2]
        o = F.scaled_dot_product_attention(q.view(b, kvh, -1, hd), kv[0, :, :, :width], kv[1, :, :, :width],
                                           attn_mask=plan.mask)
        return o.reshape(b, h, hd)
    # (B, H, 1, D) with enable_gqa: bitwise what transformers computes for each sequence alone.
    q = q.unsqueeze(2)
    parts = []
    for lo, hi, width in plan.groups:
        mask = None if plan.mask is None else plan.mask[lo:hi, :, :, :width]
        parts.append(F.scaled_dot_product_attention(q[lo:hi], kv[0, lo:hi, :, :width], kv[1, lo:hi, :, :width],
                                                    attn_mask=mask, enable_gqa=True))
    o = parts[0] if len(parts) == 1 else torch.cat(parts)
    o = o.view(b, h, hd)
    if plan.order is not None:
        o = torch.empty_like(o).index_copy_(0, plan.order, o)
    return o


def _prefill_runs(prefills: list[PrefillSeq]) -> list[tuple[PrefillSeq, int]]:
    """(first, count): consecutive fresh prompts of equal length, adjacent in the batch, which
    one SDPA call can take as a batch. SDPA's CPU kernel splits work by the query and key
    lengths only, so each prompt's result is the same bits as in a call of its own."""
    runs: list[tuple[PrefillSeq, int]] = []
    for s in prefills:
        if runs and s.start == 0:
            first, count = runs[-1]
            if first.start == 0 and first.n == s.n and first.row + count * first.n == s.row:
                runs[-1] = (first, count + 1)
                continue
        runs.append((s, 1))
    return runs


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, batch: AttentionBatch
) -> torch.Tensor:
    """q: (T, heads, head_dim); k, v: this step's (T, kv_heads, head_dim). Returns (T, heads, hd)."""
    out = torch.empty_like(q) if batch.prefills else None
    for s, count in _prefill_runs(batch.prefills):
        rows = slice(s.row, s.row + count * s.n)
        qs = q[rows].view(count, s.n, *q.shape[1:]).transpose(1, 2)  # (count, H, n, D)
        if s.start == 0:
            ks, vs = k[rows].view(count, s.n, *k.shape[1:]), v[rows].view(count, s.n, *v.shape[1:])
            mask, causal = None, True
        else:
            ctx = s.start + s.n
            ks, vs = _gather(cache[0], s.block_table, ctx)[None], _gather(cache[1], s.block_table, ctx)[None]
            qpos = torch.arange(s.start, ctx).unsqueeze(1)
            mask, causal = torch.arange(ctx).unsqueeze(0) <= qpos, False
        o = F.scaled_dot_product_attention(
            qs, ks.transpose(1, 2).to(q.dtype), vs.transpose(1, 2).to(q.dtype),
            attn_mask=mask, is_causal=causal, enable_gqa=True,
        )
        assert out is not None  # made above: there are prefills
        out[rows] = o.transpose(1, 2).reshape(-1, *q.shape[1:])
    if batch.decode_block_tables is not None:
        start = batch.num_prefill_tokens
        o = decode_attention(q[start:], cache, batch)
        if out is None:
            return o
        out[start:] = o
    assert out is not None, "an attention batch with neither prefills nor decodes"
    return out
