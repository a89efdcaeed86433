"""Record every registry policy's `flowyard simulate` output on three small workloads, or
compare two such records: a refactor of the policies must not change a single decision.

    python benchmarks/policy_identity.py record OUT_DIR
    python benchmarks/policy_identity.py compare BEFORE_DIR AFTER_DIR

A record holds, per (policy, workload), the `--json` summary and the `--timeline` trace (every
step, KV transfer and cluster decision), with the wall-clock fields removed, so `compare` is a
byte comparison of what the simulator decided. It runs the `flowyard` next to this Python.
`sim_identity.py` guards simulator speed work by request outcomes on larger runs; this one is
for refactors of the policies: small runs, and every decision and step event compared."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from flowyard.policies.registry import POLICY_NAMES

# name -> simulate flags: short runs, loaded past the SLOs so shedding, flips and migrations act
WORKLOADS: dict[str, list[str]] = {
    "azure-conv": ["--trace", "azure-conv", "--num-requests", "200", "--rate-scale", "150", "--instances", "4",
                   "--ttft-slo", "0.3"],
    "burstgpt": ["--trace", "burstgpt", "--num-requests", "150", "--rate-scale", "400", "--instances", "4",
                 "--enable-prefix-caching", "--ttft-slo", "0.3"],
    "azure-code": ["--trace", "azure-code", "--num-requests", "150", "--rate-scale", "80", "--instances", "4",
                   "--ttft-slo", "0.5", "--tpot-slo", "0.05"],
}
WALL_KEYS = ("wall_s", "events_per_s")


def _strip(obj: object) -> object:
    """`obj` without wall-clock fields (the only ones a run may differ in)."""
    if isinstance(obj, dict):
        return {k: _strip(v) for k, v in obj.items() if k not in WALL_KEYS}
    if isinstance(obj, list):
        return [_strip(v) for v in obj]
    return obj


def _run(policy: str, workload: str, out: Path) -> str:
    exe = Path(sys.executable).with_name("flowyard")
    with tempfile.TemporaryDirectory() as tmp:
        summary, timeline = Path(tmp) / "s.json", Path(tmp) / "t.json"
        cmd = [str(exe), "simulate", "--policy", policy, *WORKLOADS[workload], "--quiet",
               "--json", str(summary), "--timeline", str(timeline)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            return f"{policy} {workload}: exit {done.returncode}: {done.stderr.strip()[-300:]}"
        record = {"summary": _strip(json.loads(summary.read_text())),
                  "timeline": _strip(json.loads(timeline.read_text()))}
    (out / f"{policy}__{workload}.json").write_text(json.dumps(record, sort_keys=True, indent=0))
    return f"{policy} {workload}: ok"


def record(out: Path, jobs: int) -> int:
    out.mkdir(parents=True, exist_ok=True)
    cells = [(p, w) for p in POLICY_NAMES for w in WORKLOADS]
    with ThreadPoolExecutor(jobs) as pool:
        lines = list(pool.map(lambda c: _run(c[0], c[1], out), cells))
    print("\n".join(lines))
    return 0 if all(line.endswith(": ok") for line in lines) else 1


def compare(before: Path, after: Path) -> int:
    names = sorted({p.name for p in before.glob("*.json")} | {p.name for p in after.glob("*.json")})
    differ = [n for n in names if not (before / n).exists() or not (after / n).exists()
              or (before / n).read_bytes() != (after / n).read_bytes()]
    print(f"{len(names) - len(differ)} of {len(names)} records byte-identical")
    for n in differ:
        print(f"DIFFERS: {n}")
    return 1 if differ or not names else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("out", type=Path)
    r.add_argument("--jobs", type=int, default=2)
    c = sub.add_parser("compare")
    c.add_argument("before", type=Path)
    c.add_argument("after", type=Path)
    a = ap.parse_args()
    return record(a.out, a.jobs) if a.cmd == "record" else compare(a.before, a.after)


if __name__ == "__main__":
    sys.exit(main())
