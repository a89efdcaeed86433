"""Quantised linears for the CPU engine: weight-only int8 (per output channel) and int4 (per
group of 32) for decode, and W8A8 (int8 weights and per-token int8 activations) for batches.

Why: a one-row decode step is memory-bound. SmolLM2-135M reads about 270 MB of bfloat16
weights per token (212 MB in the 30 layers, 57 MB in the tied lm_head); int8 halves that and
int4 quarters it. The kernels are torch's own maintained CPU ones, not loops of ours:

  int8  `aten._weight_int8pack_mm(x, w_int8 (N, K), scales (N,))`, symmetric, w = q * s
  int4  `aten._convert_weight_to_int4pack_for_cpu` + `aten._weight_int4pack_mm_for_cpu`,
        asymmetric per group of `INT4_GROUP_SIZE` input columns, w = (q - 8) * s + z

Both compute in the activation dtype and take no bias (we add it). They only pay while few
rows share the weights: with many rows oneDNN's bfloat16 GEMM is compute-bound and faster.
Measured on the 2-core Sapphire Rapids VM (benchmarks/quant_kernels.py: one decode step's
layer linears over 30 distinct layers, ms, bf16 / int8 / int4): 1 row 13.7 / 9.1 / 4.8;
4 rows 15.8 / 11.9 / 7.9; 8 rows 21.4 / 22.5 / 14.0; 16 rows 29.7 / 36.4 / 26.3; 32 rows
50.4 / 62.9 / 51.6; 1,024 rows 1,273 / 1,738 / 1,622. So a call with more than
`MAX_QUANT_ROWS[mode]` rows (prefill chunks, larger decode batches) runs PackedLinear on the
bfloat16 weights instead. To keep that one model, `quantize_model` writes the dequantised
values back into the weights: both paths multiply by the same quantised weights, the
bfloat16 path rounded to bfloat16.
Engine numbers: benchmarks/results/engine_quant.md.

Group size 32: the embedded GGUF is Q4_1, 4-bit min/max codes per group of 32, so int4 at
32 lands on the file's own grid (a larger group would requantise, and lose, a second time;
64 was at most 3 % faster). We requantise from the dequantised floats the loader hands us
(after the engine's cast to bfloat16) rather than repacking llama.cpp blocks: simpler, and
from float32 it gives the Q4_1 weights back exactly; from bfloat16, with bfloat16 scales,
the mean error is about twice what the bfloat16 cast alone adds. int8 per output channel is
coarser than Q4_1's groups here (mean error 5x int4's): its one scale spans all 576 columns.
Only the decoder layers' linears are quantised; the lm_head (tied embedding) stays
bfloat16 (see `_layer_weights`).

w8a8: compute-bound GEMMs (prefill chunks, many decode rows) need fewer multiply cycles, not
fewer weight bytes. Without AMX this CPU's int8 VNNI GEMM (`aten._int_mm`) runs about 7x
oneDNN's bfloat16 one, and even with each call's activation quantisation and rescaling a
256-token prefill of SmolLM2 takes 152 ms against 405 ms. The same int8 codes serve one to
four rows through `_weight_int8pack_mm` (bfloat16 activations, as "int8"), where quantising
activations does not pay. Quality: tests/test_quant.py, benchmarks/results/engine_quant.md.
"""

from __future__ import annotations

import math

import torch

from flowyard.engine.gemv_kernel import gemv_bf16
from flowyard.engine.model import CausalLM, PackedLinear

QUANTIZATION_MODES = ("int8", "int4", "w8a8")
INT4_GROUP_SIZE = 32
# Rows up to which the quantised kernel beats bfloat16 PackedLinear (measured, see above).
# w8a8 has a kernel for every row count: weight-only int8 up to W8A8_MIN_ROWS - 1 rows,
# int8 x int8 from W8A8_MIN_ROWS (see w8a8_linear).
MAX_QUANT_ROWS = {"int8": 4, "int4": 16, "w8a8": 1 << 62}
W8A8_MIN_ROWS = 5


def check_quantization(mode: str | None) -> None:
    """Raise a ValueError naming the valid values unless `mode` is None, "int8" or "int4"."""
    if mode is not None and mode not in QUANTIZATION_MODES:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_MODES)} "
                         f"(or None for none), got {mode!r}")


