"""How an engine is configured: dtype, KV cache, batch limits, quantisation and attention mode,
checked when built so a bad flag fails with a message instead of deep inside a step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flowyard.engine.model import PackedLinear
from flowyard.engine.quant import check_quantization

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ATTENTION_MODES = ("paged", "grouped", "exact")
# vLLM's --kv-cache-dtype names; "auto" stores KV in the model dtype. fp8_e5m2 (the fp8 that
# vLLM's CPU backend offers) halves the bytes a long-context decode step reads.
KV_CACHE_DTYPES = {"auto": None, "fp8_e5m2": torch.float8_e5m2}


@dataclass(frozen=True)
class EngineConfig:
    # "auto" (vLLM's default) is the fastest correct dtype here: bfloat16 where the CPU has
    # native bfloat16 matmuls (oneDNN: AVX512-BF16/AMX) or on a GPU, else float32.
    dtype: str = "auto"
    block_size: int = 16
    kv_cache_memory_mb: int = 384  # KV cache size; kv_cache_tokens overrides it
    kv_cache_tokens: int | None = None
    enable_prefix_caching: bool = True
    max_model_len: int | None = None  # default: the model's context, capped by the KV cache
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None  # chunked-prefill token budget (default_token_budget)
    max_waiting: int = 256  # bounded queue; past it the server answers 503 + Retry-After
    threads: int | None = None
    # Quantised linears (quant.py): None, "int8" or "int4" (weight-only: few-row GEMMs read
    # int8/int4 weights) or "w8a8" (int8 weights, and int8 activations from 5 rows on).
    # Applied in place when the engine is built.
    quantization: str | None = None
    # Decode attention: "paged" (default, fastest) reads KV blocks in place with a compiled
    # kernel (paged_kernel.py); "grouped" gathers blocks then runs one SDPA call; "exact"
    # gathers and computes what transformers computes, bit for bit (slowest).
    attention: str = "paged"
    kv_cache_dtype: str = "auto"  # see KV_CACHE_DTYPES

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto or one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.block_size:
            raise ValueError("kv_cache_tokens must hold at least one block")
        if self.attention not in ATTENTION_MODES:
            raise ValueError(f"attention must be one of {', '.join(ATTENTION_MODES)}, got {self.attention!r}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}")
        if self.kv_cache_memory_mb < 1:
            raise ValueError("kv_cache_memory_mb must be positive")
        check_quantization(self.quantization)


def default_token_budget(device: str = "cpu") -> int:
    """The chunked-prefill token budget when none is given: vLLM's 2048 on a GPU, 512 on a CPU.

    Why smaller on a CPU: its GEMMs are compute-bound from about 128 rows, so a bigger step
    prefills hardly faster (8 x 256-token prompts on the 2-core VM: 919 tok/s at 256 tokens a
    step, 949 at 2048 in bfloat16; w8a8 peaks at 512) but lasts longer: every prompt in it gets
    its first token only at the step's end, and every running decode waits for it. Served
    with vLLM's client at 4 req/s (w8a8), 512 gave median TPOT 98 ms against 344 at 2048."""
    return 512 if device == "cpu" else 2048


def resolve_dtype(name: str, device: str = "cpu") -> str:
    """The dtype `name` stands for on `device` ("auto": see EngineConfig.dtype)."""
    if name != "auto":
        return name
    if device != "cpu" or PackedLinear.available:
        return "bfloat16"
    return "float32"
