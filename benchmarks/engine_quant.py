"""bfloat16 against weight-only int8/int4 linears (EngineConfig.quantization) on the embedded
SmolLM2-135M-Instruct, every config in one process and measured in interleaved rounds.

Why interleaved: on a shared 2-core VM other jobs come and go, and a 2-thread engine slows
down several-fold whenever one of its OpenMP threads loses its core. Round r measures every
config back to back, and each figure is the best of the rounds (the median is printed too),
so every config gets the same chances at a quiet moment. benchmarks/engine_cpu.py
(`--configs bfloat16/paged/int4`) measures one config after the other instead.

Per config and round:
  single     decode tok/s of one greedy stream (30-token prompt, 64 tokens after the first)
  32-stream  decode tok/s of 32 greedy streams (64-token prompts prefilled in one step first)
  prefill    tok/s of one 1,000-token prompt (time to its first token)
and once: build, the seconds LLMEngine takes on the loaded model (quantisation included).
Prints a markdown table. Run: python benchmarks/engine_quant.py [--rounds 8] [--configs none,int8,int4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

from flowyard.engine.embedded import embedded_model_path
from flowyard.engine.engine_config import EngineConfig
from flowyard.engine.llm_engine import LLMEngine
from flowyard.engine.loader import load_checkpoint
from flowyard.engine.model import CausalLM
from flowyard.engine.sampling import SamplingParams


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return "unknown CPU"


def single(engine: LLMEngine, r: int) -> float:
    engine.add_request(f"single-{r}", [1000 + r + i for i in range(30)],
                       SamplingParams(max_tokens=65, temperature=0, ignore_eos=True))
    engine.step()  # prefill + first token
    t = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return 64 / (time.perf_counter() - t)


def streams(engine: LLMEngine, r: int) -> float:
    params = SamplingParams(max_tokens=33, temperature=0, ignore_eos=True)
    for i in range(32):
        engine.add_request(f"stream-{r}-{i}", [(i * 131 + j + 7919 * r) % 40000 + 100 for j in range(64)], params)
    engine.step()  # all 32 prompts in one step
    t, produced = time.perf_counter(), 0
    while engine.has_unfinished():
        produced += sum(len(o.new_token_ids) for o in engine.step())
    return produced / (time.perf_counter() - t)


def prefill(engine: LLMEngine, r: int) -> float:
    prompt = [(i * 7 + r) % 40000 + 100 for i in range(1000)]
    t = time.perf_counter()
    engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
    return 1000 / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--configs", default="none,int8,int4", help="comma-separated quantization values (none: bf16)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--attention", default="paged")
    args = ap.parse_args()
    ckpt = load_checkpoint(embedded_model_path())
    engines: dict[str, LLMEngine] = {}
    build: dict[str, float] = {}
    for name in args.configs.split(","):
        model = CausalLM(ckpt.config, max_positions=4096)
        model.load_weights(dict(ckpt.weights))  # a fresh copy per config: quantisation is in place
        t = time.perf_counter()
        engines[name] = LLMEngine(model, ckpt.tokenizer, EngineConfig(
            dtype=args.dtype, attention=args.attention, quantization=None if name == "none" else name,
            enable_prefix_caching=False, kv_cache_memory_mb=256,
            max_num_batched_tokens=2048))  # vLLM's budget: the 32 streams' prompts prefill in one step
        build[name] = time.perf_counter() - t
        engines[name].generate([list(range(100, 140))], SamplingParams(max_tokens=4, temperature=0))  # warm up
    runs: dict[str, dict[str, list[float]]] = {n: {"single": [], "streams": [], "prefill": []} for n in engines}
    for r in range(args.rounds):
        for name, engine in engines.items():
            for what, fn in (("single", single), ("streams", streams), ("prefill", prefill)):
                runs[name][what].append(fn(engine, r))
        print(f"round {r + 1}/{args.rounds}: load average {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)

    print(f"machine: {cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__} "
          f"({torch.backends.cpu.get_cpu_capability()}), {torch.get_num_threads()} threads")
    print(f"command: python benchmarks/engine_quant.py --rounds {args.rounds} --configs {args.configs} "
          f"--dtype {args.dtype} --attention {args.attention}\n")
    print("| config | single-stream decode tok/s | 32-stream decode tok/s | 1k prefill tok/s | build s |")
    print("|---|---|---|---|---|")
    base = runs.get("none")
    for name, res in runs.items():
        cells = []
        for what in ("single", "streams", "prefill"):
            best, med = max(res[what]), statistics.median(res[what])
            ratio = f" ({best / max(base[what]):.2f}x)" if base is not None and name != "none" else ""
            cells.append(f"**{best:.1f}**{ratio}, median {med:.1f}")
        label = f"{args.dtype}" + ("" if name == "none" else f" + {name}")
        print(f"| {label} | " + " | ".join(cells) + f" | {build[name]:.1f} |")


if __name__ == "__main__":
    main()