class Scratch:
    """Work buffers reused from one weight to the next.

    Why: a tensor of a few MB is a fresh mmap, and page faults are so dear on the VMs this
    runs on that allocating float32/int32 temporaries per weight made quantising SmolLM2
    about ten times slower (int4: 11 s against about 1 s for the arithmetic itself).
    """

    def __init__(self) -> None:
        self._bufs: dict[torch.dtype, torch.Tensor] = {}

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        n = math.prod(shape)
        buf = self._bufs.get(dtype)
        if buf is None or buf.numel() < n:
            buf = self._bufs[dtype] = torch.empty(n, dtype=dtype)
        return buf[:n].view(shape)


def quantize_int8(w: torch.Tensor, scratch: Scratch | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: codes (N, K) int8, scales (N,) in w's dtype, and the
    dequantised weight (float32, in `scratch`: valid until its next use)."""
    wf = (scratch or Scratch()).take(tuple(w.shape), torch.float32).copy_(w.detach())
    lo, hi = torch.aminmax(wf, dim=1)
    scale = (torch.maximum(hi, lo.neg()) / 127).clamp_(min=1e-12).to(w.dtype)
    s = scale.float()[:, None]
    codes = wf.div_(s).round_().clamp_(-127, 127)
    return codes.to(torch.int8), scale, codes.mul_(s)


def quantize_int4(w: torch.Tensor, group: int = INT4_GROUP_SIZE,
                  scratch: Scratch | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric (min/max) 4-bit codes per `group` input columns.

    Returns codes (N, K) int32 in 0..15, scale_zeros (K / group, N, 2) in w's dtype (the
    layout `_weight_int4pack_mm_for_cpu` reads: w = (q - 8) * scale + zero) and the
    dequantised weight (float32); codes and dequantised weight live in `scratch`, valid until
    its next use. Scale and zero are rounded to w's dtype before the codes are chosen, so
    codes and scales agree.
    """
    scratch = scratch or Scratch()
    n, k = w.shape
    wg = scratch.take((n, k // group, group), torch.float32).copy_(w.detach().view(n, k // group, group))
    lo, hi = torch.aminmax(wg, dim=-1)
    scale = ((hi - lo) / 15).clamp_(min=1e-8).to(w.dtype).float()
    # Centre the zero on the group's range: with a rounded scale that splits the error between
    # both ends instead of piling 15 scale-roundings onto the maximum. (Exact scales: lo + 8s.)
    zero = ((lo + hi) / 2 + scale / 2).to(w.dtype).float()
    s, z = scale[..., None], zero[..., None]
    codes = wg.sub_(z).div_(s).add_(8).round_().clamp_(0, 15)
    int_codes = scratch.take((n, k), torch.int32).copy_(codes.view(n, k))
    scale_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(w.dtype)
    return int_codes, scale_zeros, codes.sub_(8).mul_(s).add_(z).view(n, k)


class QuantWeight:
    """One weight's quantised copy and the kernel call that multiplies by it."""

    def __init__(self, mode: str, q: torch.Tensor, scale: torch.Tensor) -> None:
        self.mode, self.q, self.scale = mode, q, scale

    @classmethod
    def make(cls, weight: torch.Tensor, mode: str,
             scratch: Scratch | None = None) -> tuple["QuantWeight", torch.Tensor]:
        """Quantise `weight`; also return its dequantised values (float32, in `scratch`)."""
        if mode in ("int8", "w8a8"):
            q, scale, dequantized = quantize_int8(weight, scratch)
            return cls(mode, q, scale), dequantized
        codes, scale_zeros, dequantized = quantize_int4(weight, scratch=scratch)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        return cls(mode, packed, scale_zeros), dequantized

    @staticmethod
    def supports(weight: torch.Tensor, mode: str) -> bool:
        """int4 needs whole groups along K; anything else stays in PackedLinear."""
        return weight.dim() == 2 and (mode != "int4" or weight.shape[1] % INT4_GROUP_SIZE == 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "w8a8" and x.shape[0] >= W8A8_MIN_ROWS:
            return w8a8_linear(x, self.q, self.scale)
        if self.mode != "int4":
            if gemv_bf16.supports_int8(x, self.q, self.scale):
                return gemv_bf16.int8(x, self.q, self.scale)
            return torch.ops.aten._weight_int8pack_mm(x, self.q, self.scale)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.q, INT4_GROUP_SIZE, self.scale)


def w8a8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x @ (q * scale).T with x quantised to int8 per row (dynamic, symmetric).

    Why: without AMX this CPU multiplies int8 (AVX512-VNNI, `aten._int_mm`) about 7x faster
    than oneDNN's bfloat16 GEMM (1,250 against 165 GOP/s at 256 x 576 x 3,072), so prefill
    chunks and large decode batches, which are compute-bound, gain most. Each row's own scale
    keeps one outlier token from coarsening the others (SmoothQuant's per-token dynamic
    scheme, which vLLM serves as W8A8 int8).
    """
    xf = x.to(torch.float32, copy=True)  # a copy even from float32: x must not change
    sx = xf.abs().amax(dim=1, keepdim=True).clamp_(min=1e-12).div_(127)
    xq = xf.div_(sx).round_().to(torch.int8)
    y = torch._int_mm(xq, q.t())
    return y.float().mul_(sx).mul_(scale.float()).to(x.dtype)


class QuantizedLinear(PackedLinear):
    """`model.linear` for a quantised model: a call with at most `max_rows` rows on a weight
    that `quantize_model` quantised goes to the quantised kernel; everything else (the lm_head;
    for int8/int4 also prefill chunks and large batches) to PackedLinear on the bfloat16
    weights.

    Entries are keyed by the weight's identity and version, as PackedLinear's are: a weight
    loaded or replaced since (`load_weights`, `.to(float32)`) runs unquantised until
    `quantize_model` is called again, as every engine build does.
    """

    def __init__(self, mode: str, max_rows: int | None = None) -> None:
        check_quantization(mode)
        if mode is None:
            raise ValueError("QuantizedLinear needs a quantization mode")
        super().__init__()
        self.mode = mode
        self.max_rows = MAX_QUANT_ROWS[mode] if max_rows is None else max_rows
        self._quant: dict[int, tuple[torch.Tensor, int, QuantWeight]] = {}

    def clear(self) -> None:
        """Drop the bfloat16 blockings only: `.to()` calls this before it swaps weights, and
        quantised entries check the weight's identity and version anyway (a same-dtype
        `.to()`, as every engine built on a shared model does, keeps them valid)."""
        super().clear()

    def lookup(self, weight: torch.Tensor) -> QuantWeight | None:
        """The quantised copy of `weight`, if it has a current one."""
        hit = self._quant.get(id(weight))
        if hit is None or hit[0] is not weight or hit[1] != _version(weight):
            return None
        return hit[2]

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= self.max_rows and x.dtype == weight.dtype and not x.requires_grad:
            qw = self.lookup(weight)
            if qw is not None:
                out = qw(x.contiguous())
                return out if bias is None else out.add_(bias)
        return super().__call__(x, weight, bias)


def _version(weight: torch.Tensor) -> int:
    return -1 if weight.is_inference() else weight._version  # inference tensors keep none


def _layer_weights(model: CausalLM) -> list[torch.Tensor]:
    """The decoder layers' linear weights. The lm_head (SmolLM2: the tied embedding) stays
    bfloat16. Quantised too, int4 decoded one stream at 88.5 tok/s instead of 78, but greedy
    tokens left bfloat16's after 8 tokens on average instead of 22 (8 chat prompts x 64
    tokens; the file stores it as Q8_0, which 4-bit groups do not reproduce); int8 gained
    0.2 ms a token, not worth a second copy of 28 M weights."""
    return [w for layer in model.decoder_layers()
            for w in (layer.qkv.weight, layer.o_proj.weight, layer.gate_up.weight, layer.down.weight)]


@torch.no_grad()
def quantize_model(model: CausalLM, mode: str | None, max_rows: int | None = None) -> CausalLM:
    """Quantise `model`'s layer linears in place (mode "int8"/"int4"); None leaves it as is.

    Installs a QuantizedLinear as model.linear and writes the dequantised weights back, so the
    bfloat16 path for large batches multiplies by the same quantised weights. Quantising again
    with the same mode reuses the current entries (free) and requantises only weights that
    changed; a model quantised one way cannot be served another way or unquantised, as its
    original weights are gone: that is a ValueError.
    """
    check_quantization(mode)
    current = model.linear.mode if isinstance(model.linear, QuantizedLinear) else None
    if current is not None and current != mode:
        raise ValueError(f"this model's weights were quantised to {current} in place; "
                         f"load it again to run it with quantization={mode!r}")
    if mode is None:
        return model
    old = model.linear if current == mode and isinstance(model.linear, QuantizedLinear) else None
    linear = QuantizedLinear(mode, max_rows)
    scratch = Scratch()
    for w in _layer_weights(model):
        qw = old.lookup(w) if old is not None else None
        if qw is None and QuantWeight.supports(w, mode):
            qw, dequantized = QuantWeight.make(w, mode, scratch)
            w.copy_(dequantized)
        if qw is not None:
            linear._quant[id(w)] = (w, _version(w), qw)  # after the copy, which bumps the version
    model.linear = linear
    return model
