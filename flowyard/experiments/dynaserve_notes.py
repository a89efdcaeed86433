"""Prose of the DynaServe report: the paper's numbers, the setup, and why ours differ.

Every number and verdict in `notes` is computed from the run's `Results`; only the paper's
own numbers and the mechanisms that explain a difference are written here, and an
explanation is given only when the difference it explains shows in the run.
"""

from __future__ import annotations

import math
from typing import TypedDict

from flowyard.experiments.common import BAND, band_verdict, fmt_range, fmt_x, ratio
from flowyard.experiments.report import null_effect_verdict
from flowyard.experiments.dynaserve import BASE, WORKLOADS, Results
from flowyard.experiments.dynaserve_bench import COLOC, DISAGG, DYNA, TBT_SLO
from flowyard.policies.dynaserve.split import DynaServeConfig

#: Table 1 of the paper: shape -> system -> (MFU G1, MFU G2, HBM G1, HBM G2, P50 TBT ms, P99 TBT ms, rps, att %)
PAPER_T1: dict[str, dict[str, tuple[float, ...]]] = {
    "P8192/D32": {DISAGG: (43.24, 0.19, 4.83, 5.77, 22.70, 58.09, 0.83, 100.0),
                  COLOC: (38.94, 38.94, 39.67, 40.03, 309.68, 352.93, 1.49, 1.73)},
    "P2048/D512": {DISAGG: (30.59, 7.93, 1.17, 94.83, 47.00, 65.11, 2.56, 99.83),
                   COLOC: (21.26, 21.26, 94.23, 95.7, 46.86, 336.81, 2.83, 84.09)},
    "P219/D1467": {DISAGG: (2.09, 14.34, 0.0, 96.27, 50.63, 74.47, 1.68, 99.95),
                   COLOC: (13.98, 13.98, 95.2, 95.33, 47.99, 162.67, 2.86, 94.46)},
}
PAPER_HYBRID = {COLOC: (4.6, 316.32), DISAGG: (5.9, 399.31), DYNA: (7.4, 473.84)}
PAPER_T4 = {0: 3606.93, 10: 3591.00, 50: 3564.90, 100: 3501.85}
#: Fig. 9: DynaServe's serving capacity over each baseline, (lowest, highest, mean) over settings
PAPER_CAPACITY = {COLOC: (1.15, 3.07, 2.37), DISAGG: (1.09, 1.67, 1.37)}
PAPER_KV_REDUCTION = 0.94
#: Fig. 8: DynaServe's goodput over each baseline, "up to" (abstract and §5.2)
PAPER_GOODPUT_UP_TO = {COLOC: 1.91, DISAGG: 1.61}
#: Fig. 11 (§6.6): share of tokens generated within the 100 ms TBT SLO, SLO-aware batching off and on
PAPER_FIG11 = {"off": 0.52, "on": 0.99}
class LCUPoint(TypedDict):
    """Fig. 6's LCU point: the model and GPU, the prefill and context lengths, the SLO (s) and
    the decodes the paper found to fit."""

    model: str
    hardware: str
    prefill: int
    ctx: int
    slo: float
    decodes: int


#: Fig. 6 text (Insight 2): Llama-3.1-8B on an A100, a 512-token prefill: latency passes the 50 ms
#: SLO beyond 29 decodes of context 1024 (the LCU point)
PAPER_LCU: LCUPoint = {"model": "llama-3.1-8b", "hardware": "a100-80g", "prefill": 512, "ctx": 1024, "slo": 0.050,
                        "decodes": 29}
#: Table 3: the global scheduler's overhead per request (ms) at 6-16 QPS
PAPER_T3_MS = (17.47, 15.48, 14.40, 13.70, 14.85, 14.54)
#: Table 4: goodput changes by -0.4 to -2.9 % with the length error; ours must stay within ±5 %
PAPER_LENGTH_ERROR_BAND = 0.05

