"""A cost model fitted to `flowyard profile` measurements of the real engine.

The GEMM operators (qkv_proj, o_proj, gate_up_proj, down_proj) depend on the number of tokens
in the step only (the rows the engine multiplies: a profile's `gemm_row_padding` says how it
pads small products, core/padding.py), but not linearly on a CPU (kernels change with the batch
shape), so they are interpolated piecewise-linearly between the measured token counts and
extrapolated along the last segment. The curve is made non-decreasing (a running maximum over
the token counts): a noisy sample must not make more tokens cost less, since the schedulers'
budget searches bisect on step time. It also carries a slow count up to the counts above it,
which is why the engine pads the slow ones away rather than the curve keeping them. The others get a small linear form in the features that drive their cost:

  attn:   a + b * prefill_seqs + c * prefill_attn + d * prefill_work + e * prefill_kv
            + f * decode_seqs + g * decode_ctx
  other:  a + b * tokens + c * sampled rows (padded as the GEMMs)    (embedding, lm_head, sampling)

`prefill_work` is the query-key products the engine's prefill kernel computes, which is not the
causal pair count: PyTorch's CPU flash kernel takes keys in blocks of 512 (all of them below
512) and skips only whole blocks past the diagonal, and a chunk after history runs with an
explicit mask and skips nothing. Pairs alone underpriced mid-length prompts (256-512 tokens,
where the kernel does twice the pairs' work; benchmarks/attention_fit.py measures it). Both
features are offered; the fit keeps the one the profile's kernel follows (a GPU kernel that
skips at fine granularity follows the pairs).

plus the engine's measured per-step time outside the forward pass (`engine_overhead_s`), and,
when the profile has a `serving` block (`flowyard.costmodel.serving`), what a served step adds:
every time scaled by its `scale`, a cost per sampled row and per step, and a frontend latency.

fitted by non-negative least squares on relative error (so 16-token and 2,048-token shapes
count alike). The simulator then emulates this engine on this machine: `flowyard simulate
--profile PATH`.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from flowyard.core.padding import RowPadding
from flowyard.core.plan import BatchShape
from flowyard.costmodel.base import LAYER_OPS, CostModel, Seconds
from flowyard.costmodel.serving import ServingTerms


GEMM_OPS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class ProfileError(ValueError):
    pass


WORK_COLUMN = 3  # prefill_work's place among the attention features
KEY_BLOCK = 512  # keys per block in PyTorch's CPU flash-attention kernel, for 512 keys or more


def prefill_work(s: BatchShape) -> np.ndarray:
    """Query-key products the CPU flash kernel computes for the shape's prefill slices, from
    their mean length n and mean history h (exact for one slice or equal ones). Fresh prompt:
    key block b (width w_b) is computed for every query from 512*b on, so the sum is
    512*k*n - 512^2*k*(k-1)/2 + r^2 with n = 512*k + r (n^2 below 512 keys). After history:
    n * (h + n), as the masked call skips nothing."""
    seqs = np.maximum(np.asarray(s.prefill_seqs, dtype=float), 1.0)
    n = np.asarray(s.prefill_tokens, dtype=float) / seqs
    h = np.maximum(np.asarray(s.prefill_kv, dtype=float) / seqs - n, 0.0)
    k = np.floor(n / KEY_BLOCK)
    r = n - KEY_BLOCK * k
    fresh = KEY_BLOCK * k * n - KEY_BLOCK ** 2 * k * (k - 1) / 2 + r * r
    return seqs * np.where(h >= 0.5, n * (h + n), fresh) * (np.asarray(s.prefill_seqs) > 0)


def _features(op: str, s: BatchShape, pad: RowPadding | None = None) -> list:
    one = 1.0 + 0.0 * np.asarray(s.decode_ctx, dtype=float)  # broadcast to the run's shape
    if op == "attn":
        return [one, one * s.prefill_seqs, one * s.prefill_attn, one * prefill_work(s), one * s.prefill_kv,
                one * s.decode_seqs, s.decode_ctx * one]
    if op == "step_other":  # the lm_head multiplies the sampled rows
        rows = np.asarray(s.prefill_seqs) + np.asarray(s.decode_seqs)
        return [one, one * s.tokens, one * (rows if pad is None else pad.rows(rows))]
    return [one, one * s.tokens]


def gemm_rows(s: BatchShape, pad: RowPadding | None) -> np.ndarray:
    """Rows the step's layer GEMMs multiply: its tokens, padded as the engine pads them."""
    n = np.asarray(s.tokens) + 0 * np.asarray(s.decode_ctx)  # broadcast to the run's shape
    return np.asarray(n if pad is None else pad.rows(n), dtype=float)


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with x >= 0 by dropping the most negative coefficient until none is left
    (enough for the handful of features here)."""
    active = list(range(a.shape[1]))
    x = np.zeros(a.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(a[:, active], b, rcond=None)
        if (sol >= 0).all():
            x[active] = sol
            return x
        active.pop(int(np.argmin(sol)))
    return x


class ProfiledCostModel(CostModel):
    def __init__(self, profile: dict | str | Path, kv_capacity_tokens: int | None = None,
                 kernel_work: bool = True) -> None:
        """kernel_work=False fits attention on the causal pairs alone (the ablation
        benchmarks/attention_fit.py reports)."""
        if not isinstance(profile, dict):
            path = Path(profile)
            try:
                loaded = json.loads(path.read_text())
            except FileNotFoundError:
                raise ProfileError(f"profile {str(path)!r} does not exist (make one with `flowyard profile`)") from None
            except (OSError, ValueError) as e:
                raise ProfileError(f"profile {str(path)!r} is not a readable JSON profile: {e}") from None
            if not isinstance(loaded, dict):
                raise ProfileError(f"profile {str(path)!r} is not a JSON object")
            profile = loaded
        try:
            self.num_layers = int(profile["num_layers"])
            self._kv_bytes = int(profile["kv_bytes_per_token"])
            samples = profile["samples"]
            self.row_padding = RowPadding.from_dict(profile.get("gemm_row_padding"))
            shapes = [BatchShape(**s["shape"]) for s in samples]
            times = {op: np.array([s["times"][op] for s in samples]) for op in (*LAYER_OPS, "step_other")}
        except (KeyError, TypeError, ValueError) as e:
            raise ProfileError(f"profile is missing or has a malformed field: {e!r}") from None
        if len(shapes) < 4:
            raise ProfileError("profile has too few samples to fit (need at least 4)")
        self.name = profile.get("model", "profile")
        self.machine = profile.get("machine", {})
        self._capacity = kv_capacity_tokens or int(profile.get("kv_capacity_tokens", 16384))
        self.engine_overhead = float(profile.get("engine_overhead_s", 0.0))  # per step, outside forward
        try:
            self.serving = ServingTerms.from_dict(profile.get("serving", {}))
        except ValueError as e:
            raise ProfileError(f"profile's serving block: {e}") from None
        self._k = self.serving.scale
        self.coef: dict[str, np.ndarray] = {}
        self.curve: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        tokens = np.array([float(gemm_rows(s, self.row_padding)) for s in shapes])
        for op, t in times.items():
            if op in GEMM_OPS:
                xs = np.unique(tokens)
                self.curve[op] = (xs, np.maximum.accumulate([t[tokens == x].mean() for x in xs]))
                continue
            x = np.array([[float(f) for f in _features(op, s, self.row_padding)] for s in shapes])
            if op == "attn" and not kernel_work:
                x[:, WORK_COLUMN] = 0.0  # nnls then leaves its coefficient at zero
            w = 1.0 / np.maximum(t, 1e-6)
            self.coef[op] = nnls(x * w[:, None], t * w)
        self.fit_error = {op: self._rel_error(op, shapes, t) for op, t in times.items()}

    def _rel_error(self, op: str, shapes: list[BatchShape], t: np.ndarray) -> float:
        pred = np.array([self._op(op, s) for s in shapes], dtype=float)
        return float(np.median(np.abs(pred - t) / np.maximum(t, 1e-9)))

    def _op(self, op: str, shape: BatchShape) -> Seconds:
        if op in self.curve:
            xs, ys = self.curve[op]
            n = gemm_rows(shape, self.row_padding)
            inside = np.interp(n, xs, ys)
            if len(xs) < 2:
                return inside
            slope = max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), 0.0)
            return np.where(n > xs[-1], ys[-1] + slope * (n - xs[-1]), inside)
        total: Seconds = 0.0
        for c, f in zip(self.coef[op], _features(op, shape, self.row_padding)):
            total = total + c * f
        return total

    def layer_op_times(self, shape: BatchShape) -> dict[str, Seconds]:
        if self._k == 1.0:
            return {op: self._op(op, shape) for op in LAYER_OPS}
        return {op: self._op(op, shape) * self._k for op in LAYER_OPS}

    def step_overhead(self, shape: BatchShape) -> dict[str, Seconds]:
        own = self._op("step_other", shape) + self.engine_overhead
        sv = self.serving
        if sv.scale == 1.0 and not sv.row_s and not sv.step_s:
            return {"overhead": own}
        return {"overhead": own * sv.scale + sv.row_s * (shape.prefill_seqs + shape.decode_seqs) + sv.step_s}

    def frontend_latency(self) -> Seconds:
        return self.serving.frontend_s

    def kv_export_time(self) -> Seconds:
        return self.serving.export_s

    def step_gap(self) -> Seconds:
        return self.serving.gap_s

    def kv_bytes_per_token(self) -> int:
        return self._kv_bytes

    def kv_capacity_tokens(self) -> int:
        return self._capacity
