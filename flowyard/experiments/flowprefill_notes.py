"""The "where and why ours differ" section of the FlowPrefill report.

The explanations are ours (mechanisms of the simulator, the workload and the baselines); every
number in them, and every "higher"/"lower"/"matches", is computed from the run's `Results`.
"""

from __future__ import annotations

import math

from flowyard.experiments.common import band_verdict, fmt_range, fmt_x, ratio
from flowyard.experiments.flowprefill import Results

FP = "FlowPrefill"
#: the paper's headline claims (§6.2, §6.4), as (low, high) factors; low None: "up to high"
PAPER: dict[str, tuple[float | None, float]] = {
    "goodput_vs_distserve": (4.7, 5.6), "goodput_vs_cp2k": (None, 2.0), "goodput_vs_cp8k": (None, 4.5),
    "slo_vs_cp2k": (1.5, 2.3), "slo_vs_cp8k": (2.1, 3.1), "layer_over_op": (3.5, 4.2),
}
#: §6.4: operator-level preemption blocks for less than this (ms)
PAPER_OP_BLOCKING_MAX_MS = 4.5
CHUNKING_HELPS = 1.2  # CP2K over DistServe goodput from which chunking counts as helping
LOW_LOAD = 0.5  # x C: a baseline that falls below 90 % under this misses "even at low load"
SPREAD = 0.05  # Fig. 11: budgets' throughputs within this share count as "the same"


def _cmp(v: list[float], key: str) -> str:
    lo, hi = PAPER[key]
    return band_verdict(v, lo, hi) + " against the paper's " + (f"up to {hi}×" if lo is None else f"{lo}×–{hi}×")


def _finite(v) -> list[float]:
    return [x for x in v if math.isfinite(x)]


def _baselines(res: Results, r: dict[str, list[float]]) -> list[str]:
    cp_vs_ds = [ratio(m.goodput["DistServe-CP2K"].value, m.goodput["DistServe"].value) for m in res.e2e]
    over_c = _finite(m.goodput[FP].value / m.capacity for m in res.e2e if m.capacity > 0)
    ds_c = _finite(m.goodput[n].value / m.capacity for m in res.e2e if m.capacity > 0
                   for n in ("DistServe", "DistServe-CP2K", "DistServe-CP8K"))
    tasks = res.e2e[0].fp_tasks if res.e2e else {}
    helps = bool(_finite(cp_vs_ds)) and max(_finite(cp_vs_ds)) >= CHUNKING_HELPS
    out = [
        "- **The chunked-prefill baselines' preemption points.** As the registry runs them (`distserve-cp2k`, "
        "`distserve-cp8k`, vLLM's scheduler), a prompt that has started keeps its turn until its last "
        "chunk and EDF only orders the waiting queue, so a 0.25 s text request that arrives behind a "
        "6,000-token search prompt still waits for all of it. "
        + (f"Chunking still helps here: DistServe-CP2K sustains {fmt_range(cp_vs_ds)} DistServe's goodput. "
           if helps else f"Chunking then buys little (below {CHUNKING_HELPS}×): DistServe-CP2K sustains "
           f"{fmt_range(cp_vs_ds)} DistServe's goodput here. ")
        + f"FlowPrefill's ratio over it ({fmt_range(r['goodput/DistServe-CP2K'])}): "
        f"{_cmp(r['goodput/DistServe-CP2K'], 'goodput_vs_cp2k')}. The paper credits CP2K with "
        "\"finer-grained preemption\", i.e. re-ranking at chunk boundaries; our *EDF per chunk* "
        f"variants do that, and against them the ratios are {fmt_range(r['goodput/CP2K, EDF per chunk'])} "
        f"for 2K ({_cmp(r['goodput/CP2K, EDF per chunk'], 'goodput_vs_cp2k')}) and "
        f"{fmt_range(r['goodput/CP8K, EDF per chunk'])} for 8K "
        f"({_cmp(r['goodput/CP8K, EDF per chunk'], 'goodput_vs_cp8k')}). Which of the two the paper "
        "ran on vLLM-0.11.2 is not stated; the EDF-per-chunk variant is the closer reading of its text. "
        "It is emulated with FlowPrefill's pool, so its small prompts are batched under Alg. 1's "
        "deadline check instead of being packed to the token budget.",
        f"- **DistServe (FCFS)**: ours {fmt_range(r['goodput/DistServe'])}, "
        f"{_cmp(r['goodput/DistServe'], 'goodput_vs_distserve')}. FCFS lets a text request queue behind "
        f"a long prompt; the re-timed Azure arrivals have inter-arrival CV {res.arrival_cv:.2f}"
        + (" (bursty)" if res.arrival_cv > 1 else "") + ", and DistServe and both registry CP baselines "
        f"fall below 90 % at {fmt_range(ds_c).replace('×', '')} of the prefill capacity C"
        + (", so they miss text SLOs even at low load." if ds_c and max(ds_c) < LOW_LOAD else "."),
    ]
    mix = res.task_mix
    long = [t for t in ("search", "file") if t in mix]
    if over_c and min(over_c) > 1:
        out.append(
            f"- **FlowPrefill beyond capacity.** FlowPrefill's goodput is {fmt_range(over_c)} C. Attainment "
            "counts requests, and S-EDF lets long prompts whose deadline is already out of reach fall behind "
            "while short ones stay on time"
            + (f" ({' and '.join(long)}: {sum(mix[t][0] for t in long):.0%} of the requests but "
               f"{sum(mix[t][1] for t in long):.0%} of the prompt tokens)" if long else "")
            + (f"; at its goodput on {res.e2e[0].label} the per-task attainment is "
               + ", ".join(f"{k} {v:.0%}" for k, v in tasks.items()) if tasks else "")
            + ". The paper describes the same mechanism (§6.2); how far past C it carries depends on the "
            "task mix and on how exact the TTFT predictions are (next points).")
    elif over_c:
        out.append(f"- **FlowPrefill's goodput** is {fmt_range(over_c)} C: it does not carry past the prefill "
                   "capacity in this run.")
    return out


