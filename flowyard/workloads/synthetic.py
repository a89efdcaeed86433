"""Workloads built from length samples rather than replayed arrivals: fixed request shapes,
lengths resampled from a trace under Poisson arrivals, and uniform mixtures of traces.

DynaServe's evaluation is built this way ("request arrival patterns using a Poisson
distribution ... input and output lengths sampled from real-world datasets"), as are its
fixed-shape studies (Table 1: P8192/D32, P2048/D512, P219/D1467; Table 4: outputs drawn
around 1467 tokens while the scheduler assumes exactly 1467).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from flowyard.core.request import Request
from flowyard.workloads.arrivals import poisson_arrivals
from flowyard.workloads.workload import Workload


def _check(n: int, rate: float) -> None:
    if n < 1:
        raise ValueError(f"a synthetic workload needs at least one request, got n={n}")
    if not rate > 0:
        raise ValueError(f"the arrival rate must be positive, got {rate}")


def from_lengths(name: str, prompts: Sequence[int], outputs: Sequence[int], *, rate: float,
                 seed: int = 0, tasks: Sequence[str | None] | None = None) -> Workload:
    """Requests with the given lengths (in order) arriving as a Poisson process at `rate`."""
    n = len(prompts)
    _check(n, rate)
    if len(outputs) != n or (tasks is not None and len(tasks) != n):
        raise ValueError("prompts, outputs (and tasks) must have the same length")
    t = poisson_arrivals(n, rate, seed)
    reqs = [Request(id=i, arrival=float(t[i]), prompt_len=max(1, int(prompts[i])),
                    output_len=max(1, int(outputs[i])), task=None if tasks is None else tasks[i])
            for i in range(n)]
    return Workload(name, reqs)


def fixed_shape(prompt: int, output: int, n: int, *, rate: float, output_std: float = 0.0,
                seed: int = 0) -> Workload:
    """n requests of `prompt` tokens; outputs of `output` tokens, or drawn from
    N(output, output_std) (rounded, at least 1) when output_std > 0."""
    _check(n, rate)
    if prompt < 1 or output < 1 or output_std < 0:
        raise ValueError(f"prompt and output must be >= 1 and output_std >= 0, got "
                            f"{prompt}, {output}, {output_std}")
    outs = np.full(n, output, dtype=np.int64)
    if output_std > 0:
        rng = np.random.default_rng((seed, 1))
        outs = np.maximum(1, np.rint(rng.normal(output, output_std, n))).astype(np.int64)
    name = f"P{prompt}/D{output}" + (f" (std {output_std:g})" if output_std else "")
    return from_lengths(name, [prompt] * n, outs.tolist(), rate=rate, seed=seed)


def resample(source: Workload, n: int, *, rate: float, seed: int = 0, name: str | None = None,
             task: str | None = None) -> Workload:
    """n (prompt, output) pairs drawn with replacement from `source`, Poisson at `rate`;
    every request tagged `task` (default: the source's name) for per-task length predictors."""
    _check(n, rate)
    if not source.requests:
        raise ValueError(f"cannot resample the empty workload {source.name!r}")
    idx = np.random.default_rng((seed, 2)).integers(0, len(source.requests), n)
    p, o = source.prompt_lens()[idx], source.output_lens()[idx]
    tag = source.name if task is None else task
    return from_lengths(name or source.name, p.tolist(), o.tolist(), rate=rate, seed=seed, tasks=[tag] * n)


def mix(sources: Sequence[Workload], n: int, *, rate: float, seed: int = 0, name: str | None = None) -> Workload:
    """A uniform mixture: each request picks a source at random, then a (prompt, output) pair
    from it; tagged with its source's name (DynaServe's hybrid workload, Table 2)."""
    _check(n, rate)
    if not sources or any(not s.requests for s in sources):
        raise ValueError("mix needs one or more non-empty workloads")
    rng = np.random.default_rng((seed, 3))
    which = rng.integers(0, len(sources), n)
    lens = [(s.prompt_lens(), s.output_lens()) for s in sources]
    pick = [int(rng.integers(0, len(s.requests))) for s in (sources[k] for k in which)]
    prompts = [int(lens[k][0][j]) for k, j in zip(which, pick)]
    outputs = [int(lens[k][1][j]) for k, j in zip(which, pick)]
    tasks = [sources[k].name for k in which]
    return from_lengths(name or "+".join(s.name for s in sources), prompts, outputs, rate=rate, seed=seed,
                        tasks=tasks)


def reasoning_like(n: int, *, rate: float, seed: int = 0, prompt_mean: float = 219.0,
                   output_mean: float = 1467.0) -> Workload:
    """A stand-in for the Mini Reasoning dataset (not available offline): short prompts and
    long outputs with the means DynaServe reports for it (P219/D1467), gamma-distributed
    (shape 2 for prompts, 4 for outputs), clipped to [16, 2048] and [32, 8192] tokens."""
    _check(n, rate)
    rng = np.random.default_rng((seed, 4))
    p = np.clip(rng.gamma(2.0, prompt_mean / 2.0, n), 16, 2048).round().astype(np.int64)
    o = np.clip(rng.gamma(4.0, output_mean / 4.0, n), 32, 8192).round().astype(np.int64)
    return from_lengths("mini-reasoning (stand-in)", p.tolist(), o.tolist(), rate=rate, seed=seed,
                        tasks=["reasoning"] * n)


__all__ = ["fixed_shape", "from_lengths", "mix", "reasoning_like", "resample"]
