"""PLA-Serve's compute-memory length boundary for prefills and re-prefills (paper §2.1).

PLA-Serve separates short (memory-bound) from long (compute-bound) fills. A fill of L new
tokens over H history tokens costs

    T_comp(L, H) = alpha * L * (L + 2H) + beta * L          (causal attention, FFN/GEMMs)
    T_mem(L, H)  = gamma_0 + gamma_w * L + gamma_r * H       (HBM traffic)

and is memory-bound while T_mem > T_comp, i.e. for L below the positive root of
alpha L^2 + (2 alpha H + beta - gamma_w) L - (gamma_r H + gamma_0) = 0.

gamma_0 is our one addition to the paper, whose T_mem holds only KV traffic (gamma_0 = 0, in
which case every formula here is exactly the paper's). Why: on the roofline, the bytes a
fill moves per new token (activations, norms, the KV write: gamma_w ~ 5 us for llama-3-8b on
H100) are far below its GEMM time per token (beta ~ 21 us), so the paper-literal model says
prefills are never memory-bound, contradicting the paper's own roofline paragraph (the
transition at 150-512 tokens). What makes a short fill memory-bound is streaming the
weights once per step, a cost independent of L and H: gamma_0. With it the prefill boundary
lands near the roofline ridge (AI* = peak FLOP/s / HBM bandwidth), as the paper reports.

The re-prefill boundary moves monotonically with H toward gamma_r / (2 alpha): it grows when
it starts below (the paper's case, gamma_0 = 0) and shrinks when the weight stream puts the
H = 0 boundary above it (the roofline's case: ~300 tokens at H = 0 falling to a few dozen).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

from flowyard.core.plan import BatchShape
from flowyard.costmodel.base import CostModel, ScaledCostModel
from flowyard.costmodel.profiled import nnls

ArrayLike = float | np.ndarray


def _out(v: np.ndarray) -> ArrayLike:
    """0-d results back to float so scalar callers get plain numbers."""
    return float(v) if np.ndim(v) == 0 else v


def _nonneg(name: str, v: ArrayLike) -> np.ndarray:
    a = np.asarray(v, dtype=float)
    if not np.isfinite(a).all() or (a < 0).any():
        raise ValueError(f"{name} must be finite and >= 0, got {v!r}")
    return a


@dataclass(frozen=True)
class LengthModel:
    """The fitted latency model of §2.1: seconds per pair / token / step of each term."""

    alpha: float     # causal attention, per query-key pair term L(L+2H)
    beta: float      # GEMMs/FFN, per new token
    gamma_w: float   # HBM traffic per new token (KV write, activations)
    gamma_r: float   # KV read per history token
    gamma_0: float = 0.0  # HBM traffic per step independent of L, H (weights); paper: 0

    def __post_init__(self) -> None:
        for name in ("alpha", "beta", "gamma_w", "gamma_r", "gamma_0"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"LengthModel.{name} must be a finite number >= 0, got {v!r}")
        if self.alpha <= 0:
            # alpha = 0 makes compute linear in L and the boundary infinite when
            # beta <= gamma_w: no length would ever be compute-bound.
            raise ValueError("LengthModel.alpha must be > 0 (compute grows quadratically in L)")

    def t_comp(self, L: ArrayLike, H: ArrayLike = 0) -> ArrayLike:
        L, H = _nonneg("L", L), _nonneg("H", H)
        return _out(self.alpha * L * (L + 2 * H) + self.beta * L)

    def t_mem(self, L: ArrayLike, H: ArrayLike = 0) -> ArrayLike:
        L, H = _nonneg("L", L), _nonneg("H", H)
        return _out(self.gamma_0 + self.gamma_w * L + self.gamma_r * H)

    @property
    def saturation(self) -> float:
        """gamma_r / (2 alpha): the re-prefill boundary's limit as H grows without bound
        (2 alpha H L of extra attention against gamma_r H of extra KV read)."""
        return self.gamma_r / (2 * self.alpha)

    def boundary(self, H: ArrayLike = 0) -> ArrayLike:
        """L_m(H): fills with fewer new tokens are memory-bound. With gamma_0 = 0 this is the
        paper's max(0, (gamma_w - beta)/alpha) at H = 0 and its re-prefill root for H > 0."""
        H = _nonneg("H", H)
        b = 2 * self.alpha * H + self.beta - self.gamma_w
        c = self.gamma_r * H + self.gamma_0
        disc = np.sqrt(b * b + 4 * self.alpha * c)
        # (-b + disc) / 2a cancels catastrophically when b > 0 and 4ac << b^2: use 2c/(b+disc).
        pos = b > 0
        root = np.where(pos, 2 * c / np.where(pos, b + disc, 1.0), (disc - b) / (2 * self.alpha))
        return _out(np.maximum(root, 0.0))

    def prefill_boundary(self) -> float:
        """L_m^prefill (H = 0)."""
        return float(self.boundary(0))

    def reprefill_boundary(self, H: ArrayLike) -> ArrayLike:
        """L_m^re-prefill(H), vectorised over H (equals prefill_boundary at H = 0)."""
        return self.boundary(H)


