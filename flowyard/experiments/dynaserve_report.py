"""The write-up of `flowyard reproduce dynaserve`: tables beside the paper's numbers, figures,
`results.json`, and why ours differ (`dynaserve_notes.py`)."""

from __future__ import annotations

import math
import platform
from dataclasses import asdict
from pathlib import Path

import numpy as np

from flowyard.experiments.common import (Report, bar_panel, curve_panel, figure, fmt_range, fmt_x,
                                         ratio, save, source_revision)
from flowyard.experiments.dynaserve import BASE, CURVE, FIG11_WORKLOAD, MODELS, SHAPES, SYSTEMS, WORKLOADS, Results
from flowyard.experiments.dynaserve_bench import COLOC, DISAGG, DYNA, HARDWARE, TBT_SLO, DSPoint
from flowyard.experiments.figures import NOT_BUILT_HEADING
from flowyard.experiments.dynaserve_notes import (PAPER_CAPACITY, PAPER_FIG11, PAPER_GOODPUT_UP_TO, PAPER_HYBRID,
                                                  PAPER_KV_REDUCTION, PAPER_LCU, PAPER_T1,
                                                  PAPER_T4, SETUP, fig11_verdict, fit_inputs, length_error_verdict, fit_verdict, lcu_decodes, not_reproduced, notes, verdict)

_finite_mean = lambda v: float(np.mean([x for x in v if math.isfinite(x)])) if any(map(math.isfinite, v)) else math.nan  # noqa: E731


def headline(rep: Report, res: Results) -> None:
    """Every paper number beside ours, with a verdict computed from the run (band: 1.5x each way
    of the paper's number; "up to": ours at most 1.5x above it)."""
    rows = []
    for base in (COLOC, DISAGG):
        peaks = [ratio(max((p.goodput_tps for p in res.curves[m][k][DYNA] if math.isfinite(p.goodput_tps)), default=0.0),
                       max((p.goodput_tps for p in res.curves[m][k][base] if math.isfinite(p.goodput_tps)), default=0.0))
                 for m in res.curves for k in res.curves[m]]
        top = max((x for x in peaks if math.isfinite(x)), default=math.nan)
        rows.append([f"Fig. 8 peak goodput over {base}, largest over models and workloads",
                     f"up to {PAPER_GOODPUT_UP_TO[base]}×", fmt_x(top), verdict(top, PAPER_GOODPUT_UP_TO[base])])
    caps = res.capacity.get(BASE, {})
    for base in (COLOC, DISAGG):
        r = [ratio(caps[k][DYNA].value, caps[k][base].value) for k in caps]
        lo, hi, mean = PAPER_CAPACITY[base]
        rows.append([f"Fig. 9 serving capacity over {base} ({BASE}), mean over workloads",
                     f"{mean}× (range {lo}–{hi}×)", f"{fmt_x(_finite_mean(r))} ({fmt_range(r)})",
                     verdict(_finite_mean(r), mean)])
    if res.hybrid:
        d = res.hybrid[DYNA][0].value
        for base in (COLOC, DISAGG):
            paper = PAPER_HYBRID[DYNA][0] / PAPER_HYBRID[base][0]
            ours = ratio(d, res.hybrid[base][0].value)
            rows.append([f"Table 2 hybrid serving capacity over {base}", f"{paper:.2f}×", fmt_x(ours),
                         verdict(ours, paper)])
    if res.sensitivity:
        means = {k: float(np.mean([p.goodput_tps for p in pts])) for k, pts in res.sensitivity.items()}
        b = means.get(0.0, means.get(0))
        ch = [ratio(v, b) - 1 for k, v in means.items() if k and b]
        rows.append(["Table 4 goodput change with output-length error (std 10-100)",
                     f"{100 * (min(PAPER_T4.values()) / PAPER_T4[0] - 1):+.1f} to "
                     f"{100 * (max(v for k, v in PAPER_T4.items() if k) / PAPER_T4[0] - 1):+.1f} %",
                     ", ".join(f"{100 * x:+.1f} %" for x in ch) or "n/a", length_error_verdict(res)])
    if res.kv:
        red = 1 - ratio(res.kv["chunked"].kv_exposed_ms, res.kv["whole"].kv_exposed_ms)
        rows.append(["chunked KV transfer: share of exposed transfer time removed", f"{100 * PAPER_KV_REDUCTION:.0f} %",
                     f"{100 * red:.0f} %", verdict(red, PAPER_KV_REDUCTION, 1.1)])
    if FIG11_WORKLOAD in res.slo_batching:
        on, off = (res.slo_batching[FIG11_WORKLOAD][k] for k in ("on", "off"))
        r11, v = fig11_verdict(res, FIG11_WORKLOAD)
        rows.append([f"Fig. 11 tokens within the TBT SLO with / without SLO-aware batching ({BASE}, "
                     f"{WORKLOADS[FIG11_WORKLOAD]})", f"{100 * PAPER_FIG11['on']:.0f} % / {100 * PAPER_FIG11['off']:.0f} % "
                     f"({fmt_x(PAPER_FIG11['on'] / PAPER_FIG11['off'])})",
                     f"{_pct(on.token_attainment)} % / {_pct(off.token_attainment)} % ({fmt_x(r11)})", v])
    lcu, fit = lcu_decodes(), fit_inputs()
    rows.append([f"Fig. 6 LCU: decodes of context {PAPER_LCU['ctx']} beside a {PAPER_LCU['prefill']}-token prefill "
                 f"within {1e3 * PAPER_LCU['slo']:g} ms (Llama-3.1-8B, A100; cost model)", str(PAPER_LCU["decodes"]),
                 str(lcu), fit_verdict(fit["LCU"]) if "LCU" in fit else verdict(float(lcu), float(PAPER_LCU["decodes"]))])
    rep.add("## Headline: the paper's numbers beside ours",
            "Verdicts are computed from this run: \"reproduced\" when ours lies within 1.5× of the paper's number "
            "either way (chunked KV: 1.1×); an \"up to\" number is the paper's best case, so our best case is held to it. "
            "A number the cost model was fitted on is marked \"fit input\": matching it checks the fit, not the design.")
    rep.table(["claim (DynaServe …)", "paper", "ours", "ours vs paper"], rows)



