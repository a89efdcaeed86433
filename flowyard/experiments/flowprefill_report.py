"""The write-up of `flowyard reproduce flowprefill`: markdown, figures and a JSON of every curve.

Every number in the report comes from the `Results` passed in; the only typed-in numbers are
the paper's (`PAPER`), always labelled as such.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path

from flowyard.experiments.common import (Report, Threshold, band_verdict, bar_panel, curve_panel, figure,
                                         fmt_ms, fmt_range, fmt_x, ratio, save, source_revision)
from flowyard.experiments.flowprefill import (HARDWARE, MODELS, PRIMARY, SENSITIVITY_SYSTEMS, SYSTEMS, TARGET,
                                              Results)
from flowyard.experiments.figures import NOT_BUILT_HEADING
from flowyard.experiments.flowprefill_moe_report import moe_json, moe_section
from flowyard.experiments.flowprefill_plots import goodput_and_slo_figure
from flowyard.experiments.flowprefill_coloc import PAPER_TBT_UP_TO, tbt_verdict, write_section
from flowyard.experiments.flowprefill_coloc import to_json as coloc_json
from flowyard.experiments.flowprefill_notes import PAPER, PAPER_OP_BLOCKING_MAX_MS, cost_figures, differences, not_reproduced

FP = "FlowPrefill"
LABELS = {m: label for m, _, label in MODELS}
#: baseline label -> (paper's goodput claim key, paper's SLO claim key)
CLAIMS: dict[str, tuple[str | None, str | None]] = {"DistServe": ("goodput_vs_distserve", None),
          "DistServe-CP2K": ("goodput_vs_cp2k", "slo_vs_cp2k"), "CP2K, EDF per chunk": ("goodput_vs_cp2k", "slo_vs_cp2k"),
          "DistServe-CP8K": ("goodput_vs_cp8k", "slo_vs_cp8k"), "CP8K, EDF per chunk": ("goodput_vs_cp8k", "slo_vs_cp8k")}


def below(seconds: list[float], limit_ms: float) -> str:
    """The verdict on a paper's upper bound: "within" only when every value was measured (a run
    with no preemption has nothing to compare, so it does not pass)."""
    if not seconds or any(not (math.isfinite(x) and x > 0) for x in seconds):
        return "not measured (no preemption)"
    worst = 1e3 * max(seconds)
    return f"within (all < {limit_ms} ms)" if worst < limit_ms else f"above ({worst:.1f} ms ≥ {limit_ms} ms)"


def _paper(lo: float | None, hi: float) -> str:
    return f"up to {hi}×" if lo is None else f"{lo}×–{hi}×"


def _ratios(res: Results) -> dict[str, list[float]]:
    """Per model: FlowPrefill's goodput over each baseline's, each baseline's min SLO over ours."""
    out: dict[str, list[float]] = {}
    for m in res.e2e:
        for name in SYSTEMS:
            if name != FP:
                out.setdefault(f"goodput/{name}", []).append(ratio(m.goodput[FP].value, m.goodput[name].value))
                out.setdefault(f"slo/{name}", []).append(ratio(m.min_slo[name].value, m.min_slo[FP].value))
    return out


def _blocking_ratios(res: Results) -> list[float]:
    return [ratio(g["layer"]["mean"], g["operator"]["mean"]) for g in (res.blocking or {}).values()]


