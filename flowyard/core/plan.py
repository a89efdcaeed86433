"""What one instance runs in one step, as plain data (vLLM v1's SchedulerOutput contract).

A local scheduler returns a `StepPlan`; an executor (simulated or real) runs it and hands a
`StepOutput` back to `update_from_output`. Neither side looks inside the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from flowyard.core.request import RequestState


@dataclass(slots=True)
class PrefillSlice:
    """Compute KV for tokens [start, start + n) of a sequence whose first `start` tokens
    (the history: earlier chunks, a cached prefix, or a transferred segment) are already in KV."""

    state: RequestState
    start: int
    n: int

    @property
    def samples(self) -> bool:
        """Whether this slice reaches the end of the known sequence and so yields a token."""
        return self.start + self.n >= self.state.seq_len


@dataclass(slots=True)
class BatchShape:
    """The numbers a cost model needs about one step, with no reference to requests.

    Fields may be numpy arrays (one entry per step of a repeated decode run); cost models
    evaluate them element-wise.
      prefill_tokens  sum of n_i over prefill slices
      prefill_seqs    number of prefill slices
      prefill_attn    causal query-key pairs, sum of n_i * (h_i + (n_i + 1) / 2)
      prefill_kv      KV tokens prefill attention reads, sum of (h_i + n_i)
      decode_seqs     number of decode tokens (one per sequence)
      decode_ctx      KV tokens decode attention reads, sum of context lengths incl. the new token
    """

    prefill_tokens: float | np.ndarray = 0
    prefill_seqs: int = 0
    prefill_attn: float = 0.0
    prefill_kv: float = 0
    decode_seqs: int | np.ndarray = 0
    decode_ctx: float | np.ndarray = 0
    graphed: bool = False  # replayed as a captured graph: per-kernel launch costs mostly vanish

    @property
    def tokens(self) -> float | np.ndarray:
        return self.prefill_tokens + self.decode_seqs

    @classmethod
    def of(cls, prefills: list[tuple[int, int]], decode_ctxs: list[int]) -> "BatchShape":
        """Build from (history, n) pairs for prefill slices and context lengths for decodes."""
        if not prefills and not decode_ctxs:  # a decode-only step's prefill part: the zeros below
            return cls()
        return cls(
            prefill_tokens=sum(n for _, n in prefills),
            prefill_seqs=len(prefills),
            prefill_attn=float(sum(n * (h + (n + 1) / 2) for h, n in prefills)),
            prefill_kv=sum(h + n for h, n in prefills),
            decode_seqs=len(decode_ctxs),
            decode_ctx=sum(decode_ctxs),
        )

    @classmethod
    def chunk(cls, history: int, n: int, decode_seqs: int = 0, decode_ctx: float = 0.0) -> "BatchShape":
        """One prompt's n tokens after `history` computed (none when n is 0), beside decode_seqs
        decodes whose contexts sum to decode_ctx: the step a budget search prices."""
        return cls(prefill_tokens=n, prefill_seqs=1 if n else 0, prefill_attn=n * (history + (n + 1) / 2),
                   prefill_kv=history + n if n else 0, decode_seqs=decode_seqs, decode_ctx=decode_ctx)


@dataclass(slots=True)
class StepPlan:
    """One step on one instance: prefill slices and decode tokens, run together.

    max_repeats > 1 is the scheduler's promise that, if no event reaches the instance, it
    would schedule the same decode-only batch (each context one token longer) that many
    times; KV for all of them is already reserved. An executor may run fewer steps.

    graph = (L, B) asks the executor to pad the prefills to a captured shape (PLA-Serve's
    short-prefill buckets) and replay its graph; executors without graphs run it eagerly.

    preempt_stride > 0 makes the step preemptible (FlowPrefill): the executor may suspend it
    after any operator whose 1-based index is a multiple of the stride (1: every operator
    boundary, 5: every layer) and later resume it. ops_done counts the operators already
    executed, so a resumed plan continues where it stopped instead of starting over.
    """

    prefills: list[PrefillSlice] = field(default_factory=list)
    decodes: list[RequestState] = field(default_factory=list)
    max_repeats: int = 1
    preempt_stride: int = 0
    ops_done: int = 0
    graph: tuple[int, int] | None = None  # (L, B): prefills padded to a captured graph shape

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes

    @property
    def num_tokens(self) -> int:
        return sum(s.n for s in self.prefills) + len(self.decodes)

    def shape(self, repeats: int = 1) -> BatchShape:
        """Batch shape of this step; with repeats > 1, decode_ctx is an array over the run."""
        if self.graph is not None:  # every row padded to L, and B - n padding rows
            length, depth = self.graph
            pre = [(s.start, length) for s in self.prefills] + [(0, length)] * (depth - len(self.prefills))
        else:
            pre = [(s.start, s.n) for s in self.prefills]
        shape = BatchShape.of(pre, [])
        shape.graphed = self.graph is not None
        nd = len(self.decodes)
        ctx0 = sum(d.num_computed + 1 for d in self.decodes)
        shape.decode_seqs = nd
        shape.decode_ctx = ctx0 if repeats == 1 else ctx0 + nd * np.arange(repeats, dtype=float)
        return shape


@dataclass(slots=True)
class StepOutput:
    """What running a plan produced: the end time of each step actually executed and, on the
    real engine, the token ids sampled per request id (one per step for decodes) and the ids
    that hit EOS or a stop string (the simulator stops requests at their trace length)."""

    end_times: np.ndarray
    sampled: dict[int, list[int]] | None = None
    stopped: frozenset[int] = frozenset()

    @property
    def steps(self) -> int:
        return len(self.end_times)
