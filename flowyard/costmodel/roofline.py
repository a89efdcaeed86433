"""Analytical roofline cost model: FLOPs and bytes of each operator, times efficiency factors.

Per GPU of a TP group (Megatron sharding: QKV and gate_up split by columns, O and down by
rows, vocab-parallel embedding and lm_head), with T = prefill_tokens + decode_seqs rows:

  linear op (K -> N per GPU)   t = max(2*T*K*N / (peak*eff_compute),
                                       (K*N + T*(K+N)) * b / (bw*eff_mem)) + gemm_fixed_s
  fused elementwise kernels    t = T * bytes_per_row / (bw*eff_elem) + launch_s each
      qkv_proj  += input RMSNorm (2*h*b per row)   o_proj += residual add (h*b: L2-resident)
      attn      += RoPE on q,k and the KV-cache write
      gate_up   += post-attention RMSNorm (2*h*b)  down   += SwiGLU (3*I/tp*b) + residual add
  attention  prefill: FLOPs = 4*(heads/tp)*d*(prefill_attn + attn_tile*prefill_tokens)
                      bytes = prefill_kv*kv_b + prefill_tokens*qo_b   (max of the two times)
             decode:  FLOPs = 4*(heads/tp)*d*decode_ctx
                      bytes = decode_ctx*kv_b + decode_seqs*qo_b     (at eff_attn_mem)
             kv_b = 2*kv_heads_per_gpu*d*b (K and V, one layer), qo_b = 2*(heads/tp)*d*b
  allreduce  2 per layer: 2*(latency + 2(tp-1)/tp * T*h*b / (link_bw*ar_eff))
  step       embed (gather T rows), lm_head on rows that sample (prefill_seqs +
             decode_seqs) after the final norm, logits all-gather, and a CPU overhead of
             step_overhead_s + (seq_overhead_s + seq_overhead_layer_s * layers) * sequences.

KV heads are split across the TP group while kv_heads >= tp and replicated (one per GPU)
beyond that, as vLLM does. A mixture-of-experts model keeps qkv_proj, attn and o_proj; its
gate_up_proj is the router plus the experts' gate+up and its down_proj the experts' down,
priced by `moe.ExpertFFN` (compute by active experts, weights by distinct experts touched). The total is computed directly in `step_time` (no dicts) because
the simulator calls it ~1e5 times per run; `layer_op_times` gives the same numbers per op.
"""

from __future__ import annotations

import numpy as np

from flowyard.core.plan import BatchShape
from flowyard.costmodel.base import CostModel, Seconds
from flowyard.costmodel.hardware import HardwareSpec, get_hardware
from flowyard.costmodel.models import ModelSpec, get_model
from flowyard.costmodel.moe import ExpertFFN

