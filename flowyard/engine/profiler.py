"""`flowyard profile`: time the engine's operators over a grid of batch shapes.

Each grid point is a real `StepPlan` (prefill slices over cached history and decode tokens over
their contexts) run by a `ModelRunner` configured as the engine's (same model, kernels, KV dtype
and attention path) on a scratch KV cache, reading the clock at every operator boundary. Per-layer operator times are averaged over layers; the time
outside the layers (embedding, final norm, lm_head) is kept as `step_other`. The result is a
JSON profile that `flowyard.costmodel.profiled.ProfiledCostModel` fits and the simulator loads.
"""

from __future__ import annotations

import itertools
import json
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from flowyard.core.kvcache import KVCacheManager, cdiv
from flowyard.core.plan import BatchShape, PrefillSlice, StepPlan
from flowyard.core.request import Request, RequestState
from flowyard.engine.model import LAYER_OPS
from flowyard.engine.runner import ModelRunner

PROFILE_VERSION = 1


@dataclass
class GridPoint:
    prefill: list[tuple[int, int]] = field(default_factory=list)  # (history, new tokens)
    decode: list[int] = field(default_factory=list)  # context lengths incl. the new token


def spread(ctx: int, n: int) -> list[int]:
    """n decode context lengths spread evenly over [ctx/2, 3 ctx/2] (mean ctx): a real batch's
    sequences have different lengths, and the engine's exact decode attention groups them by
    length, so a profile of equal lengths measures a case that rarely occurs."""
    if n == 1:
        return [ctx]
    return [max(2, round(ctx * (0.5 + k / (n - 1)))) for k in range(n)]


def default_grid(quick: bool = False) -> list[GridPoint]:
    """Prefill-only, decode-only and mixed shapes spanning what a CPU instance serves."""
    # 512 is where the CPU attention kernel starts to take keys in blocks (ProfiledCostModel's
    # prefill_work): the quick grid samples both sides of it.
    pre = [16, 64, 128, 256, 512, 1024] if quick else [16, 32, 64, 128, 256, 512, 1024, 2048]
    # Every small batch size: CPU GEMMs with an odd number of rows are much slower than their
    # neighbours (3 decodes took 126 ms, 4 took 94 ms), which powers of two alone interpolate away.
    # 8 and 32: row counts the engine pads small GEMMs to (skinny_gemm.ROW_PADDING: 7-8 rows run
    # as 8, 25-32 as 32), so the curve is measured where those steps land.
    batches = [1, 3, 4, 8, 16, 32] if quick else [1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 48, 64]
    ctxs = [128, 1024] if quick else [64, 256, 1024, 2048]
    grid = [GridPoint(prefill=[(0, n)]) for n in pre]
    grid += [GridPoint(prefill=[(h, 256)]) for h in ([512] if quick else [256, 1024])]
    # Small chunks over a long history (chunked prefill's later chunks, DynaServe's and
    # FlowPrefill's budgets): with one history shape the attention fit could not tell the cost
    # per cached token from the cost per causal pair, and priced a 56-token chunk over 900 cached
    # tokens at twice its served time (DynaServe's budgets then fell to their 16-token floor).
    grid += [GridPoint(prefill=[(h, 64)]) for h in ([512, 1024] if quick else [256, 1024, 2048])]
    grid += [GridPoint(decode=spread(c, b)) for b in batches for c in ctxs]
    grid += [GridPoint(prefill=[(0, n)], decode=spread(256, b)) for n in (64, 512) for b in (4, 16)]
    return grid


def scratch_runner(runner: ModelRunner, num_blocks: int) -> ModelRunner:
    """A runner configured exactly as `runner` (same model, KV dtype, decode-attention path)
    over its own scratch KV cache, so profiling never touches a live engine's KV."""
    return ModelRunner(runner.model, KVCacheManager(num_blocks, runner.bs), runner.kv_cache.dtype,
                       grouped_decode=runner.grouped_decode, paged_decode=runner.paged_decode)


def point_blocks(point: GridPoint, block_size: int) -> int:
    """KV blocks a grid point's plan allocates: a scratch runner sized for a grid holds any of
    its points without evicting."""
    return sum(cdiv(h + n, block_size) for h, n in point.prefill) + sum(cdiv(c, block_size) for c in point.decode)


def grid_plan(point: GridPoint, kv: KVCacheManager, vocab: int = 1000) -> StepPlan:
    """The StepPlan an engine would run for this grid point: prefill slices over `h` cached
    tokens and decodes over contexts `c`, with their KV allocated on `kv`. Profiling runs these
    plans through `ModelRunner`, the engine's own path, so a kernel the engine uses (paged
    decode attention, the small-GEMV kernel, an fp8 cache) is the kernel the profile times."""
    ids = itertools.count(1_000_000)
    plan = StepPlan()
    for h, n in point.prefill:
        rid = next(ids)
        prompt = tuple((7 * i + 3) % vocab for i in range(h + n))
        st = RequestState(Request(rid, 0.0, h + n, max_tokens=1, prompt_tokens=prompt), num_computed=h)
        kv.allocate(rid, h + n)
        plan.prefills.append(PrefillSlice(st, h, n))
    for c in point.decode:
        rid = next(ids)
        prompt = tuple((5 * i + 1) % vocab for i in range(c - 1))
        st = RequestState(Request(rid, 0.0, c - 1, max_tokens=2, prompt_tokens=prompt), num_computed=c - 1,
                          output_tokens=[11 % vocab])
        kv.allocate(rid, c)
        plan.decodes.append(st)
    return plan


