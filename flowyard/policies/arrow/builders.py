"""Builder of Arrow's policies: `arrow` and its static-split ablations `arrow-minload`, `arrow-rr`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from flowyard.policies.arrow.router import ArrowConfig, ArrowRouter
from flowyard.policies.framework.compose import Composed
from flowyard.policies.framework.continuous_batching import BatchConfig
from flowyard.policies.framework.contracts import Role
from flowyard.policies.framework.policy import Policy

if TYPE_CHECKING:
    from flowyard.policies.registry import PolicyOptions


def arrow_policy(mode: str) -> Callable[[str, PolicyOptions], Policy]:
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
