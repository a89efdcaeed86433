"""Policy names (as `--policy` takes them) and how each assembles its schedulers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from flowyard.core.kvcache import KVCacheManager
from flowyard.policies.base import GlobalScheduler, LocalScheduler, Role
from flowyard.policies.local import BatchConfig, BatchScheduler
from flowyard.policies.routers import DistServeDispatch, LeastLoad, RoundRobin, VllmDataParallel


class UnknownPolicyError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class PolicyOptions:
    """Cluster-shape knobs a policy may read (from the CLI)."""

    num_instances: int = 1
    num_prefill: int | None = None  # static PD splits; default half
    chunk_size: int | None = None  # override the policy's token budget
    max_num_seqs: int = 256


@dataclass
class Policy:
    """A named assembly: one global scheduler and a local scheduler per instance."""

    name: str
    global_scheduler: GlobalScheduler
    roles: list[Role]
    configs: dict[Role, BatchConfig] = field(default_factory=dict)

    def make_local(self, instance: int, kv: KVCacheManager) -> LocalScheduler:
        role = self.roles[instance]
        return BatchScheduler(instance, role, kv, self.configs[role])


def _colocated(router: Callable[[], GlobalScheduler]) -> Callable[[str, PolicyOptions], Policy]:
    def build(name: str, o: PolicyOptions) -> Policy:
        cfg = BatchConfig(max_num_batched_tokens=o.chunk_size or 2048, max_num_seqs=o.max_num_seqs)
        return Policy(name, router(), [Role.MIXED] * o.num_instances, {Role.MIXED: cfg})

    return build


def _distserve(chunk: int | None, order: str) -> Callable[[str, PolicyOptions], Policy]:
    def build(name: str, o: PolicyOptions) -> Policy:
        n = o.num_instances
        p = o.num_prefill if o.num_prefill is not None else n // 2
        if n < 2 or not 1 <= p < n:
            raise ValueError(
                f"{name} needs at least one prefill and one decode instance "
                f"(--instances {n}, --prefill-instances {p})"
            )
        budget = o.chunk_size or chunk or 8192
        prefill = BatchConfig(
            max_num_batched_tokens=budget, chunked_prefill=chunk is not None or o.chunk_size is not None,
            order=order, max_num_seqs=o.max_num_seqs,
        )
        decode = BatchConfig(max_num_batched_tokens=2048, max_num_seqs=o.max_num_seqs)
        roles = [Role.PREFILL] * p + [Role.DECODE] * (n - p)
        return Policy(name, DistServeDispatch(), roles, {Role.PREFILL: prefill, Role.DECODE: decode})

    return build


_BUILDERS: dict[str, Callable[[str, PolicyOptions], Policy]] = {
    "vllm": _colocated(VllmDataParallel),
    "round-robin": _colocated(RoundRobin),
    "least-load": _colocated(LeastLoad),
    "distserve": _distserve(None, "fcfs"),
    "distserve-cp2k": _distserve(2048, "edf"),
    "distserve-cp8k": _distserve(8192, "edf"),
}

POLICY_NAMES: tuple[str, ...] = tuple(_BUILDERS)


def build_policy(name: str, options: PolicyOptions | None = None) -> Policy:
    key = name.lower()
    if key not in _BUILDERS:
        raise UnknownPolicyError(
            f"unknown policy {name!r}; valid policies: {', '.join(POLICY_NAMES)}"
        )
    return _BUILDERS[key](key, options or PolicyOptions())