_LINEAR = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class RooflineCostModel(CostModel):
    """Step time of `model` on a TP group of `tp` GPUs of type `hardware`.

    Every `RooflineParams` factor can be overridden by keyword (e.g. `eff_compute=0.6`);
    the defaults are the hardware family's calibrated values."""

    def __init__(self, model: ModelSpec | str, hardware: HardwareSpec | str, tp: int = 1, *,
                 gpu_mem_util: float = 0.9, activation_reserve_bytes: float | None = None,
                 dtype_bytes: int | None = None, **overrides: float) -> None:
        self.model = m = get_model(model)
        hw = get_hardware(hardware)
        self.hardware = hw = hw.with_params(**overrides) if overrides else hw
        if tp < 1 or m.heads % tp:
            raise ValueError(f"tp={tp} must divide {m.name}'s {m.heads} attention heads")
        self.tp, self.gpu_mem_util = tp, gpu_mem_util
        self.num_layers = m.layers
        p = hw.params
        self.dtype_bytes = b = dtype_bytes or hw.dtype_bytes or m.bytes_per_param
        h, d, inter = m.hidden, m.head_dim, m.intermediate / tp
        self.heads_per_gpu = hq = m.heads // tp
        self.kv_heads_per_gpu = hk = max(1, -(-m.kv_heads // tp))
        flops, bw = hw.peak_flops * p.eff_compute, hw.mem_bw * p.eff_mem
        elem = hw.mem_bw * p.eff_elem
        # (K, N) per GPU of each linear op's GEMM, and the elementwise kernels folded into
        # each op with their HBM bytes per row (named as in Vidur's profiles). Residual adds
        # count one hidden vector: their operands were just written and still sit in L2.
        self.gemms = {"qkv_proj": (h, (hq + 2 * hk) * d), "o_proj": (hq * d, h),
                      "gate_up_proj": (h, 2 * inter), "down_proj": (inter, h)}
        self._kv_b = kv_b = 2 * hk * d * b
        self.elementwise: dict[str, tuple[tuple[str, float], ...]] = {
            "qkv_proj": (("input_layernorm", 2 * h * b),),
            "attn": (("attn_rope", 2 * (hq + hk) * d * b), ("kv_cache_write", kv_b)),
            "o_proj": (("add", h * b),),
            "gate_up_proj": (("post_attention_layernorm", 2 * h * b),),
            "down_proj": (("mlp_act", 3 * inter * b), ("add", h * b)),
        }
        # Per linear op: (sec per row of compute, sec of weight stream, sec per row of
        # activations, sec per row of elementwise traffic, fixed seconds of its kernels).
        self._lin = {}
        for op, (k, n) in self.gemms.items():
            ew = self.elementwise[op]
            self._lin[op] = (2 * k * n / flops, k * n * b / bw, (k + n) * b / bw,
                             sum(r for _, r in ew) / elem, p.gemm_fixed_s + len(ew) * p.launch_s)
        # MoE: gemms hold ONE expert's shapes; the FFN's GEMMs are priced by `self._moe` and
        # the dense entries keep only its element-wise kernels and fixed times.
        self._moe = mo = ExpertFFN.build(m, hw, tp, b) if m.is_moe else None
        if mo is not None:
            self.gemms["gate_up_proj"], self.gemms["down_proj"] = (h, 2 * m.expert_intermediate / tp), \
                (m.expert_intermediate / tp, h)
            self._lin["gate_up_proj"] = (0.0, 0.0, 0.0, mo.gate_up_elem, mo.gate_up_fixed)
            self._lin["down_proj"] = (0.0, 0.0, 0.0, mo.down_elem, mo.down_fixed)
        self._a = tuple(self._lin[op][0] for op in _LINEAR)
        self._w = tuple(self._lin[op][1] for op in _LINEAR)
        self._b = tuple(self._lin[op][2] for op in _LINEAR)
        self._lin_elem = sum(v[3] for v in self._lin.values())
        self._lin_launch = sum(v[4] for v in self._lin.values())
        # Attention: the attention kernel plus RoPE and the KV-cache write.
        qo_b = 2 * hq * d * b
        self._attn_elem = sum(r for _, r in self.elementwise["attn"]) / elem
        self._attn_launch = 3 * p.launch_s
        self._pf = 4 * hq * d / (hw.peak_flops * p.eff_attn)  # sec per causal pair
        self._tile = p.attn_tile
        self._pkv, self._pqo = kv_b / bw, qo_b / bw
        dbw = hw.mem_bw * p.eff_attn_mem
        self._dkv, self._dqo = kv_b / dbw, qo_b / dbw
        self._afix = p.attn_fixed_s  # per attention kernel that runs (0 under 'vidur')
        self._causal = p.attn_causal_extra  # extra cost per pair of a new token's causal block
        # step_time's linear ops as (4, 1) columns
        self._a4, self._w4, self._b4 = (np.array(v)[:, None] for v in (self._a, self._w, self._b))
        # TP collectives: within a node over NVLink, beyond it over the network.
        link = hw.nvlink_bw if tp <= hw.gpus_per_node else hw.net_bw
        ring = 2 * (tp - 1) / tp
        if tp > 1:
            self._ar_c = 2 * p.ar_latency_s
            self._ar_row = 2 * ring * h * b / (link * p.ar_eff)
            self._gather_row = (tp - 1) / tp * m.vocab * 4 / (link * p.ar_eff)
        else:
            self._ar_c = self._ar_row = self._gather_row = 0.0
        # Step level: embedding gather (+ its all-reduce), final norm, lm_head, overhead.
        vocab = m.vocab / tp
        self._emb_row = 2 * h * b / elem + self._ar_row / 2
        self._emb_c = p.launch_s + self._ar_c / 2
        self._lm_a, self._lm_w = 2 * h * vocab / flops, h * vocab * b / bw
        self._lm_b = (h + vocab) * b / bw
        self._lm_gather = self._gather_row  # logits all-gather, per sampled row
        self._lm_norm = 2 * h * b / elem
        self._lm_c = p.gemm_fixed_s + p.launch_s + self._ar_c / 2
        self._ovh_c = p.step_overhead_s
        self._ovh_seq = p.seq_overhead_s + p.seq_overhead_layer_s * m.layers
        self._rows_c = self._lm_gather + self._ovh_seq
        self._row_c = self._lin_elem + self._attn_elem + self._ar_row
        # What a graph replay saves: per-kernel launches of every layer and the CPU step time.
        elem_launch = self._lin_launch - len(self._lin) * p.gemm_fixed_s + self._attn_launch
        self._graph_c = p.graph_saving * (m.layers * elem_launch + self._ovh_c)
        self._graph_seq = p.graph_saving * self._ovh_seq
        # Memory: weights held per GPU (K/V projections replicate with the KV heads).
        # An MoE model holds every expert (and its router) on every GPU of the group.
        layer_w = (sum(k * n for k, n in self.gemms.values()) if mo is None else
                   sum(k * n for op, (k, n) in self.gemms.items() if op in ("qkv_proj", "o_proj"))
                   + mo.weight_params)
        self.weight_bytes_per_gpu = int(b * (m.layers * layer_w
                                             + m.vocab * h / tp * (1 if m.tied_embeddings else 2)))
        if activation_reserve_bytes is None:
            # The runtime's own memory plus the activations of an 8192-token batch (vLLM's
            # default max_num_batched_tokens, which it profiles at start-up); an MoE token
            # has k routed rows of the experts' width.
            ffn = 2 * inter if mo is None else 2 * mo.active * m.expert_intermediate / tp + m.experts
            activation_reserve_bytes = hw.runtime_reserve_bytes + 8192 * (
                self.gemms["qkv_proj"][1] + ffn + 4 * h) * b
        self.activation_reserve_bytes = activation_reserve_bytes

    # -- the hot path -----------------------------------------------------------------------
    def step_time(self, shape: BatchShape) -> Seconds:
        """Whole-step seconds; element-wise when any field is a numpy array.

        Every term is the same float expression, summed in the same order, as before this was
        sped up (tests/test_roofline_step_time.py keeps that form); only how it is evaluated
        depends on the fields' types (the simulator calls this ~3e5 times a run, DynaServe's
        predictor on arrays of a few hundred passes): terms whose inputs are scalars use
        Python floats, the four linear ops share one (4, n) numpy evaluation when the token
        count is an array, and sums accumulate in place."""
        pt, ps = shape.prefill_tokens, shape.prefill_seqs
        ds, dc = shape.decode_seqs, shape.decode_ctx
        pa: Seconds = shape.prefill_attn
        pk = shape.prefill_kv
        T = pt + ds
        layer: Seconds
        if type(T) is np.ndarray:
            x = self._a4 * T
            y = self._b4 * T
            y += self._w4
            np.maximum(x, y, out=x)
            layer = x[0] + x[1]
            layer += x[2]
            layer += x[3]
        else:
            assert not isinstance(T, np.ndarray)  # for the type checker: array fields make T an array
            if T == 0 and _max_for(shape) is max:
                return 0.0  # nothing to run (layer_op_times still prices the weight stream)
            a, w, bb = self._a, self._w, self._b
            layer = (_max(a[0] * T, w[0] + bb[0] * T) + _max(a[1] * T, w[1] + bb[1] * T)
                     + _max(a[2] * T, w[2] + bb[2] * T) + _max(a[3] * T, w[3] + bb[3] * T))
        if self._moe is not None:  # dense terms 2, 3 above are 0: the FFN is the experts'
            layer = layer + self._moe.time(T)
        if self._causal:
            pa = self._pairs(shape)
        layer = layer + _mx(self._pf * (pa + self._tile * pt), self._pkv * pk + self._pqo * pt)
        layer += _mx(self._pf * dc, self._dkv * dc + self._dqo * ds)
        layer += self._row_c * T
        layer += self._lin_launch
        layer += self._attn_launch
        layer += self._ar_c
        if self._afix:
            layer += self._afix * ((pt > 0) * 1.0 + (ds > 0) * 1.0)  # numpy bools would OR
        rows = ps + ds
        out: Seconds = self.num_layers * layer
        if shape.graphed:  # x - 0.0 == x: without a graph nothing is subtracted
            out = out - (self._graph_c + self._graph_seq * rows)
        out += self._emb_row * T
        out += self._emb_c
        out += _mx(self._lm_a * rows, self._lm_w + self._lm_b * rows)
        out += self._lm_norm * T
        out += self._lm_c
        out += self._rows_c * rows
        out += self._ovh_c
        return out

    # -- per operator (FlowPrefill's preemption points, profiling, reports) -----------------
    def layer_op_times(self, shape: BatchShape) -> dict[str, Seconds]:
        pt, ds, dc = shape.prefill_tokens, shape.decode_seqs, shape.decode_ctx
        T = pt + ds
        mx = _max_for(shape)
        out: dict[str, Seconds] = {}
        for op in ("qkv_proj", "attn", "o_proj", "gate_up_proj", "down_proj"):
            if op == "attn":
                out[op] = (mx(self._pf * (self._pairs(shape) + self._tile * pt),
                              self._pkv * shape.prefill_kv + self._pqo * pt)
                           + mx(self._pf * dc, self._dkv * dc + self._dqo * ds)
                           + self._attn_elem * T + self._attn_launch
                           + self._afix * ((pt > 0) * 1.0 + (ds > 0) * 1.0))
            else:
                a, w, b, e, c = self._lin[op]
                out[op] = mx(a * T, w + b * T) + e * T + c
        if self._moe is not None:
            gu, dn = self._moe.op_times(T)
            out["gate_up_proj"] = out["gate_up_proj"] + gu
            out["down_proj"] = out["down_proj"] + dn
        out["allreduce"] = self._ar_row * T + self._ar_c
        return {k: _scalar(v) for k, v in out.items()}

    def _pairs(self, shape: BatchShape) -> Seconds:
        """Causal pairs priced by prefill attention: the new tokens' own causal block costs
        (1 + attn_causal_extra) per pair, as if every slice had the mean length pt/ps (exact for
        one slice; BatchShape keeps no per-slice lengths)."""
        pa, pt = shape.prefill_attn, shape.prefill_tokens
        if not self._causal:
            return pa
        return pa + self._causal * pt * pt / (2 * _mx(shape.prefill_seqs, 1))

    def attention_kernel_times(self, shape: BatchShape) -> tuple[Seconds, Seconds]:
        """(prefill, decode) attention kernel seconds in ONE layer, without RoPE, the KV-cache
        write or launches: what Vidur's attn_prefill / attn_decode profile columns time."""
        pt, ds, dc = shape.prefill_tokens, shape.decode_seqs, shape.decode_ctx
        mx = _max_for(shape)
        pre = (mx(self._pf * (self._pairs(shape) + self._tile * pt),
                  self._pkv * shape.prefill_kv + self._pqo * pt) + self._afix * (pt > 0))
        dec = mx(self._pf * dc, self._dkv * dc + self._dqo * ds) + self._afix * (ds > 0)
        return _scalar(pre), _scalar(dec)

    def step_overhead(self, shape: BatchShape) -> dict[str, Seconds]:
        T = shape.prefill_tokens + shape.decode_seqs
        rows = shape.prefill_seqs + shape.decode_seqs
        lm = (_max_for(shape)(self._lm_a * rows, self._lm_w + self._lm_b * rows)
              + self._lm_gather * rows)
        out = {"embed": _scalar(self._emb_row * T + self._emb_c),
               "lm_head": _scalar(lm + self._lm_norm * T + self._lm_c),
               "overhead": _scalar(self._ovh_c + self._ovh_seq * rows
                                   + 0.0 * np.asarray(shape.decode_ctx, dtype=float))}
        if shape.graphed:
            out["graph"] = -(self._graph_c + self._graph_seq * rows)
        return out

    def collective_time(self, shape: BatchShape) -> Seconds:
        """The TP collectives inside `step_time`: two all-reduces per layer, the embedding's, and
        the logits' all-gather. What is left is one rank's compute, the part one GPU can time
        (benchmarks/gpu_steps_measure.py --tp), so the two can be checked apart."""
        T = shape.prefill_tokens + shape.decode_seqs
        rows = shape.prefill_seqs + shape.decode_seqs
        return _scalar(self.num_layers * (self._ar_row * T + self._ar_c) + self._ar_row / 2 * T
                       + self._ar_c + self._gather_row * rows)

    # -- the two sides of the roofline (PLA-Serve's compute-memory boundary) ----------------
    def compute_memory_split(self, shape: BatchShape) -> tuple[Seconds, Seconds]:
        """(t_comp, t_mem): the compute and the memory side of every operator of the step,
        each summed over the step instead of taking max() per operator as `step_time` does.

        t_comp: GEMM FLOPs, prefill/decode attention FLOPs (diagonal-tile waste included),
        lm_head FLOPs. t_mem: weight streams, activation rows, elementwise kernels (norms,
        RoPE, KV-cache write, SwiGLU, adds), attention KV/q/o reads, embedding gather. Left
        out, being neither HBM nor FLOPs: fixed kernel/launch times, TP collectives and CPU
        overhead. PLA-Serve (§2.1) fits T_comp and T_mem separately; this is their source."""
        pt, ps = shape.prefill_tokens, shape.prefill_seqs
        ds, dc = shape.decode_seqs, shape.decode_ctx
        T, rows = pt + ds, ps + ds
        L = self.num_layers
        comp = (L * (sum(self._a) * T + self._pf * (self._pairs(shape) + self._tile * pt)
                     + self._pf * dc) + self._lm_a * rows)
        emb_row = self._emb_row - self._ar_row / 2  # the gather alone, without its all-reduce
        mem = (L * (sum(self._w) + (sum(self._b) + self._lin_elem + self._attn_elem) * T
                    + self._pkv * shape.prefill_kv + self._pqo * pt
                    + self._dkv * dc + self._dqo * ds)
               + emb_row * T + self._lm_w + self._lm_b * rows + self._lm_norm * T)
        if self._moe is not None:
            c_moe, m_moe = self._moe.compute_memory(T)
            comp, mem = comp + L * c_moe, mem + L * m_moe
        return _scalar(comp), _scalar(mem)

    def weight_stream_bytes(self, tokens: Seconds) -> Seconds:
        """Weight bytes one GPU reads from HBM in a step of `tokens` rows (the layers' GEMMs and
        lm_head): constant for a dense model; an MoE model reads the experts its tokens touch."""
        m, b = self.model, self.dtype_bytes
        lm = m.hidden * m.vocab / self.tp
        if self._moe is None:
            return float(b * (m.layers * sum(k * n for k, n in self.gemms.values()) + lm))
        attn = sum(k * n for op, (k, n) in self.gemms.items() if op in ("qkv_proj", "o_proj"))
        return b * (m.layers * (attn + self._moe.streamed_params(tokens)) + lm)

    # -- memory -----------------------------------------------------------------------------
    def kv_bytes_per_token(self) -> int:
        """2 (K,V) * layers * kv_heads_per_gpu * head_dim * dtype bytes, on one GPU."""
        return self.num_layers * self._kv_b

    def frontend_latency(self) -> Seconds:
        return self.hardware.params.frontend_s

    def kv_capacity_tokens(self) -> int:
        """(memory * util - weights/GPU - activation reserve) / KV bytes per token. Every GPU of
        the group holds its shard of every token, so this is the instance's capacity."""
        free = (self.hardware.mem_bytes * self.gpu_mem_util - self.weight_bytes_per_gpu
                - self.activation_reserve_bytes)
        return max(0, int(free // self.kv_bytes_per_token()))

    def __repr__(self) -> str:
        return f"RooflineCostModel({self.model.name!r}, {self.hardware.name!r}, tp={self.tp})"


def _max_for(shape: BatchShape):
    """Builtin max (fast) for scalar shapes, np.maximum when any field is an array."""
    for v in (shape.decode_ctx, shape.prefill_tokens, shape.prefill_attn, shape.prefill_kv,
              shape.decode_seqs, shape.prefill_seqs):
        if type(v) is np.ndarray:
            return np.maximum
    return max


def _max(x: float, y: float) -> float:
    """max(x, y) for two floats without the builtin's call overhead (same result: max keeps
    its first argument unless the second is larger)."""
    return y if y > x else x


def _mx(x: Seconds, y: Seconds) -> Seconds:
    """Element-wise max when either side is an array, else the float max."""
    if type(x) is np.ndarray or type(y) is np.ndarray:
        return np.maximum(x, y)
    return y if y > x else x


def _scalar(v: Seconds) -> Seconds:
    """numpy 0-d results back to float, so scalar callers get plain floats."""
    return float(v) if np.ndim(v) == 0 else v
