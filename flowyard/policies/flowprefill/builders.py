"""Builders of FlowPrefill's policies: the paper's PD setting and S-EDF on colocated instances."""

from __future__ import annotations

from typing import TYPE_CHECKING

from flowyard.core.kvcache import KVCacheManager
from flowyard.policies.baselines.routers import RoundRobinPD, VllmDataParallel
from flowyard.policies.flowprefill.scheduler import FlowPrefillConfig, FlowPrefillScheduler
from flowyard.policies.framework.continuous_batching import BatchConfig, BatchScheduler
from flowyard.policies.framework.contracts import LocalScheduler, Role
from flowyard.policies.framework.policy import Policy, pd_roles
from flowyard.policies.framework.slack import TTFTPredictor

if TYPE_CHECKING:
    from flowyard.policies.registry import PolicyOptions


def flowprefill_policy(name: str, o: PolicyOptions) -> Policy:
    """FlowPrefill (§4): PD disaggregation; prefill instances run S-EDF with operator-level
    preemption, decode instances FCFS continuous batching; the proxy routes round robin."""
    roles = pd_roles(name, o.num_instances, o.num_prefill)
    if o.predictor is None:
        raise ValueError(f"{name} needs a TTFT predictor (PolicyOptions.predictor: a cost model "
                         "or a profile of the engine)")
    fp = o.flowprefill or FlowPrefillConfig(chunk_size=o.chunk_size, max_num_seqs=o.max_num_seqs)
    predictor = o.predictor

    def prefill(instance: int, role: Role, kv: KVCacheManager, batch: BatchConfig) -> LocalScheduler:
        return FlowPrefillScheduler(instance, role, kv, fp, predictor, max_model_len=batch.max_model_len,
                                    max_repeats=batch.max_repeats)

    decode = BatchConfig(max_num_batched_tokens=2048, max_num_seqs=o.max_num_seqs)
    return Policy(name, RoundRobinPD(), roles, {Role.DECODE: decode}, {Role.PREFILL: prefill})


def flowprefill_colocated_policy(name: str, o: PolicyOptions) -> Policy:
    """FlowPrefill's S-EDF on colocated instances (the PD-colocation setting of its Fig. 16, as
    far as existing parts compose it): MIXED instances running vLLM's chunked prefill, decodes
    riding along in every step, whose waiting queue is ranked by S-EDF with the TTFT predictor;
    vLLM's data-parallel dispatch. It differs from `vllm` only in the queue order, so a run
    against `vllm` at the same chunk isolates the selector. What it lacks: operator-level
    preemption (a step that carries decodes runs to its end, and a started prompt keeps its turn
    between chunks) and the paper's intra-PD split of a device group into prefill and decode."""
    if o.predictor is None:
        raise ValueError(f"{name} needs a TTFT predictor (PolicyOptions.predictor) for S-EDF's slack")
    ttft_hat = TTFTPredictor(o.predictor).request
    cfg = BatchConfig(max_num_batched_tokens=o.chunk_size or 2048, max_num_seqs=o.max_num_seqs, order="s-edf")

    def local(instance: int, role: Role, kv: KVCacheManager, batch: BatchConfig) -> LocalScheduler:
        return BatchScheduler(instance, role, kv, batch, ttft_hat=ttft_hat)

    return Policy(name, VllmDataParallel(), [Role.MIXED] * o.num_instances, {Role.MIXED: cfg}, {Role.MIXED: local})
