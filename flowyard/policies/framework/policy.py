"""The `Policy` type: one global scheduler and a local scheduler per instance, as every paper
package's builder assembles it and every executor runs it. It lives here, not in the registry,
so a paper's builder can return one without importing the registry that imports the paper."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

from flowyard.core.kvcache import KVCacheManager
from flowyard.policies.framework.continuous_batching import BatchConfig, BatchScheduler
from flowyard.policies.framework.contracts import GlobalScheduler, LocalScheduler, Role

# (instance, role, KV manager, the role's BatchConfig with the executor's context limit and
# step promise applied) -> the local scheduler
SchedulerFactory = Callable[[int, Role, KVCacheManager, BatchConfig], LocalScheduler]


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


def pd_roles(name: str, num_instances: int, num_prefill: int | None) -> list[Role]:
    """The roles of a static PD split: `num_prefill` (default half) PREFILL, the rest DECODE."""
    n = num_instances
    p = num_prefill if num_prefill is not None else n // 2
    if n < 2 or not 1 <= p < n:
        raise ValueError(
            f"{name} needs at least one prefill and one decode instance "
            f"(--instances {n}, --prefill-instances {p})"
        )
    return [Role.PREFILL] * p + [Role.DECODE] * (n - p)