def _states(plan: StepPlan) -> list[RequestState]:
    return [s.state for s in plan.prefills] + list(plan.decodes)


@torch.inference_mode()
def time_point(runner: ModelRunner, point: GridPoint, repeats: int = 3) -> dict[str, float]:
    """Median seconds per layer for each operator, and per step outside the layers (batch
    preparation, embedding, final norm, lm_head), for the plan of one grid point."""
    plan = grid_plan(point, runner.kv, runner.model.cfg.vocab_size)
    runs: list[dict[str, float]] = []
    try:
        for _ in range(repeats + 1):  # the first run warms caches and allocators up
            acc = {op: 0.0 for op in LAYER_OPS}
            start = time.perf_counter()
            gen, _ = runner.forward_steps(plan)
            last = time.perf_counter()
            while True:
                try:
                    _, op = next(gen)
                except StopIteration:
                    break
                now = time.perf_counter()
                acc[op] += now - last
                last = now
            end = time.perf_counter()
            layers = runner.model.cfg.num_layers
            row = {op: t / layers for op, t in acc.items()}
            row["step_other"] = (end - start) - sum(acc.values())
            runs.append(row)
    finally:
        for st in _states(plan):
            runner.kv.free(st.id)
    return {k: statistics.median(r[k] for r in runs[1:]) for k in runs[0]}


def step_seconds(times: dict[str, float], num_layers: int) -> float:
    """A whole step's seconds from `time_point`'s per-layer operator times and the rest of the
    step (a profile sample's `times`)."""
    return sum(times[op] for op in LAYER_OPS) * num_layers + times["step_other"]


def run_profile(runner: ModelRunner, *, grid: list[GridPoint] | None = None, repeats: int = 3,
                name: str = "model", progress=None, passes: int = 1) -> dict:
    """Time every grid point on a scratch copy of `runner` (an engine's `runner`: the profile
    then describes exactly the steps that engine runs).

    `passes` > 1 times the whole grid that many times and keeps each operator's median over
    the passes. Repeats of one point run back to back, so a slow minute on a shared VM skews
    all of them alike; passes spread each point's runs over the profile's whole duration.
    Measured on the 2-core VM: two one-pass quick profiles made within the hour priced the same
    sample up to 1.4x apart (per-sample spread of their log ratio about 0.2)."""
    if passes < 1:
        raise ValueError(f"passes must be at least 1, got {passes}")
    model = runner.model
    limit = model.rope.cos.shape[0]  # positions the model supports
    grid = [p for p in (grid or default_grid())
            if all(h + n <= limit for h, n in p.prefill) and all(c <= limit for c in p.decode)]
    scratch = scratch_runner(runner, max(point_blocks(p, runner.bs) for p in grid))
    runs: list[list[dict[str, float]]] = [[] for _ in grid]
    for k in range(passes):
        for i, point in enumerate(grid):
            runs[i].append(time_point(scratch, point, repeats))
            if progress:
                progress(k * len(grid) + i + 1, passes * len(grid))
    samples = [{"shape": asdict(BatchShape.of(point.prefill, point.decode)),
                "times": {op: statistics.median(r[op] for r in rs) for op in rs[0]}}
               for point, rs in zip(grid, runs)]
    cfg = model.cfg
    kv_dtype = runner.kv_cache.dtype
    kv_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * kv_dtype.itemsize
    weights = next(model.parameters()).dtype
    return {
        "version": PROFILE_VERSION, "model": name, "dtype": str(weights).removeprefix("torch."),
        "kv_dtype": str(kv_dtype).removeprefix("torch."),
        "attention": "paged" if runner.paged_decode else "grouped" if runner.grouped_decode else "exact",
        # the rows the engine's small GEMMs are padded to: the fit prices each at those rows
        "gemm_row_padding": None if model.linear.row_padding is None else model.linear.row_padding.to_dict(),
        "num_layers": cfg.num_layers, "kv_bytes_per_token": kv_bytes, "block_size": runner.bs,
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "threads": torch.get_num_threads(), "torch": torch.__version__},
        "repeats": repeats, "passes": passes, "samples": samples,
    }


def save_profile(profile: dict, path: str | Path) -> None:
    try:
        Path(path).write_text(json.dumps(profile, indent=1))
    except OSError as e:
        raise OSError(f"cannot write profile to '{path}': {e.strerror or e}") from None


def measure_engine_overhead(engine, steps: int = 40) -> float:
    """Median seconds a real engine step spends outside the forward pass (scheduling, batch
    preparation, sampling, detokenisation, bookkeeping): a per-step constant the operator
    timings above do not see."""
    from flowyard.engine.sampling import SamplingParams

    forward = engine.runner.execute
    spent: list[float] = []

    def timed(plan):
        t = time.perf_counter()
        out = forward(plan)
        spent.append(time.perf_counter() - t)
        return out

    engine.runner.execute = timed
    rid = f"overhead-probe-{time.monotonic_ns()}"
    engine.add_request(rid, list(range(10, 42)), SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True))
    extra: list[float] = []
    try:
        while engine.has_unfinished():
            t = time.perf_counter()
            engine.step()
            extra.append(time.perf_counter() - t - spent[-1])
    finally:
        engine.runner.execute = forward
    return statistics.median(extra[1:] or extra)