SETUP = """\
**Setup.** Two instances on simulated {hardware} (roofline cost model), {models}. Systems:
PD Coloc. = `vllm`, two replicas, round robin, chunked prefill (chunk tuned per workload among
{chunks}, as the paper tuned 256-2048); PD Disagg. = `distserve` 1P1D; DynaServe = `dynaserve`
(split search K = 6, Alg. 2 batches under the 100 ms TBT SLO, per-task empirical length
predictor + 20 tokens, chunked KV push). Workloads: Poisson arrivals with lengths resampled from
the bundled traces (Azure Code 2023, the 400-row public head of BurstGPT, arXiv summarization);
Mini Reasoning is not available offline, so a stand-in with its reported mean shape (P219/D1467,
gamma-distributed) replaces it. Each run holds rate x {duration:g} s of arrivals ({min_n} to
{max_n} requests), so an overloaded run builds a queue rather than being absorbed by the
cluster's 512 concurrent sequences. Metric definitions: `flowyard/experiments/dynaserve_bench.py`."""


def verdict(ours: float, paper: float, band: float = BAND) -> str:
    """`band_verdict` against one paper number; a zero, missing or non-finite value (ours or the
    paper's) is never reproduced."""
    if not (math.isfinite(paper) and paper > 0):
        return "not measured (no paper number)"
    return band_verdict(ours, paper, paper, band)


def fit_inputs(calibration: str | None = None) -> dict[str, str]:
    """Which of this report's paper numbers the cost model was fitted on, under `calibration` (None:
    the simulator's default, what every run here uses): "LCU" for Fig. 6's point and each Table 1
    shape key ("P8192/D32") whose PD Disagg. P50 TBT is a fitted point, mapped to the point's name.
    A prediction of a number the model was fitted on is a fit input, not a check."""
    from flowyard.costmodel.fit import fitted_on
    from flowyard.sim.run import SimConfig

    out: dict[str, str] = {}
    for p in fitted_on(calibration or SimConfig().calibration):
        if p.name.startswith("dynaserve fig6 LCU"):
            out["LCU"] = p.name
        elif p.name.startswith("dynaserve T1 disagg decode "):
            out[p.name.rsplit(" ", 2)[-2] + "/" + p.name.rsplit(" ", 1)[-1]] = p.name
    return out


def fit_verdict(name: str, calibration: str | None = None) -> str:
    """The verdict cell of a number the model was fitted on."""
    from flowyard.sim.run import SimConfig

    return (f"fit input, not a check (the '{calibration or SimConfig().calibration}' calibration was fitted on "
            f"the point '{name}', flowyard/costmodel/published.py)")


def length_error_verdict(res: Results) -> str:
    """Table 4's claim (goodput moves less than ±PAPER_LENGTH_ERROR_BAND with output-length error),
    judged against the goodput's spread over the seeds each std was run with."""
    per_seed = {k: [p.goodput_tps for p in pts] for k, pts in res.sensitivity.items()}
    return null_effect_verdict(per_seed, 0.0 if 0.0 in per_seed else 0, PAPER_LENGTH_ERROR_BAND)


def fig11_verdict(res: Results, key: str) -> tuple[float, str]:
    """Fig. 11's claim on workload `key`: SLO-aware batching raises the share of tokens within the
    TBT SLO by the paper's factor (0.99 / 0.52). Judged as a ratio over batching without it, so a
    run where Alg. 2's budget does not help (ratio <= 1) is never reproduced."""
    pts = res.slo_batching.get(key)
    if not pts:
        return math.nan, "not measured (not run)"
    r = ratio(pts["on"].token_attainment, pts["off"].token_attainment)
    return r, verdict(r, PAPER_FIG11["on"] / PAPER_FIG11["off"])


def _mean(vals: list[float]) -> float:
    v = [x for x in vals if math.isfinite(x)]
    return sum(v) / len(v) if v else math.nan


