"""The "where and why ours differ" section of the FlowPrefill report.

The explanations are ours (mechanisms of the simulator, the workload and the baselines); every
number in them, and every "higher"/"lower"/"matches", is computed from the run's `Results`.
"""

from __future__ import annotations

import math

from flowyard.experiments.common import fmt_range, fmt_x, ratio
from flowyard.experiments.flowprefill import Results

FP = "FlowPrefill"


def _cmp(v: list[float], lo: float | None, hi: float) -> str:
    v = [x for x in v if math.isfinite(x)]
    if not v:
        return "not measurable"
    if max(v) > hi * 1.05:
        return "above the paper's"
    if lo is not None and min(v) < lo * 0.95:
        return "below the paper's" if max(v) < lo else "partly below the paper's"
    return "consistent with the paper's"


def _baselines(res: Results, r: dict[str, list[float]]) -> list[str]:
    cp_vs_ds = [ratio(m.goodput["DistServe-CP2K"].value, m.goodput["DistServe"].value) for m in res.e2e]
    over_c = [m.goodput[FP].value / m.capacity for m in res.e2e]
    ds_c = [m.goodput[n].value / m.capacity for m in res.e2e for n in ("DistServe", "DistServe-CP2K", "DistServe-CP8K")]
    tasks = res.e2e[0].fp_tasks if res.e2e else {}
    out = [
        "- **The chunked-prefill baselines' preemption points.** As the registry runs them (`distserve-cp2k`, "
        "`distserve-cp8k`, vLLM's scheduler), a prompt that has started keeps its turn until its last "
        "chunk and EDF only orders the waiting queue, so a 0.25 s text request that arrives behind a "
        "6,000-token search prompt still waits for all of it. Chunking then buys almost nothing: "
        f"DistServe-CP2K sustains {fmt_range(cp_vs_ds)} DistServe's goodput here, and FlowPrefill's ratio "
        f"over it ({fmt_range(r['goodput/DistServe-CP2K'])}) is "
        f"{_cmp(r['goodput/DistServe-CP2K'], None, 2.0)} (up to 2.0×). The paper credits CP2K with "
        "\"finer-grained preemption\", i.e. re-ranking at chunk boundaries; our *EDF per chunk* "
        f"variants do that, and against them the ratios are {fmt_range(r['goodput/CP2K, EDF per chunk'])} "
        f"for 2K ({_cmp(r['goodput/CP2K, EDF per chunk'], None, 2.0)} up to 2.0×) and "
        f"{fmt_range(r['goodput/CP8K, EDF per chunk'])} for 8K "
        f"({_cmp(r['goodput/CP8K, EDF per chunk'], None, 4.5)} up to 4.5×). Which of the two the paper "
        "ran on vLLM-0.11.2 is not stated; the EDF-per-chunk variant is the closer reading of its text. "
        "It is emulated with FlowPrefill's pool, so its small prompts are batched under Alg. 1's "
        "deadline check instead of being packed to the token budget.",
        f"- **DistServe (FCFS)**: ours {fmt_range(r['goodput/DistServe'])}, "
        f"{_cmp(r['goodput/DistServe'], 4.7, 5.6)} 4.7×–5.6×. FCFS misses text SLOs even at low load "
        "whenever a text request queues behind a long prompt, and our arrivals are bursty (the re-timed "
        f"Azure trace has inter-arrival CV {res.arrival_cv:.2f}), so DistServe and both registry CP "
        f"baselines fall below 90 % at {fmt_range(ds_c).replace('×', '')} of the prefill capacity C.",
        f"- **FlowPrefill beyond capacity.** FlowPrefill's goodput is {fmt_range(over_c)} C. Attainment "
        "counts requests, and S-EDF lets long prompts whose deadline is already out of reach (search and "
        "file: 24 % of the requests but about three quarters of the prompt tokens) fall behind while short "
        "ones stay on time"
        + (f"; at its goodput on {res.e2e[0].label} the per-task attainment is "
           + ", ".join(f"{k} {v:.0%}" for k, v in tasks.items()) if tasks else "")
        + ". The paper describes the same mechanism (§6.2); how far past C it carries depends on the "
        "task mix and on how exact the TTFT predictions are (next point).",
    ]
    return out


def _slo(res: Results, r: dict[str, list[float]]) -> list[str]:
    fp_min = [m.min_slo[FP].value for m in res.e2e]
    sens = ""
    if res.sensitivity and res.e2e:
        m = res.e2e[0]
        sens = ("; on " + m.label + " the CP2K ratio is " + ", ".join(
            f"{fmt_x(ratio(t['DistServe-CP2K'].value, t[FP].value))} at {f:g} C" for f, t in sorted(res.sensitivity.items()))
            + f" against {fmt_x(r['slo/DistServe-CP2K'][0])} at the rate used above")
    return [
        f"- **Tighter SLOs**: ours {fmt_range(r['slo/DistServe-CP2K'])} vs CP2K "
        f"({_cmp(r['slo/DistServe-CP2K'], 1.5, 2.3)} 1.5×–2.3×) and {fmt_range(r['slo/DistServe-CP8K'])} vs "
        f"CP8K ({_cmp(r['slo/DistServe-CP8K'], 2.1, 3.1)} 2.1×–3.1×); against the EDF-per-chunk variants "
        f"{fmt_range(r['slo/CP2K, EDF per chunk'])} and {fmt_range(r['slo/CP8K, EDF per chunk'])}. The "
        "paper does not give the fixed rate of its SLO sweep, and the ratio grows with it because the "
        f"baselines' minimum scale grows with load while FlowPrefill's ({fmt_range(fp_min).replace('×', '')}) "
        "is set by how long the longer text prompts take to prefill alone" + sens + ".",
    ]


