"""The linear kernels behind EngineConfig.quantization, timed as one decode step reads them:
SmolLM2-135M's four layer linears (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536)
for 30 distinct layers of random weights, then the 49152x576 lm_head, at a number of rows.

Kernels: bfloat16 oneDNN on a pre-blocked weight (PackedLinear, the engine's bf16 path),
torch's int8 per-channel `_weight_int8pack_mm`, and int4 `_weight_int4pack_mm_for_cpu` with
groups of 32 and 64. Distinct layers matter: one weight timed in a loop stays in cache and
hides what quantisation saves. Each figure is the best of --sweeps (the VM is shared).
This is what MAX_QUANT_ROWS and INT4_GROUP_SIZE in flowyard/engine/quant.py were chosen from.
Run: python benchmarks/quant_kernels.py [--rows 1,4,8,16,32,64] [--sweeps 10]
"""

from __future__ import annotations

import argparse
import time

import torch

from flowyard.engine.quant import quantize_int4, quantize_int8

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LM_HEAD = (49152, 576)


def kernel(w: torch.Tensor, kind: str):
    """A function x -> x @ w.T with w as `kind` stores it."""
    if kind == "bf16":
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 32)
        return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    if kind == "int8":
        q, scale, _ = quantize_int8(w)
        return lambda x: torch.ops.aten._weight_int8pack_mm(x, q, scale)
    group = int(kind.removeprefix("int4g"))
    codes, scale_zeros, _ = quantize_int4(w, group)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, scale_zeros)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4,8,16,32,64")
    ap.add_argument("--sweeps", type=int, default=10)
    ap.add_argument("--kinds", default="bf16,int8,int4g32,int4g64")
    args = ap.parse_args()
    kinds = args.kinds.split(",")
    torch.manual_seed(0)
    layers = {k: [] for k in kinds}
    for _ in range(30):
        for n, k in SHAPES:
            w = (torch.randn(n, k) * 0.05).bfloat16()
            for kind in kinds:
                layers[kind].append((k, kernel(w, kind)))
    head_w = (torch.randn(*LM_HEAD) * 0.05).bfloat16()
    head = {kind: kernel(head_w, kind) for kind in kinds}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; ms per decode step, best of {args.sweeps}")
    print("| rows | " + " | ".join(f"{k} layers / lm_head" for k in kinds) + " |")
    print("|---|" + "---|" * len(kinds))
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(rows, k).bfloat16() for k in (576, 1536)}
        best = {kind: [float("inf"), float("inf")] for kind in kinds}
        for _ in range(args.sweeps):
            for kind in kinds:  # interleaved, so a busy moment hits every kind alike
                t = time.perf_counter()
                for k, fn in layers[kind]:
                    fn(xs[k])
                mid = time.perf_counter()
                head[kind](xs[576])
                end = time.perf_counter()
                best[kind] = [min(best[kind][0], mid - t), min(best[kind][1], end - mid)]
        print(f"| {rows} | " + " | ".join(f"{best[k][0] * 1e3:.1f} / {best[k][1] * 1e3:.2f}" for k in kinds) + " |",
              flush=True)


if __name__ == "__main__":
    main()