def _headline(res: Results, rep: Report) -> None:
    r, models = _ratios(res), ", ".join(m.label for m in res.e2e)
    op_max = max((g["operator"]["max"] for g in (res.blocking or {}).values()), default=math.nan)
    rows = []
    for i, what in ((0, "goodput vs"), (1, "tighter SLO than")):
        for base, keys in CLAIMS.items():
            key = keys[i]
            if key is None:
                continue
            lo, hi = PAPER[key]
            v = r[("goodput/" if i == 0 else "slo/") + base]
            rows.append([f"{what} {base}", _paper(lo, hi), " / ".join(fmt_x(x) for x in v), band_verdict(v, lo, hi)])
    lo, hi = PAPER["layer_over_op"]
    br = _blocking_ratios(res)
    b = res.blocking or {}
    op_means = [g["operator"]["mean"] for g in b.values()]
    lim = PAPER_OP_BLOCKING_MAX_MS
    rows.append(["operator-level blocking time, mean per model", f"< {lim} ms (Fig. 12 plots means)",
                 " / ".join(f"{fmt_ms(x)} ms" for x in op_means), below(op_means, lim)])
    rows.append(["operator-level blocking time, every preemption", f"< {lim} ms (\"all observed\")",
                 f"max {fmt_ms(op_max)} ms; " + " / ".join(f"{g['operator']['below_4.5ms']:.0%}" for g in b.values())
                 + " of them below", below([op_max], lim)])
    rows.append(["layer- over operator-level mean blocking", _paper(lo, hi),
                 " / ".join(fmt_x(x) for x in br), band_verdict(br, lo, hi)])
    if res.colocation is not None:
        rows.append(["Fig. 16 colocated: TBT attainment vs vLLM-CP2K (Llama3-8B, one instance)",
                     f"up to {PAPER_TBT_UP_TO}×", " / ".join(fmt_x(x) for x in res.colocation.ratios("tbt")),
                     tbt_verdict(res.colocation)])
    rep.add("## Headline: the paper's numbers beside ours",
            f"Ours per model ({models}; blocking: {', '.join(LABELS[m] for m in res.blocking or {})}).")
    rep.table(["claim (FlowPrefill …)", "paper", "ours", "ours vs paper"], rows)


def _setup(res: Results, rep: Report) -> None:
    s = res.settings
    rep.add("## Setup", "\n".join([
        f"- **Hardware**: simulated A800-SXM4-80GB (`--hardware {HARDWARE}`: 312 TFLOPS bf16, 2.0 TB/s "
        "HBM, 200 GB/s NVLink), priced by flowyard's per-operator roofline calibrated on measured A100 "
        "operator times. Two instances per model, each of TP GPUs: Llama3-8B TP1, Qwen2.5-14B TP2, "
        "Llama3-70B TP4 (catalog `llama-3-8b`, `qwen2.5-14b`, `llama-3-70b`).",
        f"- **Workload**: the QwenTrace stand-in `qwentrace_like` ({s.n_requests} requests, seed "
        f"{res.seed}): the task mix and prompt-length statistics of Table 1 (text 68 %, image 8 %, search "
        "20 %, file 4 %), each task's TTFT SLO from Table 2 for the model, 16 output tokens, and "
        "arrivals taken from consecutive timestamps of the Azure LLM conversation trace, rescaled to "
        "the requested mean rate (its burstiness kept). The same requests are replayed at every rate.",
        "- **Metric**: TTFT SLO attainment = share of all requests whose TTFT meets their task's SLO "
        "(FlowPrefill's metric; it only schedules prefill, so no decode SLO is set or counted). "
        f"Goodput = highest rate with attainment ≥ {TARGET:.0%}; min SLO scale = smallest factor on "
        f"all Table 2 SLOs with attainment ≥ {TARGET:.0%} at a fixed rate. Both are found by "
        "evaluating the plotted grid, then bisecting the first crossing of the target "
        f"(relative tolerance {s.tol:.0%}); vertical dotted lines in the figures mark them.",
        "- **Rates** are set relative to one instance's *prefill capacity* C = 1 / (mean time to "
        f"prefill one prompt alone) of each model: rate grid {', '.join(f'{f:g}' for f in s.rate_fracs)} × C; "
        f"The SLO sweep (Fig. 9b) runs at the goodput of {PRIMARY}, the paper's primary baseline (the "
        "rate at which it just meets Table 2's SLOs, so its min SLO scale is ≤ 1), since the paper does "
        "not give its fixed rate; the ratios at other fixed rates follow the table of Fig. 9. The "
        f"blocking runs (Fig. 12) are at {s.blocking_rate_frac:g} × C.",
        "- **Systems**: `flowprefill` (1P1D; prefill: S-EDF, SLO-aware batching with budget 4K, "
        "operator-level preemption; decode: continuous batching), `distserve` (1P1D, FCFS whole "
        "prompts), `distserve-cp2k` / `distserve-cp8k` (1P1D, chunked prefill 2048 / 8192 with EDF, "
        "scheduled as vLLM does: a prompt that has started keeps its turn until its last chunk, EDF "
        "orders only the waiting queue), *CP2K / CP8K, EDF per chunk* (the same chunk sizes, but "
        "every chunk boundary re-ranks all prompts by EDF, partial ones included, which is the "
        "chunk-level preemption the paper credits its CP baselines with; run by FlowPrefill's "
        "execution pool at `granularity=\"chunk\"`, EDF, budget of one chunk, so small prompts are "
        "batched with Alg. 1's deadline check rather than filled to the budget), and `vllm` "
        "(vLLM-CP2K: both instances colocated, data parallel, chunked prefill 2048, decode first). "
        "The paper compared colocation differently (§6.5: intra-PD on half the GPUs with 3× the "
        "SLOs and TBT SLOs); ours gives vLLM the same two instances and the same SLOs, so its "
        "prefill capacity is twice that of any 1P1D system.",
    ]))