def _pct(v: float) -> str:
    return "n/a" if not math.isfinite(v) else f"{100 * v:.1f}"


def _ms(v: float) -> str:
    return "n/a" if not math.isfinite(v) else f"{1e3 * v:.1f}"


def _cap(c) -> str:
    return c.search.text("{:.2f}")


def table1(rep: Report, res: Results) -> None:
    rates = "; ".join(f"{k}: " + ", ".join(f"{sys_} {res.table1[k][sys_].rate:.2f}" for sys_ in SYSTEMS)
                      for k in res.table1)
    rep.add("## Table 1: fixed shapes on two A100 (Qwen2.5-14B)",
            "Each system at its saturation rate on each shape (the highest Poisson rate it keeps up with: median "
            "scheduling delay within 2 s, whatever the TBT; the paper: \"rates adjusted to saturate the system "
            f"capacity\"), req/s: {rates}. Colocation with vLLM's default 2048-token chunks, as in the paper. "
            "Ours / paper's.")
    names = ["MFU G1 (%)", "MFU G2 (%)", "HBM (KV) G1 (%)", "HBM (KV) G2 (%)", "P50 TBT (ms)", "P99 TBT (ms)",
             "throughput (req/s)", "TBT attainment (%)"]
    columns = []  # one per (shape, system): "ours / paper's" for each metric
    fit = fit_inputs()
    for key in res.table1:
        for sys_ in SYSTEMS:
            p = res.table1[key][sys_]
            ours = ([100 * p.mfu[0], 100 * p.mfu[1], 100 * p.hbm[0], 100 * p.hbm[1], 1e3 * p.tbt_p50,
                     1e3 * p.tbt_p99, p.rps, 100 * p.token_attainment] if p.mfu else [math.nan] * len(names))
            paper = PAPER_T1.get(key, {}).get(sys_)
            fitted = sys_ == DISAGG and key in fit
            columns.append([f"{v:.2f}" + (f" / {paper[i]:.2f}" if paper else "")
                            + (" (fit input)" if fitted and names[i] == "P50 TBT (ms)" else "") for i, v in enumerate(ours)])
    heads = ["metric"] + [f"{k} {s}" for k in res.table1 for s in SYSTEMS]
    rep.table(heads, [[name] + [col[i] for col in columns] for i, name in enumerate(names)])


