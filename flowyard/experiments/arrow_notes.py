"""Prose of the Arrow report: where and why ours differ from the paper. Every number and every
claim that depends on the outcome is computed from the `Results` passed in (or from the cost
model the runs used); the typed-in numbers are the paper's (`PAPER*`), labelled as such."""

from __future__ import annotations

import math

from flowyard.core.plan import BatchShape
from flowyard.experiments.arrow import (ABLATION, ARROW, DISAGG, HARDWARE, MODEL, VLLM, VLLM_DP, Results, Search,
                                        window)
from flowyard.experiments.common import fmt_x, ratio
from flowyard.sim.run import DEFAULT_SLOS, SimConfig, build_cost_model

#: §7.2: Arrow's sustainable rate over (vLLM, vLLM-disaggregated) per trace
PAPER = {"azure-code": (5.62, 7.78), "burstgpt": (3.60, 5.04), "azure-conv": (3.76, 4.06),
         "mooncake-conv": (3.73, 4.14)}
#: §7.3: SLO-aware over minimal load (rate), minimal load over round robin (attainment points, "up to")
PAPER_ABLATION: dict[str, tuple[str, float]] = {"azure-code": ("1.67×", 4.3), "azure-conv": ("1.1× (≈ +10 req/s)", 2.4)}
SLO_AWARE, MINLOAD, RR = list(ABLATION)


def _tpot_slo(trace: str) -> float:
    """The trace's default TPOT SLO (s); every trace Arrow runs has one."""
    tpot = DEFAULT_SLOS[trace].tpot
    assert tpot is not None, f"{trace} has no default TPOT SLO"
    return tpot


def goodput_ratio(a: Search, b: Search) -> tuple[float, str]:
    """Goodput ratio a/b and its qualifier: capped searches give bounds."""
    x, y = a.goodput, b.goodput
    v = ratio(x.value, y.value)
    if x.capped and y.capped:
        return v, "~"  # both beyond the grid: unknown
    return v, "≥ " if x.capped or (y.never_met and x.value > 0) else ("≤ " if y.capped else "")


def ratio_text(a: Search, b: Search) -> str:
    v, q = goodput_ratio(a, b)
    if q == "~":
        return "n/a (both capped)"
    return "∞ (never met)" if math.isinf(v) else q + fmt_x(v)


