"""Published GPU measurements the simulator is checked against (`flowyard validate`).

Every point is a number someone else measured on a GPU, with where it comes from: a paper's
table, a number its text states, a public profiling file (repository, path and the commit we
read), or a public benchmark write-up. Nothing here was produced by flowyard. Numbers read from
a figure are marked `from_figure` (none so far: the four papers' figures carry no values in
/work/shared/papers/*.txt, so their Figs. 1/3/5 (PLA) and 3/4 (FlowPrefill) are left out).

Where a point is derived (e.g. a decode batch size from Little's law on a table's throughput
and TBT), the derivation is computed in `derive`/the point's fields, not typed, and `note`
says so.

Kinds (what `flowyard.costmodel.fit.predict` compares against):
  step          whole step time (ms) of a batch: prefills (history, new tokens), decodes
  attn_prefill  one layer's prefill attention kernel (ms), one sequence
  attn_decode   one layer's decode attention kernel (ms)
  cpu_overhead  per-step CPU time outside the GPU kernels (ms) for `decodes` sequences
  ridge         prefill tokens where a lone prefill turns compute-bound (a range [lo, hi])
A point with `hi` set is a range: the error is 0 inside it, else the distance to the nearest end.
"""

from __future__ import annotations

from dataclasses import dataclass

from flowyard.costmodel.models import ModelSpec

VIDUR_REPO = "microsoft/vidur"
VIDUR_ATTENTION = ("data/profiling/a100/attention.csv", "e2d00e9afba96cec9f0e7ea560bbfc4a539fae6a")
VIDUR_CPU = ("data/profiling/a100/cpu_overheads.csv", "0633efaee2826c47b16741e57df0476b58136714")

# Models Vidur profiled that are not in our catalog (shapes from their config.json).
LLAMA2_7B = ModelSpec("llama-2-7b", hidden=4096, layers=32, heads=32, kv_heads=32, head_dim=128,
                      intermediate=11008, vocab=32000)
CODELLAMA_34B = ModelSpec("codellama-34b", hidden=8192, layers=48, heads=64, kv_heads=8,
                          head_dim=128, intermediate=22016, vocab=32000)


@dataclass(frozen=True)
class Point:
    """One published measurement and the batch it was taken on."""

    name: str
    kind: str
    model: str | ModelSpec
    hardware: str
    tp: int
    measured: float
    unit: str
    source: str                                  # paper + table/figure, or repo:path@commit, or URL
    prefills: tuple[tuple[int, int], ...] = ()   # (history, new tokens)
    decodes: tuple[tuple[int, int], ...] = ()    # (count, context length)
    hi: float | None = None                      # set: `measured` is the low end of a range
    note: str = ""
    from_figure: bool = False
    kernel: str = ""                             # a measured kernel with its own terms
                                                 # (hardware.KERNEL_TERMS), e.g. Vidur's

    @property
    def is_range(self) -> bool:
        return self.hi is not None


def _vidur_attn(kind: str, measured_ms: float, *, chunk: int = 0, kv: int = 0, batch: int = 0,
                ctx: int = 0) -> Point:
    """A row of Vidur's A100 attention profile: n_embd 8192, 64 q / 8 kv heads, TP 2 (the
    Llama-3-70B shape), FlashAttention backend, Kineto; median of the row (ms). Priced with
    the terms of that profiled kernel (hardware.KERNEL_TERMS['vidur-profile'])."""
    path, commit = VIDUR_ATTENTION
    src = f"{VIDUR_REPO}:{path}@{commit[:12]}"
    if kind == "attn_prefill":
        return Point(f"vidur attn prefill {chunk} new + {kv} cached", kind, "llama-3-70b",
                     "a100-80g", 2, measured_ms, "ms", src, prefills=((kv, chunk),),
                     note="attn_prefill median, batch 1", kernel="vidur-profile")
    return Point(f"vidur attn decode {batch} x ctx {ctx}", kind, "llama-3-70b", "a100-80g", 2,
                 measured_ms, "ms", src, decodes=((batch, ctx),), note="attn_decode median",
                 kernel="vidur-profile")


# Vidur cpu_overheads.csv, tensor_parallel_degree 1: medians (ms) of SCHEDULE, SAMPLER_E2E,
# PREPARE_INPUTS_E2E and PROCESS_MODEL_OUTPUTS, the CPU phases Vidur adds to each step.
_CPU_ROWS: tuple[tuple[ModelSpec, int, tuple[float, float, float, float]], ...] = (
    (LLAMA2_7B, 8, (0.16513349025318164, 0.8878073216415597, 0.2931705055545493,
                    0.6243771681952621)),
    (LLAMA2_7B, 16, (0.2783152190057239, 0.9445935791220815, 0.43911199948509766,
                     1.1354164981388284)),
    (LLAMA2_7B, 32, (0.5798413880809572, 1.1263693997825983, 0.6709902766162451,
                     2.2456606850184615)),
    (LLAMA2_7B, 64, (0.9521806380555277, 1.3702587697044193, 1.1629961351208513,
                     4.108261601388884)),
    (CODELLAMA_34B, 8, (0.15396944217894318, 0.9258893668969445, 0.5246621669728105,
                        0.7905703924151583)),
    (CODELLAMA_34B, 32, (0.5040898624290469, 1.1151618332777034, 1.7006315413722282,
                         2.9891822798536354)),
)