def _table1(res: Results) -> list[str]:
    out = []
    t1 = res.table1
    coloc = [(k, t1[k][COLOC].tbt_p99) for k in ("P8192/D32", "P2048/D512") if k in t1]
    if coloc:
        over = [k for k, v in coloc if v > TBT_SLO]
        out.append("- **Table 1, colocation's tail.** With 2048-token chunks colocation's P99 TBT is "
                   + ", ".join(f"{1e3 * v:.0f} ms on {k} (paper {PAPER_T1[k][COLOC][5]:.0f} ms)" for k, v in coloc)
                   + (f"; it misses the {1e3 * TBT_SLO:.0f} ms SLO on {', '.join(over)}, as in the paper."
                      if over else f"; it holds the {1e3 * TBT_SLO:.0f} ms SLO, unlike the paper."))
    idle = [(k, min(t1[k][DISAGG].mfu)) for k in ("P8192/D32", "P219/D1467") if k in t1 and t1[k][DISAGG].mfu]
    if idle:
        out.append("- **Disaggregation idles a GPU on unbalanced shapes:** its less busy GPU's MFU is "
                   + ", ".join(f"{100 * v:.2f} % on {k} (paper {min(PAPER_T1[k][DISAGG][:2]):.2f} %)" for k, v in idle)
                   + ".")
    rps = {s: [ratio(t1[k][s].rps, PAPER_T1[k][s][6]) for k in t1 if k in PAPER_T1] for s in (COLOC, DISAGG)}
    if any(rps.values()):
        out.append("- **Throughput at saturation**, ours over the paper's: colocation "
                   f"{fmt_range(rps[COLOC])}, disaggregation {fmt_range(rps[DISAGG])}.")
    mfu = [t1[k][COLOC].mfu[0] for k in ("P8192/D32",) if k in t1 and t1[k][COLOC].mfu]
    if mfu:
        side = "higher" if 100 * mfu[0] > PAPER_T1["P8192/D32"][COLOC][0] else "lower"
        out.append(f"- **MFU on P8192/D32** (colocation): {100 * mfu[0]:.1f} % against the paper's "
                   f"{PAPER_T1['P8192/D32'][COLOC][0]:.1f} %, {side}"
                   + (": the roofline's compute efficiency is calibrated on GEMM microbenchmarks, while real "
                      "steps also spend time in the scheduler, sampling and kernel launches." if side == "higher"
                      else "."))
    return out


def _capacity(res: Results) -> list[str]:
    caps = res.capacity.get(BASE, {})
    out = []
    for base, name in ((COLOC, "colocation"), (DISAGG, "disaggregation")):
        r = [ratio(caps[k][DYNA].value, caps[k][base].value) for k in caps]
        lo, hi, mean = PAPER_CAPACITY[base]
        text = (f"- **Serving capacity over {name}** ({BASE}): {fmt_range(r)}, mean {fmt_x(_mean(r))} "
                f"(paper {lo:g}-{hi:g}x, mean {mean:g}x): {verdict(_mean(r), mean)}.")
        if base == COLOC and math.isfinite(_mean(r)) and _mean(r) < lo:
            chunks = sorted({ch for k in caps if (ch := caps[k][COLOC].chunk)})
            text += (f" Colocation gets its best chunk size per workload ({', '.join(map(str, chunks))} won here); "
                     "with small chunks the roofline prices a mixed step well under the SLO, because it has no "
                     "kernel interference between prefill and decode inside one step, which is what the paper "
                     "blames for colocation's tail (§2.4).")
        out.append(text)
    reason = caps.get("reasoning")
    if reason:
        best = max(reason[COLOC].value, reason[DISAGG].value)
        gain = ratio(reason[DYNA].value, best)
        out.append(f"- **Decode-heavy work** (reasoning stand-in): DynaServe's capacity is {fmt_x(gain)} the better "
                   "baseline's" + (": there KV memory and the scheduling-delay bound set capacity, not the TBT SLO, "
                                   "so splitting cannot help much." if math.isfinite(gain) and gain < 1.1 else "."))
    return out