def _slo(res: Results, r: dict[str, list[float]]) -> list[str]:
    fp_min = [m.min_slo[FP].value for m in res.e2e]
    sens, grows = "", None
    if res.sensitivity and res.e2e:
        m = res.e2e[0]
        pts = [(m.slo_rate / m.capacity if m.capacity > 0 else math.nan, r['slo/DistServe-CP2K'][0])]
        pts += [(f, ratio(t['DistServe-CP2K'].value, t[FP].value)) for f, t in sorted(res.sensitivity.items())]
        ys = [y for _, y in sorted(pts) if math.isfinite(y)]
        grows = len(ys) > 1 and ys[-1] > ys[0] and all(a <= b for a, b in zip(ys, ys[1:]))
        sens = ("; on " + m.label + " the CP2K ratio is " + ", ".join(
            f"{fmt_x(ratio(t['DistServe-CP2K'].value, t[FP].value))} at {f:g} C" for f, t in sorted(res.sensitivity.items()))
            + f" against {fmt_x(r['slo/DistServe-CP2K'][0])} at the rate used above")
    why = ("the ratio grows with it because the baselines' minimum scale grows with load while FlowPrefill's "
           f"({fmt_range(fp_min).replace('×', '')}) is set by how long the longer text prompts take to prefill "
           "alone" if grows else "the ratio depends on it (FlowPrefill's min SLO scale here: "
           f"{fmt_range(fp_min).replace('×', '')})" + ("; in this run it does not grow steadily with the rate"
                                                        if grows is False else ""))
    return [
        f"- **Tighter SLOs**: ours {fmt_range(r['slo/DistServe-CP2K'])} vs CP2K "
        f"({_cmp(r['slo/DistServe-CP2K'], 'slo_vs_cp2k')}) and {fmt_range(r['slo/DistServe-CP8K'])} vs "
        f"CP8K ({_cmp(r['slo/DistServe-CP8K'], 'slo_vs_cp8k')}); against the EDF-per-chunk variants "
        f"{fmt_range(r['slo/CP2K, EDF per chunk'])} and {fmt_range(r['slo/CP8K, EDF per chunk'])}. The "
        "paper does not give the fixed rate of its SLO sweep, and " + why + sens + ".",
    ]


