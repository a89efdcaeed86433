"""Paged decode attention that reads KV blocks where they lie in the cache (CPU).

The gather path (attention.gather_decode_kv) copies every decode's whole context into a
contiguous buffer on every layer of every step, and SDPA then reads it again: three passes over
the KV bytes, so an 8-stream step at 1,024-token contexts cost about twice one at 16 tokens
(issue 14). Here the block-table lookup is inside the kernel (csrc/paged_decode.c): each K and
V row is read once, straight from its block, for all query heads that share it.

Why a small C kernel rather than torch.compile or a library: an Inductor-compiled
index-multiply-reduce formulation of the same math measured slower than the gather path it
replaces (8x1k step 120 ms vs 68 ms, benchmarks/results/engine_cpu.md), vLLM's and IPEX's CPU
paged-attention kernels come only with those whole packages, and one C file does it: a
one-pass AVX-512 kernel where the CPU has it (16-token tiles, online softmax, K/V widened in
registers: 8 sequences x 1,024 tokens x 30 layers in 8.8 ms bf16 / 6.3 ms fp8 against 16.9 /
14.8 for the earlier three-pass loop, benchmarks/results/paged_kernel_speed.md), portable C
elsewhere. It is compiled on first use with the machine's C compiler and loaded with ctypes
(engine/ckernels.py); it runs on the OpenMP threads PyTorch already has. Without a
compiler, on other devices (CUDA), or for other dtypes, callers keep the gather path: same
results up to rounding. FLOWYARD_PAGED_KERNEL=0 turns the kernel off.

Numerics: scores, softmax and the weighted sum run in float32 and are rounded once, so results
differ from SDPA's bfloat16 path by rounding only; correctness is judged the way vLLM judges it
(greedy tokens against transformers, top-5 logprobs where they diverge: tests/test_engine.py).
"""

from __future__ import annotations

import ctypes
import os

import torch

from flowyard.engine import ckernels

SOURCE = ckernels.CSRC / "paged_decode.c"
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # the kernel's dtype codes (q, out and cache)
_KV_DTYPES = {**_DTYPES, torch.float8_e5m2: 2}  # the cache may also be fp8 (kv_cache_dtype)


def build(cc: str | None = None):
    """Compile the kernel (once per source, compiler and CPU) and return the shared object."""
    return ckernels.build(SOURCE, cc=cc)


class PagedKernel:
    """The compiled kernel, loaded on first use; `available` is False where it cannot run."""

    def __init__(self) -> None:
        self._lib: ctypes.CDLL | None = None
        self._tried = False

    def _load(self) -> ctypes.CDLL | None:
        self._tried = True
        if os.environ.get("FLOWYARD_PAGED_KERNEL", "1") == "0":
            return None
        lib = ckernels.load(SOURCE, what="decodes gather their KV instead")
        if lib is None:
            return None
        p, i = ctypes.c_void_p, ctypes.c_int
        lib.paged_decode.argtypes = [p] * 6 + [i] * 6 + [ctypes.c_float, i, i, i]
        lib.paged_decode.restype = i
        return lib

    def supports(self, q: torch.Tensor, cache: torch.Tensor) -> bool:
        if (q.device.type != "cpu" or q.dtype not in _DTYPES or cache.dtype not in (q.dtype, torch.float8_e5m2)
                or q.shape[-1] > 256):
            return False
        if not self._tried:
            self._lib = self._load()
        return self._lib is not None

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 tables: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        """q: (B, kv_heads, group, D); k_cache/v_cache: (num_blocks, block_size, kv_heads, D);
        tables: (B, max_blocks) block ids; lens: (B,) context lengths >= 1. Returns q's shape."""
        assert self._lib is not None, "call supports() first"
        b, kvh, group, d = q.shape
        q = q.contiguous()
        tables = tables.to(torch.int64).contiguous()
        lens = lens.to(torch.int64).contiguous()
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("the KV cache must be contiguous")
        out = torch.empty_like(q)
        rc = self._lib.paged_decode(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), lens.data_ptr(),
            out.data_ptr(), b, tables.shape[1], k_cache.shape[1], kvh, group, d, d ** -0.5,
            torch.get_num_threads(), _DTYPES[q.dtype], _KV_DTYPES[k_cache.dtype])
        if rc != 0:
            raise RuntimeError(f"paged decode kernel failed ({rc}): head_dim {d}, group {group}")
        return out


def raw(t: torch.Tensor) -> torch.Tensor:
    """`t` as bytes where it holds float8 (an fp8 KV cache): PyTorch's CPU index_copy and
    index_select have no float8 kernels, and moving bytes is the same thing."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.is_floating_point() else t


def paged_decode_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           tables: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """The kernel's math in PyTorch, for tests: same shapes, float32 inside."""
    nb, bs = tables.shape[1], k_cache.shape[1]
    qf = q.float() * q.shape[-1] ** -0.5
    k = raw(k_cache)[tables].view(k_cache.dtype).flatten(1, 2).float()  # (B, T, kvh, D)
    v = raw(v_cache)[tables].view(v_cache.dtype).flatten(1, 2).float()
    s = torch.einsum("bhgd,bthd->bhgt", qf, k)
    pad = torch.arange(nb * bs).view(1, 1, 1, -1) >= lens.view(-1, 1, 1, 1)
    p = torch.softmax(s.masked_fill(pad, float("-inf")), dim=-1)
    return torch.einsum("bhgt,bthd->bhgd", p, v).to(q.dtype)


paged_decode = PagedKernel()
