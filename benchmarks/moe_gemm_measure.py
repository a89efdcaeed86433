"""Time one MoE layer's experts on a GPU, by tokens per step: the two grouped GEMMs alone, and
the whole routed MLP (router, top-k, sort, grouped GEMMs, combine) as `gpu_steps_measure.py`
runs it.

Why: the roofline prices an MoE layer's experts at the dense GEMM rate and at full memory
bandwidth (flowyard/costmodel/moe.py); whole steps timed on an H100 came out 25-40 % dearer
(docs/results/gpu_steps_h100_qwen3-30b-a3b.md). These layer-level times are what a grouped-GEMM
term of the cost model can be fitted on, so that the whole steps stay a held-out check.

    python benchmarks/moe_gemm_measure.py --out benchmarks/results/moe_gemm_h100.json  # on a GPU
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from gpu_steps_measure import SHAPES, TINY_MOE, Model, graph_of, moe, timed

TOKENS = (1, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def graphed(fn, reps: int, cuda: bool) -> float:
    """Median ms of fn replayed from a CUDA graph (eager on the CPU)."""
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(3):
        fn()
    if not cuda:
        return 1e3 * timed(fn, reps, sync)
    g = graph_of(fn)
    for _ in range(3):
        g.replay()
    return 1e3 * timed(g.replay, reps, sync)


def measure(m: Model, tokens: int, reps: int) -> dict:
    s, L = m.s, m.layers[0]
    cuda = m.device.startswith("cuda")
    h = torch.randn(tokens, s.hidden, device=m.device, dtype=m.dtype)
    # the rows the grouped GEMMs see: each token's k copies sorted by expert (uniform routing)
    idx = torch.rand(tokens, s.experts, device=m.device).topk(s.experts_active, dim=-1).indices.reshape(-1)
    order = idx.argsort(stable=True)
    xs = h.index_select(0, order // s.experts_active)
    offs = torch.bincount(idx, minlength=s.experts).cumsum(0).to(torch.int32)
    act = torch.randn(len(xs), s.expert_intermediate, device=m.device, dtype=m.dtype)

    def gemms() -> torch.Tensor:
        torch._grouped_mm(xs, L["egu"].transpose(-2, -1), offs=offs)
        return torch._grouped_mm(act, L["edown"].transpose(-2, -1), offs=offs)

    with torch.inference_mode():
        return {"tokens": tokens, "distinct_experts": int((offs.diff(prepend=offs[:1] * 0) > 0).sum()),
                "gemms_ms": graphed(gemms, reps, cuda), "moe_ms": graphed(lambda: moe(h, L, s), reps, cuda)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="qwen3-30b-a3b", choices=[k for k, v in SHAPES.items() if v.experts])
    ap.add_argument("--tiny", action="store_true", help="a tiny MoE on the CPU (a smoke test)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rev", default="")
    a = ap.parse_args(argv)
    device = "cpu" if a.tiny or not torch.cuda.is_available() else "cuda"
    shape = TINY_MOE if a.tiny else SHAPES[a.model]
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    m = Model(shape.__class__(**{**shape.__dict__, "layers": 1}), device, dtype)  # one layer is enough
    t0, rows = time.time(), []
    for t in (TOKENS if not a.tiny else TOKENS[:4]):
        rows.append(measure(m, t, a.reps))
        print(json.dumps(rows[-1]), flush=True)
    meta = {"revision": a.rev, "model": a.model if not a.tiny else "tiny", "shape": shape.__dict__,
            "dtype": str(dtype), "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor(),
            "torch": torch.__version__, "reps": a.reps, "wall_s": round(time.time() - t0, 1)}
    with open(a.out, "w") as f:
        json.dump({"meta": meta, "points": rows}, f, indent=1)
    print(f"wrote {a.out}: {len(rows)} token counts in {meta['wall_s']} s")


if __name__ == "__main__":
    main()
