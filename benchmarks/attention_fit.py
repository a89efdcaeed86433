"""How well a quick profile's fit prices the shapes it did not sample (issue 30).

The real-cluster runs simulate every step with a fit to a quick profile (`flowyard profile
--quick`, 21 shapes). This profiles the embedded model twice on the same machine, once on the
quick grid and once on the full one (73 shapes), fits the quick profile, and prices every full
shape the quick grid lacks: attention alone (the operator whose model changed) and the whole
step. Both attention models are reported: the causal pairs alone, and with the work PyTorch's
CPU flash kernel does (`ProfiledCostModel(kernel_work=...)`). Once with one thread (a Ray
actor's engine) and once with the machine's threads (an in-process server).

Run: python benchmarks/attention_fit.py [--threads 1,2] [--out benchmarks/results/attention_fit.md]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from flowyard.core.plan import BatchShape
from flowyard.engine.profiler import step_seconds
from flowyard.costmodel.profiled import ProfiledCostModel
from flowyard.experiments.provenance import machine
from flowyard.experiments.report import md_table, source_revision


def profile(path: Path, threads: int, quick: bool) -> float:
    """`flowyard profile` in a fresh process with `threads` threads; returns its seconds."""
    cmd = [sys.executable, "-m", "flowyard.cli", "profile", "--out", str(path)]
    cmd += ["--quick", "--passes", "3"] if quick else ["--passes", "1"]
    t = time.perf_counter()
    subprocess.run(cmd, check=True, env=dict(os.environ, OMP_NUM_THREADS=str(threads)), stdout=subprocess.DEVNULL)
    return time.perf_counter() - t


def held_out(quick: dict, full: dict) -> list[dict]:
    seen = {json.dumps(s["shape"], sort_keys=True) for s in quick["samples"]}
    return [s for s in full["samples"] if json.dumps(s["shape"], sort_keys=True) not in seen]


def errors(quick: dict, shapes: list[dict], num_layers: int) -> dict[str, dict[str, np.ndarray]]:
    """Relative error of each model on each held-out shape: attention per layer, whole step."""
    out = {}
    for name, kw in (("pairs", False), ("kernel work", True)):
        m = ProfiledCostModel(quick, kernel_work=kw)
        attn, step = [], []
        for s in shapes:
            sh = BatchShape(**s["shape"])
            attn.append(float(m.layer_op_times(sh)["attn"]) / s["times"]["attn"] - 1)
            real = step_seconds(s["times"], num_layers)
            step.append(float(m.step_time(sh)) / (real + m.engine_overhead) - 1)
        out[name] = {"attn": np.array(attn), "step": np.array(step)}
    return out


def shape_label(sh: dict) -> str:
    hist = sh["prefill_kv"] - sh["prefill_tokens"] if sh["prefill_seqs"] else 0
    parts = []
    if sh["prefill_seqs"]:
        parts.append(f"prefill {sh['prefill_tokens']:g}" + (f" after {hist:g}" if hist else ""))
    if sh["decode_seqs"]:
        parts.append(f"{sh['decode_seqs']:g} decodes, ctx {sh['decode_ctx']:g}")
    return " + ".join(parts)


def section(threads: int, quick: dict, full: dict, secs: tuple[float, float]) -> list[str]:
    shapes = held_out(quick, full)
    err = errors(quick, shapes, int(full["num_layers"]))
    lines = [f"## {threads} thread{'s' if threads > 1 else ''}", "",
             f"Quick profile {len(quick['samples'])} shapes ({secs[0]:.0f} s), full profile {len(full['samples'])} shapes "
             f"({secs[1]:.0f} s); {len(shapes)} full shapes the quick grid lacks.", ""]
    rows = []
    for name, e in err.items():
        for what in ("attn", "step"):
            a = np.abs(e[what])
            rows.append([name, "attention" if what == "attn" else "whole step", f"{np.median(a):.1%}",
                         f"{np.percentile(a, 90):.1%}", f"{a.max():.1%}"])
    lines += [md_table(["attention model", "priced", "median |error|", "P90", "max"], rows), ""]
    pre = [(i, s) for i, s in enumerate(shapes) if s["shape"]["prefill_tokens"] >= 128]
    lines += ["Held-out shapes with a prefill of 128 tokens or more (attention per layer):", "",
              md_table(["shape", "measured (ms)", "pairs", "kernel work"],
                       [[shape_label(s["shape"]), f"{s['times']['attn'] * 1e3:.3f}",
                         f"{err['pairs']['attn'][i]:+.0%}", f"{err['kernel work']['attn'][i]:+.0%}"] for i, s in pre]), ""]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts to profile with")
    ap.add_argument("--out", default="benchmarks/results/attention_fit.md")
    ap.add_argument("--work-dir", default=None, help="where the profiles go (default: a temp dir)")
    args = ap.parse_args()
    try:
        threads = [int(t) for t in args.threads.split(",")]
    except ValueError:
        sys.exit(f"attention_fit: --threads takes comma-separated integers, got {args.threads!r}")
    if not threads or min(threads) < 1:
        sys.exit("attention_fit: --threads must name at least one count of 1 or more")
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="attention-fit-"))
    work.mkdir(parents=True, exist_ok=True)
    import torch

    host = machine()
    lines = [f"# Attention fit on shapes the profile did not sample (revision {source_revision() or 'unknown'})", "",
             f"Machine: {host['arch']}, {host['cpu']}; torch {torch.__version__}, {host['cpus']} CPUs. "
             f"Command: `python {' '.join(sys.argv)}`. Profiles in {work}.", ""]
    for t in threads:
        q, f = work / f"quick-{t}.json", work / f"full-{t}.json"
        secs = (profile(q, t, quick=True), profile(f, t, quick=False))
        print(f"profiled with {t} thread(s) in {secs[0]:.0f} + {secs[1]:.0f} s", file=sys.stderr, flush=True)
        lines += section(t, json.loads(q.read_text()), json.loads(f.read_text()), secs)
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