def fit_length_model(samples: np.ndarray | list, *, mem_intercept: bool = True) -> LengthModel:
    """Fit alpha, beta (T_comp on [L(L+2H), L]) and gamma_w, gamma_r (T_mem on [L, H], plus a
    constant gamma_0 unless mem_intercept=False, the paper-literal form) by non-negative least
    squares on rows (L, H, t_comp, t_mem). Unweighted: both curves are exact polynomials in
    the model, and relative weighting would let per-step constants the model lacks (the
    lm_head's FLOPs for its one sampled row) bend beta. Raises ValueError naming what the
    samples lack when a coefficient cannot be identified."""
    a = np.asarray(samples, dtype=float)
    if a.ndim != 2 or a.shape[1] != 4:
        raise ValueError(f"samples must be rows (L, H, t_comp, t_mem); got shape {a.shape}")
    if not np.isfinite(a).all():
        raise ValueError("samples contain NaN or infinite values")
    for i, name in enumerate(("L", "H", "t_comp", "t_mem")):
        if (a[:, i] < 0).any():
            raise ValueError(f"samples have negative {name}")
    need = 5 if mem_intercept else 4
    if len(a) < need:
        raise ValueError(f"need at least {need} samples to fit {need} coefficients, got {len(a)}")
    L, H, tc, tm = a.T
    if not (L > 0).any():
        raise ValueError("no sample has L > 0 new tokens: nothing to fit T_comp on")
    if np.unique((L + 2 * H)[L > 0]).size < 2:
        raise ValueError("T_comp: samples need at least two values of L + 2H (vary L or H) "
                         "to separate alpha (attention) from beta (FFN)")
    if not (H > 0).any():
        raise ValueError("no sample has H > 0: gamma_r (KV read per history token) cannot be "
                         "fitted; add re-prefill samples")
    if np.unique(L).size < 2:
        raise ValueError("all samples have the same L: gamma_w cannot be told from "
                         + ("gamma_0" if mem_intercept else "gamma_r"))
    xc = np.column_stack([L * (L + 2 * H), L])
    xm = np.column_stack([L, H] + ([np.ones_like(L)] if mem_intercept else []))
    if _rank(xm) < xm.shape[1]:
        raise ValueError("T_mem: L and H are collinear in the samples (e.g. H a fixed function "
                         "of L); vary them independently")
    alpha, beta = _nnls_scaled(xc, tc)
    gw, gr, *g0 = _nnls_scaled(xm, tm)
    if alpha * xc[:, 0].max() <= 1e-6 * tc.max():  # quadratic term lost in rounding
        raise ValueError("T_comp shows no quadratic growth (alpha fitted as 0): add samples "
                         "with longer fills or histories")
    return LengthModel(float(alpha), float(beta), float(gw), float(gr),
                       float(g0[0]) if g0 else 0.0)


def _rank(x: np.ndarray) -> int:
    norms = np.linalg.norm(x, axis=0)
    return int(np.linalg.matrix_rank(x / np.where(norms > 0, norms, 1.0), tol=1e-10))


