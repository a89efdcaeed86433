"""Simulator speed: replay the whole Azure conversation trace (19,366 requests, 1 h) on 8
simulated H100 with the `vllm` policy, then the trace tiled x2 and x4 in time (same load, more
requests), and print wall time, events/s and the cost per request relative to x1.

Target (issue 2): x1 in at most 10 s on a 2-core machine; cost linear in requests.
Run: python benchmarks/sim_throughput.py [--policy vllm] [--copies 1,2,4] [--repeat 2]
Wall time includes summarising the metrics; it is the best of --repeat runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import time

from flowyard.sim.run import SimConfig, build_cost_model, load_workload, simulate
from flowyard.workloads import Workload


def tile(w: Workload, copies: int) -> Workload:
    """The trace repeated `copies` times back to back: same load, copies x the requests."""
    span = w.duration + 1.0
    reqs = [
        dataclasses.replace(r, id=k * len(w.requests) + r.id, arrival=r.arrival + k * span)
        for k in range(copies) for r in w.requests
    ]
    return w.derive(reqs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--policy", default="vllm")
    ap.add_argument("--trace", default="azure-conv")
    ap.add_argument("--instances", type=int, default=8)
    ap.add_argument("--copies", default="1,2,4")
    ap.add_argument("--repeat", type=int, default=2, help="best of N runs (the VM is noisy)")
    args = ap.parse_args()
    cfg = SimConfig(trace=args.trace, model="llama-3-8b", hardware="h100", instances=args.instances,
                    policy=args.policy, prefill_instances=None)
    base = load_workload(cfg)
    cost = build_cost_model(cfg)
    print(f"machine: {platform.processor() or platform.machine()}, python {platform.python_version()}")
    print(f"{'copies':>6} {'requests':>9} {'events':>9} {'steps':>10} {'wall s':>7} "
          f"{'events/s':>9} {'ms/1k req':>9} {'vs x1':>6} {'attain':>7}")
    per_req0 = None
    for copies in [int(c) for c in args.copies.split(",")]:
        w = tile(base, copies)
        wall = float("inf")
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            summary, res = simulate(cfg, w, cost_model=cost)
            wall = min(wall, time.perf_counter() - t0)
        per_req = wall / len(w.requests)
        per_req0 = per_req0 or per_req
        print(f"{copies:>6} {len(w.requests):>9,} {res.events:>9,} {res.steps:>10,} {wall:>7.2f} "
              f"{res.events / wall:>9,.0f} {per_req * 1e6:>9.1f} {per_req / per_req0:>6.2f} "
              f"{summary.slo_attainment:>7.1%}")


if __name__ == "__main__":
    main()
