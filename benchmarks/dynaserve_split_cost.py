"""Cost of one DynaServe split decision (Alg. 1: K-probe bisection on the virtual-batch
predictor, plus committing the chosen segments) against the round-robin router, on a cluster
whose instances already hold 8, 64 or 512 queued requests.

The paper reports 13-17 ms per request (Table 3, C++ scheduler, Qwen-2.5-14B on 2 GPUs). The
instances here are a fake cluster view whose snapshots agree with the scheduler's own view
(so no re-seeding happens: the steady state), with Qwen2.5-14B on A100-80G priced by the
roofline. Each timed decision starts from the same queue (the router's state is copied before
it), so the queue length is what the row says.

    python benchmarks/dynaserve_split_cost.py [--decisions 200] [--sizes 8,64,512]
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import time

import numpy as np

from flowyard.core.request import Request
from flowyard.costmodel import make_cost_model
from flowyard.policies.framework.contracts import InstanceSnapshot, Role
from flowyard.policies.dynaserve.split import DynaServeConfig, DynaServeRouter
from flowyard.policies.dynaserve.lengths import OracleLengthPredictor
from flowyard.policies.baselines.routers import RoundRobin


class MirrorView:
    """Two MIXED instances whose snapshots say exactly what the router's views predict."""

    def __init__(self, router: DynaServeRouter, now: float = 0.0) -> None:
        self.router, self.now = router, now

    def instances(self, role: Role | None = None) -> list[int]:
        return [0, 1]

    def snapshot(self, i: int) -> InstanceSnapshot:
        v = self.router.view(i)
        dec = v.decoding_at(self.now)
        return InstanceSnapshot(instance=i, role=Role.MIXED, num_running=dec + 1, num_waiting=1,
                                waiting_tokens=int(v.prefill_left(self.now)), running_tokens=0,
                                kv_free_blocks=1, kv_total_blocks=2, block_size=16, num_decoding=dec)


def request(i: int, rng: np.random.Generator) -> Request:
    """P2048/D512-shaped requests with some spread (DynaServe's balanced workload)."""
    return Request(id=i, arrival=0.0, prompt_len=int(rng.integers(1024, 3072)),
                   output_len=int(rng.integers(256, 768)))


def measure(size: int, decisions: int, cost) -> tuple[float, float, float, float, float]:
    """(µs per DynaServe decision: wall and CPU medians, µs per round-robin route, mean probes,
    passes per view)."""
    rng = np.random.default_rng(size)
    router = DynaServeRouter(cost, OracleLengthPredictor(), DynaServeConfig())
    view = MirrorView(router)
    for i in range(size):  # the queue: requests already assigned, none executed yet
        router.route(request(i, rng), view, 0.0)
    reqs = [request(size + i, rng) for i in range(decisions)]
    times, cpu, probes = [], [], []
    for r in reqs:
        trial = copy.deepcopy(router)
        v = MirrorView(trial)
        c, t = time.process_time(), time.perf_counter()
        trial.route(r, v, 0.0)
        trial.split_point(r, trial.last.first, v, 0.0)  # type: ignore[union-attr]
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
        probes.append(len(trial.last.probes))  # type: ignore[union-attr]
    rr, rv = RoundRobin(), MirrorView(router)
    t = time.perf_counter()
    for r in reqs:
        rr.route(r, rv, 0.0)
    rr_us = (time.perf_counter() - t) / len(reqs) * 1e6
    passes = (router.view(0).passes + router.view(1).passes) / 2
    return float(np.median(times)) * 1e6, float(np.median(cpu)) * 1e6, rr_us, float(np.mean(probes)), passes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--decisions", type=int, default=200)
    ap.add_argument("--sizes", default="8,64,512")
    args = ap.parse_args()
    cost = make_cost_model("qwen2.5-14b", "a100-80g")
    print(f"machine: {platform.processor() or platform.machine()}, Python {platform.python_version()}")
    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    print("| queued requests | passes per view | probes | DynaServe µs/decision, wall (median) | CPU µs (median) "
          "| round robin µs/route | ratio (wall) |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for size in (int(s) for s in args.sizes.split(",")):
        ds, cpu, rr, k, passes = measure(size, args.decisions, cost)
        print(f"| {size} | {passes:.0f} | {k:.1f} | {ds:.0f} | {cpu:.0f} | {rr:.2f} | {ds / rr:.0f}× |")


if __name__ == "__main__":
    main()
