"""The paged decode kernel alone (engine/csrc/paged_decode.c through paged_kernel.py), timed as
one decode step reads it: 8 sequences, SmolLM2-135M's attention shapes (9 query heads on 3 KV
heads, head_dim 64, the engine's 16-token blocks), 30 calls on 30 distinct layer caches so
that the KV comes from memory as in the engine, not from L2. Block tables are random
permutations, as a long-running engine's are. Each figure is the best of --repeats (the VM is
shared); GB/s counts the K and V bytes of the contexts read once. On a busy machine, wall
time with 2 threads measures the scheduler (a preempted OpenMP thread stalls every call):
`--threads 1 --cpu-time` times the process's CPU time instead, which others' load barely moves.

    python benchmarks/paged_kernel_speed.py [--contexts 16,256,1024] [--repeats 7] [--threads N] [--cpu-time]
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

from flowyard.engine.paged_kernel import paged_decode

B, KV_HEADS, GROUP, D, BLOCK, LAYERS = 8, 3, 3, 64, 16, 30
CACHES = {"bf16": torch.bfloat16, "fp8_e5m2": torch.float8_e5m2}


def layers(ctx: int, dtype: torch.dtype, g: torch.Generator):
    """LAYERS (k, v, tables) triples, each with its own cache tensors."""
    blocks = -(-ctx // BLOCK)
    out = []
    for _ in range(LAYERS):
        cache = torch.randn(2, B * blocks, BLOCK, KV_HEADS, D, generator=g).to(dtype)
        tables = torch.randperm(B * blocks, generator=g).view(B, blocks)
        out.append((cache[0], cache[1], tables))
    return out


def time_step(ctx: int, dtype: torch.dtype, repeats: int, clock=time.perf_counter) -> float:
    g = torch.Generator().manual_seed(ctx)
    data = layers(ctx, dtype, g)
    q = torch.randn(B, KV_HEADS, GROUP, D, generator=g).bfloat16()
    lens = torch.full((B,), ctx, dtype=torch.long)
    assert paged_decode.supports(q, data[0][0])
    best = float("inf")
    for _ in range(repeats + 1):  # the first sweep warms up (and builds the kernel)
        t = clock()
        for k, v, tables in data:
            paged_decode(q, k, v, tables, lens)
        best = min(best, clock() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="16,256,1024")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=0, help="OpenMP threads (default: torch's)")
    ap.add_argument("--cpu-time", action="store_true", help="time CPU time, not wall time (with --threads 1)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    contexts = [int(c) for c in args.contexts.split(",")]
    print(f"Machine: {platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}; "
          f"{B} sequences, {KV_HEADS * GROUP} q / {KV_HEADS} KV heads, head_dim {D}, block {BLOCK}, "
          f"{LAYERS} layers, best of {args.repeats}{', CPU time' if args.cpu_time else ''}.\n")
    print("| KV cache | context | ms / 30 layers | KV MB read | GB/s |")
    print("|---|---:|---:|---:|---:|")
    for name, dtype in CACHES.items():
        for ctx in contexts:
            s = time_step(ctx, dtype, args.repeats, time.process_time if args.cpu_time else time.perf_counter)
            nbytes = 2 * LAYERS * B * ctx * KV_HEADS * D * torch.tensor([], dtype=dtype).element_size()
            print(f"| {name} | {ctx} | {s * 1e3:.2f} | {nbytes / 1e6:.1f} | {nbytes / s / 1e9:.1f} |", flush=True)


if __name__ == "__main__":
    main()
