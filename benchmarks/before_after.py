"""Do two revisions of flowyard simulate the same thing? (issue 13: the composable parts must
leave every reproduction and goodput number where it was.)

For each revision: a git worktree, then `flowyard reproduce NAME --quick` for the four papers
and one `flowyard goodput` search over every registry policy on Azure Code (4 instances, 300 s);
then a markdown report comparing the two: each reproduction's raw JSON with wall times removed,
and each policy's goodput with the ratio after/before.
Run:    python benchmarks/before_after.py run BEFORE AFTER --dir /tmp/ba      (about 15 CPU-min)
Report: python benchmarks/before_after.py report BEFORE AFTER --dir /tmp/ba --out docs/results/parts_before_after.md
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import subprocess
import sys

EXPERIMENTS = ("flowprefill", "pla-serve", "arrow", "dynaserve")
GOODPUT = ["--trace", "azure-code", "--instances", "4", "--duration", "300"]
VOLATILE = {"wall_s", "revision", "out", "command", "cpu_s", "provenance"}  # differ run to run, not results


def flowyard(src: str, *args: str) -> None:
    cmd = [sys.executable, "-c", "import sys; from flowyard.cli import main; sys.exit(main())", *args]
    subprocess.run(cmd, cwd=src, env={**os.environ, "PYTHONPATH": src}, check=True)


def run(rev: str, workdir: str) -> None:
    src = os.path.join(workdir, f"src-{rev}")
    if not os.path.isdir(src):
        subprocess.run(["git", "worktree", "add", "-f", src, rev], check=True)
    out = os.path.join(workdir, rev)
    for name in EXPERIMENTS:
        flowyard(src, "reproduce", name, "--quick", "--quiet", "--out", out)
    from flowyard.policies.registry import POLICY_SPECS
    flowyard(src, "goodput", "--policies", ",".join(POLICY_SPECS), *GOODPUT, "--quiet",
             "--json", os.path.join(out, "goodput.json"))


def strip(x):
    if isinstance(x, dict):
        return {k: strip(v) for k, v in x.items() if k not in VOLATILE}
    if isinstance(x, list):
        return [strip(v) for v in x]
    return x


def report(before: str, after: str, workdir: str) -> str:
    lines = [f"# Before/after: {before} vs {after}", "",
             f"`python benchmarks/before_after.py run {before} {after}` then `report` "
             f"({platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}). "
             "Every value below is read from that run's files.", "",
             "## Reproductions (`flowyard reproduce NAME --quick`)", "",
             "| experiment | raw JSON files | identical apart from wall time |", "|---|---|---|"]
    for name in EXPERIMENTS:
        files = sorted(glob.glob(os.path.join(workdir, before, name, "*.json")))
        same = [strip(json.load(open(f))) == strip(json.load(open(f.replace(f"/{before}/", f"/{after}/"))))
                for f in files]
        lines.append(f"| {name} | {len(files)} | {'yes' if files and all(same) else 'NO'} |")
    b = {r["policy"]: r["goodput_rps"] for r in json.load(open(os.path.join(workdir, before, "goodput.json")))["results"]}
    a = {r["policy"]: r["goodput_rps"] for r in json.load(open(os.path.join(workdir, after, "goodput.json")))["results"]}
    lines += ["", f"## Goodput (req/s), `flowyard goodput {' '.join(GOODPUT)}`", "",
              f"| policy | {before} | {after} | after / before |", "|---|---|---|---|"]
    for p in b:
        lines.append(f"| {p} | {b[p]:.3f} | {a[p]:.3f} | {a[p] / b[p]:.3f} |" if p in a and b[p] > 0
                     else f"| {p} | {b[p]:.3f} | {a.get(p, float('nan')):.3f} | n/a |")
    changed = [p for p in b if p not in a or abs(a[p] - b[p]) > 1e-9 * max(1.0, b[p])]
    lines += ["", f"Policies whose goodput changed: {', '.join(changed) if changed else 'none'} "
                  f"(of {len(b)}; every goodput is positive: {all(v > 0 for v in b.values())})."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["run", "report"])
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--dir", default="/tmp/ba")
    ap.add_argument("--out", help="report: write the markdown here (default: print)")
    args = ap.parse_args()
    if args.what == "run":
        for rev in (args.before, args.after):
            run(rev, args.dir)
        return
    text = report(args.before, args.after, args.dir)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        print(text, end="")


if __name__ == "__main__":
    main()
