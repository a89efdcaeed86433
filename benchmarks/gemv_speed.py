"""Decode-sized bfloat16 linears: oneDNN (PackedLinear) against the gemv_bf16 C kernel.

Per M (rows: 1, 2, 4) and kernel, the time of
  layers   the 30 layers' four linears (qkv 960x576 with bias-free, o_proj 576x576,
           gate_up 3072x576, down 576x1536) on 30 distinct weight copies, in layer order, so
           the 212 MB stream from memory as in a decode step;
  lm_head  the 49152x576 tied embedding;
and GB/s of weight bytes read. Rounds interleave the kernels (best of the rounds, since other
jobs on a shared VM come and go). Also the per-call overhead of each on a tiny weight.
Prints a markdown table. Run: python benchmarks/gemv_speed.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import time

import torch

from flowyard.engine.gemv_kernel import gemv_bf16
from flowyard.engine.model import PackedLinear

SHAPES = {"qkv": (960, 576), "o_proj": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
LAYERS = 30


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rows", default="1,2,4")
    args = ap.parse_args()
    torch.manual_seed(0)
    if not gemv_bf16.available():
        raise SystemExit("gemv_bf16 kernel unavailable")
    layers = [[(torch.randn(*s) * 0.05).bfloat16() for s in SHAPES.values()] for _ in range(LAYERS)]
    lm_head = (torch.randn(49152, 576) * 0.05).bfloat16()
    layer_bytes = sum(w.numel() * 2 for ws in layers for w in ws)
    onednn = PackedLinear()
    kernels = {"oneDNN": onednn, "gemv_bf16": gemv_bf16}
    rows = [int(r) for r in args.rows.split(",")]
    xs = {m: {k: (torch.randn(m, k) * 0.5).bfloat16() for k in (576, 1536)} for m in rows}

    def run_layers(fn, m):
        x = xs[m]
        for ws in layers:
            for w in ws:
                fn(x[w.shape[1]], w)

    best: dict[tuple, float] = {}
    with torch.inference_mode():
        for name, fn in kernels.items():  # warm up (oneDNN packs its copies here)
            for m in rows:
                run_layers(fn, m)
                fn(xs[m][576], lm_head)
        for _ in range(args.rounds):
            for m in rows:
                for name, fn in kernels.items():
                    t = time.perf_counter()
                    run_layers(fn, m)
                    t1 = time.perf_counter()
                    fn(xs[m][576], lm_head)
                    t2 = time.perf_counter()
                    for key, v in (((name, m, "layers"), t1 - t), ((name, m, "lm_head"), t2 - t1)):
                        best[key] = min(best.get(key, 1e9), v)
        # per-call overhead: a 16x64 weight, 1 row
        tiny_w, tiny_x = torch.randn(16, 64).bfloat16(), torch.randn(1, 64).bfloat16()
        over = {}
        for name, fn in kernels.items():
            for _ in range(200):
                fn(tiny_x, tiny_w)
            ts = []
            for _ in range(5):
                t = time.perf_counter()
                for _ in range(1000):
                    fn(tiny_x, tiny_w)
                ts.append((time.perf_counter() - t) / 1000)
            over[name] = min(ts)

    lm_bytes = lm_head.numel() * 2
    print(f"threads: {torch.get_num_threads()}, rounds: {args.rounds} (best of)\n")
    print("| rows | kernel | 30 layers' linears ms | GB/s | lm_head ms | GB/s |")
    print("|---:|---|---:|---:|---:|---:|")
    for m in rows:
        for name in kernels:
            tl, th = best[(name, m, "layers")], best[(name, m, "lm_head")]
            print(f"| {m} | {name} | {tl * 1e3:.2f} | {layer_bytes / tl / 1e9:.1f} | {th * 1e3:.2f} | {lm_bytes / th / 1e9:.1f} |")
    print("\nper-call time on a 16x64 weight, 1 row (call overhead): "
          + ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in over.items()))


if __name__ == "__main__":
    main()
