"""One simulation run from plain settings: what `flowyard simulate` and `goodput` call.

Keeps the assembly (workload → policy → cost model → topology → simulator → summary) in one
place, so the CLI, the benchmarks and `reproduce` experiments build runs the same way.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable

from flowyard.cluster.timeline import Timeline
from flowyard.core.metrics import Summary, summarize
from flowyard.core.plan import StepPlan
from flowyard.core.request import SLO
from flowyard.costmodel import DEFAULT_CALIBRATION, Link, get_hardware, make_cost_model
from flowyard.costmodel.base import CostModel, with_error
from flowyard.policies.framework.policy import Policy
from flowyard.policies.registry import PolicyOptions, build_policy
from flowyard.sim.arrivals import ClosedLoop
from flowyard.sim.client_cpu import SharedClient
from flowyard.sim.cluster import Topology
from flowyard.sim.simulator import SimResult, Simulator
from flowyard.workloads import Workload, clip, load_trace, scale_rate, slo_by_length, with_slo
from flowyard.workloads.scale import mixed, tile

# SLOs a bundled trace carries unless the command line overrides them: Arrow's Table 1
# (Llama-3.1-8B; TTFT s, TPOT s) for the traces it uses; ShareGPT as a conversation trace and
# arXiv as a prompt-heavy one, by analogy (our choice).
DEFAULT_SLOS: dict[str, SLO] = {
    "azure-code": SLO(ttft=3.0, tpot=0.1),
    "azure-code-vidur": SLO(ttft=3.0, tpot=0.1),
    "azure-conv": SLO(ttft=2.0, tpot=0.15),
    "azure-conv-vidur": SLO(ttft=2.0, tpot=0.15),
    "burstgpt": SLO(ttft=0.25, tpot=0.075),
    "burstgpt-v1": SLO(ttft=0.25, tpot=0.075),
    "mooncake-conv": SLO(ttft=30.0, tpot=0.1),
    "sharegpt": SLO(ttft=2.0, tpot=0.15),
    "arxiv": SLO(ttft=3.0, tpot=0.1),
}


@dataclass(frozen=True)
class SimConfig:
    """Everything one simulation needs, by name: the CLI flags of DESIGN.md."""

    trace: str = "azure-conv"
    model: str = "llama-3-8b"
    hardware: str = "h100"
    tp: int = 1
    instances: int = 1
    prefill_instances: int | None = None
    policy: str = "vllm"
    rate_scale: float = 1.0
    duration: float | None = None
    num_requests: int | None = None
    rate: float | None = None  # arrival rate for length-only traces
    ttft_slo: float | None = None
    tpot_slo: float | None = None
    ttft_slo_by_length: str | None = None
    seed: int = 0
    chunk_size: int | None = None
    max_num_seqs: int = 256
    block_size: int = 16
    prefix_caching: bool = False
    profile: str | None = None  # a `flowyard profile` JSON: emulate that engine
    snapshot_staleness: float = 0.0  # seconds; global policies see snapshots this old at most
    predictor_error: float = 1.0  # SLO-aware policies predict times this factor off the truth
    # Closed loop: this many clients, each sending its next request (a session's next turn)
    # think_time seconds after its previous one ends; trace arrival times are then ignored.
    concurrency: int | None = None
    think_time: float = 0.0
    # The closed-loop clients read their streams on one processor that spends this long on
    # each token (`sim.client_cpu.SharedClient`: a threaded Python benchmark); 0: free clients.
    client_chunk_s: float = 0.0
    calibration: str = DEFAULT_CALIBRATION  # roofline factor set (costmodel.CALIBRATIONS); `flowyard validate`
    # Large workloads (`flowyard.workloads.scale`): other traces superposed on this one
    # ("NAME[:SCALE],..."), then the result repeated `tile` times back to back.
    mix: str | None = None
    tile: int = 1
    # host-side costs of the emulated serving stack (costmodel.engines); None: the default
    engine_profile: str | None = None

    def __post_init__(self) -> None:
        for name in ("tp", "instances", "max_num_seqs", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        if self.snapshot_staleness < 0:
            raise ValueError(f"--snapshot-staleness must be >= 0, got {self.snapshot_staleness}")
        if not self.predictor_error > 0:
            raise ValueError(f"--predictor-error must be positive, got {self.predictor_error}")
        if not self.rate_scale > 0:
            raise ValueError(f"--rate-scale must be positive, got {self.rate_scale}")
        if self.duration is not None and not self.duration > 0:
            raise ValueError(f"--duration must be positive, got {self.duration}")
        if self.tile < 1:
            raise ValueError(f"--tile must be at least 1, got {self.tile}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"--concurrency must be at least 1, got {self.concurrency}")
        if not (self.think_time >= 0 and math.isfinite(self.think_time)):
            raise ValueError(f"--think-time must be a finite number >= 0, got {self.think_time}")
        if not (self.client_chunk_s >= 0 and math.isfinite(self.client_chunk_s)):
            raise ValueError(f"--client-token-ms must be a finite number >= 0, got {1e3 * self.client_chunk_s:g}")
        if self.concurrency is None and self.client_chunk_s:
            raise ValueError("--client-token-ms needs --concurrency (closed-loop clients)")
        if self.concurrency is None and self.think_time:
            raise ValueError("--think-time needs --concurrency (closed-loop clients)")
        if self.concurrency is not None and self.rate_scale != 1.0:
            raise ValueError("--rate-scale has no meaning with --concurrency: closed-loop clients "
                             "send when their previous request ends, not at trace times")

    def replace(self, **changes) -> "SimConfig":
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict:
        """The settings for JSON reports; the large-workload knobs only when used, so a run
        without them writes what it wrote before they existed."""
        d = dataclasses.asdict(self)
        for k, default in (("mix", None), ("tile", 1)):
            if d[k] == default:
                del d[k]
        return d


def load_workload(cfg: SimConfig) -> Workload:
    """The trace with the default SLOs, duration clip and SLO overrides applied, unscaled.

    Clipping is in trace time (before rate scaling), so a rate sweep replays the same
    requests faster or slower, as in Arrow's method.
    """
    w = _trace(cfg, cfg.trace)
    if cfg.duration is not None or cfg.num_requests is not None:
        w = clip(w, duration=cfg.duration, max_requests=cfg.num_requests)
    if cfg.mix:
        w = mixed(w, cfg.mix, lambda name: _trace(cfg, name))
    if cfg.tile > 1:
        w = tile(w, cfg.tile)
    if cfg.ttft_slo_by_length:
        w = slo_by_length(w, cfg.ttft_slo_by_length)
    if cfg.ttft_slo is not None or cfg.tpot_slo is not None:
        w = with_slo(w, ttft=cfg.ttft_slo, tpot=cfg.tpot_slo)
    if not w.requests:
        raise ValueError(f"trace {cfg.trace!r} has no requests in the chosen window")
    return w


def _trace(cfg: SimConfig, name: str) -> Workload:
    """One trace with its default SLOs (when it carries none)."""
    w = load_trace(name, rate=cfg.rate, seed=cfg.seed, num_requests=cfg.num_requests)
    default = DEFAULT_SLOS.get(name.strip().lower())
    if default is not None and all(r.slo.empty for r in w.requests):
        w = with_slo(w, ttft=default.ttft, tpot=default.tpot)
    return w


def build_cost_model(cfg: SimConfig) -> CostModel:
    if cfg.profile is not None:
        from flowyard.costmodel.profiled import ProfiledCostModel

        return ProfiledCostModel(cfg.profile)
    return make_cost_model(cfg.model, cfg.hardware, tp=cfg.tp, calibration=cfg.calibration,
                           engine_profile=cfg.engine_profile)


def build_topology(cfg: SimConfig) -> Topology:
    hw = get_hardware(cfg.hardware)
    return Topology(tp=cfg.tp, intra=Link.nvlink(hw), inter=Link.network(hw))


def policy_options(cfg: SimConfig, cost: CostModel, **knobs) -> PolicyOptions:
    """The policy's options from `cfg`; `knobs` are PolicyOptions' per-policy overrides
    (flowprefill=, dynaserve=, pla=, ...) that experiments' ablations set."""
    return PolicyOptions(
        num_instances=cfg.instances, num_prefill=cfg.prefill_instances,
        chunk_size=cfg.chunk_size, max_num_seqs=cfg.max_num_seqs,
        predictor=with_error(cost, cfg.predictor_error), **knobs,
    )


