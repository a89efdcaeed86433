"""FlowPrefill's configuration and its execution tasks (§5): what `scheduler.FlowPrefillSelector`
submits, suspends and resumes, and the counters it keeps."""

from __future__ import annotations

from dataclasses import dataclass, field

from flowyard.core.plan import StepPlan
from flowyard.core.request import RequestState
from flowyard.costmodel.base import LAYER_OPS
from flowyard.policies.framework.slack import PRIORITIES

GRANULARITY_STRIDE = {"operator": 1, "layer": len(LAYER_OPS), "chunk": 0}


@dataclass(frozen=True, slots=True)
class FlowPrefillConfig:
    """priority: "s-edf" (the paper's), "edf" or "d-edf" (the ablation of Fig. 10).
    batch_token_budget: G of Alg. 1; None batches without a token limit, 0 never batches.
    granularity: where a running task may be suspended: after any operator, after a whole
      layer, or only between steps ("chunk", which is preemption by chunked prefill alone).
    chunk_size: split prompts into chunks of at most this many tokens (§6.5); None runs each
      prompt whole."""

    priority: str = "s-edf"
    batch_token_budget: int | None = 4096
    granularity: str = "operator"
    chunk_size: int | None = None
    max_num_seqs: int = 256

    def __post_init__(self) -> None:
        if self.priority not in PRIORITIES:
            raise ValueError(f"priority must be one of {', '.join(PRIORITIES)}, got {self.priority!r}")
        if self.granularity not in GRANULARITY_STRIDE:
            raise ValueError(f"granularity must be one of {', '.join(GRANULARITY_STRIDE)}, "
                             f"got {self.granularity!r}")
        if self.batch_token_budget is not None and self.batch_token_budget < 0:
            raise ValueError("batch_token_budget must be >= 0 (or None for no limit)")
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ValueError("chunk_size must be positive (or None for whole prompts)")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be positive")


@dataclass(eq=False, slots=True)
class Task:
    """An execution task: one batch led by its highest-priority request `head` (H)."""

    plan: StepPlan
    head: RequestState
    total_ops: int
    predicted: float  # predicted time of the whole step (the batch latency L of Alg. 1)

    @property
    def remaining(self) -> float:
        """Share of the task's operators still to run."""
        return 1.0 - self.plan.ops_done / self.total_ops


@dataclass(slots=True)
class FlowPrefillStats:
    rounds: int = 0
    submits: int = 0
    preemptions: int = 0
    resumes: int = 0
    batched: list[int] = field(default_factory=list)  # requests per submitted task
