"""The sampler's cost on the CPU, batched against the per-row loop it replaced, and what that
does to a decode step of many sampled requests.

Why: requests that send no temperature are sampled at OpenAI's default of 1.0, and the sampler
used to take each such row on its own (softmax and a multinomial draw over the 49,152-token
vocabulary), milliseconds a row on a CPU. In served real-cluster runs, decode steps of a dozen
sampled requests then ran 1.3-1.6x the price the profile (timed greedy) put on them. The
baseline below is that loop, kept here verbatim in behaviour so the two are measured in one run.

    python benchmarks/sampler_speed.py [--rows 1,4,16,64] [--repeat 20] [--out benchmarks/results/sampler_speed.md]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from flowyard.engine.sampling import SamplingParams, sample
from flowyard.experiments.provenance import generated_by
from flowyard.experiments.report import heading, md_table, source_revision

VOCAB = 49152  # the embedded SmolLM2's


def per_row_sample(logits, params, generators, banned) -> list[int]:
    """The sampler before it was batched: one softmax and one multinomial draw per sampled row."""
    for i, ids in enumerate(banned):
        if ids:
            logits[i, list(ids)] = float("-inf")
    if all(p.greedy for p in params):
        return logits.argmax(dim=-1).tolist()
    out = []
    for i, p in enumerate(params):
        row = logits[i]
        if p.greedy:
            out.append(int(row.argmax()))
            continue
        row = row / p.temperature
        if 0 < p.top_k < row.shape[-1]:
            row = row.masked_fill(row < torch.topk(row, p.top_k).values[-1], float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_p, idx = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_p, 0) - sorted_p < p.top_p
            probs = torch.zeros_like(probs).scatter_(0, idx[keep], sorted_p[keep])
        out.append(int(torch.multinomial(probs, 1, generator=generators[i])))
    return out


def timed(fn, repeat: int) -> float:
    ts = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def sampler_rows(rows: list[int], repeat: int) -> list[tuple]:
    out = []
    for label, p in (("temperature 1 (no sampling fields sent)", SamplingParams()),
                     ("temperature 0.8, top_p 0.9", SamplingParams(temperature=0.8, top_p=0.9))):
        for n in rows:
            logits = torch.randn(n, VOCAB)
            args = ([p] * n, [None] * n, [(2,)] * n)  # EOS banned, as before min_tokens
            old = timed(lambda: per_row_sample(logits.clone(), *args), repeat)
            new = timed(lambda: sample(logits.clone(), *args), repeat)
            out.append((label, n, f"{1e3 * old:.2f}", f"{1e3 * new:.2f}", f"{old / new:.1f}×"))
    return out


def engine_rows(streams: int, tokens: int) -> list[tuple]:
    """Output tokens/s of `streams` sampled requests decoded together by the embedded model,
    with each sampler, beside the same requests decoded greedily."""
    import flowyard.engine.llm_engine as le
    from flowyard.engine.engine_config import EngineConfig

    engine = le.LLMEngine.from_path(None, EngineConfig(kv_cache_memory_mb=512))
    prompts = [[10 + (7 * i + j) % 500 for j in range(64)] for i in range(streams)]
    engine.generate(prompts, SamplingParams(max_tokens=4, temperature=0))  # warm up at this batch
    out, rates = [], {}
    for label, fn, p in (("greedy", sample, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)),
                         ("sampled, per-row loop", per_row_sample, SamplingParams(max_tokens=tokens, ignore_eos=True)),
                         ("sampled, batched", sample, SamplingParams(max_tokens=tokens, ignore_eos=True))):
        le.sample = fn
        try:
            best = 0.0
            for _ in range(2):  # the better of two: the VM is noisy
                t = time.perf_counter()
                engine.generate(prompts, p)
                best = max(best, streams * tokens / (time.perf_counter() - t))
            rates[label] = best
        finally:
            le.sample = sample
        out.append((label, streams, tokens, f"{rates[label]:.1f}", f"{rates[label] / rates['greedy']:.2f}"))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,4,16,64")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--streams", type=int, default=16, help="sampled requests decoded together (engine table)")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    try:
        rows = [int(x) for x in a.rows.split(",")]
    except ValueError:
        ap.error(f"--rows takes comma-separated integers, got {a.rows!r}")
    if min(rows) < 1 or a.repeat < 1 or a.streams < 1 or a.tokens < 1:
        ap.error("--rows, --repeat, --streams and --tokens must be positive")
    rev = source_revision()
    lines = [heading(f"The sampler, batched vs per row (report at {rev or 'unknown revision'})", rev), "",
             f"{generated_by('benchmarks/sampler_speed.py', argv if argv is not None else sys.argv[1:])}, "
             f"torch {torch.__version__} "
             f"({torch.get_num_threads()} threads). Median of {a.repeat} calls over random logits of the "
             "embedded model's vocabulary.", "",
             md_table(("parameters", "rows", "per-row loop ms", "batched ms", "speed-up"), sampler_rows(rows, a.repeat)),
             "", f"## A decode run of {a.streams} sampled requests (the embedded model)", "",
             md_table(("sampler", "requests", "tokens each", "output tok/s", "over greedy"),
                      engine_rows(a.streams, a.tokens)), ""]
    text = "\n".join(lines)
    print(text)
    if a.out:
        a.out.write_text(text)


if __name__ == "__main__":
    main()
