"""Runs one `StepPlan` on the model: flattens it into a token batch, reads block tables from
the shared KV manager, runs the operator-step forward pass and samples."""

from __future__ import annotations

from typing import Generator

import torch

from flowyard.core.kvcache import KVCacheManager
from flowyard.core.plan import StepPlan
from flowyard.core.request import RequestState
from flowyard.engine.attention import AttentionBatch, PrefillSeq
from flowyard.engine.model import CausalLM
from flowyard.engine.paged_kernel import paged_decode as paged_kernel


def seq_tokens(st: RequestState, start: int, n: int) -> list[int]:
    """Tokens [start, start + n) of prompt + outputs, without copying the whole sequence."""
    prompt = st.req.prompt_tokens or ()
    p = len(prompt)
    if start + n <= p:
        return list(prompt[start:start + n])
    head = list(prompt[start:p]) if start < p else []
    return head + st.output_tokens[max(0, start - p):start + n - p]


class ModelRunner:
    def __init__(self, model: CausalLM, kv: KVCacheManager, dtype: torch.dtype,
                 grouped_decode: bool = False, paged_decode: bool = False) -> None:
        """dtype: the KV cache's (the model's, or float8 for an fp8 cache)."""
        cfg = model.cfg
        self.model = model
        self.kv = kv
        self.bs = kv.block_size
        self.grouped_decode = grouped_decode
        self.paged_decode = paged_decode
        if paged_decode:  # build/load the kernel now, not inside the first request's decode step
            qdtype = next(model.parameters()).dtype
            paged_kernel.supports(torch.empty(1, 1, 1, cfg.head_dim, dtype=qdtype), torch.empty(1, dtype=dtype))
        self.kv_cache = torch.zeros(
            cfg.num_layers, 2, kv.num_blocks, kv.block_size, cfg.num_kv_heads, cfg.head_dim, dtype=dtype
        )

    def _slots(self, table: list[int], start: int, n: int) -> list[int]:
        bs = self.bs
        return [table[p // bs] * bs + p % bs for p in range(start, start + n)]

    def prepare(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch, list[RequestState]]:
        """Flatten the plan: prefill slices first, then decodes. Returns the rows that sample
        in the order of the returned states."""
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        samplers: list[RequestState] = []
        prefills: list[PrefillSeq] = []
        for s in plan.prefills:
            table = self.kv.block_table(s.state.id)
            row = len(ids)
            ids += seq_tokens(s.state, s.start, s.n)
            pos += range(s.start, s.start + s.n)
            slots += self._slots(table, s.start, s.n)
            nblocks = -(-(s.start + s.n) // self.bs)
            prefills.append(PrefillSeq(row, s.n, s.start, torch.tensor(table[:nblocks], dtype=torch.long)))
            if s.samples:
                sample_rows.append(row + s.n - 1)
                samplers.append(s.state)
        num_prefill = len(ids)
        batch = AttentionBatch(slot_mapping=torch.empty(0), sample_rows=torch.empty(0),
                               prefills=prefills, num_prefill_tokens=num_prefill,
                               grouped_decode=self.grouped_decode, paged_decode=self.paged_decode)
        if plan.decodes:
            tables, lens = [], []
            for d in plan.decodes:
                table = self.kv.block_table(d.id)
                p = d.num_computed
                sample_rows.append(len(ids))
                samplers.append(d)
                if d.output_tokens:
                    ids.append(d.output_tokens[-1])
                else:
                    prompt = d.req.prompt_tokens
                    assert prompt is not None, f"request {d.req.id} reached the engine without token ids"
                    ids.append(prompt[-1])
                pos.append(p)
                slots.append(table[p // self.bs] * self.bs + p % self.bs)
                tables.append(table[: p // self.bs + 1])
                lens.append(p + 1)
            width = max(len(t) for t in tables)
            batch.decode_block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
            batch.decode_ctx_lens = torch.tensor(lens, dtype=torch.long)
        batch.finalize(self.bs)
        batch.slot_mapping = torch.tensor(slots, dtype=torch.long)
        batch.sample_rows = torch.tensor(sample_rows, dtype=torch.long)
        return torch.tensor(ids, dtype=torch.long), torch.tensor(pos, dtype=torch.long), batch, samplers

    def forward_steps(self, plan: StepPlan) -> tuple[Generator[tuple[int, str], None, torch.Tensor], list[RequestState]]:
        """The plan's forward pass as an operator-step generator (for preemption/profiling)."""
        ids, pos, batch, samplers = self.prepare(plan)
        return self.model.forward_steps(ids, pos, batch, self.kv_cache), samplers

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> tuple[torch.Tensor, list[RequestState]]:
        """Run the plan to the end; logits (rows, vocab) for the states that sample."""
        ids, pos, batch, samplers = self.prepare(plan)
        return self.model(ids, pos, batch, self.kv_cache), samplers

    # -- KV movement between instances (used by the runtime) -------------------------------
    def export_kv(self, blocks: list[int]) -> torch.Tensor:
        return self.kv_cache[:, :, blocks]  # a list index gathers into a new tensor: already a copy

    def import_kv(self, blocks: list[int], data: torch.Tensor) -> None:
        self.kv_cache[:, :, blocks] = data.to(self.kv_cache.dtype)