def _cpu_points() -> list[Point]:
    path, commit = VIDUR_CPU
    return [Point(f"vidur cpu overhead {m.name} batch {bs}", "cpu_overhead", m, "a100-80g", 1,
                  sum(parts), "ms", f"{VIDUR_REPO}:{path}@{commit[:12]}", decodes=((bs, 1024),),
                  note="sum of the schedule, sampler, prepare-inputs and output-processing medians")
            for m, bs, parts in _CPU_ROWS]


def _dynaserve_table1() -> list[Point]:
    """DynaServe Table 1, PD-disaggregated decode GPU (Qwen-2.5-14B, one A100): p50 TBT at a
    saturating rate. The decode batch is derived by Little's law, batch = rps * D * TBT, and the
    mean context is P + D/2: a derived point, the TBT is the paper's."""
    out = []
    for p, d, rps, tbt_ms in ((8192, 32, 0.83, 22.70), (2048, 512, 2.56, 47.00),
                              (219, 1467, 1.68, 50.63)):
        batch = max(1, round(rps * d * tbt_ms / 1e3))
        out.append(Point(f"dynaserve T1 disagg decode P{p} D{d}", "step", "qwen2.5-14b",
                         "a100-80g", 1, tbt_ms, "ms", "DynaServe (arXiv) Table 1, p50-TBT, Disagg.",
                         decodes=((batch, p + d // 2),),
                         note=f"batch {batch} = {rps} rps x {d} tokens x {tbt_ms} ms (Little's law)"))
    # Prefill GPU of the same run, P=8192 D=32: 0.83 rps saturating one prefill GPU bounds a
    # lone 8192-token prefill by 1/0.83 s from above.
    out.append(Point("dynaserve T1 disagg prefill 8192 (bound)", "step", "qwen2.5-14b", "a100-80g",
                     1, 0.0, "ms", "DynaServe (arXiv) Table 1, throughput 0.83 rps, Disagg.",
                     prefills=((0, 8192),), hi=1e3 / 0.83,
                     note="upper bound: the prefill GPU serves at most 0.83 rps of 8192 tokens"))
    return out


def published_points() -> list[Point]:
    """Every point, in table order."""
    pts: list[Point] = []
    # Vidur A100 decode attention (batch, context per sequence) -> median ms.
    for batch, ctx, ms in ((1, 32, 0.015), (18, 2688, 0.080), (32, 2688, 0.138),
                           (48, 2688, 0.161), (64, 2688, 0.280), (93, 2688, 0.308)):
        pts.append(_vidur_attn("attn_decode", ms, batch=batch, ctx=ctx))
    # Vidur A100 prefill attention (new tokens, cached tokens) -> median ms.
    for chunk, kv, ms in ((256, 0, 0.033), (256, 512, 0.053), (224, 1024, 0.072),
                          (224, 2048, 0.110), (224, 3840, 0.179), (1088, 0, 0.245),
                          (1024, 1024, 0.316), (1024, 2048, 0.417), (1024, 3072, 0.533),
                          (3456, 0, 1.698), (3392, 512, 1.778), (3584, 128, 1.844)):
        pts.append(_vidur_attn("attn_prefill", ms, chunk=chunk, kv=kv))
    pts += _cpu_points()
    pts += _dynaserve_table1()
    pts.append(Point(
        "dynaserve fig6 LCU 512 prefill + 29 decodes @1024", "step", "llama-3.1-8b", "a100-80g", 1,
        50.0, "ms", "DynaServe (arXiv) §4.2 text on Fig. 6 (Insight 2)",
        prefills=((0, 512),), decodes=((29, 1024),),
        note="the text: with a 512-token prefill, latency passes the 50 ms SLO beyond 29 decodes "
             "of context 1024 (the LCU point)"))
    pts.append(Point(
        "vllm 0.23 A100-40G Llama-3.1-8B decode, concurrency 1", "step", "llama-3.1-8b",
        "a100-40g", 1, 1e3 / 75, "ms",
        "https://johnmusgrave.com/p/vllm-throughput-latency-sweep-on (vLLM 0.23.0)",
        decodes=((1, 1024 + 64),),
        note="'about 75 tokens/sec' at one request, 1024-token prompts, 128 outputs; mean context"))
    # PLA-Serve §2.1: the compute-memory transition of a prefill lies between 150 and 512
    # tokens on A100/H100/H200 for 7B-32B models (citing Yuan et al. 2024, DistServe).
    for model, hw in (("llama-3-8b", "a100-80g"), ("qwen2.5-7b", "h100"),
                      ("qwen2.5-14b", "h200"), ("qwen2.5-32b", "h200")):
        pts.append(Point(f"ridge {model} {hw}", "ridge", model, hw, 1, 150.0, "tokens",
                         "PLA-Serve §2.1 text (profiling of A100/H100/H200, 7B-32B)", hi=512.0,
                         note="range, as the paper states it"))
    return pts
