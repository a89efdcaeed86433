"""float32 linears of a few rows as W @ x^T (CPU).

A decode step multiplies a few rows (one per sequence) by every weight of the model, so its
linears are bound by reading each weight once. On some CPUs MKL's float32 GEMM in `F.linear`'s
layout (x @ W^T) reads a weight several times over when it has 2 to a few dozen rows: on the
2-core AVX2 EPYC VM a 3-row product cost about three times a 1-row one, so a 3-stream decode
step cost twice a 1-stream step and a step's cost jumped with its batch size in a way no smooth
cost model follows. The same product as W @ x^T (a tall GEMM with a skinny right side) streams
each weight once. Which layout is faster is measured once per process, since CPU flags alone
do not tell; FLOWYARD_SKINNY_GEMM=linear|mm decides instead. The sums are float32 either way,
only their order differs (last-bit differences). Measured in benchmarks/results/skinny_gemm.md
(`python benchmarks/skinny_gemm_speed.py`).

The same MKL product runs fast only at some skinny sides there (15 rows cost about twice 16, 3
rows more than 4), so the engine pads a product of 3 rows to 4 and of 7 to 32 rows up to the
next multiple of 8 (`ROW_PADDING`, flowyard/core/padding.py), where that measured faster (the
zero rows are multiplied, then cut from the result). Its profile records the rule so the
simulator prices the rows actually multiplied.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Callable

import torch
import torch.nn.functional as F

from flowyard.core.padding import RowPadding

MAX_ROWS = 32  # rows up to which W @ x^T is used (at 64 F.linear was as fast or faster)
# 3 rows as 4; 7 to 32 rows to a multiple of 8 (5 and 6 rows unpadded were faster than 8; past
# MAX_ROWS the engine calls F.linear, unpadded)
ROW_PADDING = RowPadding(((3, 4, 4), (7, MAX_ROWS, 8)))


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """A float32 CPU call of 1 to MAX_ROWS rows."""
    return (weight.dtype == torch.float32 and x.dtype == torch.float32 and x.dim() == 2
            and weight.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS
            and x.device.type == "cpu" and not x.requires_grad)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           padding: RowPadding | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) computed as (weight @ x^T)^T, contiguous; with `padding`, over
    x padded with zero rows to the rule's row count."""
    n = x.shape[0]
    m = n if padding is None else padding.rows(n)
    xt = x.t() if m == n else F.pad(x, (0, 0, 0, m - n)).t()
    out = torch.mm(weight, xt)[:, :n].t().contiguous()
    return out if bias is None else out.add_(bias)


def faster(env: str, on: str, off: str, rows: int, out_features: int, fast: Callable, slow: Callable) -> bool:
    """Whether `fast(x, w)` beats `slow(x, w)` by 0.8x on `rows` rows of an `out_features` x 576
    weight here (best of seven each), unless the environment variable `env` says `on` or `off`."""
    forced = os.environ.get(env, "auto")
    if forced not in ("auto", on, off):
        raise ValueError(f"{env} must be auto, {off} or {on}, got {forced!r}")
    if forced != "auto":
        return forced == on
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(out_features, 576, generator=gen), torch.randn(rows, 576, generator=gen)
    return best_seconds(lambda: fast(x, w), 8) < 0.8 * best_seconds(lambda: slow(x, w), 8)


@functools.cache
def transposed_faster() -> bool:
    """Whether W @ x^T beats F.linear on a float32 product of 4 rows of a 16,384 x 576 weight,
    larger than the caches (about 70 ms once per process; best of three once chose F.linear on
    a machine still busy from a benchmark); FLOWYARD_SKINNY_GEMM=linear|mm decides instead."""
    return faster("FLOWYARD_SKINNY_GEMM", "mm", "linear", 4, 16_384, linear, F.linear)


@functools.cache
def padding_faster() -> bool:
    """Whether the padded product beats the unpadded one on 15 rows of a 3,072 x 576 weight
    (SmolLM2's gate_up); FLOWYARD_SKINNY_PAD=on|off decides instead."""
    return faster("FLOWYARD_SKINNY_PAD", "on", "off", 15, 3072,
                  lambda x, w: linear(x, w, padding=ROW_PADDING), linear)


def best_seconds(fn: Callable[[], object], runs: int = 4) -> float:
    """The fastest of `runs` calls of `fn` after the first (a warm-up): the engine's start-up
    checks that pick a GEMM layout (here and model.large_gemm_f32) compare these."""
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times[1:])
