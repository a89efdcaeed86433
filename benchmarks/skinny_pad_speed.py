"""Small float32 GEMMs padded to a multiple of 8 rows against unpadded (core/padding.py).

Part 1 times one decoder layer's four linears of SmolLM2-135M (qkv 960 x 576, o 576 x 576,
gate_up 3,072 x 576, down 576 x 1,536) as the engine's skinny product W @ x^T, for every row
count from 1 to 40, unpadded and padded by `skinny_gemm.ROW_PADDING`. Part 2 times the embedded
model's whole float32 steps through the profiler's own path (`time_point`, the engine's runner):
decode steps of 1 to 24 sequences and prefill chunks of 9 to 31 tokens over 512 cached tokens
beside two decodes, padding off and on. Each cell is the best of `--rounds` interleaved rounds
(median beside it), so a slow minute on a shared VM hits both columns alike; which setting goes
first alternates by round.

Run: python benchmarks/skinny_pad_speed.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from flowyard.engine import skinny_gemm
from flowyard.engine.engine_config import EngineConfig
from flowyard.engine.llm_engine import LLMEngine
from flowyard.engine.profiler import GridPoint, point_blocks, scratch_runner, spread, step_seconds, time_point
from flowyard.experiments.provenance import generated_by
from flowyard.experiments.report import heading, source_revision

LAYER = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # (out, in) of qkv, o, gate_up, down
PAD = skinny_gemm.ROW_PADDING
# Which setting runs first alternates by round: the second of a back-to-back pair ran about 15 %
# slower on identical code (1, 2 and 4 rows, which are not padded) when padded always went second.
ORDER = ((False, True), (True, False))


def layer_ms(ws: list[torch.Tensor], xs: list[torch.Tensor], padded: bool, reps: int = 10) -> float:
    pad = PAD if padded else None
    skinny_gemm.linear(xs[0], ws[0], padding=pad)
    t = time.perf_counter()
    for _ in range(reps):
        for w, x in zip(ws, xs):
            skinny_gemm.linear(x, w, padding=pad)
    return 1e3 * (time.perf_counter() - t) / reps


def cell(res: list[float], base: list[float]) -> str:
    return f"{min(res):.2f} ({min(res) / min(base):.2f}x), median {statistics.median(res):.2f}"


def kernel_table(rounds: int) -> list[str]:
    gen = torch.Generator().manual_seed(0)
    ws = [torch.randn(o, i, generator=gen) for o, i in LAYER]
    rows = range(1, 41)
    xs = {n: [torch.randn(n, i, generator=gen) for _, i in LAYER] for n in rows}
    runs: dict[tuple[int, bool], list[float]] = {(n, p): [] for n in rows for p in (False, True)}
    for r in range(rounds):
        for n in rows:
            for p in ORDER[r % 2]:
                runs[(n, p)].append(layer_ms(ws, xs[n], p))
    lines = ["| rows | padded to | unpadded ms | padded ms (ratio) |", "|---:|---:|---:|---|"]
    for n in rows:
        lines.append(f"| {n} | {PAD.rows(n)} | {min(runs[(n, False)]):.2f} | {cell(runs[(n, True)], runs[(n, False)])} |")
    return lines


def step_table(rounds: int) -> list[str]:
    engine = LLMEngine.from_path(None, EngineConfig(dtype="float32", kv_cache_memory_mb=256))
    points = [(f"{b} decodes", GridPoint(decode=spread(256, b))) for b in range(1, 25)]
    points += [(f"{n}-token chunk over 512 + 2 decodes", GridPoint(prefill=[(512, n)], decode=spread(300, 2)))
               for n in (9, 13, 15, 21, 27, 29)]
    runner = scratch_runner(engine.runner, max(point_blocks(p, engine.runner.bs) for _, p in points))
    layers = engine.model.cfg.num_layers
    runs: dict[tuple[str, bool], list[float]] = {(k, p): [] for k, _ in points for p in (False, True)}
    for r in range(rounds):
        for key, point in points:
            for p in ORDER[r % 2]:
                engine.model.linear.row_padding = PAD if p else None
                runs[(key, p)].append(1e3 * step_seconds(time_point(runner, point, repeats=2), layers))
        print(f"round {r + 1}/{rounds}: load average {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
    lines = ["| step | rows | unpadded ms | padded ms (ratio) |", "|---|---:|---:|---|"]
    for key, point in points:
        n = sum(n for _, n in point.prefill) + len(point.decode)
        lines.append(f"| {key} | {n} → {PAD.rows(n)} | {min(runs[(key, False)]):.1f} | "
                     f"{cell(runs[(key, True)], runs[(key, False)])} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None, help="also write the report here (markdown)")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    rev = source_revision()
    out = [heading(f"Small float32 GEMMs padded to a multiple of 8 rows (report at {rev or 'unknown revision'})", rev), "",
           f"{generated_by('benchmarks/skinny_pad_speed.py', sys.argv[1:])}; torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}), "
           f"{torch.get_num_threads()} threads; skinny_gemm.transposed_faster() = {skinny_gemm.transposed_faster()}, "
           f"padding_faster() = {skinny_gemm.padding_faster()}; rule {PAD}. Each cell: best of {args.rounds} "
           "interleaved rounds (ratio padded / unpadded), median beside it.", "",
           "## One decoder layer's four linears (W @ x^T)", "", *kernel_table(args.rounds), "",
           "## Whole steps of the embedded model (the profiler's path)", "", *step_table(args.rounds)]
    text = "\n".join(out) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
