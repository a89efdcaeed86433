"""How an 8-stream decode step grows with context, per KV cache dtype (issue 14's target: the
step at 1,024-token contexts <= 1.3x the step at 16-token contexts).

Every config's engine shares one model; rounds alternate between configs so that a noisy
machine slows them alike; each figure is the best step of its rounds. Prints a markdown table.

    python benchmarks/decode_context.py [--configs auto,fp8_e5m2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import time

import torch

from flowyard.engine.engine_config import EngineConfig
from flowyard.engine.llm_engine import LLMEngine
from flowyard.engine.loader import load_checkpoint
from flowyard.engine.embedded import embedded_model_path
from flowyard.engine.model import CausalLM
from flowyard.engine.sampling import SamplingParams

CONTEXTS = (16, 256, 1024)
STREAMS = 8


def steps_at(engine: LLMEngine, ctx: int, tag: str, salt: int = 0) -> float:
    """Best seconds of a pure 8-decode step with every context about `ctx` tokens. `salt`
    changes the prompts, so that an engine with prefix caching prefills them anew."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for i in range(STREAMS):
        prompt = [(i * 977 + j * 13 + ctx + salt) % 40000 + 100 for j in range(ctx)]
        engine.add_request(f"{tag}-{ctx}-{i}", prompt, params)
    times = []
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.step()
        plan = engine.last_plan
        if plan is not None and not plan.prefills and len(plan.decodes) == STREAMS:
            times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="auto,fp8_e5m2", help="comma-separated kv_cache_dtype values")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    ckpt = load_checkpoint(embedded_model_path())
    model = CausalLM(ckpt.config)
    model.load_weights(dict(ckpt.weights))
    engines = {kv: LLMEngine(model, ckpt.tokenizer, EngineConfig(dtype=args.dtype, kv_cache_dtype=kv,
                                                                 enable_prefix_caching=False, kv_cache_memory_mb=512))
               for kv in args.configs.split(",")}
    for e in engines.values():
        e.warm_up()
    best: dict[tuple[str, int], float] = {}
    for r in range(args.rounds):
        for kv, e in engines.items():
            for ctx in CONTEXTS:
                t = steps_at(e, ctx, f"{kv}-{r}")
                best[kv, ctx] = min(best.get((kv, ctx), t), t)
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"Machine: {platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}; "
          f"git {rev}; {args.dtype} model, paged attention, best of {args.rounds} rounds.\n")
    print("| KV cache dtype | " + " | ".join(f"{c}-token ctx step (ms)" for c in CONTEXTS)
          + f" | {CONTEXTS[-1]} / {CONTEXTS[0]} |")
    print("|---|" + "---:|" * (len(CONTEXTS) + 1))
    for kv in engines:
        cells = " | ".join(f"{best[kv, c] * 1e3:.1f}" for c in CONTEXTS)
        print(f"| {kv} | {cells} | {best[kv, CONTEXTS[-1]] / best[kv, CONTEXTS[0]]:.2f} |")


if __name__ == "__main__":
    main()
