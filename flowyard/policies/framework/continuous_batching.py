"""Continuous batching with (optionally chunked) prefill: the local scheduler of the baselines.

vLLM's colocated scheduler, DistServe's prefill and decode instances and the chunked-prefill +
EDF variants differ only in role, token budget, chunking and queue order, so each is the one
core (`local_core.LocalCore`) with vLLM's prefill side (`chunked.ChunkedSelector`): running requests
first (decodes, then partial prefills), then waiting requests while the token budget,
`max_num_seqs` and KV allow; when a running request cannot get a KV block, the most recently
admitted running request is preempted and later recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from flowyard.core.kvcache import KVCacheManager
from flowyard.core.request import RequestState
from flowyard.policies.framework.contracts import Role
from flowyard.policies.framework.local_core import LocalCore
from flowyard.policies.framework.order import ORDERS
from flowyard.policies.framework.chunked import ChunkedSelector


@dataclass(frozen=True, slots=True)
class BatchConfig:
    """Knobs of `BatchScheduler`, named as in vLLM where vLLM has them."""

    max_num_batched_tokens: int = 2048  # token budget of one step (the chunk size)
    max_num_seqs: int = 256
    chunked_prefill: bool = True  # False: a prompt runs whole (alone if over the budget)
    # False: vLLM V0's default scheduler and SGLang's without mixed chunks: a step runs prompts
    # or decodes, never both, and prompts go first whenever one can start (decodes stall)
    mix_decodes: bool = True
    # queue order (`order.QueueOrder`): "fcfs", "edf" (earliest TTFT deadline first),
    # "priority" (vLLM's), or FlowPrefill's "s-edf"/"d-edf" (s-edf needs a TTFT predictor)
    order: str = "fcfs"
    max_model_len: int | None = None  # sequences stop ("length") when they reach it
    max_repeats: int = 512  # longest decode-only run promised in one plan

    def __post_init__(self) -> None:
        if self.order not in ORDERS:
            raise ValueError(f"order must be one of {', '.join(map(repr, ORDERS))}, got {self.order!r}")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1 or self.max_repeats < 1:
            raise ValueError("token budget, max_num_seqs and max_repeats must be positive")


class BatchScheduler(LocalCore):
    """`LocalCore` configured from a `BatchConfig` with vLLM's chunked prefill selector."""

    def __init__(self, instance: int, role: Role, kv: KVCacheManager, config: BatchConfig,
                 ttft_hat: Callable[[RequestState], float] | None = None) -> None:
        self.config = config
        selector = ChunkedSelector(config.max_num_batched_tokens, config.chunked_prefill, config.order,
                                   ttft_hat=ttft_hat, prefill_first=not config.mix_decodes)
        super().__init__(instance, role, kv, selector, max_num_seqs=config.max_num_seqs,
                         max_model_len=config.max_model_len, max_repeats=config.max_repeats)
