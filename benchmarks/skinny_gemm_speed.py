"""float32 linears of a few rows: F.linear (x @ W^T) against W @ x^T (engine/skinny_gemm.py).

Part 1 times the product alone on SmolLM2-135M's 49,152 x 576 vocabulary matrix (its lm_head)
for 1 to 64 rows (best of `--repeats`; GB/s counts the weight's bytes once). Part 2 runs the
embedded model's float32 engine twice in one process, its linears through F.linear and through
W @ x^T, measured in interleaved rounds (best of rounds, median beside it): greedy decode tok/s
of 1, 3, 8 and 16 streams. Prints markdown tables with the ratio of each to F.linear.

Run: python benchmarks/skinny_gemm_speed.py [--rounds 5] [--repeats 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from flowyard.engine import skinny_gemm
from flowyard.engine.embedded import embedded_model_path
from flowyard.engine.engine_config import EngineConfig
from flowyard.engine.llm_engine import LLMEngine
from flowyard.engine.loader import load_checkpoint
from flowyard.engine.model import CausalLM
from flowyard.engine.sampling import SamplingParams

ROWS = (1, 2, 3, 4, 8, 16, 32, 64)  # 64: past skinny_gemm.MAX_ROWS, for comparison
STREAMS = (1, 3, 8, 16)


def best_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * min(times[1:])


def decode_tok_s(engine: LLMEngine, n: int, r: int) -> float:
    params = SamplingParams(max_tokens=33, temperature=0, ignore_eos=True)
    for i in range(n):
        engine.add_request(f"s{n}-{r}-{i}", [(i * 131 + j + 7919 * r) % 40000 + 100 for j in range(48)], params)
    engine.step()  # the prompts (one step) and their first tokens
    t, produced = time.perf_counter(), 0
    while engine.has_unfinished():
        produced += sum(len(o.new_token_ids) for o in engine.step())
    return produced / (time.perf_counter() - t)


def kernel_table(repeats: int) -> list[str]:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(49152, 576, generator=gen)
    lines = ["| rows | F.linear ms | GB/s | W @ x^T ms | GB/s | speed-up |", "|---:|---:|---:|---:|---:|---:|"]
    for m in ROWS:
        x = torch.randn(m, 576, generator=gen)
        a = best_ms(lambda: F.linear(x, w), repeats)
        b = best_ms(lambda: skinny_gemm.linear(x, w), repeats)
        gb = w.numel() * 4 / 1e6
        lines.append(f"| {m} | {a:.2f} | {gb / a:.1f} | {b:.2f} | {gb / b:.1f} | {a / b:.2f}x |")
    return lines


def engine_table(rounds: int) -> list[str]:
    ckpt = load_checkpoint(embedded_model_path())
    engines = {}
    for name, on in (("F.linear", False), ("W @ x^T", True)):
        model = CausalLM(ckpt.config, max_positions=4096)
        model.load_weights(dict(ckpt.weights))
        eng = LLMEngine(model, ckpt.tokenizer, EngineConfig(dtype="float32", attention="paged",
                                                           enable_prefix_caching=False, kv_cache_memory_mb=256))
        eng.model.linear.skinny_mm = on  # the one difference between the two engines
        eng.generate([list(range(100, 140))], SamplingParams(max_tokens=4, temperature=0))  # warm up
        engines[name] = eng
    runs = {name: {n: [] for n in STREAMS} for name in engines}
    for r in range(rounds):
        for name, eng in engines.items():
            for n in STREAMS:
                runs[name][n].append(decode_tok_s(eng, n, r))
        print(f"round {r + 1}/{rounds}: load average {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
    lines = ["| linears | " + " | ".join(f"{n}-stream tok/s" for n in STREAMS) + " |",
             "|---|" + "---|" * len(STREAMS)]
    base = runs["F.linear"]
    for name, res in runs.items():
        cells = [f"**{max(res[n]):.1f}** ({max(res[n]) / max(base[n]):.2f}x), median {statistics.median(res[n]):.1f}"
                 for n in STREAMS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    print(f"torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}), {torch.get_num_threads()} threads, "
          f"{os.cpu_count()} cores; skinny_gemm.transposed_faster() = {skinny_gemm.transposed_faster()}")
    print(f"command: python benchmarks/skinny_gemm_speed.py --rounds {args.rounds} --repeats {args.repeats}\n")
    print("\n".join(kernel_table(args.repeats)) + "\n")
    print("\n".join(engine_table(args.rounds)))


if __name__ == "__main__":
    main()
