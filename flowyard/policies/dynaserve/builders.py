"""Builder of DynaServe's policies: `dynaserve` and `dynaserve-oracle` (exact output lengths)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable

from flowyard.core.kvcache import KVCacheManager
from flowyard.policies.dynaserve.lengths import make_length_predictor
from flowyard.policies.dynaserve.local_batch import dynaserve_scheduler
from flowyard.policies.dynaserve.split import DynaServeConfig, DynaServeRouter
from flowyard.policies.framework.compose import Composed, RoundRobinDispatch
from flowyard.policies.framework.continuous_batching import BatchConfig
from flowyard.policies.framework.contracts import LocalScheduler, Role
from flowyard.policies.framework.policy import Policy

if TYPE_CHECKING:
    from flowyard.policies.registry import PolicyOptions


def dynaserve_policy(oracle: bool) -> Callable[[str, PolicyOptions], Policy]:
    """DynaServe (§4): a unified pool of MIXED instances; requests split into micro-requests
    on round-robin pairs by the split search (Alg. 1); SLO-aware local batches (Alg. 2).
    `dynaserve-oracle` predicts output lengths exactly (the true target)."""

    def build(name: str, o: PolicyOptions) -> Policy:
        if o.predictor is None:
            raise ValueError(f"{name} needs a predictor (PolicyOptions.predictor) for its split "
                             "search and its step-time profile")
        cfg = o.dynaserve or DynaServeConfig(max_num_seqs=o.max_num_seqs, chunk_cap=o.chunk_size or 1024)
        if oracle:
            cfg = dataclasses.replace(cfg, lengths="oracle")
        lengths = make_length_predictor(cfg.lengths, margin=cfg.length_margin, error=cfg.length_error,
                                        sigma=cfg.length_sigma, prior_mean=cfg.length_prior)
        predictor, local_cfg = o.predictor, cfg.local()
        batch = BatchConfig(max_num_batched_tokens=cfg.chunk_cap, max_num_seqs=cfg.max_num_seqs)
        gs = Composed("dynaserve", RoundRobinDispatch(), splitter=DynaServeRouter(predictor, lengths, cfg))
        policy = Policy(name, gs, [Role.MIXED] * o.num_instances, {Role.MIXED: batch})

        def local(instance: int, role: Role, kv: KVCacheManager, batch: BatchConfig) -> LocalScheduler:
            # `batch` is policy.configs[role] when built (a caller's override applies) with the
            # executor's context limit and single-step promise
            return dynaserve_scheduler(instance, role, kv, predictor, local_cfg, max_num_seqs=batch.max_num_seqs,
                                       max_model_len=batch.max_model_len, max_repeats=batch.max_repeats)

        policy.schedulers[Role.MIXED] = local
        return policy

    return build
