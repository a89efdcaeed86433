"""Decision guard for simulator speed work: run every registry policy on a few workloads at 8
instances and write what `flowyard simulate --json` writes (minus wall time) plus a digest of
every request's outcome (instance, first token, finish, token count) into a directory; compare
two such directories.

A change that only makes the simulator faster must leave both files byte-identical.

    python benchmarks/sim_identity.py save DIR        # at the old revision (a git worktree)
    python benchmarks/sim_identity.py save DIR2       # at the new one
    python benchmarks/sim_identity.py compare DIR DIR2
    python benchmarks/sim_identity.py speed OLD_SRC    # CPU seconds at 8 instances, old vs this tree,
                                                       # runs interleaved (the machine may be shared)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

from flowyard.bench.report import write_json
from flowyard.policies.registry import POLICY_NAMES
from flowyard.sim.run import SimConfig, build_cost_model, load_workload, simulate

# (name, trace, duration in trace seconds, rate scale): three different shapes of traffic
WORKLOADS = (("conv", "azure-conv", 300.0, 1.5), ("code", "azure-code", 300.0, 1.0),
             ("burst", "burstgpt", None, 100.0), ("moon", "mooncake-conv", 200.0, 1.0))


def digest(states) -> str:
    """One hash over every request's outcome, so any routing or timing change shows."""
    h = hashlib.sha256()
    for s in states:
        h.update(repr((s.id, s.status.value, s.instance, s.first_token_time, s.finish_time,
                       s.num_output, s.preemptions)).encode())
    return h.hexdigest()


def save(out: Path, policies: list[str], workloads: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, trace, duration, scale in WORKLOADS:
        if workloads and name not in workloads:
            continue
        base = SimConfig(trace=trace, duration=duration, rate_scale=scale, instances=8)
        w = load_workload(base)
        cost = build_cost_model(base)
        for policy in policies:
            cfg = base.replace(policy=policy)
            t0 = time.perf_counter()
            summary, result = simulate(cfg, w, cost_model=cost)
            wall = time.perf_counter() - t0
            path = out / f"{name}-{policy}.json"
            write_json(summary, str(path), extra={"config": cfg.as_dict(), "events": result.events,
                                                  "sim_time_s": result.sim_time})
            data = json.loads(path.read_text())
            data.pop("wall_s", None)
            data["request_digest"] = digest(result.states)
            path.write_text(json.dumps(data, indent=1, sort_keys=True))
            (out / f"{name}-{policy}.wall").write_text(f"{wall:.3f}\n")
            print(f"{name:6s} {policy:18s} {len(w.requests):6d} req  wall {wall:6.2f} s", flush=True)


def compare(a: Path, b: Path) -> int:
    bad = 0
    names = sorted(p.name for p in a.glob("*.json"))
    wa = wb = 0.0
    for n in names:
        other = b / n
        if not other.exists():
            print(f"missing in {b}: {n}")
            bad += 1
            continue
        same = a.joinpath(n).read_text() == other.read_text()
        ta = float(a.joinpath(n).with_suffix(".wall").read_text())
        tb = float(other.with_suffix(".wall").read_text())
        wa, wb = wa + ta, wb + tb
        print(f"{'same' if same else 'DIFFERENT':9s} {n:28s} wall {ta:6.2f} -> {tb:6.2f} s")
        bad += not same
    print(f"{len(names) - bad}/{len(names)} identical; total wall {wa:.1f} -> {wb:.1f} s")
    return 1 if bad else 0


SPEED_CHILD = r"""
import sys, time
from flowyard.sim.run import SimConfig, build_cost_model, load_workload, simulate
cfg = SimConfig(trace="azure-conv", duration=600.0, instances=8, policy=sys.argv[1])
w = load_workload(cfg)
cost = build_cost_model(cfg)
c0, t0 = time.process_time(), time.perf_counter()
simulate(cfg, w, cost_model=cost)
print(time.process_time() - c0, time.perf_counter() - t0)
"""


def speed(old: Path, policies: list[str], repeat: int) -> int:
    """Best-of-`repeat` CPU seconds of one azure-conv 600 s run per policy, old vs new."""
    import os
    import subprocess

    new = Path(__file__).resolve().parents[1]
    print(f"{'policy':18s} {'old CPU s':>10s} {'new CPU s':>10s} {'new/old':>8s}")
    for p in policies:
        best = {}
        for _ in range(repeat):
            for name, src in (("old", old), ("new", new)):
                out = subprocess.run([sys.executable, "-c", SPEED_CHILD, p], capture_output=True, text=True,
                                     check=True, env={**os.environ, "PYTHONPATH": str(src)})
                cpu = float(out.stdout.split()[0])
                best[name] = min(best.get(name, cpu), cpu)
        print(f"{p:18s} {best['old']:10.2f} {best['new']:10.2f} {best['new'] / best['old']:8.2f}", flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("save")
    s.add_argument("out", type=Path)
    s.add_argument("--policies", default=",".join(POLICY_NAMES))
    s.add_argument("--workloads", default="", help="subset of " + ",".join(w[0] for w in WORKLOADS))
    c = sub.add_parser("compare")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    sp = sub.add_parser("speed")
    sp.add_argument("old", type=Path, help="source tree of the old revision (a git worktree)")
    sp.add_argument("--policies", default="vllm,arrow,dynaserve,flowyard")
    sp.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    if args.cmd == "speed":
        return speed(args.old, [p for p in args.policies.split(",") if p], args.repeat)
    if args.cmd == "save":
        save(args.out, [p for p in args.policies.split(",") if p],
             [w for w in args.workloads.split(",") if w])
        return 0
    return compare(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