def _system(res: Results, br: list[float]) -> list[str]:
    b = res.blocking or {}
    lim = PAPER_OP_BLOCKING_MAX_MS
    op_mean = _finite(g["operator"]["mean"] for g in b.values())
    op_max = _finite(g["operator"]["max"] for g in b.values())
    out = [
        "- **Simulated hardware and perfect prediction.** Step times come from flowyard's roofline of an "
        "A800 (calibrated on measured A100 operators), not from kernels on the GPU: no launch jitter, no "
        "thread or CUDA-stream switching in FlowPrefill's execution pool, no cost to suspend or resume "
        "a task beyond the blocking time. The TTFT predictor behind S-EDF and Alg. 1 is the simulator's "
        "own cost model, so predictions are exact (the paper's polynomial fit has outliers, Fig. 13); "
        "`flowyard simulate --predictor-error F` measures the effect of a wrong predictor.",
        "- **Workload.** QwenTrace is not public. The stand-in has Table 1's task shares and per-task "
        "mean/std/P99 prompt lengths (shifted-Weibull fits), Table 2's SLOs, single-turn requests with 16 "
        "output tokens, and the Azure conversation trace's arrival pattern re-timed to each rate; the "
        "paper replays QwenTrace's own timestamps. Our rates are therefore relative (multiples of C), "
        "not the paper's absolute req/s."
        + (" Drawn task mix: " + ", ".join(f"{t} {q:.0%} of requests / {k:.0%} of prompt tokens"
                                          for t, (q, k) in res.task_mix.items()) + "." if res.task_mix else ""),
    ]
    if op_mean and op_max:
        over = max(op_max) * 1e3 >= lim
        out.append(
            "- **Blocking time.** The operator-level mean is "
            + " / ".join(f"{1e3 * x:.2f} ms" for x in op_mean)
            + f" (paper: below {lim} ms; " + ("within" if max(op_mean) * 1e3 < lim else "above") + "), and the "
            "maximum is " + " / ".join(f"{1e3 * x:.1f} ms" for x in op_max)
            + (": a single operator of a long prompt (gate_up_proj or attention over 15k-30k tokens) runs that "
               "long on one A800 in the roofline, and a preemption must wait for it. Fig. 12 plots averages, so "
               f"the paper's \"all below {lim} ms\" may refer to them; chunking (Fig. 15) is what bounds the "
               "maximum." if over else f", below {lim} ms as well.")
            + f" Layer-level blocking is {fmt_range(br)} the operator-level mean "
            f"({_cmp(br, 'layer_over_op')}): a layer has five operators of unequal length.")
    return out


def _ablations(res: Results) -> list[str]:
    out = []
    if res.priority:
        g = {n: t[0].value for n, t in res.priority.items()}
        sl = {n: t[1].value for n, t in res.priority.items()}
        if not any(v > 0 for v in g.values()):
            out.append("- **Fig. 10**: no priority variant met the target at any rate of the grid; nothing to rank.")
        else:
            best_g = max(g, key=lambda n: g[n])
            met = [n for n in sl if math.isfinite(sl[n])]
            tight = [n for n in met if sl[n] == min(sl[m] for m in met)]
            best_s = tight[0] if len(tight) == 1 else "no single variant" if tight else "none"
            out.append(f"- **Fig. 10**: the highest goodput is {best_g}'s and the tightest SLO is {best_s}'s "
                       + ("(as in the paper: S-EDF wins both)" if best_g == best_s == "S-EDF" else
                          "(the paper has S-EDF winning both)")
                       + f"; S-EDF over EDF {fmt_x(ratio(g['S-EDF'], g['EDF']))} in goodput, over D-EDF "
                       f"{fmt_x(ratio(g['S-EDF'], g['D-EDF']))}.")
    if res.budget:
        last = {n: pts[-1] for n, pts in res.budget.items()}
        thr = _finite(t for _, _, t in last.values())
        if thr and max(thr) > 0:
            spread = (max(thr) - min(thr)) / max(thr)
            worst = min(last, key=lambda n: last[n][1])
            order = [last[n][1] for n in ("2K", "4K", "8K", "no limit") if n in last]
            falls = len(order) > 1 and order[0] > order[-1] and all(a >= b for a, b in zip(order, order[1:]))
            out.append(
                f"- **Fig. 11**: at the highest rate the throughputs of all budgets are within {spread:.1%} of each "
                "other" + (". In the roofline a prefill of a few hundred tokens already saturates the A800's "
                           "compute, so batching short prompts saves only per-step fixed costs; the real GPU gains "
                           "more from it, which is what makes the paper's no-batching curve the lowest"
                           if spread < SPREAD else "") +
                f". The lowest attainment at that rate is \"{worst}\"'s; "
                + ("attainment falls from 2K to 4K, 8K and no limit, as in the paper: a bigger batch delays "
                   "its head." if falls else "attainment does not fall steadily with the budget there "
                   "(the paper: larger budgets raise the SLO-violation risk)."))
    if res.chunk:
        v = {n: t.value for n, t in res.chunk.items()}
        best, worst = max(v, key=lambda n: v[n]), min(v, key=lambda n: v[n])
        if not v[best] > 0:
            out.append("- **Fig. 15**: no chunk size met the target at any rate of the grid; nothing to rank.")
        else:
            inner = best not in ("no chunking", "16K", "2K")
            out.append(f"- **Fig. 15**: the best chunk size here is {best} "
                       + ("(an intermediate size, as in the paper)" if inner else
                          "(the paper finds an intermediate size best)")
                       + f"; the worst is {worst} (the paper: 2K and 16K both hurt)."
                       + (" With operator-level preemption already bounding the blocking time, chunking adds "
                          "per-step costs and re-reads the history's KV in attention, while what it takes off the "
                          "longest operators matters little against TTFT SLOs of a quarter second and more."
                          if best == "no chunking" else ""))
    return out


