"""The two-executor guard's driver: one workload through the simulator and through a real
in-process cluster whose clock is virtual, each step priced by the same profile cost model.

The cluster's engines really run the tiny model; only time is simulated. The cluster is a
`LocalCluster` (engines in this process) or a `RayCluster` in lockstep (one actor process per
instance, stepped one at a time by the driver). The driver delivers
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
from flowyard.runtime.lockstep import StepPause
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


def simulate(name: str, jobs: list[Job], cost, opts: PolicyOptions, block: int, timeline=None,
             ran: list | None = None) -> DecisionLog:
    """The workload through the simulator (ran: gets the `Simulator`, to read its instances)."""
    log = timeline.log if timeline is not None else DecisionLog()
    reqs = [Request(i, j.arrival, prompt_len=len(j.prompt), max_tokens=j.max_tokens, slo=j.slo)
            for i, j in enumerate(jobs)]
    n = opts.num_instances
    sim = Simulator(reqs, build_policy(name, opts), cost, Topology(n, ZeroLink(), ZeroLink()), block_size=block,
                    shared_device=True, decisions=log, timeline=timeline)
    sim.run()
    if ran is not None:
        ran.append(sim)
    return log


class VirtualClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def priced(p: StepPause, cost) -> float:
    """When a step reaches a pause on the virtual clock: the cost model's step time after its
    start, or, for a preemptible plan, the operator boundary's time on its operator timeline
    (which starts where the plan's first run started: a resumed plan continues it)."""
    if p.stride:
        rel = cost.op_boundaries(p.shape)
        base = p.start - (float(rel[p.ops_done - 1]) if p.ops_done else 0.0)
        return base + float(rel[-1] if p.kind == "executed" else rel[p.ops - 1])
    return p.start + float(cost.step_time(p.shape))


def run_cluster(name: str, jobs: list[Job], cost, opts: PolicyOptions, model, tok, block: int,
                kv_tokens: int, timeline=None) -> tuple[DecisionLog, dict[str, list[int]]]:
    """The workload through a `LocalCluster` on a virtual clock."""
    clock = VirtualClock()
    log = timeline.log if timeline is not None else DecisionLog()
    cluster = LocalCluster(model, tok, build_policy(name, opts), engine_config(kv_tokens, block),
                           decisions=log, clock=clock, timeline=timeline)
    drive = Driver(cluster, jobs, clock, cost)
    starts = {}

    def executed(plan, e) -> None:  # the forward pass is done
        start = starts.pop(e.instance, clock.t) if plan.preempt_stride else clock.t
        drive.pause(StepPause(e.instance, "executed", start, plan.shape(1), plan.preempt_stride, plan.ops_done,
                              plan.ops_done))

    def boundary(e) -> None:  # an operator boundary of a preemptible prefill
        plan = e.pool.running
        drive.pause(StepPause(e.instance, "boundary", starts[e.instance], plan.shape(1), plan.preempt_stride,
                              plan.ops_done, e.pool.ops))

    for e in cluster.engines:
        e.on_executed = lambda plan, e=e: executed(plan, e)
        e.boundary_hook = lambda e=e: boundary(e)
        orig = e.pool.run

        def run(plan, orig=orig, e=e):  # where a (resumed) preemptible plan's step starts
            starts[e.instance] = clock.t
            return orig(plan)
        e.pool.run = run

    return drive.run(), drive.tokens


def run_ray_cluster(name: str, jobs: list[Job], cost, opts: PolicyOptions, model_dir: str, block: int,
                    kv_tokens: int, actors: list) -> tuple[DecisionLog, dict[str, list[int]]]:
    """The workload through a `RayCluster` in lockstep on a virtual clock (Ray initialised).
    actors: running actors to reuse, given back (plus any started) when the run is done."""
    from flowyard.runtime.ray_cluster import RayCluster

    clock = VirtualClock()
    log = DecisionLog()
    cluster = RayCluster(model_dir, build_policy(name, opts), engine_config(kv_tokens, block), decisions=log,
                         lockstep=True, clock=clock, actors=actors)
    try:
        drive = Driver(cluster, jobs, clock, cost)
        cluster.on_pause = drive.pause
        drive.run()
        assert all(s.kv_free_blocks == s.kv_total_blocks for s in cluster.fresh_snapshots())  # no KV kept
    finally:
        used = cluster.detach()
        actors[:len(used)] = used
    return log, drive.tokens


def load_dir(model_dir: str):
    """(CausalLM, tokenizer) of a checkpoint directory (what the Ray actors load)."""
    from helpers_models import load_model

    return load_model(model_dir)


def engine_config(kv_tokens: int, block: int) -> EngineConfig:
    return EngineConfig(dtype="float32", kv_cache_tokens=kv_tokens, block_size=block, enable_prefix_caching=False)


class Driver:
    """Delivers the clock's events to a cluster (`LocalCluster`, or `RayCluster` in lockstep)
    in the simulator's order and prices every pause of a step with the cost model."""

    def __init__(self, cluster, jobs: list[Job], clock: VirtualClock, cost) -> None:
        self.cluster, self.jobs, self.clock, self.cost = cluster, jobs, clock, cost
        # the cluster core's tick grid (`flowyard.cluster.ticks`), which the simulator keeps
        # too: this driver delivers each tick at its own time, inside steps as well
        self.ticks = cluster.core.ticks
        self.pending = sorted(range(len(jobs)), key=lambda i: (jobs[i].arrival, i))
        self.done = 0
        self.tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(jobs))}

    def collect(self, outs) -> None:
        for o in outs:
            assert o.error is None, o.error
            self.tokens[o.request_id] += o.new_token_ids
            self.done += o.finished

    def next_event(self, until: float, arrivals_inclusive: bool):
        """The earliest event before `until` as (time, kind) or None (kinds: 0 arrival, 4 timer)."""
        cands = []
        jobs, pending = self.jobs, self.pending
        if pending and (jobs[pending[0]].arrival < until or arrivals_inclusive and jobs[pending[0]].arrival == until):
            cands.append((jobs[pending[0]].arrival, 0, "arrival"))
        w = self.cluster.next_wake()
        if w is not None and w < until:
            cands.append((w, 4, "wake"))
        if self.ticks.next is not None and self.ticks.next < until:
            cands.append((self.ticks.next, 4, "tick"))
        return min(cands) if cands else None

    def deliver(self, until: float, arrivals_inclusive: bool = True) -> None:
        cluster = self.cluster
        while (ev := self.next_event(until, arrivals_inclusive)) is not None:
            t, _, what = ev
            self.clock.t = t
            if what == "arrival":
                i = self.pending.pop(0)
                j = self.jobs[i]
                cluster.add_request(f"r{i}", j.prompt, SamplingParams(max_tokens=j.max_tokens, temperature=0,
                                                                       ignore_eos=True), j.slo, arrival=t)
            elif what == "wake":
                cluster.wake_due(t)
            else:
                assert cluster.core.tick_due(t)
                if self.done >= len(self.jobs):  # the simulator's last tick
                    self.ticks.end()

    def pause(self, p: StepPause) -> None:
        """A step stopped (its forward pass done, or at an operator boundary): what happens
        before that moment happens first, then the clock reaches it."""
        t = priced(p, self.cost)
        self.deliver(t)
        self.clock.t = t

    def run(self) -> DecisionLog:
        cluster = self.cluster
        while self.pending or cluster.has_unfinished():
            if cluster.turns.ready:
                self.collect(cluster.step())
                # a tick or wake-up at exactly the end of that step comes after it (timers after steps)
                self.deliver(np.nextafter(self.clock.t, np.inf), arrivals_inclusive=False)
                continue
            ev = self.next_event(np.inf, True)
            if ev is None:
                self.collect(cluster.step())
                if not cluster.has_unfinished() and not self.pending:
                    break
                continue
            self.deliver(np.nextafter(ev[0], np.inf))  # everything at that instant
        if self.ticks.next is not None:  # the simulator fires the tick it already had scheduled
            self.deliver(np.nextafter(self.ticks.next, np.inf))
        return cluster.decisions
