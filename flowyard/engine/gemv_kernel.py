"""bfloat16 GEMV / skinny GEMM for decode linears of 1 to 4 rows (CPU), csrc/gemv_bf16.c.

Why: a one-stream decode step streams every weight once (SmolLM2-135M: 212 MB in the 30
layers' linears plus the 57 MB lm_head), so its linears are bound by memory bandwidth. oneDNN's
bfloat16 kernel (PackedLinear) reads them at about 15.5 GB/s on the 2-core Sapphire Rapids VM
(no AMX), which reads memory at about 32 GB/s with 2 threads. This kernel reads each weight row
once, dotted with all the input rows while it is in registers (four weight rows in flight, 32
bfloat16 pairs per AVX512_BF16 vdpbf16ps), and splits the output features across the OpenMP
threads PyTorch already has. Measured (benchmarks/results/gemv_speed.md): the 30 layers'
linears at one row in 7.9 ms (26.8 GB/s) against oneDNN's 12.6 ms; one-stream decode of the
engine 62.8 tok/s against 44.2.

Numerics: products and sums in float32, bias added in float32, one round-to-nearest-even to
bfloat16, so outputs are F.linear in float32 rounded once, within a bfloat16 ulp (summation
order differs). Not bit-equal to oneDNN's bfloat16 kernel, so the engine does not use it in
`exact` attention mode (PackedLinear.small_gemv).

Without a compiler, without AVX512_BF16 (a portable C loop is compiled instead, still one pass
over W), for other dtypes, devices, or more rows, callers keep PackedLinear's oneDNN path.
FLOWYARD_GEMV_KERNEL=0 turns the kernel off.
"""

from __future__ import annotations

import ctypes
import os
from typing import Callable

import torch

from flowyard.engine import ckernels

SOURCE = ckernels.CSRC / "gemv_bf16.c"
MAX_ROWS = 4
_BF16 = torch.bfloat16


class GemvKernel:
    """The compiled kernel, loaded on first use; `available()` is False where it cannot run."""

    def __init__(self) -> None:
        # ctypes function pointers; their arguments are ints (pointers, sizes) or None (NULL)
        self._fn: Callable[..., int] | None = None
        self._w8: Callable[..., int] | None = None
        self._tried = False
        self.impl = -1  # 1: AVX512_BF16, 0: portable C, -1: not loaded

    def available(self) -> bool:
        if not self._tried:
            self._tried = True
            if os.environ.get("FLOWYARD_GEMV_KERNEL", "1") != "0":
                lib = ckernels.load(SOURCE, what="bfloat16 decode linears stay on oneDNN")
                if lib is not None:
                    fn = lib.gemv_bf16
                    p, i, l_ = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
                    fn.argtypes = [p, l_, p, p, p, i, l_, l_, i]
                    fn.restype = i
                    w8 = lib.gemv_w8
                    w8.argtypes = [p, l_, p, p, p, p, i, l_, l_, p, i]
                    w8.restype = i
                    lib.gemv_bf16_impl.restype = i
                    self.impl = lib.gemv_bf16_impl()
                    self._fn, self._w8 = fn, w8
        return self._fn is not None

    def supports(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
        return (x.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS and x.dtype == torch.bfloat16 and not x.requires_grad
                and weight.dtype == torch.bfloat16 and x.device.type == "cpu" and weight.device.type == "cpu"
                and weight.dim() == 2 and weight.is_contiguous() and x.shape[1] == weight.shape[1]
                and (bias is None or (bias.dtype == torch.bfloat16 and bias.is_contiguous()
                                      and bias.shape == (weight.shape[0],)))
                and self.available())

    def supports_int8(self, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> bool:
        """Whether `int8` takes this call: `supports` for int8 codes with a bfloat16 scale."""
        return (x.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS and x.dtype == torch.bfloat16 and x.device.type == "cpu"
                and q.dtype == torch.int8 and q.dim() == 2 and q.is_contiguous() and x.shape[1] == q.shape[1]
                and scale.dtype == torch.bfloat16 and scale.is_contiguous() and scale.shape == (q.shape[0],)
                and self.available())

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """y = x @ weight.T (+ bias). x: (M <= 4, K) bf16 whose rows are contiguous (any row
        stride; other layouts are copied); weight: (N, K) contiguous; bias: (N,) or None.
        Dtypes and devices are the caller's to check (`supports`, or PackedLinear's own test)."""
        fn = self._fn
        if fn is None:
            if not self.available():
                raise RuntimeError("the gemv_bf16 kernel is not available")
            fn = self._fn
            assert fn is not None  # available() loaded it
        m, k = x.shape
        if m > 1:
            ldx = x.stride(0)
            if x.stride(1) != 1 or ldx < k:
                x, ldx = x.contiguous(), k
        else:
            ldx = k
            if x.stride(1) != 1:
                x = x.contiguous()
        n, kw = weight.shape
        if kw != k:
            raise ValueError(f"x has {k} columns, weight {kw}")
        y = torch.empty((m, n), dtype=_BF16)
        if fn(x.data_ptr(), ldx, weight.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
              m, n, k, torch.get_num_threads()):
            raise ValueError(f"gemv_bf16 rejected x {tuple(x.shape)}, weight {tuple(weight.shape)}")
        return y

    def int8(self, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """y = (x @ q.T) * scale for 1..MAX_ROWS bfloat16 rows, q (N, K) int8 contiguous,
        scale (N,) bfloat16: `--quantization int8/w8a8`'s few-row path, one pass over the int8
        codes (half bfloat16's bytes). Callers check `supports_int8`."""
        if not self.available():
            raise RuntimeError("the gemv_bf16 kernel is not available")
        x = x.contiguous()
        m, k = x.shape
        n = q.shape[0]
        xf = torch.empty(m * k, dtype=torch.float32)  # x widened once (per call: engines may share us)
        y = torch.empty((m, n), dtype=_BF16)
        w8 = self._w8
        assert w8 is not None  # available() loaded it
        if w8(x.data_ptr(), k, q.data_ptr(), scale.data_ptr(), None, y.data_ptr(), m, n, k,
                    xf.data_ptr(), torch.get_num_threads()):
            raise ValueError(f"gemv_w8 rejected x {tuple(x.shape)}, weight {tuple(q.shape)}")
        return y


gemv_bf16 = GemvKernel()