def _fig9(res: Results, rep: Report) -> None:
    rep.add("## End-to-end (Fig. 9)")
    for m in res.e2e:
        file = f"fig9_{m.model}.png"
        goodput_and_slo_figure(m, file, rep)
        rows = [[n, m.goodput[n].text(), fmt_x(ratio(m.goodput[FP].value, m.goodput[n].value)),
                 m.min_slo[n].text(), fmt_x(ratio(m.min_slo[n].value, m.min_slo[FP].value))] for n in SYSTEMS]
        rep.add(f"### {m.label} (C = {m.capacity:.2f} req/s; SLO sweep at {m.slo_rate:.2f} req/s)")
        rep.table(["system", "goodput (req/s)", "FlowPrefill / system", "min SLO scale",
                   "system / FlowPrefill"], rows)
        rep.image(file, f"Fig. 9 {m.label}")
    r = _ratios(res)
    rep.add("### Ratios across models",
            "FlowPrefill's goodput over each baseline's, and each baseline's min SLO scale over "
            "FlowPrefill's (how much tighter an SLO FlowPrefill meets):")
    def claim(n: str, i: int) -> str:
        key = CLAIMS.get(n, (None, None))[i]
        return "—" if key is None else _paper(*PAPER[key])

    rep.table(["baseline", "goodput ratio", "paper", "SLO ratio", "paper"],
              [[n, fmt_range(r[f"goodput/{n}"]), claim(n, 0), fmt_range(r[f"slo/{n}"]), claim(n, 1)]
               for n in SYSTEMS if n != FP])


def _sensitivity(res: Results, rep: Report) -> None:
    if not res.sensitivity or not res.e2e:
        return
    m, bases = res.e2e[0], SENSITIVITY_SYSTEMS[1:]

    def row(label: str, t: dict[str, Threshold]) -> list[str]:
        return [label, t[FP].text()] + [f"{t[n].text()} ({fmt_x(ratio(t[n].value, t[FP].value))})" for n in bases]

    rows = [row(f"{m.slo_rate:.2f} ({m.slo_rate / m.capacity:.2f} C, {PRIMARY} goodput)", m.min_slo)]
    rows += [row(f"{f * m.capacity:.2f} ({f:g} C)", t) for f, t in sorted(res.sensitivity.items())]
    rep.add(f"### How the SLO ratios depend on the fixed rate ({m.label})",
            "The paper does not state the rate of its SLO sweep, so each ratio is a function of that "
            "choice; the table gives it at more fixed rates (how it moves is in the notes below):")
    rep.table(["fixed rate (req/s)", "FlowPrefill min SLO"] + [f"{n} (÷ FlowPrefill)" for n in bases], rows)


