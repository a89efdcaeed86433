"""Paged decode attention that reads KV blocks where they lie in the cache (CPU).

The gather path (attention.gather_decode_kv) copies every decode's whole context into a
contiguous buffer on every layer of every step, and SDPA then reads it again: three passes over
the KV bytes, so an 8-stream step at 1,024-token contexts cost about twice one at 16 tokens
(issue 14). Here the block-table lookup is inside the kernel (csrc/paged_decode.c): each K and
V row is read once, straight from its block, for all query heads that share it.

Why a small C kernel rather than torch.compile or a library: an Inductor-compiled
index-multiply-reduce formulation of the same math measured slower than the gather path it
replaces (8x1k step 120 ms vs 68 ms, benchmarks/results/engine_cpu.md), vLLM's and IPEX's CPU
paged-attention kernels come only with those whole packages, and this loop is 60 lines that
gcc vectorises. It is compiled on first use with the machine's C compiler (`CC`, else `cc`)
into a per-user cache and loaded with ctypes; it runs on the OpenMP threads PyTorch already
has (torch's libgomp.so.1 is loaded first, so the kernel binds to it by soname). Without a
compiler, on other devices (CUDA), or for other dtypes, callers keep the gather path: same
results up to rounding. FLOWYARD_PAGED_KERNEL=0 turns the kernel off.

Numerics: scores, softmax and the weighted sum run in float32 and are rounded once, so results
differ from SDPA's bfloat16 path by rounding only; correctness is judged the way vLLM judges it
(greedy tokens against transformers, top-5 logprobs where they diverge: tests/test_engine.py).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("csrc") / "paged_decode.c"
# -ffast-math vectorises expf and the dot products' reductions (0.85 -> 0.50 ms for 8x1k contexts
# per layer); it is given only when compiling: linking with it would add crtfastmath.o, which
# turns on flush-to-zero for the whole process (tests/test_engine_paged.py checks it does not).
COMPILE = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-c"]
LINK = ["-shared", "-fopenmp"]
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # the kernel's dtype codes (q, out and cache)
_KV_DTYPES = {**_DTYPES, torch.float8_e5m2: 2}  # the cache may also be fp8 (kv_cache_dtype)


def _cache_dir() -> Path:
    root = os.environ.get("FLOWYARD_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME")
                                                            or os.path.expanduser("~/.cache"), "flowyard")
    return Path(root) / "kernels"


def _cpu_id() -> str:
    """The CPU's feature flags: a cached -march=native build must not move to another CPU."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def build(cc: str | None = None) -> Path:
    """Compile the kernel (once per source, compiler and CPU) and return the shared object."""
    cc = cc or os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        raise RuntimeError(f"no C compiler {cc!r} on PATH")
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join([cc, *COMPILE, *LINK, _cpu_id()]).encode()).hexdigest()[:16]
    out = _cache_dir() / f"paged_decode-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:  # then an atomic rename: safe for
        obj, lib = os.path.join(tmp, "k.o"), os.path.join(tmp, "k.so")  # processes building at once
        try:
            subprocess.run([cc, *COMPILE, str(SOURCE), "-o", obj], check=True, capture_output=True, text=True)
            subprocess.run([cc, *LINK, obj, "-o", lib, "-lm"], check=True, capture_output=True, text=True)
        except subprocess.CalledProcessError as e:
            raise RuntimeError(f"compiling {SOURCE.name} failed: {e.stderr.strip()[-500:]}") from e
        os.replace(lib, out)
    return out


class PagedKernel:
    """The compiled kernel, loaded on first use; `available` is False where it cannot run."""

    def __init__(self) -> None:
        self._lib: ctypes.CDLL | None = None
        self._tried = False

    def _load(self) -> ctypes.CDLL | None:
        self._tried = True
        if os.environ.get("FLOWYARD_PAGED_KERNEL", "1") == "0":
            return None
        try:
            lib = ctypes.CDLL(str(build()))
        except (RuntimeError, OSError) as e:
            log.warning("paged decode kernel unavailable (%s); decodes gather their KV instead", e)
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