def _nnls_scaled(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """nnls on unit-norm columns (L(L+2H) reaches 1e9 while the constant is 1)."""
    norms = np.linalg.norm(x, axis=0)
    norms = np.where(norms > 0, norms, 1.0)
    return nnls(x / norms, y) / norms


def samples_from_cost_model(cost: CostModel, lengths, histories, *,
                            method: Literal["auto", "split", "floor"] = "auto") -> np.ndarray:
    """Rows (L, H, t_comp, t_mem) of a lone (re-)prefill for every L in lengths, H in
    histories, from a cost model instead of runtime samples.

    "split": the cost model's own compute and memory sides (`compute_memory_split`, which
    `RooflineCostModel` has; a `ScaledCostModel` over one scales it). Exact.

    "floor" (any CostModel; "auto" uses it when there is no split): only the total T(L, H)
    is known. T_mem := the memory floor T(1, H) + (L - 1) * g, where a 1-token fill at the
    same history is memory-bound (weights + the H-token KV read, negligible FLOPs) and g,
    the KV bytes of one more token, is priced as the slope of T(1, H) in H (writing a new
    token's KV moves the bytes reading one does). T_comp := T - T_mem, which is the paper's
    own additive assumption T = T_comp + T_mem. Fixed overheads land in gamma_0. For a
    max()-style cost model (the roofline) T - T_mem is max(C - M, 0), so the boundary falls
    where a step takes twice its memory floor: later than the true ridge, by under 2x.
    """
    Ls = _nonneg("lengths", lengths).ravel()
    Hs = _nonneg("histories", histories).ravel()
    if Ls.size == 0 or Hs.size == 0 or (Ls < 1).any():
        raise ValueError("lengths must be non-empty with every L >= 1, histories non-empty")
    if method not in ("auto", "split", "floor"):
        raise ValueError(f"method must be 'auto', 'split' or 'floor', got {method!r}")
    L, H = (g.ravel() for g in np.meshgrid(Ls, Hs, indexing="ij"))
    split, factor = _split_of(cost)
    if method == "split" and split is None:
        raise ValueError(f"{type(cost).__name__} has no compute_memory_split; use method='floor'")
    if split is not None and method != "floor":
        shape = BatchShape(prefill_tokens=L, prefill_seqs=1, prefill_attn=L * (H + (L + 1) / 2),
                           prefill_kv=H + L)
        tc, tm = split(shape)
        tc, tm = np.broadcast_to(tc, L.shape) * factor, np.broadcast_to(tm, L.shape) * factor
    else:
        total = np.array([cost.prefill_time(int(l), int(h)) for l, h in zip(L, H)])
        one = {int(h): cost.prefill_time(1, int(h)) for h in np.unique(np.append(Hs, 0))}
        h_ref = int(Hs.max()) if Hs.max() > 0 else 4096
        g = max((cost.prefill_time(1, h_ref) - one[0]) / h_ref, 0.0)
        tm = np.array([one[int(h)] for h in H]) + (L - 1) * g
        tc = np.maximum(total - tm, 0.0)
    return np.column_stack([L, H, tc, tm])


def _split_of(cost: CostModel):
    """The model's compute_memory_split and a factor (unwrapping ScaledCostModel chains)."""
    factor = 1.0
    while isinstance(cost, ScaledCostModel):
        factor *= cost.factor
        cost = cost.base
    split = getattr(cost, "compute_memory_split", None)
    return split, factor


def classify(prompt_len: int, history_len: int, model: LengthModel) -> Literal["short", "long"]:
    """Return "short" (memory-bound: batch it with other short fills) when the new tokens L
    fall below the boundary (the prefill boundary when history_len == 0, the re-prefill
    boundary at H = history_len otherwise), else "long" (compute-bound)."""
    for name, v in (("prompt_len", prompt_len), ("history_len", history_len)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise ValueError(f"{name} must be an integer, got {v!r}")
    if prompt_len < 1:
        raise ValueError(f"prompt_len must be >= 1 new token, got {prompt_len}")
    if history_len < 0:
        raise ValueError(f"history_len must be >= 0, got {history_len}")
    bound = model.prefill_boundary() if history_len == 0 else model.reprefill_boundary(history_len)
    return "short" if prompt_len < bound else "long"
