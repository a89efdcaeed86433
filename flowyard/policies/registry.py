"""Policy names (as `--policy` takes them) and how each assembles its schedulers from parts:
a local scheduler per instance (`core.LocalCore` with a prefill selector and a role) and one
global scheduler (`compose.Composed`: dispatcher, splitter, decode router, controllers, pools).
`POLICY_SPECS` declares what each policy needs, so callers (`flowyard serve`) derive their
behaviour from it instead of keeping lists of names."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

from flowyard.core.kvcache import KVCacheManager
from flowyard.costmodel.base import CostModel
from flowyard.policies.arrow import ArrowConfig, ArrowRouter
from flowyard.policies.framework.contracts import GlobalScheduler, LocalScheduler, Role
from flowyard.policies.framework.compose import Composed, MostFreeKVDecode, RoundRobinDispatch
from flowyard.policies.dynaserve import DynaServeConfig, DynaServeRouter
from flowyard.policies.dynaserve_local import dynaserve_scheduler
from flowyard.policies.dynaserve_predict import make_length_predictor
from flowyard.policies.flowprefill import FlowPrefillConfig, FlowPrefillScheduler
from flowyard.policies.flowyard_policy import FlowyardConfig, flowyard_policy
from flowyard.policies.framework.continuous_batching import BatchConfig, BatchScheduler
from flowyard.policies.pla import PLAConfig, length_model_of, pla_scheduler
from flowyard.policies.pla_router import ControllerConfig, PLARouter
from flowyard.policies.framework.slack import TTFTPredictor
from flowyard.policies.routers import (DistServeDispatch, LeastLoad, RoundRobin, RoundRobinPD,
                                       VllmDataParallel)

# (instance, role, KV manager, the role's BatchConfig with the executor's context limit and
# step promise applied) -> the local scheduler
SchedulerFactory = Callable[[int, Role, KVCacheManager, BatchConfig], LocalScheduler]


class UnknownPolicyError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class PolicyOptions:
    """Cluster-shape knobs a policy may read (from the CLI)."""

    num_instances: int = 1
    num_prefill: int | None = None  # static PD splits; default half
    chunk_size: int | None = None  # override the policy's token budget
    max_num_seqs: int = 256
    # What SLO-aware policies predict step and TTFT times with: the simulator's cost model (or
    # a deliberately wrong copy), or a profile of the real engine. Policies that need one
    # refuse to build without it.
    predictor: CostModel | None = None
    flowprefill: FlowPrefillConfig | None = None  # override FlowPrefill's knobs (ablations)
    pla: PLAConfig | None = None  # override PLA-Serve's knobs (variants)
    pla_controller: ControllerConfig | None = None
    dynaserve: DynaServeConfig | None = None  # override DynaServe's knobs (K, tolerance, SLO, lengths)
    flowyard: FlowyardConfig | None = None  # override flowyard's knobs (ablations, pinned regimes)


@dataclass
class Policy:
    """A named assembly: one global scheduler and a local scheduler per instance."""

    name: str
    global_scheduler: GlobalScheduler
    roles: list[Role]
    configs: dict[Role, BatchConfig] = field(default_factory=dict)
    # Roles whose local scheduler is not a BatchScheduler (FlowPrefill's prefill instances).
    schedulers: dict[Role, SchedulerFactory] = field(default_factory=dict)

    def make_local(self, instance: int, kv: KVCacheManager, *, max_model_len: int | None = None,
                   single_step: bool = False) -> LocalScheduler:
        """The local scheduler of `instance`. A real engine passes its context limit and
        single_step (it never takes up a multi-step decode promise)."""
        role = self.roles[instance]
        cfg = self.configs.get(role, BatchConfig())
        if max_model_len is not None:
            cfg = dataclasses.replace(cfg, max_model_len=max_model_len)
        if single_step:
            cfg = dataclasses.replace(cfg, max_repeats=1)
        if role not in self.schedulers:
            return BatchScheduler(instance, role, kv, cfg)
        # every factory builds its scheduler from cfg's context limit and step promise
        return self.schedulers[role](instance, role, kv, cfg)


def _colocated(router: Callable[[], GlobalScheduler]) -> Callable[[str, PolicyOptions], Policy]:
    def build(name: str, o: PolicyOptions) -> Policy:
        cfg = BatchConfig(max_num_batched_tokens=o.chunk_size or 2048, max_num_seqs=o.max_num_seqs)
        return Policy(name, router(), [Role.MIXED] * o.num_instances, {Role.MIXED: cfg})

    return build


def _pd_roles(name: str, o: PolicyOptions) -> list[Role]:
    n = o.num_instances
    p = o.num_prefill if o.num_prefill is not None else n // 2
    if n < 2 or not 1 <= p < n:
        raise ValueError(
            f"{name} needs at least one prefill and one decode instance "
            f"(--instances {n}, --prefill-instances {p})"
        )
    return [Role.PREFILL] * p + [Role.DECODE] * (n - p)


def _distserve(chunk: int | None, order: str) -> Callable[[str, PolicyOptions], Policy]:
    def build(name: str, o: PolicyOptions) -> Policy:
        roles = _pd_roles(name, o)
        budget = o.chunk_size or chunk or 8192
        prefill = BatchConfig(
            max_num_batched_tokens=budget, chunked_prefill=chunk is not None or o.chunk_size is not None,
            order=order, max_num_seqs=o.max_num_seqs,
        )
        decode = BatchConfig(max_num_batched_tokens=2048, max_num_seqs=o.max_num_seqs)
        return Policy(name, DistServeDispatch(), roles, {Role.PREFILL: prefill, Role.DECODE: decode})

    return build


def _flowprefill(name: str, o: PolicyOptions) -> Policy:
    """FlowPrefill (§4): PD disaggregation; prefill instances run S-EDF with operator-level
    preemption, decode instances FCFS continuous batching; the proxy routes round robin."""
    roles = _pd_roles(name, o)
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


def _flowprefill_colocated(name: str, o: PolicyOptions) -> Policy:
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


def _pla_spatial(name: str, o: PolicyOptions) -> Policy:
    """PLA-Serve with spatial disaggregation: short and long prefill pools (Alg. 2)."""
    return _pla(name, dataclasses.replace(o, pla=dataclasses.replace(
        o.pla or PLAConfig(max_num_seqs=o.max_num_seqs), spatial=True)))


def _pla(name: str, o: PolicyOptions) -> Policy:
    """PLA-Serve (§3): PD disaggregation; prefill instances split short/long by the fitted
    compute-memory boundary, AWD batches for short prefills, C_l chunks for long ones, never
    in the same step (temporal disaggregation); new requests to the least-loaded prefill
    instance, later turns of a session to the one holding their history. `pla-spatial` adds
    short and long pools under the pressure controller; `pla-mix` runs those pools on
    colocated instances that also decode (no decode pool)."""
    mix = name == "pla-mix"
    roles = [Role.MIXED] * o.num_instances if mix else _pd_roles(name, o)
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


def _arrow(mode: str) -> Callable[[str, PolicyOptions], Policy]:
    """Arrow (§5): stateless MIXED instances (decode-first chunked batching) in elastic P/D
    pools; `mode` "minload" and "rr" are the static-split ablations of Fig. 8."""

    def build(name: str, o: PolicyOptions) -> Policy:
        if o.predictor is None:
            raise ValueError(f"{name} needs a predictor (PolicyOptions.predictor) for its TTFT "
                             "predictor and Max Running Tokens")
        n = o.num_instances
        p = o.num_prefill if o.num_prefill is not None else max(1, n // 2)
        if n > 1 and not 1 <= p < n:
            raise ValueError(f"{name} starts with P and D pools: need 1 <= --prefill-instances < "
                             f"--instances (got {p} of {n})")
        chunk = o.chunk_size or 2048
        cfg = ArrowConfig(mode=mode, num_prefill=min(p, n), chunk_size=chunk, max_num_seqs=o.max_num_seqs)
        local = BatchConfig(max_num_batched_tokens=chunk, max_num_seqs=o.max_num_seqs)
        arrow = ArrowRouter(o.predictor, cfg, name)  # dispatch, decode routing and monitor share pools
        gs = Composed(name, arrow, decode_router=arrow, controllers=[arrow] if arrow.period is not None else [])
        return Policy(name, gs, [Role.MIXED] * n, {Role.MIXED: local})

    return build


def _dynaserve(oracle: bool) -> Callable[[str, PolicyOptions], Policy]:
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


@dataclass(frozen=True, slots=True)
class PolicySpec:
    """What a policy is built from and what it needs: `needs_predictor` (a cost model or a
    profile of the engine for step or TTFT times: its builder refuses to assemble without
    one) and `disaggregated` (PREFILL and DECODE instances; else all MIXED)."""

    build: Callable[[str, PolicyOptions], Policy]
    needs_predictor: bool = False
    disaggregated: bool = False


POLICY_SPECS: dict[str, PolicySpec] = {
    "vllm": PolicySpec(_colocated(VllmDataParallel)),
    "round-robin": PolicySpec(_colocated(RoundRobin)),
    "least-load": PolicySpec(_colocated(LeastLoad)),
    "distserve": PolicySpec(_distserve(None, "fcfs"), disaggregated=True),
    "distserve-cp2k": PolicySpec(_distserve(2048, "edf"), disaggregated=True),
    "distserve-cp8k": PolicySpec(_distserve(8192, "edf"), disaggregated=True),
    "flowprefill": PolicySpec(_flowprefill, needs_predictor=True, disaggregated=True),
    "flowprefill-colocated": PolicySpec(_flowprefill_colocated, needs_predictor=True),
    "pla": PolicySpec(_pla, needs_predictor=True, disaggregated=True),
    "pla-spatial": PolicySpec(_pla_spatial, needs_predictor=True, disaggregated=True),
    "pla-mix": PolicySpec(_pla_spatial, needs_predictor=True),
    "arrow": PolicySpec(_arrow("slo"), needs_predictor=True),
    "arrow-minload": PolicySpec(_arrow("minload"), needs_predictor=True),
    "arrow-rr": PolicySpec(_arrow("rr"), needs_predictor=True),
    "dynaserve": PolicySpec(_dynaserve(False), needs_predictor=True),
    "dynaserve-oracle": PolicySpec(_dynaserve(True), needs_predictor=True),
    "flowyard": PolicySpec(flowyard_policy, needs_predictor=True),
}

POLICY_NAMES: tuple[str, ...] = tuple(POLICY_SPECS)


def policy_spec(name: str) -> PolicySpec:
    key = name.lower()
    if key not in POLICY_SPECS:
        raise UnknownPolicyError(f"unknown policy {name!r}; valid policies: {', '.join(POLICY_NAMES)}")
    return POLICY_SPECS[key]


def build_policy(name: str, options: PolicyOptions | None = None) -> Policy:
    spec, o = policy_spec(name), options or PolicyOptions()
    if spec.needs_predictor and o.predictor is None:
        raise ValueError(f"{name.lower()} needs a predictor (PolicyOptions.predictor: a cost model or a "
                         "profile of the engine) for its step or TTFT times")
    return spec.build(name.lower(), o)


def policy_requires_predictor(name: str) -> bool:
    """Whether policy `name` predicts step or TTFT times (declared in `POLICY_SPECS`)."""
    return policy_spec(name).needs_predictor
