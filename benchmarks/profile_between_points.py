"""How well a quick profile prices the steps between its grid points, engine padding off and on.

A real-cluster run profiles the engine on the quick grid (`flowyard profile --quick`), whose
token counts are few (1, 3, 4, 8, 16, 32, 64, ...), and the cost model interpolates between them.
Decode batches and chunk sizes in a served run take every count in between. This makes a quick
profile of the embedded float32 engine with its small GEMMs unpadded and one with them padded
(core/padding.py), then times steps at every decode batch from 1 to 32, chunks of 6 to 38 tokens
over 512 cached tokens beside two decodes, and fresh prompts of 16 to 96 tokens, through the
profiler's own path, and compares each with its own profile's price. The two profiles' passes
and the rounds alternate the two settings so a slow minute on a shared VM hits both alike; a
step's time is its median over rounds, a profile's sample its median over passes.
"Held out" counts only steps whose token count no grid point ran.

Run: python benchmarks/profile_between_points.py [--rounds 2] [--passes 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

from flowyard.core.plan import BatchShape
from flowyard.costmodel.profiled import ProfiledCostModel
from flowyard.engine import skinny_gemm
from flowyard.engine.engine_config import EngineConfig
from flowyard.engine.llm_engine import LLMEngine
from flowyard.engine.profiler import (GridPoint, default_grid, point_blocks, run_profile, scratch_runner, spread,
                                      step_seconds, time_point)
from flowyard.experiments.provenance import generated_by
from flowyard.experiments.report import heading, source_revision

GROUPS = (("decodes 1-4", "d", 1, 4), ("decodes 5-8", "d", 5, 8), ("decodes 9-16", "d", 9, 16),
          ("decodes 17-32", "d", 17, 32), ("chunk 6-38 + 2 decodes", "c", 0, 99), ("prompt 16-96", "p", 0, 999))


def points() -> list[tuple[str, int, GridPoint]]:
    pts = [("d", b, GridPoint(decode=spread(256, b))) for b in range(1, 33)]
    pts += [("c", n, GridPoint(prefill=[(512, n)], decode=spread(300, 2))) for n in range(6, 39, 2)]
    pts += [("p", n, GridPoint(prefill=[(0, n)])) for n in range(16, 97, 8)]
    return pts


def tokens(p: GridPoint) -> int:
    return sum(n for _, n in p.prefill) + len(p.decode)


def median_profile(passes: list[dict]) -> dict:
    """One profile from several one-pass profiles of the same grid: each operator's median."""
    out = dict(passes[0], passes=len(passes))
    out["samples"] = [{"shape": s["shape"], "times": {op: statistics.median(p["samples"][i]["times"][op] for p in passes)
                                                    for op in s["times"]}}
                      for i, s in enumerate(passes[0]["samples"])]
    return out


def summary(errs: list[float]) -> str:
    if not errs:
        return "—"
    a = np.abs(errs)
    return f"{np.median(a) * 100:.0f} % / {np.percentile(a, 90) * 100:.0f} % ({len(a)})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--passes", type=int, default=3, help="passes of each quick profile (real-cluster runs: 3)")
    ap.add_argument("--out", type=Path, default=None, help="also write the report here (markdown)")
    args = ap.parse_args()
    rev = source_revision()
    if args.rounds < 1 or args.passes < 1:
        ap.error("--rounds and --passes must be at least 1")
    engine = LLMEngine.from_path(None, EngineConfig(dtype="float32", kv_cache_memory_mb=256))
    if not engine.model.linear.skinny_mm:
        raise SystemExit("this CPU's engine does not take the skinny product (skinny_gemm.transposed_faster): "
                         "nothing is padded here")
    settings = {"unpadded": None, "padded": skinny_gemm.ROW_PADDING}
    passes: dict[str, list[dict]] = {name: [] for name in settings}
    for _ in range(args.passes):  # the two profiles' passes alternate, as the rounds below do
        for name, pad in settings.items():
            engine.model.linear.row_padding = pad
            passes[name].append(run_profile(engine.runner, grid=default_grid(quick=True), repeats=3))
    models = {name: ProfiledCostModel(median_profile(ps)) for name, ps in passes.items()}
    grid_tokens = {int(BatchShape(**s["shape"]).tokens) for s in passes["padded"][0]["samples"]}
    pts = points()
    runner = scratch_runner(engine.runner, max(point_blocks(p, engine.runner.bs) for _, _, p in pts))
    layers = engine.model.cfg.num_layers
    times: dict[tuple[str, str, int], list[float]] = {}
    for _ in range(args.rounds):
        for name, pad in settings.items():
            engine.model.linear.row_padding = pad
            for kind, n, p in pts:
                times.setdefault((name, kind, n), []).append(step_seconds(time_point(runner, p, repeats=3), layers))
    out = [heading(f"A quick profile's price between its grid points, small GEMMs unpadded and padded "
                   f"(report at {rev or 'unknown revision'})", rev), "",
           f"{generated_by('benchmarks/profile_between_points.py', sys.argv[1:])}, torch {torch.__version__} ({torch.get_num_threads()} threads); "
           f"padding rule {skinny_gemm.ROW_PADDING}. Each cell: median / P90 of |real step / its profile's price - 1| "
           "over the group's steps (their count).", ""]
    head = "| steps | " + " | ".join(f"{s}: median / P90 |error| (steps)" for s in settings)
    lines = [head + " | " + " | ".join(f"{s}: held out" for s in settings) + " | "
             + "step time padded / unpadded |", "|---|" + "---|" * (2 * len(settings) + 1)]
    for label, kind, lo, hi in (*GROUPS, ("all", "", 0, 999)):
        sel = [(k, n, p) for k, n, p in pts if (not kind or k == kind) and (kind != "d" or lo <= n <= hi)]
        errs = {s: [] for s in settings}
        held = {s: [] for s in settings}
        for k, n, p in sel:
            shape = BatchShape.of(p.prefill, p.decode)
            for s in settings:
                real = statistics.median(times[(s, k, n)])
                e = real / float(models[s].step_time(shape)) - 1
                errs[s].append(e)
                if tokens(p) not in grid_tokens:
                    held[s].append(e)
        speed = [statistics.median(times[("padded", k, n)]) / statistics.median(times[("unpadded", k, n)])
                 for k, n, _ in sel]
        lines.append(f"| {label} | " + " | ".join(summary(errs[s]) for s in settings) + " | "
                     + " | ".join(summary(held[s]) for s in settings) + f" | {statistics.median(speed):.2f}x median |")
    out += [*lines, "", "Every step (ms, median over rounds; price in brackets):", "",
            "| step | tokens | " + " | ".join(settings) + " |", "|---|---:|" + "---|" * len(settings)]
    for k, n, p in pts:
        shape = BatchShape.of(p.prefill, p.decode)
        cells = [f"{1e3 * statistics.median(times[(s, k, n)]):.1f} ({1e3 * float(models[s].step_time(shape)):.1f})"
                 for s in settings]
        out.append(f"| {dict(d='decodes', c='chunk over 512 + 2 decodes', p='prompt')[k]} {n} | {tokens(p)} | "
                   + " | ".join(cells) + " |")
    text = "\n".join(out) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
