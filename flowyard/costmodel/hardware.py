"""Hardware catalog: datasheet peaks plus the roofline's calibrated efficiency factors.

A roofline needs only a few numbers per accelerator: dense bf16 tensor FLOP/s, HBM bandwidth
and capacity, and the links a tensor-parallel all-reduce or a KV transfer crosses. Peaks come
from vendor datasheets (cited per entry). How close real kernels get to those peaks is a
property of the GPU generation, not of the model, so the efficiency factors live here in a
`RooflineParams` per family, fitted to Vidur's measured operator and NCCL timings by
`flowyard.costmodel.calibrate` (see `A100_PARAMS`/`H100_PARAMS` for the fit and its error).
Variants with the same silicon (A800, H800, H200) reuse their family's factors.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from flowyard.costmodel.catalog import lookup
from flowyard.costmodel.engines import EngineProfile, calibration_data, get_engine_profile

GB = 1e9
GiB = 1024**3


@dataclass(frozen=True)
class RooflineParams:
    """Efficiency factors and constants of `RooflineCostModel` (fractions of datasheet peak).

    eff_compute   GEMM FLOP/s / peak            eff_mem      weight/activation stream / HBM bw
    gemm_fixed_s  fixed time per GEMM (launch, tail wave, the ridge the max() misses)
    eff_elem      norm/act/add/RoPE / HBM bw    launch_s     fixed time per other kernel
    eff_attn      prefill attention FLOP/s / peak, at long sequence (FlashAttention-2)
    attn_tile     causal pairs wasted per query token on diagonal tiles (short prompts are slower)
    eff_attn_mem  decode attention KV stream / HBM bw
    ar_eff, ar_latency_s   all-reduce bus bandwidth / link bandwidth, and its fixed latency
    step_overhead_s, seq_overhead_s   per-step and per-sequence CPU time not hidden by the GPU
    graph_saving  share of launch and per-step CPU time a graph replay removes
    attn_fixed_s  fixed time of each attention kernel that runs (prefill and decode)
    attn_causal_extra  extra cost per pair of a new token's causal block (vs a cached pair)
    seq_overhead_layer_s  per-sequence CPU time per decoder layer (added to seq_overhead_s)
    frontend_s    latency of the serving frontend a client's request crosses before it reaches
                  the scheduler (HTTP, tokenizing, the hop to the engine process, streaming the
                  first token back); not a step cost: the simulator delays arrivals by it
    """

    eff_compute: float
    eff_mem: float
    gemm_fixed_s: float
    eff_elem: float
    launch_s: float
    eff_attn: float
    attn_tile: float
    eff_attn_mem: float
    ar_eff: float
    ar_latency_s: float
    step_overhead_s: float = 300e-6
    seq_overhead_s: float = 5e-6
    # Share of kernel-launch and per-step CPU time a captured graph removes (our assumption,
    # after PLA-Serve Fig. 5 and vLLM's decode graphs; only steps with BatchShape.graphed).
    graph_saving: float = 0.7
    # Fixed time of each attention kernel that runs (prefill, decode), beyond its FLOPs/bytes:
    # Vidur's A100 profile shows a ~30 us floor for short prefills. 0 under the 'vidur'
    # calibration; fitted under 'published' (flowyard.costmodel.fit).
    attn_fixed_s: float = 0.0
    # Extra cost per pair of the new tokens' own causal block, over a cached-prefix pair
    # (Vidur's A100 prefill rows: a chunk over no cache costs ~3x per pair what the same chunk
    # costs per extra cached token). 0 under 'vidur'.
    attn_causal_extra: float = 0.0
    # Per-sequence CPU time that grows with the layer count: Vidur's cpu_overheads.csv rises
    # 0.163 ms per sequence for CodeLlama-34B (48 layers) and 0.111 ms for Llama-2-7B (32
    # layers) from the same ~1.09 ms intercept (slope ratio 1.47, layer ratio 1.5). 0 under
    # 'vidur'; fitted under 'published'.
    seq_overhead_layer_s: float = 0.0
    # Client-visible frontend latency of the serving stack (an engine profile's term, fitted
    # under 'published' on lone requests' TTFT; 0 under 'vidur' and for our own engine, whose
    # frontend is real time, not simulated).
    frontend_s: float = 0.0


# Fitted by `python -m flowyard.costmodel.calibrate` on the Vidur a100 (Meta-Llama-3-8B,
# Meta-Llama-3-70B, Qwen-72B) and h100 (Llama-2-7b, Llama-2-70b, Qwen-72B) profiles, TP 1-8,
# 1..4096 tokens (3132 rows per family): GEMM factors on the GEMM columns, elementwise factors
# on the norm/act/add/RoPE columns, all-reduce on intra-node NCCL rows. Median relative error
# of our composite ops (A100 / H100): qkv_proj 5.2 / 6.8 %, o_proj 7.0 / 5.7 %, gate_up_proj
# 5.3 / 5.5 %, down_proj 5.7 / 9.0 %; p90 14-21 % (the max() misses the GEMM ridge and
# cuBLAS's odd kernel choices, e.g. 2x slow gate_up at 256 tokens on H100). All-reduce 5.9 /
# 6.7 %. ar_eff is the bus bandwidth NCCL reached over per-direction NVLink bandwidth (Vidur
# timed eager torch.distributed calls; its `size` column is bytes, calibrate.load_allreduce).
# eff_attn: FlashAttention-2 causal forward, head dim 128, reaches 335 TFLOP/s on H100 SXM5 at
# 16k (298 at 2k, 191 at 512) [Shah et al., FlashAttention-3, arXiv:2407.08608, Fig. 5];
# 335/989 = 0.34, with attn_tile reproducing the drop at short lengths. On A100 FA2 reaches
# 50-73 % of peak [Dao, FlashAttention-2, arXiv:2307.08691]; causal taken as 0.6.
# eff_attn_mem is not calibrated (no attention profile): assumed below the GEMV streaming
# efficiency because paged KV reads are gathered block by block.
A100_PARAMS = RooflineParams(
    eff_compute=0.695, eff_mem=0.777, gemm_fixed_s=9.2e-6, eff_elem=0.43, launch_s=2.3e-6,
    eff_attn=0.6, attn_tile=128.0, eff_attn_mem=0.7, ar_eff=0.576, ar_latency_s=48e-6)
H100_PARAMS = RooflineParams(
    eff_compute=0.685, eff_mem=0.886, gemm_fixed_s=8.3e-6, eff_elem=0.458, launch_s=1.85e-6,
    eff_attn=0.34, attn_tile=128.0, eff_attn_mem=0.7, ar_eff=0.781, ar_latency_s=29e-6)
# 2-core CPU running the engine in float32 (PyTorch): measured on the dev VM (AMD EPYC Zen 4,
# 2 vCPU): numpy sgemm 2048^3 at 68 GFLOP/s, fp32 GEMV at 7.4 GB/s; ~10 us per torch op.
CPU_PARAMS = RooflineParams(
    eff_compute=0.45, eff_mem=0.37, gemm_fixed_s=20e-6, eff_elem=0.25, launch_s=10e-6,
    eff_attn=0.25, attn_tile=64.0, eff_attn_mem=0.3, ar_eff=0.5, ar_latency_s=50e-6,
    step_overhead_s=2e-3, seq_overhead_s=20e-6)


@dataclass(frozen=True)
class HardwareSpec:
    """One accelerator (one GPU, or the CPU box) as the roofline sees it.

    nvlink_bw is per GPU and per direction (datasheets quote the bidirectional total: half
    of it); net_bw is the GPU's share of inter-node network (one 200/400 Gb/s NIC per GPU).
    dtype_bytes overrides the model's parameter width (the CPU engine runs float32).
    runtime_reserve_bytes is memory the runtime keeps besides weights, activations and KV
    (CUDA context, CUDA graphs, NCCL buffers).
    """

    name: str
    peak_flops: float
    mem_bw: float
    mem_bytes: float
    nvlink_bw: float
    net_bw: float
    params: RooflineParams = field(repr=False, default=H100_PARAMS)
    gpus_per_node: int = 8
    nvlink_latency_s: float = 8e-6   # Vidur send/recv, 4 KB message: 5-8 us intra-node
    net_latency_s: float = 20e-6     # and 17-24 us across nodes
    dtype_bytes: int | None = None
    runtime_reserve_bytes: float = 1.5 * GiB

    def with_params(self, **changes: float) -> "HardwareSpec":
        """A copy with some roofline factors replaced (for what-if studies and fitting)."""
        return replace(self, params=replace(self.params, **changes))


HARDWARE: dict[str, HardwareSpec] = {
    # A100 SXM4 datasheet: 312 TFLOPS bf16 dense, 40 GB HBM2 at 1,555 GB/s or 80 GB HBM2e at
    # 2,039 GB/s, NVLink 3 600 GB/s (bidirectional). DGX A100: 200 Gb/s HDR IB per GPU.
    "a100-40g": HardwareSpec("a100-40g", 312e12, 1555 * GB, 40 * GiB, 300 * GB, 25 * GB,
                             A100_PARAMS),
    "a100-80g": HardwareSpec("a100-80g", 312e12, 2039 * GB, 80 * GiB, 300 * GB, 25 * GB,
                             A100_PARAMS),
    # A800 SXM4 80GB: the export A100; same compute/HBM, NVLink cut to 400 GB/s bidirectional.
    "a800": HardwareSpec("a800", 312e12, 2039 * GB, 80 * GiB, 200 * GB, 25 * GB, A100_PARAMS),
    # H100 SXM5 datasheet: 989 TFLOPS bf16 dense (1,979 with sparsity), 80 GB HBM3 at
    # 3.35 TB/s, NVLink 4 900 GB/s bidirectional. DGX H100: 400 Gb/s NDR IB per GPU.
    "h100": HardwareSpec("h100", 989e12, 3350 * GB, 80 * GiB, 450 * GB, 50 * GB, H100_PARAMS),
    # H800 SXM5: export H100; same compute/HBM, NVLink 400 GB/s bidirectional.
    "h800": HardwareSpec("h800", 989e12, 3350 * GB, 80 * GiB, 200 * GB, 50 * GB, H100_PARAMS),
    # H200 SXM datasheet: H100 compute, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s.
    "h200": HardwareSpec("h200", 989e12, 4800 * GB, 141 * GB, 450 * GB, 50 * GB, H100_PARAMS),
    # 2-core AVX-512 server CPU (AMD Zen 4 class, e.g. a 2-vCPU EPYC cloud VM): 32 fp32
    # FLOP/cycle/core (two 256-bit FMA pipes run AVX-512 in halves) x 2 cores x ~2.4 GHz =
    # 154 GFLOP/s fp32 (the engine's CPU dtype); ~20 GB/s of DRAM bandwidth for two cores;
    # 16 GB RAM; "NVLink" is a shared-memory copy, "network" 10 Gb/s Ethernet.
    "cpu": HardwareSpec("cpu", 154e9, 20 * GB, 16 * GiB, 5 * GB, 1.25 * GB, CPU_PARAMS,
                        gpus_per_node=1, nvlink_latency_s=20e-6, net_latency_s=100e-6,
                        dtype_bytes=4, runtime_reserve_bytes=0.5 * GiB),
}
HARDWARE_NAMES: tuple[str, ...] = tuple(HARDWARE)


# -- calibrations ---------------------------------------------------------------------------
# 'vidur': the factors above, GEMM/elementwise/all-reduce fitted on Vidur's
# operator profiles and the overhead and attention terms assumed.
# 'published': the same GEMM/elementwise/all-reduce factors, with the assumed terms refitted by
# `python -m flowyard.costmodel.fit` on the published GPU points of
# `flowyard.costmodel.published` (flowyard/data/published_points.json; see
# docs/results/fidelity_published.md). The attention terms are fitted on A100 rows only; H100 /
# H200 keep their own attention efficiencies (FlashAttention-3 paper) and take attn_fixed_s and
# the engine profile's host terms.
# The fitted values live in flowyard/data/calibration.json, written by
# `python -m flowyard.costmodel.fit --write` (the vidur values were 300e-6, 5e-6, 0.6, 128, 0.7,
# 0, 0, 0): the A100 attention terms ("kernel"), terms of one measured kernel ("kernel_only"),
# and the host-side terms per engine profile (flowyard.costmodel.engines), each profile fitted
# on its own source family.
# attn_causal_extra is a term of the kernel Vidur profiled, not of the serving stacks: its
# prefill rows price a new token's causal pair at ~2x a cached pair up to 3.6k new tokens,
# while DynaServe Table 1 (vLLM 0.7.2, FlashAttention-2, same A100) serves 0.83 rps of
# 8192-token prefills on one GPU, which bounds such a prefill by 1205 ms. So the fit prices
# Vidur's attention rows with it (KERNEL_TERMS['vidur-profile']) and the simulator's
# 'published' factors leave it at 0.
_CAL = calibration_data()
_FITTED_A100 = dict(_CAL["kernel"])
KERNEL_TERMS: dict[str, dict[str, float]] = {k: dict(v) for k, v in _CAL["kernel_only"].items()}
PUBLISHED_PARAMS: dict[RooflineParams, RooflineParams] = {
    A100_PARAMS: replace(A100_PARAMS, **_FITTED_A100),
    H100_PARAMS: replace(H100_PARAMS, attn_fixed_s=_FITTED_A100["attn_fixed_s"]),
}
CALIBRATIONS: tuple[str, ...] = ("vidur", "published")
# The simulator's default (make_cost_model, SimConfig, `--calibration`): 'published', the
# factor set docs/results/fidelity_published.md validates by leave-one-source-out
# cross-validation, with the engine profile DEFAULT_ENGINE_PROFILE (today's vLLM).
DEFAULT_CALIBRATION = "published"


def calibrated(hw: HardwareSpec, calibration: str = DEFAULT_CALIBRATION, kernel: str = "",
               engine: str | EngineProfile | None = None) -> HardwareSpec:
    """`hw` with the factors of a named calibration and, under 'published', the host-side
    terms of an engine profile (None: DEFAULT_ENGINE_PROFILE). Hardware with no published fit
    (the CPU box, custom specs) keeps its own factors under every calibration. `kernel` names
    the measured kernel of a published point whose own terms (KERNEL_TERMS) apply on top,
    under 'published' only; the simulator never passes it."""
    name = calibration.strip().lower()
    if name not in CALIBRATIONS:
        raise ValueError(f"unknown calibration {calibration!r}; choose one of {', '.join(CALIBRATIONS)}")
    profile = get_engine_profile(engine)  # an unknown name is an error under any calibration
    if name == "vidur":
        return hw
    params = PUBLISHED_PARAMS.get(hw.params)
    if params is None:
        return hw
    return replace(hw, params=replace(params, **profile.terms(), **KERNEL_TERMS.get(kernel, {})))


def get_hardware(name: str | HardwareSpec) -> HardwareSpec:
    """A catalog accelerator by (case-insensitive) name."""
    if isinstance(name, HardwareSpec):
        return name
    return lookup("hardware", str(name), HARDWARE)
