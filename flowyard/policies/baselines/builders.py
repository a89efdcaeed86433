"""Builders of the baseline policies: vLLM-style colocation under a data-parallel router
(vLLM's, SGLang's round robin or least load) and DistServe's static PD split, each running
continuous batching with (optionally chunked) prefill on every instance."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from flowyard.policies.baselines.routers import DistServeDispatch
from flowyard.policies.framework.continuous_batching import BatchConfig
from flowyard.policies.framework.contracts import GlobalScheduler, Role
from flowyard.policies.framework.policy import Policy, pd_roles

if TYPE_CHECKING:
    from flowyard.policies.registry import PolicyOptions


def colocated_policy(router: Callable[[], GlobalScheduler], mix: bool = True) -> Callable[[str, PolicyOptions], Policy]:
    """MIXED instances running vLLM's chunked prefill (`mix`), or vLLM V0's prefill-first
    steps (whole prompts in a budget of 8,192 tokens, no decodes beside them), new requests
    placed by `router`."""

    def build(name: str, o: PolicyOptions) -> Policy:
        cfg = BatchConfig(max_num_batched_tokens=o.chunk_size or (2048 if mix else 8192), max_num_seqs=o.max_num_seqs,
                          chunked_prefill=mix, mix_decodes=mix)
        return Policy(name, router(), [Role.MIXED] * o.num_instances, {Role.MIXED: cfg})

    return build


def distserve_policy(chunk: int | None, order: str) -> Callable[[str, PolicyOptions], Policy]:
    """DistServe: PREFILL and DECODE instances; prompts run whole (`chunk` None) or in chunks
    of `chunk` tokens, queued by `order`."""

    def build(name: str, o: PolicyOptions) -> Policy:
        roles = pd_roles(name, o.num_instances, o.num_prefill)
        budget = o.chunk_size or chunk or 8192
        prefill = BatchConfig(
            max_num_batched_tokens=budget, chunked_prefill=chunk is not None or o.chunk_size is not None,
            order=order, max_num_seqs=o.max_num_seqs,
        )
        decode = BatchConfig(max_num_batched_tokens=2048, max_num_seqs=o.max_num_seqs)
        return Policy(name, DistServeDispatch(), roles, {Role.PREFILL: prefill, Role.DECODE: decode})

    return build