def fig8(rep: Report, res: Results) -> None:
    models = list(res.curves)
    fig, axes = figure(len(WORKLOADS), len(models), size=(4.2 * len(WORKLOADS), 3.3 * len(models)))
    for r, m in enumerate(models):
        for c, key in enumerate(WORKLOADS):
            series = {s: [(p.rate, p.goodput_tps) for p in res.curves[m][key][s]] for s in SYSTEMS}
            curve_panel(axes[r * len(WORKLOADS) + c], series, xlabel="request rate (req/s)",
                        ylabel="goodput (tokens/s)", target=None, percent=False, title=f"{m}, {WORKLOADS[key]}")
    save(fig, rep.figure_path("fig8_goodput.png"))
    rep.add("## Fig. 8: goodput against request rate",
            f"Goodput = output tokens/s of requests whose own P99 TBT is within 100 ms. Rates at "
            f"{', '.join(f'{x:g}' for x in CURVE)} x the best system's serving capacity on that workload.")
    rep.image("fig8_goodput.png", "goodput curves")
    rows = []
    best: dict[str, list[float]] = {COLOC: [], DISAGG: []}
    for m in models:
        for key in WORKLOADS:
            mx = {s: max((p.goodput_tps for p in res.curves[m][key][s] if math.isfinite(p.goodput_tps)), default=0.0)
                  for s in SYSTEMS}
            for b in best:
                best[b].append(ratio(mx[DYNA], mx[b]))
            rows.append([m, WORKLOADS[key]] + [f"{mx[s]:.0f}" for s in SYSTEMS]
                        + [fmt_x(ratio(mx[DYNA], mx[COLOC])), fmt_x(ratio(mx[DYNA], mx[DISAGG]))])
    rep.add("Peak goodput over the curve (tokens/s) and DynaServe's ratio (paper: up to 1.91x over colocation and "
            "1.61x over disaggregation).")
    rep.table(["model", "workload"] + list(SYSTEMS) + ["vs Coloc.", "vs Disagg."], rows)
    res_max = {b: max((v for v in best[b] if math.isfinite(v)), default=math.nan) for b in best}
    rep.add(f"Largest ratio here: {fmt_x(res_max[COLOC])} over colocation and {fmt_x(res_max[DISAGG])} "
            "over disaggregation.")


def fig9(rep: Report, res: Results) -> None:
    caps = res.capacity[BASE]
    groups = [WORKLOADS[k] for k in WORKLOADS]
    fig, (ax,) = figure(1, 1, size=(8.0, 3.8))
    bar_panel(ax, groups, {s: [caps[k][s].value for k in WORKLOADS] for s in SYSTEMS},
              ylabel="serving capacity (req/s)", title=f"{BASE}: P99 TBT <= 100 ms, median delay <= 2 s")
    save(fig, rep.figure_path("fig9_capacity.png"))
    rep.add("## Fig. 9: serving capacity",
            "The highest rate with P99 TBT within 100 ms and a median scheduling delay within 2 s (Sarathi-Serve's "
            "definition, which the paper follows); colocation takes its best chunk size per workload.")
    rep.image("fig9_capacity.png", "serving capacity")
    rows, rc, rd = [], [], []
    for m in res.capacity:
        for key in WORKLOADS:
            c = res.capacity[m][key]
            a, b = ratio(c[DYNA].value, c[COLOC].value), ratio(c[DYNA].value, c[DISAGG].value)
            if m == BASE:
                rc.append(a)
                rd.append(b)
            rows.append([m, WORKLOADS[key], f"{_cap(c[COLOC])} (chunk {c[COLOC].chunk})", _cap(c[DISAGG]),
                         _cap(c[DYNA]), fmt_x(a), fmt_x(b)])
    rep.table(["model", "workload", "PD Coloc. (req/s)", "PD Disagg.", "DynaServe", "vs Coloc.", "vs Disagg."], rows)
    mean = _finite_mean
    rep.add(f"{BASE} mean ratio: {fmt_x(mean(rc))} over colocation and {fmt_x(mean(rd))} over disaggregation "
            "(paper: 2.37x and 1.37x; range 1.15-3.07x and 1.09-1.67x).")