def _ablations(res: Results, rep: Report) -> None:
    if res.priority is None or res.budget is None or res.chunk is None:
        return
    rep.add("## Scheduling policy: S-EDF vs EDF vs D-EDF (Fig. 10)",
            f"Llama3-8B; goodput over the rate grid, min SLO scale at {res.priority_rate:.2f} req/s "
            "(a heavier load than Fig. 9b, where the policies differ).")
    names = list(res.priority)
    rep.table(["priority", "goodput (req/s)", "min SLO scale"],
              [[n, g.text(), s.text()] for n, (g, s) in res.priority.items()])
    fig, (a, b) = figure(2)
    bar_panel(a, names, {"goodput": [res.priority[n][0].value for n in names]}, ylabel="goodput (req/s)",
              title="max goodput (higher is better)")
    bar_panel(b, names, {"min SLO scale": [res.priority[n][1].value for n in names]}, ylabel="min SLO scale",
              title="min SLO scale (lower is better)")
    save(fig, rep.figure_path("fig10_priority.png"))
    rep.image("fig10_priority.png", "Fig. 10")

    rep.add("## SLO-aware batching: token budget (Fig. 11)",
            "Llama3-8B, FlowPrefill with batch token budget G; throughput = completed requests / makespan.")
    rates = [r for r, _, _ in next(iter(res.budget.values()))]
    rep.table(["budget"] + [f"{r:.2f} req/s: attain. / thr." for r in rates],
              [[n] + [f"{a:.1%} / {t:.2f}" for _, a, t in pts] for n, pts in res.budget.items()])
    fig, (a, b) = figure(2)
    curve_panel(a, {n: [(r, x) for r, x, _ in p] for n, p in res.budget.items()}, xlabel="request rate (req/s)",
                title="attainment vs rate")
    curve_panel(b, {n: [(r, t) for r, _, t in p] for n, p in res.budget.items()}, xlabel="request rate (req/s)",
                ylabel="throughput (req/s)", target=None, percent=False, title="throughput vs rate")
    save(fig, rep.figure_path("fig11_budget.png"))
    rep.image("fig11_budget.png", "Fig. 11")

    rep.add("## FlowPrefill with chunked prefill (Fig. 15)",
            "Llama3-8B, FlowPrefill (operator-level preemption) with prompts split into chunks.")
    rep.table(["chunk", "goodput (req/s)", "vs no chunking"],
              [[n, t.text(), fmt_x(ratio(t.value, res.chunk["no chunking"].value))] for n, t in res.chunk.items()])
    fig, (a,) = figure(1, size=(6.4, 4.0))
    curve_panel(a, {n: t.curve for n, t in res.chunk.items()}, xlabel="request rate (req/s)",
                marks={n: t.value for n, t in res.chunk.items()}, title="FlowPrefill + chunked prefill")
    save(fig, rep.figure_path("fig15_chunk.png"))
    rep.image("fig15_chunk.png", "Fig. 15")