def differences(res: Results) -> str:
    c1, c8 = (build_cost_model(SimConfig(model=MODEL, hardware=HARDWARE, tp=tp)) for tp in (1, 8))
    sp = " / ".join(f"{c1.prefill_time(n) / c8.prefill_time(n):.1f}×" for n in (2048, 8192, 32768, 100_000))
    by = {w.spec.trace: w for w in res.workloads}

    def vs(base: str) -> str:
        return ", ".join(f"{w.spec.label} {ratio_text(w.systems[ARROW], w.systems[base])}" for w in res.workloads)

    def below_paper(base: int, name: str) -> list[str]:
        """Traces whose ratio of Arrow over `name` is (an exact number or an upper bound) under the paper's."""
        out = []
        for w in res.workloads:
            v, q = goodput_ratio(w.systems[ARROW], w.systems[name])
            pv = PAPER.get(w.spec.trace)
            if pv and math.isfinite(v) and v > 0 and q in ("", "≤ ") and v < pv[base]:
                out.append(w.spec.label)
        return out

    papered = [w for w in res.workloads if w.spec.trace in PAPER]
    low = below_paper(1, DISAGG)
    out = [f"- **Healthy disaggregated baselines.** Arrow over vLLM-disagg. 1P1D: {vs(DISAGG)}; over DistServe "
           f"4P4D: {vs('DistServe 4P4D')}. In the paper both were held back by their implementations: vLLM "
           "v0.7.3's PD mode overflowed its KV-transfer buffer (the authors enlarged it and limited the batch "
           "size) and failed above 25 req/s on Azure Conversation and beyond the lowest rate on Mooncake; "
           "DistServe ran out of memory and never met the SLOs. Our `distserve` runs on the same roofline, "
           "KV links and batching as every other system, so only its static split separates it from Arrow"
           + (f"; our ratio over vLLM-disagg. is below the paper's on {len(low)} of {len(papered)} traces"
              + (f" ({', '.join(low)})" if low else "") if papered else "") + "."]
    margin = {w.spec.trace: goodput_ratio(w.systems[ARROW], w.systems[VLLM])[0] for w in res.workloads}
    margin = {k: v for k, v in margin.items() if math.isfinite(v) and v > 0}
    least = min(margin, key=lambda k: margin[k]) if margin else None
    out.append(f"- **vLLM at TP8.** In our roofline one TP8 instance prefills {sp} faster than one TP1 GPU on "
               "2k / 8k / 32k / 100k-token prompts: well under eight TP1 instances on short prompts, closer to "
               "them on long ones such as Mooncake's (mean 14k tokens, up to 126k), where TP8 also has eight "
               "GPUs' KV memory in one instance and the 30 s TTFT SLO is loose."
               + (f" Arrow's margin over vLLM is smallest on {by[least].spec.label} here ({fmt_x(margin[least])}"
                  + (f"; the paper's {PAPER[least][0]:.2f}×" if least in PAPER else "") + ")"
                  + (", as the TP8 scaling predicts." if least == "mooncake-conv" else ".") if least else ""))
    dp = [(w, goodput_ratio(w.systems[VLLM_DP], w.systems[VLLM])) for w in res.workloads if VLLM_DP in w.systems]
    if dp:
        better = [w.spec.label for w, (v, q) in dp if math.isfinite(v) and v > 1 and q != "≤ "]
        out.append("- **vLLM as deployed: 8 data-parallel TP1 instances against one TP8.** DP8's goodput over "
                   "TP8's: " + ", ".join(f"{w.spec.label} {ratio_text(w.systems[VLLM_DP], w.systems[VLLM])}"
                                         for w, _ in dp)
                   + f"; Arrow over DP8: {vs(VLLM_DP)}. "
                   + (f"DP8 is the stronger vLLM baseline on {', '.join(better)}, so the paper's ratios over "
                      "TP8 overstate Arrow's gain over vLLM as it is usually deployed there."
                      if better else "TP8 is the stronger vLLM baseline on every trace here, so the paper's "
                      "choice of baseline does not inflate Arrow's gain."))
    tp = [f"{w.spec.label} {1e3 * w.systems[ARROW].points[w.table_rate].tpot_p90:.0f} ms (SLO "
          f"{1e3 * _tpot_slo(w.spec.trace):g})" for w in res.workloads]
    step = [1e3 * float(c1.step_time(BatchShape.of([], [ctx] * n))) for n, ctx in ((8, 1024), (128, 2048))]
    slos = sorted({1e3 * _tpot_slo(w.spec.trace) for w in res.workloads})
    binds = step[-1] >= 0.5 * slos[0] if slos else True
    out.append("- **TTFT or TPOT?** Arrow's P90 TPOT at each table rate: " + ", ".join(tp) + ". "
               f"A decode step of the 8B model on one simulated {HARDWARE} takes {step[0]:.0f} ms (8 sequences at "
               f"1k context) to {step[1]:.0f} ms (128 at 2k), against TPOT SLOs of "
               + "-".join(f"{v:g}" for v in slos) + " ms: "
               + ("TPOT binds only under overload, so the misses at the table rates are mostly TTFT misses "
                  "(TTFT met / TPOT met columns)." if not binds else
                  "steps come close to the SLO, so TPOT binds too (TTFT met / TPOT met columns)."))
    over = [f"{w.spec.label} {x:g} req/s: {1e3 * p.tpot_p90:.0f} ms" for w in res.workloads
            for x, p in sorted(w.systems[ARROW].points.items()) if p.tpot_p90 > _tpot_slo(w.spec.trace)]
    if not over:
        out.append("- **Decode load.** Arrow's P90 TPOT stayed within the SLO at every rate of this run, so its "
                   "overload rule (favour decode) was not put to the test here.")
    else:
        out.append("- **Looks wrong in the Arrow policy: decode load that Alg. 2 does not see.** Past the goodput "
                   "Arrow's P90 TPOT exceeds the SLO (" + "; ".join(over) + "), where the "
                   "overload rule should favour decode (the paper: TPOT stays near the SLO). Traced on Azure "
                   "Conversation: Alg. 2 ranks D instances by the tokens of their *running* requests and admits "
                   "while those stay under Max Running Tokens, so a D instance at its 256-sequence batch limit, "
                   "whose running tokens stay flat while KV migrations queue behind it, remains the least loaded "
                   "and keeps receiving decodes; its token interval (steps of the 256 running) never trips the "
                   "monitor and nothing flips towards decode. Traced on Mooncake: with the D instances' KV full, "
                   "decodes go to P→D instances that still hold long queued prompts, and every step there carries "
                   "a 2048-token chunk over a long history.")
    out.append("- **Also in the policy: queued prompts stay where they were sent.** Alg. 1, the paper's only "
               "path from decode to prefill, runs on arrivals, while Alg. 2 and the monitor move instances to "
               "decode (the overload rule). Our monitor flips P→D instances holding stranded prompts back, but "
               "queued prefills are never re-dispatched: under overload Arrow can end with one or two P "
               "instances holding all queued prompts and, once arrivals stop, drains them there while D "
               "instances idle: the far right of the P90 TTFT panels.")
    if "burstgpt" in by:
        wl = window(by["burstgpt"].spec, res.seed)
        slow = sum(r.slo.ttft is not None and c1.prefill_time(r.prompt_len) > r.slo.ttft for r in wl.requests)
        out.append(f"- **BurstGPT.** The 400-row public head replaces the paper's 6,009-request clip, so the "
                   f"rates differ and few bursts decide the goodput. {slow} of its {len(wl)} prompts take longer "
                   "than the 0.25 s TTFT SLO to prefill alone on one GPU: on TP1 instances (Arrow, DistServe) "
                   "they always miss, while TP4/TP8 meet them when idle.")
    if res.scale:
        w = by[res.settings.scale_trace]
        span = [(k, w.spec.duration or 0, res.scale[k][SLO_AWARE].goodput.value) for k in sorted(res.scale)]
        mins = [x.spec.duration / 60 for x in res.workloads if x.spec.duration]
        per = [g / k for k, _, g in span]
        faster = len(per) > 1 and per[0] > 0 and all(a < b for a, b in zip(per, per[1:]))
        out.append("- **Windows and compressed bursts.** Our windows are "
                   + (f"{min(mins):g}–{max(mins):g} min" if mins else "whole traces") + ", not the paper's hour "
                   "(see Setup), and Arrow's method compresses them: at Arrow's goodput the "
                   f"{w.spec.label} window lasts " + " / ".join(
                       f"{d * w.base_rate / g:.0f} s" if g > 0 else "n/a" for _, d, g in span)
                   + f" on {'/'.join(str(k) for k, _, _ in span)} GPUs. The TTFT SLO does not shrink with it, so "
                   "a burst of a given size costs less TTFT the faster the cluster"
                   + (": goodput grows faster than the GPU count here (" + " / ".join(f"{x:.2f}" for x in per)
                      + " req/s per GPU), where the paper reports nearly linear gains in attainment."
                      if faster else "; in this run goodput per GPU does not grow with the GPU count ("
                      + " / ".join(f"{x:.2f}" for x in per) + " req/s per GPU)."))
    return "\n".join(out)


def not_reproduced() -> str:
    """The "figures not reproduced" section, generated from the figure registry."""
    from flowyard.experiments.figures import not_built_section

    return not_built_section("arrow")