def build_simulator(
    cfg: SimConfig,
    workload: Workload | None = None,
    *,
    cost_model: CostModel | None = None,
    policy: Policy | None = None,
    progress: Callable[[int, int], None] | None = None,
    on_step: Callable[[int, StepPlan, int], None] | None = None,
    timeline: Timeline | None = None,
) -> Simulator:
    """The one assembly of a run (workload → policy → cost model → topology → simulator).
    `workload` (unscaled) may be passed to avoid reloading it; `policy` one already built
    (from `policy_options`) that the caller wants to inspect or adjust before the run."""
    w = workload if workload is not None else load_workload(cfg)
    if cfg.rate_scale != 1.0:  # never with concurrency (checked): closed loop ignores trace times
        w = scale_rate(w, cfg.rate_scale)
    cost = cost_model or build_cost_model(cfg)
    if policy is None:
        policy = build_policy(cfg.policy, policy_options(cfg, cost))
    arrivals: ClosedLoop | None = None  # None: open-loop trace replay
    if cfg.concurrency is not None:
        arrivals = (SharedClient(w.requests, cfg.concurrency, cfg.client_chunk_s, cfg.think_time)
                    if cfg.client_chunk_s else ClosedLoop(w.requests, cfg.concurrency, cfg.think_time))
    return Simulator(
        w.requests, policy, cost, build_topology(cfg),
        block_size=cfg.block_size, progress=progress, on_step=on_step,
        prefix_caching=cfg.prefix_caching, snapshot_staleness=cfg.snapshot_staleness,
        arrivals=arrivals, timeline=timeline,
    )


def simulate(
    cfg: SimConfig,
    workload: Workload | None = None,
    *,
    cost_model: CostModel | None = None,
    progress: Callable[[int, int], None] | None = None,
    timeline: Timeline | None = None,
) -> tuple[Summary, SimResult]:
    """Run one simulation; `workload` (unscaled) may be passed to avoid reloading it."""
    sim = build_simulator(cfg, workload, cost_model=cost_model, progress=progress, timeline=timeline)
    result = sim.run()
    # Arrivals are the send times the simulator recorded, so throughput is over the real span.
    summary = summarize(result.states, policy=cfg.policy, wall_s=result.wall_s)
    return summary, result
