"""The cost-model seam: how long one step of a `BatchShape` takes on one instance.

Two sources stand behind this one interface: the analytical roofline (`roofline.py`) and,
later, a profile fitted from `flowyard profile` measurements. The simulator uses it as the
clock of its instances; policies use the very same object as their predictor (TTFT-hat,
batch latency), optionally through `with_error` to test robustness.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from flowyard.core.plan import BatchShape

# Operators of one decoder layer, in execution order (FlowPrefill's preemption points sit
# between them). Norms and RoPE are folded into the operator that follows them.
LAYER_OPS: tuple[str, ...] = ("qkv_proj", "attn", "o_proj", "gate_up_proj", "down_proj")
# Per-step operators outside the layers, and the tensor-parallel collective.
STEP_OPS: tuple[str, ...] = ("embed", "lm_head", "allreduce", "overhead", "graph")

Seconds = float | np.ndarray


class CostModel(ABC):
    """Predicts execution time of a step on one instance (a model on a TP group of GPUs)."""

    num_layers: int

    @abstractmethod
    def layer_op_times(self, shape: BatchShape) -> dict[str, Seconds]:
        """Time of each LAYER_OPS operator in ONE layer (norms/RoPE/activation included where
        they run), plus 'allreduce' for the layer's TP collectives (0 when tp == 1)."""

    @abstractmethod
    def step_overhead(self, shape: BatchShape) -> dict[str, Seconds]:
        """Per-step time outside the layers: 'embed', 'lm_head' (only rows that sample) and
        'overhead' (scheduling, launch and sampling constants)."""

    @abstractmethod
    def kv_bytes_per_token(self) -> int:
        """KV bytes one token occupies on this instance (all layers, K and V, this TP shard)."""

    @abstractmethod
    def kv_capacity_tokens(self) -> int:
        """Tokens of KV that fit in the instance's memory after weights and activations."""

    def frontend_latency(self) -> Seconds:
        """Time a request spends in the serving frontend (HTTP, tokenizing, the hop to the
        engine, the first token's way back) that a client's TTFT includes and no step does;
        the simulator delays every arrival by it. 0 unless the cost model emulates a stack."""
        return 0.0

    def kv_export_time(self) -> Seconds:
        """Time an instance spends giving up each request whose KV moves out (Ray: copying it
        into the object store) before it can start its next step; 0 unless the cost model
        emulates an executor that pays it."""
        return 0.0

    def step_gap(self) -> Seconds:
        """The share of `step_time` that falls after the step's tokens exist: the serving
        loop between one step's end and the next step's start (streaming, scheduling). The
        instance is busy through it, but a policy that times its steps (DynaServe's online
        profile) sees the step end before it, as on a real engine. 0 unless emulated."""
        return 0.0

    def op_times(self, shape: BatchShape) -> dict[str, Seconds]:
        """Whole-step time per operator (layer operators summed over all layers)."""
        out = {k: v * self.num_layers for k, v in self.layer_op_times(shape).items()}
        out.update(self.step_overhead(shape))
        return out

    def op_boundaries(self, shape: BatchShape) -> np.ndarray:
        """Seconds from the start of a step to the end of each of its num_layers * 5 layer
        operators, in execution order (the FlowPrefill preemption points), plus a last entry
        for the end of the step. Embedding and per-step overhead run before the first
        operator, lm_head after the last; a layer's TP collectives follow o_proj and down_proj."""
        layer = self.layer_op_times(shape)
        per_op = np.array([float(layer.get(op, 0.0)) for op in LAYER_OPS])
        ar = float(layer.get("allreduce", 0.0)) / 2
        per_op[2] += ar
        per_op[4] += ar
        step = self.step_overhead(shape)
        head = float(step.get("embed", 0.0)) + float(step.get("overhead", 0.0))
        ends = head + np.cumsum(np.tile(per_op, self.num_layers))
        return np.append(ends, ends[-1] + float(step.get("lm_head", 0.0)))

    def step_time(self, shape: BatchShape) -> Seconds:
        total: Seconds = 0.0
        for v in self.op_times(shape).values():
            total = total + v
        return total

    def prefill_time(self, prompt_len: int, history: int = 0) -> float:
        """Time of a lone prefill of prompt_len new tokens over `history` cached tokens."""
        return float(self.step_time(BatchShape.of([(history, prompt_len)], [])))


