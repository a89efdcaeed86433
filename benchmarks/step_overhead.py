"""What an engine step costs outside the model (issue 14 item 4), on the embedded model.

Runs greedy decode batches of 1, 8 and 32 streams and splits each step's wall time into:
  schedule     the local scheduler's plan (LocalScheduler.schedule)
  prepare      building the model inputs: token ids, positions, slots, block tables
  model        the forward pass (all layers, the logits of the sampled rows)
  sample       picking tokens (greedy argmax here)
  detok        incremental detokenisation and stop checks
  update       the scheduler applying the step's output (update_from_output)
  outputs      building the RequestOutput deltas (text, token ids) for the server
and prints mean microseconds per step for each and the share outside the model. Only decode
steps are counted (the prefill step is skipped). The VM is shared: the table is the best of
--repeat runs per batch size.
Run: python benchmarks/step_overhead.py [--repeat 3] [--tokens 64] [--dtype auto]
"""

from __future__ import annotations

import argparse
import functools
import platform
import time
from collections import defaultdict

import torch

from flowyard.engine.engine_config import EngineConfig
from flowyard.engine.llm_engine import LLMEngine
from flowyard.engine.sampling import SamplingParams

PARTS = ("schedule", "prepare", "model", "sample", "detok", "update", "outputs")


def instrument(engine: LLMEngine, acc: dict[str, float]) -> None:
    """Wrap the step's parts with timers (instance attributes: this engine only)."""
    def timed(name, fn):
        @functools.wraps(fn)
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                acc[name] += time.perf_counter() - t
        return wrapper

    engine.scheduler.schedule = timed("schedule", engine.scheduler.schedule)
    engine.scheduler.update_from_output = timed("update", engine.scheduler.update_from_output)
    engine.runner.prepare = timed("prepare", engine.runner.prepare)
    model = engine.runner.model
    model.forward = timed("model", model.forward)  # nn.Module.__call__ finds the instance's
    engine._check_stop = timed("detok", engine._check_stop)
    engine._output = timed("outputs", engine._output)
    import flowyard.engine.llm_engine as mod
    mod.sample = timed("sample", mod.sample)


def run(engine: LLMEngine, streams: int, tokens: int, rep: int) -> tuple[dict[str, float], float, int]:
    acc: dict[str, float] = {}
    params = SamplingParams(max_tokens=tokens + 1, temperature=0, ignore_eos=True)
    for i in range(streams):
        prompt = [(i * 131 + j + 7919 * rep) % 40000 + 100 for j in range(32)]
        engine.add_request(f"s{streams}-{rep}-{i}", prompt, params)
    engine.step()  # the prefill step
    engine._acc.clear()
    steps, total = 0, 0.0
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.step()
        total += time.perf_counter() - t
        steps += 1
    acc.update(engine._acc)
    return acc, total, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--streams", default="1,8,32")
    args = ap.parse_args()
    engine = LLMEngine.from_path(None, EngineConfig(dtype=args.dtype))
    engine._acc = defaultdict(float)
    instrument(engine, engine._acc)
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0))  # warm up
    print(f"machine: {platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"dtype {engine.dtype}, attention {engine.config.attention}")
    head = " ".join(f"{p:>9}" for p in PARTS)
    print(f"\n{'streams':>7} {'step us':>8} {head} {'other':>7} {'outside model':>13}")
    for n in (int(s) for s in args.streams.split(",")):
        best = None
        for rep in range(args.repeat):
            acc, total, steps = run(engine, n, args.tokens, rep)
            if best is None or total < best[1]:
                best = (acc, total, steps)
        acc, total, steps = best
        per = {p: acc[p] / steps * 1e6 for p in PARTS}
        other = total / steps * 1e6 - sum(per.values())
        outside = total / steps * 1e6 - per["model"]
        print(f"{n:>7} {total / steps * 1e6:>8.0f} " + " ".join(f"{per[p]:>9.0f}" for p in PARTS)
              + f" {other:>7.0f} {outside:>8.0f} ({outside / (total / steps * 1e6):.0%})")


if __name__ == "__main__":
    main()
