"""float32 vocabulary projections of a few rows as W @ x^T (CPU).

A decode step's lm_head multiplies a few rows (one per sampled sequence) by the vocabulary
matrix (SmolLM2: 49,152 x 576, 113 MB in float32), so it is bound by reading that matrix once.
On some CPUs MKL's float32 GEMM for `F.linear`'s layout (x @ W^T, 2 to 32 rows) reads it several
times over: on the 2-core AVX2 VM (EPYC, no AVX-512) 2 rows cost twice one row and 3 rows
three times (benchmarks/vocab_gemm_speed.py), so every decode step of a batch paid for its lm_head
as if the weight were read once per row, and the step's cost jumped with the batch size in a
way no smooth cost model follows. The same product as W @ x^T (a tall GEMM with a skinny right
side) streams W once. Which layout is faster is measured once per process, since CPU flags alone
do not tell; FLOWYARD_VOCAB_GEMM=linear|mm decides instead. The sums are float32 either way;
only their order differs (last-bit differences in the logits).
"""

from __future__ import annotations

import functools
import os
import time

import torch
import torch.nn.functional as F

MIN_OUT = 16_384  # output features from which a weight counts as a vocabulary projection
MAX_ROWS = 32  # rows up to which W @ x^T is used (at 64 F.linear was as fast or faster)


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """A float32 CPU call of 1 to MAX_ROWS rows against a vocabulary-sized weight."""
    return (weight.dtype == torch.float32 and x.dtype == torch.float32 and x.dim() == 2
            and weight.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS and weight.shape[0] >= MIN_OUT
            and x.device.type == "cpu" and not x.requires_grad)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) computed as (weight @ x^T)^T, contiguous."""
    out = torch.mm(weight, x.t()).t().contiguous()
    return out if bias is None else out.add_(bias)


@functools.cache
def transposed_faster() -> bool:
    """Whether W @ x^T beats F.linear on a vocabulary-sized float32 product of 4 rows here
    (best of three each way, on a 16,384 x 576 weight: about 20 ms once per process)."""
    forced = os.environ.get("FLOWYARD_VOCAB_GEMM", "auto")
    if forced not in ("auto", "linear", "mm"):
        raise ValueError(f"FLOWYARD_VOCAB_GEMM must be auto, linear or mm, got {forced!r}")
    if forced != "auto":
        return forced == "mm"
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(MIN_OUT, 576, generator=gen), torch.randn(4, 576, generator=gen)

    def best(fn) -> float:
        times = []
        for _ in range(4):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return min(times[1:])

    return best(lambda: linear(x, w)) < 0.8 * best(lambda: F.linear(x, w))
