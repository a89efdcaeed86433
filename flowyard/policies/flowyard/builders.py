"""Builder of the `flowyard` policy: the four designs composed (see `router`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from flowyard.core.kvcache import KVCacheManager
from flowyard.policies.flowyard.router import FlowyardConfig, FlowyardRouter
from flowyard.policies.flowyard.selector import flowyard_scheduler
from flowyard.policies.framework.compose import Composed
from flowyard.policies.framework.continuous_batching import BatchConfig
from flowyard.policies.framework.contracts import LocalScheduler, Role
from flowyard.policies.framework.policy import Policy

if TYPE_CHECKING:
    from flowyard.policies.registry import PolicyOptions


def flowyard_policy(name: str, o: PolicyOptions) -> Policy:
    """Assemble `flowyard` (registry entry): MIXED instances under a `Composed` global scheduler
    whose dispatcher, decode router and controller are one `FlowyardRouter`. Each instance is a
    `LocalCore` whose chunked selector (`selector.flowyard_selector`) is S-EDF order x
    `TPOTSlackBudget` x parking `Admission` x `SlackPlaces` x `MooreHodgsonShedding`."""
    if o.predictor is None:
        raise ValueError(f"{name} needs a predictor (PolicyOptions.predictor) for its regime controller, "
                         "TTFT predictor and step budgets")
    cfg = o.flowyard or FlowyardConfig(chunk=o.chunk_size or 2048, max_num_seqs=o.max_num_seqs)
    router = FlowyardRouter(o.predictor, cfg, name, shared_device=o.shared_device)
    gs = Composed(name, router, decode_router=router, controllers=[router] if router.period is not None else [])
    predictor = o.predictor

    def local(instance: int, role: Role, kv: KVCacheManager, batch: BatchConfig) -> LocalScheduler:
        return flowyard_scheduler(instance, role, kv, predictor, chunk=cfg.chunk, order=cfg.order,
                                  tbt_budget=cfg.tbt_budget, slack=cfg.slack, park=cfg.park, shed=cfg.shed,
                                  prefill_preempts=cfg.prefill_preempts, rescue=cfg.rescue, places=cfg.places,
                                  default_tpot=cfg.tpot_slo, shed_rate=cfg.shed_rate,
                                  max_num_seqs=batch.max_num_seqs,
                                  max_model_len=batch.max_model_len, max_repeats=batch.max_repeats)

    batch = BatchConfig(max_num_batched_tokens=cfg.chunk, max_num_seqs=cfg.max_num_seqs)
    return Policy(name, gs, [Role.MIXED] * o.num_instances, {Role.MIXED: batch}, {Role.MIXED: local})
