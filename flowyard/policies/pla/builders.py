"""Builders of PLA-Serve's policies: `pla` (temporal disaggregation), `pla-spatial` (short and
long pools) and `pla-mix` (those pools on colocated instances)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from flowyard.core.kvcache import KVCacheManager
from flowyard.policies.framework.compose import Composed, MostFreeKVDecode
from flowyard.policies.framework.continuous_batching import BatchConfig
from flowyard.policies.framework.contracts import LocalScheduler, Role
from flowyard.policies.framework.policy import Policy, pd_roles
from flowyard.policies.pla.router import PLARouter
from flowyard.policies.pla.selector import PLAConfig, length_model_of, pla_scheduler

if TYPE_CHECKING:
    from flowyard.policies.registry import PolicyOptions


def pla_spatial_policy(name: str, o: PolicyOptions) -> Policy:
    """PLA-Serve with spatial disaggregation: short and long prefill pools (Alg. 2)."""
    return pla_policy(name, dataclasses.replace(o, pla=dataclasses.replace(
        o.pla or PLAConfig(max_num_seqs=o.max_num_seqs), spatial=True)))


def pla_policy(name: str, o: PolicyOptions) -> Policy:
    """PLA-Serve (§3): PD disaggregation; prefill instances split short/long by the fitted
    compute-memory boundary, AWD batches for short prefills, C_l chunks for long ones, never
    in the same step (temporal disaggregation); new requests to the least-loaded prefill
    instance, later turns of a session to the one holding their history. `pla-spatial` adds
    short and long pools under the pressure controller; `pla-mix` runs those pools on
    colocated instances that also decode (no decode pool)."""
    mix = name == "pla-mix"
    roles = [Role.MIXED] * o.num_instances if mix else pd_roles(name, o.num_instances, o.num_prefill)
    if o.predictor is None:
        raise ValueError(f"{name} needs a predictor (PolicyOptions.predictor) to fit its length boundary")
    cfg = o.pla or PLAConfig(max_num_seqs=o.max_num_seqs)
    predictor = o.predictor
    lengths = length_model_of(predictor)
    parts = PLARouter(lengths, predictor, o.pla_controller, spatial=cfg.spatial, boundary=cfg.boundary,
                      affinity=cfg.affinity_tolerance)
    router = Composed("pla", parts, decode_router=None if mix else MostFreeKVDecode(),
                      controllers=[parts] if cfg.spatial else [])
    def local(instance: int, role: Role, kv: KVCacheManager, batch: BatchConfig) -> LocalScheduler:
        return pla_scheduler(instance, role, kv, cfg, predictor, lengths, max_model_len=batch.max_model_len,
                             max_repeats=batch.max_repeats)

    if mix:  # no decode pool: each instance decodes what it prefilled
        return Policy(name, router, roles, {Role.MIXED: BatchConfig(max_num_seqs=cfg.max_num_seqs)},
                      {Role.MIXED: local})
    decode = BatchConfig(max_num_batched_tokens=2048, max_num_seqs=o.max_num_seqs)
    return Policy(name, router, roles, {Role.DECODE: decode}, {Role.PREFILL: local})
