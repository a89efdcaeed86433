"""Policy names (as `--policy` takes them) and the builder of each, taken from its paper's
package (`baselines`, `flowprefill`, `pla`, `arrow`, `dynaserve`, `flowyard`); each builder
assembles a `framework.policy.Policy` from parts. `POLICY_SPECS` declares what each policy
needs, so callers (`flowyard serve`) derive their behaviour from it instead of keeping lists of
names. This is the one module that imports every paper's package."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from flowyard.costmodel.base import CostModel
from flowyard.policies.arrow import arrow_policy
from flowyard.policies.baselines import colocated_policy, distserve_policy
from flowyard.policies.baselines.routers import LeastLoad, RoundRobin, VllmDataParallel
from flowyard.policies.dynaserve import dynaserve_policy
from flowyard.policies.dynaserve.split import DynaServeConfig
from flowyard.policies.flowprefill import flowprefill_colocated_policy, flowprefill_policy
from flowyard.policies.flowprefill.scheduler import FlowPrefillConfig
from flowyard.policies.flowyard import flowyard_policy
from flowyard.policies.flowyard.router import FlowyardConfig
from flowyard.policies.framework.policy import Policy
from flowyard.policies.pla import pla_policy, pla_spatial_policy
from flowyard.policies.pla.router import ControllerConfig
from flowyard.policies.pla.selector import PLAConfig


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
    # The instances take turns on one device (`flowyard serve`'s in-process cluster, a
    # `Simulator(shared_device=True)`): a policy that prices its options may price them as one
    # device's steps rather than N devices'.
    shared_device: bool = False


@dataclass(frozen=True, slots=True)
class PolicySpec:
    """What a policy is built from and what it needs: `needs_predictor` (a cost model or a
    profile of the engine for step or TTFT times: its builder refuses to assemble without
    one) and `disaggregated` (PREFILL and DECODE instances; else all MIXED)."""

    build: Callable[[str, PolicyOptions], Policy]
    needs_predictor: bool = False
    disaggregated: bool = False


POLICY_SPECS: dict[str, PolicySpec] = {
    "vllm": PolicySpec(colocated_policy(VllmDataParallel)),
    "prefill-first": PolicySpec(colocated_policy(VllmDataParallel, mix=False)),
    "round-robin": PolicySpec(colocated_policy(RoundRobin)),
    "least-load": PolicySpec(colocated_policy(LeastLoad)),
    "distserve": PolicySpec(distserve_policy(None, "fcfs"), disaggregated=True),
    "distserve-cp2k": PolicySpec(distserve_policy(2048, "edf"), disaggregated=True),
    "distserve-cp8k": PolicySpec(distserve_policy(8192, "edf"), disaggregated=True),
    "flowprefill": PolicySpec(flowprefill_policy, needs_predictor=True, disaggregated=True),
    "flowprefill-colocated": PolicySpec(flowprefill_colocated_policy, needs_predictor=True),
    "pla": PolicySpec(pla_policy, needs_predictor=True, disaggregated=True),
    "pla-spatial": PolicySpec(pla_spatial_policy, needs_predictor=True, disaggregated=True),
    "pla-mix": PolicySpec(pla_spatial_policy, needs_predictor=True),
    "arrow": PolicySpec(arrow_policy("slo"), needs_predictor=True),
    "arrow-minload": PolicySpec(arrow_policy("minload"), needs_predictor=True),
    "arrow-rr": PolicySpec(arrow_policy("rr"), needs_predictor=True),
    "dynaserve": PolicySpec(dynaserve_policy(False), needs_predictor=True),
    "dynaserve-oracle": PolicySpec(dynaserve_policy(True), needs_predictor=True),
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
