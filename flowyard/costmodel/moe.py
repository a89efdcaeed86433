"""The roofline of an MoE layer's FFN: router, routed experts and an optional shared expert.

Attention is priced as for a dense model (roofline.py); this prices what replaces the MLP, per
GPU of a TP group whose GPUs each hold every expert with its width split `tp` ways (vLLM's
default tensor-parallel fused MoE, no expert parallelism), for T token rows:

  router     hidden -> experts GEMM, replicated:  max(2*T*h*E / F, (h*E + T*(h+E)) * b / B)
  gate_up    the experts' fused gate+up:  max(2*T*k*h*2i / F, D(T)*h*2i*b / B + T*k*(h+2i)*b / B)
  down       the experts' down:           max(2*T*k*i*h / F,  D(T)*i*h*b / B  + T*k*(i+h)*b / B)
  shared     an always-on expert of width s/tp, priced like a dense MLP

with E experts, k active per token, i = expert width / tp, F and B the calibrated FLOP rate and
memory bandwidth. Compute follows the k experts each token uses; the weights streamed follow
D(T) = E * (1 - (1 - k/E)^T), the expected number of distinct experts T tokens touch when each
picks k of E uniformly: k for one decode row, all E once a batch is a few hundred tokens. Per
expert the max() of its rows' compute and its weights would give the same total, since under
uniform routing every touched expert gets the same expected rows. Real routers are not uniform
(fewer distinct experts, a skewed hottest expert) and grouped GEMMs over small per-expert row
counts run below the dense GEMM efficiency; neither is modelled.

Element-wise kernels follow the dense layout: the post-attention RMSNorm and the router's
softmax/top-k run with gate_up, SwiGLU over the k routed rows, the weighted combine of the k
expert outputs and the residual add with down.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flowyard.costmodel.hardware import HardwareSpec
from flowyard.costmodel.models import ModelSpec

Seconds = float | np.ndarray
_Lin = tuple[float, float, float]  # (sec per row of compute, sec of weight stream, sec per row of activations)


def distinct_experts(tokens: Seconds, experts: int, active: int) -> Seconds:
    """Expected number of distinct experts that `tokens` tokens touch, each routed to `active`
    of `experts` uniformly: experts * (1 - (1 - active/experts)^tokens)."""
    miss = 1.0 - active / experts  # chance one token leaves a given expert out
    if isinstance(tokens, np.ndarray):
        return experts * (1.0 - np.power(miss, tokens.astype(float)))
    return experts * (1.0 - miss ** float(tokens))


@dataclass(frozen=True)
class ExpertFFN:
    """Per-GPU prices of one MoE layer's FFN (see the module docstring)."""

    experts: int
    active: int
    router: _Lin
    gate_up: _Lin  # compute and activations per token (k routed rows), weights per distinct expert
    down: _Lin
    shared: tuple[_Lin, _Lin] | None  # (gate_up, down) of the shared expert
    gate_up_elem: float  # sec per token of element-wise traffic
    down_elem: float
    gate_up_fixed: float  # fixed seconds of the op's kernels
    down_fixed: float
    weight_params: int  # router + all experts + shared expert, per GPU, per layer
    expert_params: int  # one expert's gate_up + down, per GPU

    @classmethod
    def build(cls, m: ModelSpec, hw: HardwareSpec, tp: int, b: int) -> "ExpertFFN":
        p = hw.params
        flops, bw, elem = hw.peak_flops * p.eff_compute, hw.mem_bw * p.eff_mem, hw.mem_bw * p.eff_elem
        h, E, k = m.hidden, m.experts, m.experts_active
        i, s = m.expert_intermediate / tp, m.shared_intermediate / tp

        def lin(kk: float, n: float, rows: float = 1.0) -> _Lin:
            return (2 * rows * kk * n / flops, kk * n * b / bw, rows * (kk + n) * b / bw)

        shared = (lin(h, 2 * s), lin(s, h)) if s else None
        n_sh = 1 if shared else 0
        return cls(
            experts=E, active=k, router=lin(h, E), gate_up=lin(h, 2 * i, k), down=lin(i, h, k), shared=shared,
            # post-attention RMSNorm, router softmax/top-k over E logits (fp32)
            gate_up_elem=(2 * h * b + 4 * E) / elem,
            # SwiGLU on k rows (+ the shared one), the combine of k outputs, the residual add
            down_elem=(3 * (k * i + s) * b + k * h * b + h * b) / elem,
            # GEMMs: router + fused gate_up (+ shared); kernels: norm, top-k
            gate_up_fixed=(2 + n_sh) * p.gemm_fixed_s + 2 * p.launch_s,
            # GEMMs: fused down (+ shared); kernels: SwiGLU (+ shared's), combine, add
            down_fixed=(1 + n_sh) * p.gemm_fixed_s + (3 + n_sh) * p.launch_s,
            weight_params=int(h * E + E * 3 * h * i + 3 * h * s),
            expert_params=int(3 * h * i),
        )

    def distinct(self, tokens: Seconds) -> Seconds:
        return distinct_experts(tokens, self.experts, self.active)

    def op_times(self, T: Seconds) -> tuple[Seconds, Seconds]:
        """(gate_up, down) seconds of one layer for T token rows, GEMMs only."""
        d = self.distinct(T)
        (ra, rw, rb), (ga, gw, gb), (da, dw, db) = self.router, self.gate_up, self.down
        gu = _mx(ra * T, rw + rb * T) + _mx(ga * T, d * gw + gb * T)
        dn = _mx(da * T, d * dw + db * T)
        if self.shared:
            (sa, sw, sb), (ta, tw, tb) = self.shared
            gu = gu + _mx(sa * T, sw + sb * T)
            dn = dn + _mx(ta * T, tw + tb * T)
        return gu, dn

    def time(self, T: Seconds) -> Seconds:
        """One layer's FFN GEMMs for T rows (element-wise kernels and launches are added by the
        roofline with the dense ops' ones)."""
        gu, dn = self.op_times(T)
        return gu + dn

    def compute_memory(self, T: Seconds) -> tuple[Seconds, Seconds]:
        """(compute seconds, memory seconds) of one layer's FFN GEMMs, each summed, no max()."""
        d = self.distinct(T)
        lins = [self.router, self.gate_up, self.down] + list(self.shared or ())
        comp = sum(a for a, _, _ in lins) * T
        mem = (self.router[1] + d * (self.gate_up[1] + self.down[1])
               + sum(w for _, w, _ in self.shared or ()) + sum(bb for _, _, bb in lins) * T)
        return comp, mem

    def streamed_params(self, T: Seconds) -> Seconds:
        """Weights read from HBM per layer for T rows: router, shared expert and the expected
        distinct experts touched."""
        return self.weight_params - self.experts * self.expert_params + self.distinct(T) * self.expert_params


def _mx(x: Seconds, y: Seconds) -> Seconds:
    if type(x) is np.ndarray or type(y) is np.ndarray:
        return np.maximum(x, y)
    return y if y > x else x