def _system(res: Results, br: list[float]) -> list[str]:
    b = res.blocking or {}
    op_max = [g["operator"]["max"] for g in b.values()]
    return [
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
        "not the paper's absolute req/s.",
        "- **Blocking time.** The operator-level mean is "
        + " / ".join(f"{1e3 * g['operator']['mean']:.2f} ms" for g in b.values())
        + " (paper: below 4.5 ms), but the maximum is "
        + " / ".join(f"{1e3 * x:.1f} ms" for x in op_max)
        + ": a single operator of a long prompt (gate_up_proj or attention over 15k–30k tokens) runs for "
        "tens of milliseconds on one A800 in the roofline, and a preemption must wait for it. Fig. 12 "
        "plots averages, so the paper's \"all below 4.5 ms\" may refer to them; chunking (Fig. 15) is "
        f"what bounds the maximum. Layer-level blocking is {fmt_range(br)} the operator-level mean "
        f"({_cmp(br, 3.5, 4.2)} 3.5×–4.2×): a layer has five operators of unequal length.",
    ]


def _ablations(res: Results) -> list[str]:
    out = []
    if res.priority:
        g = {n: t[0].value for n, t in res.priority.items()}
        s = {n: t[1].value for n, t in res.priority.items()}
        best_g, best_s = max(g, key=g.get), min(s, key=s.get)
        out.append(f"- **Fig. 10**: the highest goodput is {best_g}'s and the tightest SLO {best_s}'s "
                   + ("(as in the paper: S-EDF wins both)" if best_g == best_s == "S-EDF" else
                      "(the paper has S-EDF winning both)")
                   + f"; S-EDF over EDF {fmt_x(ratio(g['S-EDF'], g['EDF']))} in goodput, over D-EDF "
                   f"{fmt_x(ratio(g['S-EDF'], g['D-EDF']))}.")
    if res.budget:
        last = {n: pts[-1] for n, pts in res.budget.items()}
        thr = [t for _, _, t in last.values()]
        worst = min(last, key=lambda n: last[n][1])
        order = [last[n][1] for n in ("2K", "4K", "8K", "no limit") if n in last]
        mono = all(a >= b for a, b in zip(order, order[1:]))
        out.append("- **Fig. 11**: at the highest rate the throughputs of all budgets are within "
                   f"{(max(thr) - min(thr)) / max(thr):.1%} of each other. In the roofline a prefill of a few "
                   "hundred tokens already saturates the A800's compute, so batching short prompts saves only "
                   "per-step fixed costs; the real GPU gains more from it, which is what makes the paper's no-"
                   f"batching curve the lowest. The lowest attainment at that rate is \"{worst}\"'s; "
                   + ("attainment falls from 2K to 4K, 8K and no limit, as in the paper: a bigger batch delays "
                      "its head." if mono else "attainment does not fall monotonically with the budget there "
                      "(the paper: larger budgets raise the SLO-violation risk)."))
    if res.chunk:
        v = {n: t.value for n, t in res.chunk.items()}
        best, worst = max(v, key=v.get), min(v, key=v.get)
        inner = best not in ("no chunking", "16K", "2K")
        out.append(f"- **Fig. 15**: the best chunk size here is {best} "
                   + ("(an intermediate size, as in the paper)" if inner else
                      "(the paper finds an intermediate size best)")
                   + f"; the worst is {worst} (the paper: 2K and 16K both hurt). With operator-level preemption "
                   "already bounding the blocking time, chunking adds per-step costs and re-reads the history's "
                   "KV in attention, while the tens of milliseconds it takes off the longest operators matter "
                   "little against TTFT SLOs of a quarter second and more.")
    return out


def differences(res: Results, ratios: dict[str, list[float]], blocking_ratios: list[float]) -> str:
    items = _baselines(res, ratios) + _slo(res, ratios) + _system(res, blocking_ratios) + _ablations(res)
    beats = all(m.goodput["vLLM-CP2K (colocated)"].value > max(m.goodput[n].value for n in
                                                                ("DistServe", "DistServe-CP2K", "DistServe-CP8K"))
                for m in res.e2e)
    items.append("- **vLLM colocated** is not the paper's §6.5 setup (intra-PD on half the GPUs, TTFT SLOs ×3, TBT "
                 "SLOs): here it has both instances, each prefilling, so twice the prefill capacity of the 1P1D "
                 "systems" + (", which is why it beats the registry DistServe variants on every model" if beats
                              else "") + f"; FlowPrefill's goodput is {fmt_range(ratios['goodput/vLLM-CP2K (colocated)'])} its.")
    items.append("- **Not reproduced**: Fig. 13 (TTFT prediction: exact by construction here), Fig. 14 "
                 "(single-SLO ShareGPT), Fig. 16 (intra-PD colocation with TBT SLOs), Fig. 17 (MoE "
                 "Qwen3-30B-A3B is not in the model catalog) and the scheduling-round counts.")
    return "\n".join(items)