class WrappedCostModel(CostModel):
    """Another cost model's step times, each step's multiplied by `factor_of(shape)`; what is
    not a step's time passes through as `base` gives it (the frontend latency, the KV export
    and the serving gap, KV sizes and capacity)."""

    def __init__(self, base: CostModel) -> None:
        self.base = base
        self.num_layers = base.num_layers

    @abstractmethod
    def factor_of(self, shape: BatchShape) -> Seconds:
        """The multiplier of this shape's times (an array for a decode run's shapes)."""

    def layer_op_times(self, shape: BatchShape) -> dict[str, Seconds]:
        f = self.factor_of(shape)
        return {k: v * f for k, v in self.base.layer_op_times(shape).items()}

    def step_overhead(self, shape: BatchShape) -> dict[str, Seconds]:
        f = self.factor_of(shape)
        return {k: v * f for k, v in self.base.step_overhead(shape).items()}

    def step_time(self, shape: BatchShape) -> Seconds:
        return self.base.step_time(shape) * self.factor_of(shape)

    def kv_bytes_per_token(self) -> int:
        return self.base.kv_bytes_per_token()

    def frontend_latency(self) -> Seconds:
        return self.base.frontend_latency()

    def kv_export_time(self) -> Seconds:
        return self.base.kv_export_time()

    def step_gap(self) -> Seconds:
        return self.base.step_gap()

    def kv_capacity_tokens(self) -> int:
        return self.base.kv_capacity_tokens()


class ScaledCostModel(WrappedCostModel):
    """A predictor that is wrong by a fixed factor: every time of `base` times `factor`.

    Policies use a cost model as their predictor (TTFT-hat, batch latency). Handing them a
    scaled copy while the simulator keeps the true one measures how robust a policy is to
    prediction error (factor 1.2 = predictions 20 % too slow).
    """

    def __init__(self, base: CostModel, factor: float) -> None:
        if not factor > 0:
            raise ValueError(f"prediction error factor must be positive, got {factor}")
        super().__init__(base)
        self.factor = factor

    def factor_of(self, shape: BatchShape) -> Seconds:
        return self.factor


class DriftedCostModel(WrappedCostModel):
    """A machine that drifted from its profile by kind of step: steps with prompt tokens take
    `prefill` times their price, decode-only steps `decode` times.

    A profile is measured in one hour; a shared VM runs the same steps later at other speeds,
    and not uniformly: its compute-bound steps (prompt tokens) slowed more than its bandwidth-
    bound decodes (docs/results/real_cluster_steps_dynaserve_zen3.md). As the simulator's
    clock, with the policies still predicting with the profile as a deployed server does, it
    asks how a policy's result responds to such a machine (benchmarks/drift_sensitivity.py).
    """

    def __init__(self, base: CostModel, prefill: float, decode: float) -> None:
        if not prefill > 0 or not decode > 0:
            raise ValueError(f"drift factors must be positive, got prefill {prefill}, decode {decode}")
        super().__init__(base)
        self.prefill, self.decode = prefill, decode

    def factor_of(self, shape: BatchShape) -> Seconds:
        has_prompt = np.asarray(shape.prefill_tokens) > 0
        return np.where(has_prompt, self.prefill, self.decode) if has_prompt.ndim else (
            self.prefill if has_prompt else self.decode)


def with_error(model: CostModel, factor: float) -> CostModel:
    """`model` as a predictor whose times are off by `factor` (see ScaledCostModel)."""
    return model if factor == 1.0 else ScaledCostModel(model, factor)
