"""The two-executor guard's driver: one workload through the simulator and through a real
in-process cluster whose clock is virtual, each step priced by the same profile cost model.

The cluster's engines really run the tiny model; only time is simulated. The driver delivers
the clock's events to the cluster exactly as the simulator's heap orders them: arrivals,
scheduler wake-ups and the global scheduler's periodic ticks that fall inside a step are
delivered at their own times before the step's outputs are applied (arrivals first at equal
times), and operator boundaries of a preemptible prefill are priced one by one so an arrival
preempts at the boundary the simulator stops at.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from flowyard.cluster.core import DecisionLog
from flowyard.core.plan import BatchShape
from flowyard.core.request import Request
from flowyard.costmodel.base import LAYER_OPS
from flowyard.costmodel.profiled import ProfiledCostModel
from flowyard.engine.engine_config import EngineConfig
from flowyard.engine.sampling import SamplingParams
from flowyard.policies.registry import PolicyOptions, build_policy
from flowyard.runtime.cluster import LocalCluster
from flowyard.sim.cluster import Topology
from flowyard.sim.simulator import Simulator


def profile_cost(num_layers: int = 2, capacity: int = 1024, scale: float = 1e-3) -> ProfiledCostModel:
    """A `flowyard profile`-style cost model (fitted from samples, as `--profile` loads one)."""
    samples = []
    for p in (0, 8, 32, 64, 128):
        for d in (0, 1, 2, 4, 8):
            if p == d == 0:
                continue
            s = BatchShape.of([(0, p)] if p else [], [16 + 8 * k for k in range(d)])
            t = {op: scale * (0.2 + 0.01 * s.tokens) for op in LAYER_OPS}
            t["attn"] = scale * (0.1 + 1e-3 * s.prefill_attn + 2e-3 * float(s.decode_ctx))
            t["step_other"] = scale * (1.0 + 0.02 * s.tokens)
            samples.append({"shape": dataclasses.asdict(s), "times": t})
    return ProfiledCostModel({"num_layers": num_layers, "kv_bytes_per_token": 256, "samples": samples,
                              "kv_capacity_tokens": capacity})


class ZeroLink:
    def transfer_time(self, nbytes: float) -> float:
        return 0.0


@dataclasses.dataclass(frozen=True)
class Job:
    arrival: float
    prompt: list[int]
    max_tokens: int
    slo: object


def simulate(name: str, jobs: list[Job], cost, opts: PolicyOptions, block: int, timeline=None) -> DecisionLog:
    log = timeline.log if timeline is not None else DecisionLog()
    reqs = [Request(i, j.arrival, prompt_len=len(j.prompt), max_tokens=j.max_tokens, slo=j.slo)
            for i, j in enumerate(jobs)]
    n = opts.num_instances
    Simulator(reqs, build_policy(name, opts), cost, Topology(n, ZeroLink(), ZeroLink()), block_size=block,
              shared_device=True, decisions=log, timeline=timeline).run()
    return log


class VirtualClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def run_cluster(name: str, jobs: list[Job], cost, opts: PolicyOptions, model, tok, block: int,
                kv_tokens: int, timeline=None) -> tuple[DecisionLog, dict[str, list[int]]]:
    clock = VirtualClock()
    log = timeline.log if timeline is not None else DecisionLog()
    policy = build_policy(name, opts)
    cluster = LocalCluster(model, tok, policy, EngineConfig(dtype="float32", kv_cache_tokens=kv_tokens, block_size=block,
                                                            enable_prefix_caching=False),
                           decisions=log, clock=clock, timeline=timeline)
    period = policy.global_scheduler.period
    cluster.ticker.period = None  # this driver delivers ticks on the simulator's schedule
    pending = sorted(range(len(jobs)), key=lambda i: (jobs[i].arrival, i))
    state = {"tick": jobs[pending[0]].arrival + period if period else None, "done": 0, "base": 0.0}
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(jobs))}

    def collect(outs) -> None:
        for o in outs:
            tokens[o.request_id] += o.new_token_ids
            state["done"] += o.finished

    def next_event(until: float, arrivals_inclusive: bool):
        """The earliest event before `until` as (time, kind) or None (kinds: 0 arrival, 4 timer)."""
        cands = []
        if pending and (jobs[pending[0]].arrival < until or arrivals_inclusive and jobs[pending[0]].arrival == until):
            cands.append((jobs[pending[0]].arrival, 0, "arrival"))
        w = cluster.next_wake()
        if w is not None and w < until:
            cands.append((w, 4, "wake"))
        if state["tick"] is not None and state["tick"] < until:
            cands.append((state["tick"], 4, "tick"))
        return min(cands) if cands else None

    def deliver(until: float, arrivals_inclusive: bool = True) -> None:
        while (ev := next_event(until, arrivals_inclusive)) is not None:
            t, _, what = ev
            clock.t = t
            if what == "arrival":
                i = pending.pop(0)
                j = jobs[i]
                cluster.add_request(f"r{i}", j.prompt, SamplingParams(max_tokens=j.max_tokens, temperature=0,
                                                                       ignore_eos=True), j.slo, arrival=t)
            elif what == "wake":
                cluster.wake_due(t)
            else:
                cluster.core.tick(t)
                more = state["done"] < len(jobs)
                state["tick"] = t + period if more else None

    def executed(plan) -> None:  # the forward pass is done: its end on the virtual clock
        start = clock.t
        if plan.preempt_stride:
            end = state["base"] + float(cost.op_boundaries(plan.shape(1))[-1])
        else:
            end = start + float(cost.step_time(plan.shape(1)))
        deliver(end)
        clock.t = end

    def boundary() -> None:  # an operator boundary of a preemptible prefill
        engine = cluster.engines[cluster._running]
        pool = engine.pool
        rel = cost.op_boundaries(pool.running.shape(1))
        b = state["base"] + float(rel[pool.ops - 1])
        deliver(b)
        clock.t = b

    for e in cluster.engines:
        e.on_executed = executed
        e.boundary_hook = boundary
        orig = e.pool.run

        def run(plan, orig=orig):  # where a (resumed) preemptible plan's timeline starts
            rel = cost.op_boundaries(plan.shape(1))
            state["base"] = clock.t - (float(rel[plan.ops_done - 1]) if plan.ops_done else 0.0)
            return orig(plan)
        e.pool.run = run

    while pending or cluster.has_unfinished():
        if cluster._ready:
            collect(cluster.step())
            # a tick or wake-up at exactly the end of that step comes after it (timers after steps)
            deliver(np.nextafter(clock.t, np.inf), arrivals_inclusive=False)
            continue
        ev = next_event(np.inf, True)
        if ev is None:
            collect(cluster.step())
            if not cluster.has_unfinished() and not pending:
                break
            continue
        deliver(np.nextafter(ev[0], np.inf))  # everything at that instant
    if state["tick"] is not None:  # the simulator fires the tick it already had scheduled
        deliver(np.nextafter(state["tick"], np.inf))
    return log, tokens
