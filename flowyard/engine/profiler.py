"""`flowyard profile`: time the engine's operators over a grid of batch shapes.

Each grid point builds a real batch (prefill slices over cached history and decode tokens over
their contexts) on a scratch KV cache and runs the operator-step forward pass, reading the
clock at every operator boundary. Per-layer operator times are averaged over layers; the time
outside the layers (embedding, final norm, lm_head) is kept as `step_other`. The result is a
JSON profile that `flowyard.costmodel.profiled.ProfiledCostModel` fits and the simulator loads.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from flowyard.core.plan import BatchShape
from flowyard.engine.attention import AttentionBatch, PrefillSeq
from flowyard.engine.model import LAYER_OPS, CausalLM

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
    pre = [16, 64, 256, 1024] if quick else [16, 32, 64, 128, 256, 512, 1024, 2048]
    # Every small batch size: CPU GEMMs with an odd number of rows are much slower than their
    # neighbours (3 decodes took 126 ms, 4 took 94 ms), which powers of two alone interpolate away.
    batches = [1, 3, 4, 16] if quick else [1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 48, 64]
    ctxs = [128, 1024] if quick else [64, 256, 1024, 2048]
    grid = [GridPoint(prefill=[(0, n)]) for n in pre]
    grid += [GridPoint(prefill=[(h, 256)]) for h in ([512] if quick else [256, 1024])]
    grid += [GridPoint(decode=spread(c, b)) for b in batches for c in ctxs]
    grid += [GridPoint(prefill=[(0, n)], decode=spread(256, b)) for n in (64, 512) for b in (4, 16)]
    return grid


def _batch(point: GridPoint, block_size: int, vocab: int = 1000) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch, int]:
    """Inputs for one grid point; sequences get disjoint block ranges of a scratch cache."""
    ids, pos, slots, sample = [], [], [], []
    prefills, next_block = [], 0
    for h, n in point.prefill:
        total = h + n
        blocks = list(range(next_block, next_block + -(-total // block_size)))
        next_block += len(blocks)
        prefills.append(PrefillSeq(len(ids), n, h, torch.tensor(blocks)))
        ids += [(7 * i + 3) % vocab for i in range(n)]
        pos += range(h, total)
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(h, total)]
        sample.append(len(ids) - 1)
    batch = AttentionBatch(torch.empty(0), torch.empty(0), prefills, num_prefill_tokens=len(ids))
    if point.decode:
        tables, lens = [], []
        for c in point.decode:
            blocks = list(range(next_block, next_block + -(-c // block_size)))
            next_block += len(blocks)
            tables.append(blocks)
            lens.append(c)
            sample.append(len(ids))
            ids.append(11 % vocab)
            pos.append(c - 1)
            slots.append(blocks[(c - 1) // block_size] * block_size + (c - 1) % block_size)
        width = max(map(len, tables))
        batch.decode_block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
        batch.decode_ctx_lens = torch.tensor(lens)
        batch.finalize(block_size)
    batch.slot_mapping = torch.tensor(slots)
    batch.sample_rows = torch.tensor(sample)
    return torch.tensor(ids), torch.tensor(pos), batch, next_block


@torch.inference_mode()
def time_point(model: CausalLM, point: GridPoint, cache: torch.Tensor, block_size: int,
               repeats: int = 3) -> dict[str, float]:
    """Median seconds per layer for each operator, and per step outside the layers."""
    ids, pos, batch, _ = _batch(point, block_size, model.cfg.vocab_size)
    runs: list[dict[str, float]] = []
    for _ in range(repeats + 1):  # the first run warms caches and allocators up
        acc = {op: 0.0 for op in LAYER_OPS}
        gen = model.forward_steps(ids, pos, batch, cache)
        start = last = time.perf_counter()
        while True:
            try:
                _, op = next(gen)
            except StopIteration:
                break
            now = time.perf_counter()
            acc[op] += now - last
            last = now
        end = time.perf_counter()
        layers = model.cfg.num_layers
        row = {op: t / layers for op, t in acc.items()}
        row["step_other"] = (end - start) - sum(acc.values())
        runs.append(row)
    return {k: statistics.median(r[k] for r in runs[1:]) for k in runs[0]}


def run_profile(model: CausalLM, *, dtype: torch.dtype, block_size: int = 16, grid: list[GridPoint] | None = None,
                repeats: int = 3, name: str = "model", progress=None) -> dict:
    limit = model.rope.cos.shape[0]  # positions the model supports
    grid = [p for p in (grid or default_grid())
            if all(h + n <= limit for h, n in p.prefill) and all(c <= limit for c in p.decode)]
    need = max(_batch(p, block_size)[3] for p in grid)
    cfg = model.cfg
    cache = torch.zeros(cfg.num_layers, 2, need, block_size, cfg.num_kv_heads, cfg.head_dim, dtype=dtype)
    samples = []
    for i, point in enumerate(grid):
        shape = BatchShape.of(point.prefill, point.decode)
        times = time_point(model, point, cache, block_size, repeats)
        samples.append({"shape": asdict(shape), "times": times})
        if progress:
            progress(i + 1, len(grid))
    kv_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize
    return {
        "version": PROFILE_VERSION, "model": name, "dtype": str(dtype).removeprefix("torch."),
        "num_layers": cfg.num_layers, "kv_bytes_per_token": kv_bytes, "block_size": block_size,
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "threads": torch.get_num_threads(), "torch": torch.__version__},
        "samples": samples,
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