def hybrid(rep: Report, res: Results) -> None:
    rep.add("## Table 2: hybrid workload (BurstGPT + Azure Code, uniformly mixed)",
            "Serving capacity, and goodput at that rate. Ours / paper's.")
    rows = [[s, f"{_cap(c)} / {PAPER_HYBRID[s][0]}", f"{p.goodput_tps:.0f} / {PAPER_HYBRID[s][1]:.0f}"]
            for s, (c, p) in res.hybrid.items()]
    rep.table(["system", "serving capacity (req/s)", "goodput (tokens/s)"], rows)
    d, c, g = (res.hybrid[s][0].value for s in (DYNA, COLOC, DISAGG))
    rep.add(f"DynaServe's capacity: {fmt_x(ratio(d, c))} colocation's and {fmt_x(ratio(d, g))} disaggregation's "
            "(paper: 1.60x and 1.25x).")


def sensitivity(rep: Report, res: Results) -> None:
    rep.add("## Table 4: output-length prediction error",
            f"P219 with outputs drawn from N(1467, std); the global scheduler assumes exactly 1467 tokens; "
            f"DynaServe at {res.sensitivity_rate:.2f} req/s (0.9 x its serving capacity on P219/D1467); goodput "
            "averaged over workload draws (seeds), each shown; the verdict compares the changes with the spread "
            "over seeds, since a ±5 % band cannot pass a change smaller than the noise between draws.")
    mean = {k: float(np.mean([p.goodput_tps for p in pts])) for k, pts in res.sensitivity.items()}
    b = mean.get(0.0, mean.get(0))
    rows = [[f"{k:g}", f"{mean[k]:.0f}", ", ".join(f"{p.goodput_tps:.0f}" for p in pts),
             f"{100 * (ratio(mean[k], b) - 1):+.1f} %" if b else "",
             f"{PAPER_T4[int(k)]:.0f} ({100 * (PAPER_T4[int(k)] / PAPER_T4[0] - 1):+.1f} %)" if int(k) in PAPER_T4 else ""]
            for k, pts in res.sensitivity.items()]
    rep.table(["std (tokens)", "goodput (tokens/s)", "per seed", "change", "paper"], rows)


def kv(rep: Report, res: Results) -> None:
    c, w = res.kv["chunked"], res.kv["whole"]
    red = 1 - ratio(c.kv_exposed_ms, w.kv_exposed_ms)
    rep.add("## Chunked KV transfer",
            f"Mini Reasoning stand-in at DynaServe's capacity: KV transfer time not hidden behind compute, per "
            f"hand-off: {c.kv_exposed_ms:.3f} ms chunked vs {w.kv_exposed_ms:.3f} ms sent whole after the first "
            f"segment ({100 * red:.0f} % less; paper: 94 % less).")