def _rest(res: Results) -> list[str]:
    out = []
    t1_dyna = [res.table1[k][DYNA].tbt_p99 for k in res.table1 if DYNA in res.table1[k]]
    if t1_dyna:
        h = DynaServeConfig().step_headroom
        out.append(f"- **Hand-offs cost TBT, so DynaServe's steps aim lower** ({100 * h:.1f} % of the SLO, "
                   "`DynaServeConfig.step_headroom`): the token after a hand-off waits for the destination's step in "
                   "flight and then its next one, about 1.5 steps. Its P99 TBT on Table 1's shapes: "
                   + ", ".join(f"{1e3 * v:.0f} ms" for v in t1_dyna)
                   + (f", all within the {1e3 * TBT_SLO:.0f} ms SLO." if max(t1_dyna) <= TBT_SLO
                      else f", not all within the {1e3 * TBT_SLO:.0f} ms SLO."))
    if res.hybrid:
        g = {s: res.hybrid[s][1].goodput_tps for s in res.hybrid}
        out.append("- **Goodput** counts the output tokens of requests whose own P99 TBT is within the SLO (the "
                   "paper does not state its rule). Hybrid mix, ours / paper's tokens/s: "
                   + ", ".join(f"{s} {g[s]:.0f} / {PAPER_HYBRID[s][1]:.0f}" for s in g if s in PAPER_HYBRID)
                   + "; only the ratios between systems compare.")
    if res.sensitivity:
        base = _mean([p.goodput_tps for p in res.sensitivity.get(0.0, res.sensitivity.get(0, []))])
        ch = {k: ratio(_mean([p.goodput_tps for p in pts]), base) - 1 for k, pts in res.sensitivity.items() if k}
        if ch:
            v = length_error_verdict(res)
            out.append("- **Length error** moves goodput by "
                       + ", ".join(f"{100 * c:+.1f} % at std {k:g}" for k, c in ch.items())
                       + " (paper: -0.4 to -2.9 %): "
                       + ("small (all within ±5 %, a band wider than the seed noise), as in the paper" if v.startswith("reproduced")
                          else "larger than the paper's (beyond ±5 %)" if v.startswith("not reproduced") else
                          "not measured (no goodput)" if v.startswith("not measured") else
                          "undecided: the workload draws alone move goodput as much as the band allows")
                       + f"; {v}.")
    if res.kv:
        c, w = res.kv.get("chunked"), res.kv.get("whole")
        if c is not None and w is not None:
            red = 1 - ratio(c.kv_exposed_ms, w.kv_exposed_ms)
            out.append(f"- **Chunked KV** hides {100 * red:.0f} % of the transfer time at hand-off (paper "
                       f"{100 * PAPER_KV_REDUCTION:.0f} %): {verdict(red, PAPER_KV_REDUCTION, 1.1)}"
                       + ("; the simulated link has no per-message overhead." if red > PAPER_KV_REDUCTION else "."))
    out.append("- **Disaggregation on long outputs.** A request that waits for a decode slot after its first token "
               "stalls once; one gap in a long output never reaches the P99 TBT, so stalls beyond the SLO count as "
               "scheduling delay here, or a saturated 1P1D cluster would look sustainable at any rate.")
    return out


def lcu_decodes() -> int:
    """Fig. 6's LCU point priced by the cost model: the most decodes of context PAPER_LCU['ctx']
    that ride with a PAPER_LCU['prefill']-token prefill within the SLO (no simulation needed)."""
    from flowyard.core.plan import BatchShape
    from flowyard.sim.run import SimConfig, build_cost_model

    c = PAPER_LCU
    cm = build_cost_model(SimConfig(model=c["model"], hardware=c["hardware"]))
    n = 0
    while n < 1024 and float(cm.step_time(BatchShape.of([(0, c["prefill"])], [c["ctx"]] * (n + 1)))) <= c["slo"]:
        n += 1
    return n


def not_reproduced(res: Results) -> str:
    """The "figures not reproduced" section, generated from the figure registry, with the numbers
    this run computes for some of them."""
    from flowyard.experiments.figures import not_built_section

    return not_built_section("dynaserve", {
        "Fig. 6": f"its one stated number, the LCU point, is in the headline ({lcu_decodes()} decodes here, paper "
                  f"{PAPER_LCU['decodes']}) but labelled a fit input: the 'published' calibration was fitted on it "
                  "(flowyard/costmodel/published.py), so it is not an independent check. The TFLOP/s panels need "
                  "per-kernel utilisation the roofline does not model.",
        "Table 3": f"The paper: {min(PAPER_T3_MS):g}-{max(PAPER_T3_MS):g} ms per request.",
    })


def notes(res: Results) -> str:
    """The report's "why ours differ" section, computed from `res`."""
    return "\n".join(_table1(res) + _capacity(res) + _rest(res))


__all__ = ["BAND", "PAPER_CAPACITY", "PAPER_FIG11", "fig11_verdict", "PAPER_GOODPUT_UP_TO", "PAPER_HYBRID", "PAPER_LCU", "PAPER_LENGTH_ERROR_BAND",
           "PAPER_T3_MS", "fit_inputs", "fit_verdict", "lcu_decodes", "length_error_verdict", "not_reproduced", "PAPER_KV_REDUCTION", "PAPER_T1", "PAPER_T4", "SETUP",
           "WORKLOADS", "notes", "verdict"]