def differences(res: Results, ratios: dict[str, list[float]], blocking_ratios: list[float]) -> str:
    items = _baselines(res, ratios) + _slo(res, ratios) + _system(res, blocking_ratios) + _ablations(res)
    beats = bool(res.e2e) and all(m.goodput["vLLM-CP2K (colocated)"].value > max(m.goodput[n].value for n in
                                                                ("DistServe", "DistServe-CP2K", "DistServe-CP8K"))
                for m in res.e2e)
    items.append("- **vLLM colocated** is not the paper's §6.5 setup (intra-PD on half the GPUs, TTFT SLOs ×3, TBT "
                 "SLOs): here it has both instances, each prefilling, so twice the prefill capacity of the 1P1D "
                 "systems" + (", which is why it beats the registry DistServe variants on every model" if beats
                              else "") + f"; FlowPrefill's goodput is {fmt_range(ratios['goodput/vLLM-CP2K (colocated)'])} its.")
    return "\n".join(items)


def not_reproduced() -> str:
    """The "figures not reproduced" section, generated from the figure registry."""
    from flowyard.experiments.figures import not_built_section

    return not_built_section("flowprefill", notes=[
        "- The paper's scheduling-round counts are event counts of its runtime, not of a simulator: not compared."])


def cost_figures(hardware: str) -> str:
    """Figs. 3 and 4 of the paper (Llama3-8B prefill alone) priced by the cost model the runs use:
    no simulation is needed, a lone prefill's time is the sum of its steps."""
    from flowyard.core.plan import BatchShape
    from flowyard.sim.run import SimConfig, build_cost_model

    cm = build_cost_model(SimConfig(model="llama-3-8b", hardware=hardware))
    n = 32768
    rows3 = []
    for c in (512, 1024, 2048, 4096, 8192, 16384, 32768):
        t = sum(float(cm.step_time(BatchShape.of([(s, min(c, n - s))], []))) for s in range(0, n, c))
        rows3.append((c, t, n / t))
    rows4 = [(L, float(cm.prefill_time(L))) for L in (1024, 2048, 4096, 8192, 16384, 32768)]
    slow = rows3[0][1] / rows3[-1][1]
    return "\n".join([
        f"**Fig. 3** (a 32K-token prompt prefilled in chunks, Llama3-8B on one simulated {hardware}): chunk size "
        "→ TTFT (s), throughput (tokens/s): " + "; ".join(f"{c:,} → {t:.2f} s, {x:,.0f}" for c, t, x in rows3)
        + f". 512-token chunks take {slow:.2f}× as long as one pass"
        + (": each chunk re-reads the history's KV and pays a step's fixed costs, the paper's argument against "
           "small chunks." if slow > 1 else "."),
        "",
        "**Fig. 4** (a lone prefill by input length): length → TTFT (ms), throughput (tokens/s), TTFT per 1K "
        "tokens (ms): " + "; ".join(f"{L:,} → {1e3 * t:.0f}, {L / t:,.0f}, {1e6 * t / L:.1f}" for L, t in rows4)
        + (". Throughput falls with length as attention's quadratic share grows, the shape the paper plots"
           if rows4[-1][0] / rows4[-1][1] < rows4[0][0] / rows4[0][1] else ". Throughput does not fall with length "
           "here, unlike the paper's plot") + " (its figure gives no values to compare)."])