def fig11(rep: Report, res: Results) -> None:
    """SLO-aware batching on and off: the TBT CDF per workload and the share within the SLO."""
    keys = list(res.slo_batching)
    fig, axes = figure(len(keys), 1, size=(4.4 * len(keys), 3.4))
    for ax, key in zip(axes, keys):
        pts = res.slo_batching[key]
        series = {f"SLO-aware batching {name}": [(1e3 * t, q / 100) for q, t in enumerate(p.tbt_cdf)]
                  for name, p in pts.items()}
        curve_panel(ax, series, xlabel="TBT (ms)", ylabel="tokens (CDF, %)", target=None,
                    title=f"{WORKLOADS.get(key, key)} at {pts['on'].rate:.2f} req/s")
        ax.axvline(1e3 * TBT_SLO, color="grey", ls="--", lw=0.8)
    save(fig, rep.figure_path("fig11_tbt_cdf.png"))
    rep.add("## Fig. 11: TBT CDF with and without SLO-aware batching",
            f"DynaServe on {BASE} at its own serving capacity on each workload (Fig. 9: the highest rate whose P99 "
            "TBT holds the SLO, our reading of the paper's \"high-workload pressure\"; the paper names no workload, so "
            f"the verdict is on {WORKLOADS[FIG11_WORKLOAD]}, the workload of its §6.6 breakdown). \"on\": Alg. 2's "
            "prefill budget per step from the profile table; \"off\": the same split search with a fixed "
            "`chunk_cap` (1024) prefill tokens every step plus its decodes (`DynaServeConfig(slo_batching=False)`). "
            "Tokens within the SLO = share of all inter-token gaps <= 100 ms (`dynaserve_bench.py`).")
    rep.image("fig11_tbt_cdf.png", "TBT CDF with and without SLO-aware batching")
    rows = [[WORKLOADS.get(k, k), f"{pts['on'].rate:.2f}"]
            + [f"{_pct(pts[n].token_attainment)} % ({_ms(pts[n].tbt_p99)} / {_ms(pts[n].tbt_cdf[-1] if pts[n].tbt_cdf else math.nan)})"
               for n in ("on", "off")] + [fig11_verdict(res, k)[1]] for k, pts in res.slo_batching.items()]
    rep.table(["workload", "rate (req/s)", "on: within SLO (P99 / max TBT, ms)", "off", "ratio vs paper's "
               f"{fmt_x(PAPER_FIG11['on'] / PAPER_FIG11['off'])}"], rows)


def write_report(res: Results, out: Path, *, command: str) -> Path:
    rep = Report(out, "dynaserve")
    s = res.settings
    runs = res.tally.runs
    rep.add("# DynaServe reproduced in the simulator",
            f"`{command}` (revision {source_revision()}; {runs} simulations, {res.wall_s:.0f} s on "
            f"{platform.machine()} {platform.system()}, {platform.python_version()}"
            f"{'; QUICK MODE: short runs, numbers are a smoke test only' if s.quick else ''}).",
            SETUP.format(hardware=HARDWARE, duration=s.duration, min_n=s.min_n, max_n=s.max_n,
                         models=", ".join(f"{m} (TP{MODELS[m][1]})" for m in s.models),
                         chunks=", ".join(map(str, s.chunks))))
    headline(rep, res)
    table1(rep, res)
    fig8(rep, res)
    fig9(rep, res)
    hybrid(rep, res)
    sensitivity(rep, res)
    kv(rep, res)
    if res.slo_batching:
        fig11(rep, res)
    rep.add("## Why ours differ", notes(res))
    rep.add(NOT_BUILT_HEADING, not_reproduced(res))
    failures = res.tally.failures
    rep.add(f"Runs that did not finish: {len(failures)}" + "".join(f"\n- {f}" for f in failures[:20]))
    rep.write_json(to_json(res))
    rep.changes()
    return rep.write()


def _point(p: DSPoint) -> dict:
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in asdict(p).items()
            if k != "tbt_cdf" or v}


def to_json(res: Results) -> dict:
    return {"seed": res.seed, "wall_s": res.wall_s, "shapes": [list(x) for x in SHAPES],
            "table1": {k: {s: _point(p) for s, p in v.items()} for k, v in res.table1.items()},
            "capacity": {m: {k: {s: {"rps": c.value, "chunk": c.chunk, "curve": c.search.curve}
                                 for s, c in v.items()} for k, v in d.items()} for m, d in res.capacity.items()},
            "goodput_curves": {m: {k: {s: [_point(p) for p in pts] for s, pts in v.items()} for k, v in d.items()}
                               for m, d in res.curves.items()},
            "hybrid": {s: {"capacity_rps": c.value, "point": _point(p)} for s, (c, p) in res.hybrid.items()},
            "sensitivity": {"rate_rps": res.sensitivity_rate,
                            "points": {f"{k:g}": [_point(p) for p in pts] for k, pts in res.sensitivity.items()}},
            "kv": {k: _point(p) for k, p in res.kv.items()},
            "fig11_slo_batching": {k: {n: _point(p) for n, p in v.items()} for k, v in res.slo_batching.items()}}