def _fig12(res: Results, rep: Report) -> None:
    b, att = res.blocking or {}, res.blocking_attainment or {}  # set together
    rep.add("## Preemption blocking time: operator vs layer boundaries (Fig. 12)",
            "Blocking = from the arrival that signals a preemption to the boundary that acknowledges "
            f"it (`SimResult.preemption_blocking`), FlowPrefill at {res.settings.blocking_rate_frac:g} × C "
            "of each model.")
    rows = []
    for model, g in b.items():
        op, ly = g["operator"], g["layer"]
        rows.append([LABELS[model], op["count"], fmt_ms(op["mean"]), fmt_ms(op["p99"]), fmt_ms(op["max"]),
                     ly["count"], fmt_ms(ly["mean"]), fmt_ms(ly["max"]), fmt_x(ratio(ly["mean"], op["mean"])),
                     f"{att[model]['operator']:.1%} / {att[model]['layer']:.1%}"])
    rep.table(["model", "op: n", "op mean (ms)", "op P99 (ms)", "op max (ms)", "layer: n", "layer mean (ms)",
               "layer max (ms)", "layer / op (mean)", "attainment op / layer"], rows)
    fig, (a,) = figure(1, size=(6.4, 4.0))
    groups = [LABELS[m].split()[0] for m in b]
    bar_panel(a, groups, {f"{gr} {k}": [1e3 * b[m][gr][k] for m in b] for gr in ("operator", "layer")
                          for k in ("mean", "max")}, ylabel="blocking time (ms)", log=True, fmt="{:.1f}",
              title="preemption blocking time")
    save(fig, rep.figure_path("fig12_blocking.png"))
    rep.image("fig12_blocking.png", "Fig. 12")


def _curves(t: Threshold) -> dict:
    return {"value": t.value if math.isfinite(t.value) else None, "capped": t.capped,
            "never_met": t.never_met, "curve": [[x, None if math.isnan(y) else y] for x, y in t.curve]}


def _json(res: Results, rep: Report) -> None:
    data = {"seed": res.seed, "settings": asdict(res.settings), "wall_s": res.wall_s,
            "e2e": [{"model": m.model, "capacity_rps": m.capacity, "slo_rate_rps": m.slo_rate,
                     "goodput": {n: _curves(t) for n, t in m.goodput.items()},
                     "min_slo_scale": {n: _curves(t) for n, t in m.min_slo.items()}} for m in res.e2e],
            "priority": {n: {"goodput": _curves(g), "min_slo_scale": _curves(s)}
                         for n, (g, s) in (res.priority or {}).items()},
            "budget": res.budget, "chunk": {n: _curves(t) for n, t in (res.chunk or {}).items()},
            "blocking_s": res.blocking, "fig17": moe_json(res.moe),
            "colocation": coloc_json(res.colocation) if res.colocation is not None else None}
    rep.write_json(data, default=float)


def write_report(res: Results, out: Path, *, command: str) -> Path:
    rep = Report(out, "flowprefill")
    t, rev = res.tally, source_revision()
    assert t is not None, "results without their run's tally"
    rep.add("# FlowPrefill (§6) reproduced in the flowyard simulator",
            f"Generated by `{command}` in {res.wall_s:.0f} s of wall time ({t.runs} simulations, "
            f"{t.events:,} events{', flowyard ' + rev if rev else ''}). Every number below comes from that run; "
            "the paper's numbers are "
            "labelled as such. Raw curves: [`flowprefill/results.json`](flowprefill/results.json)."
            + (" **Quick mode**: one model, few rates and requests; not the full study." if res.settings.n_requests
               < 1000 else ""))
    _headline(res, rep)
    _setup(res, rep)
    _fig9(res, rep)
    _sensitivity(res, rep)
    _ablations(res, rep)
    _fig12(res, rep)
    if res.colocation is not None:
        write_section(rep, res.colocation)
    moe_section(res.moe, rep)
    rep.add("## Where and why ours differ", differences(res, _ratios(res), _blocking_ratios(res)))
    if t.failures:
        rep.add(f"### Runs that did not finish ({len(t.failures)})",
                "These simulations ended with requests stuck (a scheduler deadlock, see above); they count "
                "as missing the target and are left out of the curves:",
                "\n".join(f"- {f[:300]}" for f in t.failures[:12]) + ("\n- …" if len(t.failures) > 12 else ""))
    _json(res, rep)
    rep.add("## Figs. 3 and 4: lone prefills priced by the cost model", cost_figures(HARDWARE))
    rep.add(NOT_BUILT_HEADING, not_reproduced())
    rep.changes()
    return rep.write()
