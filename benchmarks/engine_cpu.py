"""Engine speed on the CPU with the embedded SmolLM2-135M-Instruct, against transformers run in
the same process and the published numbers quoted in issue 3.

Measures, each as the best of --repeat runs (the VM is noisy):
  single-stream decode tok/s   (30-token prompt, 128 greedy tokens, EOS ignored)
  32-stream output tok/s       (32 prompts of 64 tokens, 128 tokens each, prefill included;
                                also the decode-only rate after the step that prefills them)
  1,000-token prefill tok/s    (time to the first token of one 1,000-token prompt)
  peak RSS of `flowyard serve` (default model and settings, after a few requests)
Run: python benchmarks/engine_cpu.py [--repeat 2] [--skip-rss] [--skip-hf] [--configs bfloat16/grouped]
A config is dtype/attention[/quantization][/fp8_e5m2], e.g. bfloat16/paged/int4 (EngineConfig.quantization)
or bfloat16/paged/fp8_e5m2 (an fp8 KV cache, EngineConfig.kv_cache_dtype).
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import subprocess
import sys
import time

import torch

from flowyard.engine.embedded import embedded_model_path
from flowyard.engine.engine_config import EngineConfig
from flowyard.engine.llm_engine import LLMEngine
from flowyard.engine.loader import load_checkpoint
from flowyard.engine.sampling import SamplingParams

from decode_context import steps_at  # this folder: 8-stream decode steps at a given context

# Issue 3's reference figures (tokens/s, 2-core AVX-512 machine of the CI kind).
PUBLISHED = {
    "single": {"vLLM CPU": 18.0, "llama.cpp Q4_1": 67.0},
    "streams32": {"vLLM CPU fp32": 195.0, "vLLM CPU bf16": 303.0},
    "prefill": {"vLLM CPU fp32": 323.0, "vLLM CPU bf16": 556.0, "llama.cpp Q4_1": 179.0},
}
TARGETS = {"single": "3x transformers", "streams32": 400.0, "prefill": 560.0}


def best(fn, repeat: int) -> float:
    return max(fn() for _ in range(repeat))


def ours(dtype: str, attention: str, repeat: int, quantization: str | None = None,
         kv_cache_dtype: str = "auto") -> dict[str, float]:
    engine = LLMEngine.from_path(None, EngineConfig(dtype=dtype, attention=attention, kv_cache_memory_mb=512,
                                                    quantization=quantization, kv_cache_dtype=kv_cache_dtype,
                                                    max_num_batched_tokens=2048))  # 32 prompts: one step
    prompt = list(range(1000, 1030))
    engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0))  # warm up

    def single() -> float:
        engine.add_request("s", prompt, SamplingParams(max_tokens=129, temperature=0, ignore_eos=True))
        engine.step()  # prefill + first token
        t = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        return 128 / (time.perf_counter() - t)

    decode_rates: list[float] = []

    def streams() -> float:
        """Output tok/s of 32 concurrent greedy streams, their prefill included; also records
        the decode-only rate (after the first step, which prefills all 32 prompts). Every
        repeat has new prompts, so the prefix cache cannot skip the prefill."""
        rep = len(decode_rates)
        prompts = [[(i * 131 + j + 7919 * rep) % 40000 + 100 for j in range(64)] for i in range(32)]
        params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
        t = time.perf_counter()
        for i, p in enumerate(prompts):
            engine.add_request(f"stream-{rep}-{i}", p, params)
        engine.step()  # all 32 prompts (2,048 tokens) fit one step's token budget
        t_first = time.perf_counter()
        produced = 32
        while engine.has_unfinished():
            produced += sum(len(o.new_token_ids) for o in engine.step())
        end = time.perf_counter()
        decode_rates.append((produced - 32) / (end - t_first))
        return produced / (end - t)

    # A fresh engine without prefix caching, so every repeat really prefills.
    engine_nc = LLMEngine(engine.model, engine.tokenizer, EngineConfig(
        dtype=dtype, attention=attention, enable_prefix_caching=False, kv_cache_memory_mb=64,
        quantization=quantization, kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=2048))

    def prefill() -> float:
        long = [(i * 7) % 40000 + 100 for i in range(1000)]
        t = time.perf_counter()
        engine_nc.generate([long], SamplingParams(max_tokens=1, temperature=0))
        return 1000 / (time.perf_counter() - t)

    step16 = min(steps_at(engine, 16, f"ctx{r}", salt=r) for r in range(repeat))
    step1k = min(steps_at(engine, 1024, f"ctx{r}", salt=r) for r in range(repeat))
    return {"single": best(single, repeat), "streams32": best(streams, repeat), "decode32": max(decode_rates),
            "prefill": best(prefill, repeat), "step16": step16, "step1k": step1k}


def transformers_single(dtype: torch.dtype, repeat: int) -> float:
    import transformers

    ckpt = load_checkpoint(embedded_model_path())
    c = ckpt.config
    cfg = transformers.LlamaConfig(
        hidden_size=c.hidden_size, num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads, intermediate_size=c.intermediate_size, vocab_size=c.vocab_size,
        rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta, tie_word_embeddings=True)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.load_state_dict(ckpt.weights, strict=False)
    hf.tie_weights()
    hf = hf.to(dtype)
    hf.model.rotary_emb.inv_freq = hf.model.rotary_emb.inv_freq.float()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    ids = torch.tensor([list(range(1000, 1030))])
    hf.generate(ids, max_new_tokens=4, do_sample=False)

    def run() -> float:
        t = time.perf_counter()
        hf.generate(ids, max_new_tokens=128, do_sample=False)
        return 128 / (time.perf_counter() - t)

    return best(run, repeat)


def serve_peak_rss_mib() -> float:
    """Start `flowyard serve` with defaults, send a few requests, read VmHWM."""
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "flowyard.cli", "serve", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(120):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(1)
        for q in ("Hello!", "Write a short poem about the sea.", "What is 2+2?"):
            httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=120,
                       json={"messages": [{"role": "user", "content": q}], "max_tokens": 64})
        status = open(f"/proc/{proc.pid}/status").read()
        return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM"))) / 1024
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--skip-rss", action="store_true")
    ap.add_argument("--configs", default="float32/paged,bfloat16/paged,bfloat16/grouped,bfloat16/exact",
                    help="comma-separated dtype/attention[/int8|int4] rows to run")
    ap.add_argument("--skip-hf", action="store_true", help="do not time transformers")
    args = ap.parse_args()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}), {torch.get_num_threads()} threads")
    hf32 = hf16 = float("nan")
    if not args.skip_hf:
        hf32 = transformers_single(torch.float32, args.repeat)
        hf16 = transformers_single(torch.bfloat16, args.repeat)
    print(f"transformers generate single-stream: float32 {hf32:.1f} tok/s, bfloat16 {hf16:.1f} tok/s")
    rows = [c.split("/") for c in args.configs.split(",")]  # dtype, attention, then int8|int4, fp8_e5m2
    print(f"\n{'flowyard config':<20} {'single tok/s':>12} {'x hf fp32':>9} {'32-stream tok/s':>15} "
          f"{'(decode only)':>13} {'1k prefill tok/s':>16} {'8x16 step ms':>12} {'8x1k step ms':>12} {'ratio':>6}")
    for dtype, attn, *extra in rows:
        quant = next((x for x in extra if x in ("int8", "int4")), None)
        kv = next((x for x in extra if x == "fp8_e5m2"), "auto")
        r = ours(dtype, attn, args.repeat, quant, kv)
        print(f"{'/'.join([dtype, attn, *extra]):<20} {r['single']:>12.1f} {r['single'] / hf32:>9.2f} "
              f"{r['streams32']:>15.1f} {r['decode32']:>13.1f} {r['prefill']:>16.1f} {r['step16'] * 1e3:>12.1f} "
              f"{r['step1k'] * 1e3:>12.1f} {r['step1k'] / r['step16']:>6.2f}")
    print(f"\ntargets: single >= 3x transformers (here {3 * hf32:.1f}) and > vLLM CPU 17-19; "
          f"32 streams >= {TARGETS['streams32']:.0f}; prefill >= {TARGETS['prefill']:.0f}; serve RSS < 1536 MiB")
    print("published (issue 3, CI-kind machine):", PUBLISHED)
    if not args.skip_rss:
        print(f"peak RSS of `flowyard serve` (defaults, float32): {serve_peak_rss_mib():.0f} MiB")


if __name__ == "__main__":
    main()
