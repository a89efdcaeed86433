"""The write-up of `flowyard reproduce arrow`: markdown, figures and a JSON of every curve. Every
number comes from the `Results` passed in; the typed-in numbers are the paper's (`PAPER*` in
`arrow_notes`), always labelled as such."""

from __future__ import annotations

import math
from pathlib import Path

from flowyard.experiments.arrow import (ARROW, DISAGG, HARDWARE, MODEL, SCALE_POLICIES, TARGET, VLLM, VLLM_DP, Results,
                                        Search, WorkloadResult, to_json)
from flowyard.experiments.figures import NOT_BUILT_HEADING
from flowyard.experiments.arrow_notes import (not_reproduced, MINLOAD, PAPER, PAPER_ABLATION, RR, SLO_AWARE, differences,
                                              goodput_ratio, ratio_text)
from flowyard.experiments.report import wrong_side
from flowyard.experiments.common import BAND, Report, curve_panel, figure, fmt_x, log_x, ratio, save, source_revision
from flowyard.sim.run import DEFAULT_SLOS

def _verdict(ours: tuple[float, str], paper: float, band: float = BAND) -> str:
    """Ours against one paper ratio, computed from the run: "reproduced" within [paper / band,
    paper * band]; a search capped at its grid gives a bound, which decides only when the whole
    band lies on one side of it."""
    v, q = ours
    if q == "~" or math.isnan(v) or v <= 0:
        return "not measured (both searches capped, or no goodput)"
    lo, hi = paper / band, paper * band
    shown = f"ours {q}{fmt_x(v)}; band {lo:.2f}×–{hi:.2f}×"
    if not q.startswith("≥") and wrong_side([v], paper, paper):  # a bound below 1 or a value: a loss
        return f"not reproduced: {wrong_side([v], paper, paper)} ({shown})"
    if math.isinf(v) or (q.startswith("≥") and v > hi):
        return f"not reproduced: above ({shown})"
    if q.startswith("≤") and v < lo:
        return f"not reproduced: below ({shown})"
    if q:
        return f"undecided (a bound inside or beside the band: {shown})"
    if lo <= v <= hi:
        return f"reproduced ({shown})"
    return f"not reproduced: {'above' if v > hi else 'below'} ({shown})"


def _gp(s: Search) -> str:
    return s.goodput.text("{:.1f}").replace(">= ", "≥ ")


def _headline(res: Results, rep: Report) -> None:
    rows = []
    for w in res.workloads:
        sy, pv = w.systems, PAPER.get(w.spec.trace)
        for base, paper in ((VLLM, pv[0] if pv else None), (DISAGG, pv[1] if pv else None)):
            ours = goodput_ratio(sy[ARROW], sy[base])
            rows.append([f"goodput over {base}, {w.spec.label}", f"{paper:.2f}×" if paper else "—",
                         ratio_text(sy[ARROW], sy[base]), _verdict(ours, paper) if paper else ""])
        rows.append([f"goodput over {VLLM_DP}, {w.spec.label}", "— (the paper ran one TP8 instance)",
                     ratio_text(sy[ARROW], sy[VLLM_DP]), ""])
        rows.append([f"goodput over DistServe 4P4D, {w.spec.label}", "never meets the SLOs (§7.2)",
                     ratio_text(sy[ARROW], sy["DistServe 4P4D"]), ""])
    for w in res.workloads:
        if w.ablation:
            claim, pts = PAPER_ABLATION.get(w.spec.trace, ("—", None))
            ours = goodput_ratio(w.ablation[SLO_AWARE], w.ablation[MINLOAD])
            d = w.ablation[SLO_AWARE].goodput.value - w.ablation[MINLOAD].goodput.value
            rows.append([f"SLO-aware over minimal load, {w.spec.label}", claim,
                         ratio_text(w.ablation[SLO_AWARE], w.ablation[MINLOAD]) + f" ({d:+.0f} req/s)",
                         _verdict(ours, float(claim.split("×")[0])) if claim != "—" else ""])
            gain = _max_gain(w.ablation[MINLOAD], w.ablation[RR])
            rows.append([f"minimal load over round robin, {w.spec.label}: most attainment gained at one rate",
                         f"up to {pts} points" if pts else "—", f"{gain:+.1f} points", ""])
    if res.scale:
        n = sorted(res.scale)
        g = [res.scale[k][SLO_AWARE].goodput.value for k in n]
        linear = n[-1] / n[0]  # "nearly linear": the paper's gain is the GPUs' ratio
        rows.append([f"scalability: Arrow's goodput at {'/'.join(map(str, n))} GPUs",
                     f"nearly linear (Fig. 9): ~{linear:g}× for {linear:g}× the GPUs",
                     " / ".join(f"{x:.1f}" for x in g) + f" req/s ({fmt_x(ratio(g[-1], g[0]))} for "
                     f"{linear:g}× the GPUs)",
                     _verdict(goodput_ratio(res.scale[n[-1]][SLO_AWARE], res.scale[n[0]][SLO_AWARE]), linear)])
    rep.add("## Headline: the paper's numbers beside ours",
            "Goodput = the highest request rate with SLO attainment ≥ 90 %. The paper's ratios are "
            "Arrow's sustainable rate over vLLM (colocated, TP8) and over vLLM-disaggregated (1P1D, TP4); "
            "\"≥\" marks a bound where a search reached the end of its grid. Verdicts are computed from the "
            f"run: \"reproduced\" when ours lies within {BAND:g}× of the paper's ratio either way. vLLM also "
            "runs as 8 data-parallel TP1 instances, the usual way to serve an 8B model on 8 GPUs; the paper "
            "has no number for it.")
    rep.table(["claim (Arrow …)", "paper", "ours", "ours vs paper"], rows)


def _max_gain(a: Search, b: Search) -> float:
    common = set(a.points) & set(b.points)
    return max((100 * (a.points[x].attainment - b.points[x].attainment) for x in common), default=math.nan)


def _setup(res: Results, rep: Report) -> None:
    s = res.settings
    rows = []
    for w in res.workloads:
        slo = DEFAULT_SLOS[w.spec.trace]
        end = "end" if w.spec.duration is None else f"{w.spec.start + w.spec.duration:g} s"
        rows.append([w.spec.label, f"`{w.spec.trace}` {w.spec.start:g} s – {end}", w.requests,
                     f"{w.base_rate:.4g}", f"{slo.ttft:g} s / {slo.tpot:g} s",
                     ", ".join(f"{x:g}" for x in w.spec.grid), w.spec.why])
    rep.add("## Setup", "\n".join([
        f"- **Cluster**: `{MODEL}` on 8 simulated H800-80GB (`--hardware {HARDWARE}`: 989 TFLOPS bf16, "
        "3.35 TB/s HBM; flowyard's catalog gives NVLink 200 GB/s where the paper's server has 400 GB/s), "
        "step times from flowyard's per-operator roofline. The TTFT predictor and Max Running Tokens of "
        "Arrow are fitted on the same cost model (exact predictions).",
        "- **Systems** (8 GPUs each): **Arrow** = `arrow`, 8 stateless TP1 instances starting 4P4D, "
        "elastic pools, SLO-aware dispatch and flips; **vLLM (TP8)** = `vllm`, one colocated TP8 "
        "instance, chunked prefill 2048, decode first; **vLLM-disagg. 1P1D (TP4)** = `distserve` "
        "with one TP4 prefill and one TP4 decode instance (vLLM v0.7.3's PD mode supports only 1P1D); "
        "**DistServe 4P4D** = `distserve` with 4 TP1 prefill and 4 TP1 decode instances. Fig. 8: "
        "`arrow` vs `arrow-minload` vs `arrow-rr` (the latter two on a static 4P4D split).",
        "- **Rates**: Arrow's method, the window's timestamps × 1/scale, so bursts keep their shape; "
        "rates are the window's mean request rate after scaling. SLO attainment counts a request "
        "when it finishes with TTFT and TPOT within Table 1's SLOs. Goodput: every grid rate is "
        f"run (the plotted curve), then the first crossing of {TARGET:.0%} is bisected to {s.tol:.0%} "
        f"(the grid doubles up to {s.extend} time(s) when every point passes; such a goodput is a bound, ≥).",
        "- **BurstGPT**: only the first 400 rows of BurstGPT are public here (`burstgpt` = "
        "BurstGPT_3's head: 11.5 h of overnight traffic, 0.0096 req/s on average), not the paper's "
        "1-hour clip of 6,009 requests; compressed to tens of req/s it is a few short bursts, so its "
        "rates are not comparable with the paper's.",
        "- **Windows** (what each run replays, and why): chosen so the whole study stays within "
        "about 15 min on a shared 2-core VM (the simulator does roughly 30k events/s).",
    ]))
    rep.table(["workload", "window", "requests", "mean rate (req/s)", "SLO TTFT / TPOT", "rate grid (req/s)",
               "why this window"], rows)


def _ticks(ax, searches, grid) -> None:
    """Log x axis labelled at the grid's rates (and its doublings or halvings that were run)."""
    xs = [x for s in searches for x in s.points]
    t = set(grid) | {max(grid) * 2 ** k for k in range(1, 6) if max(grid) * 2 ** k <= max(xs) * 1.01}
    log_x(ax, sorted(t | {min(grid) / 2 ** k for k in range(1, 6) if min(grid) / 2 ** k >= min(xs) / 1.01}))


def _p90_panel(ax, w: WorkloadResult, key: str, ylabel: str, slo: float | None, log: bool) -> None:
    series = {n: [(x, getattr(p, key) * (1 if log else 1e3)) for x, p in s.points.items()] for n, s in w.systems.items()}
    curve_panel(ax, series, xlabel="request rate (req/s)", ylabel=ylabel, target=None, percent=False,
                title=f"{w.spec.label}: {ylabel}")
    if slo is not None:  # the SLO line
        ax.axhline(slo if log else 1e3 * slo, color="grey", ls="--", lw=0.8)
    _ticks(ax, w.systems.values(), w.spec.grid)
    if log:
        ax.set_yscale("log")


def _fig7(res: Results, rep: Report) -> None:
    rep.add("## End-to-end (Fig. 7)",
            "Per workload: each system's goodput, and at one rate (the largest grid rate at which Arrow "
            "still meets 90 %) its attainment, P90 TTFT and TPOT, and the shares of requests meeting each "
            "SLO. \"flips\": Arrow's instance moves between the P and D sides at that rate, and the most "
            "instances it had on the prefill side (P + D→P) at once.")
    k = len(res.workloads)
    fig, axes = figure(k, 3, size=(4.2 * k, 10.5))
    for j, w in enumerate(res.workloads):
        slo = DEFAULT_SLOS[w.spec.trace]
        _p90_panel(axes[j], w, "ttft_p90", "P90 TTFT (s)", slo.ttft, True)
        _p90_panel(axes[k + j], w, "tpot_p90", "P90 TPOT (ms)", slo.tpot, False)
        curve_panel(axes[2 * k + j], {n: list((x, p.attainment) for x, p in s.points.items())
                                      for n, s in w.systems.items()},
                    xlabel="request rate (req/s)", ylabel="SLO attainment (%)", title=f"{w.spec.label}: attainment",
                    marks={n: s.goodput.value for n, s in w.systems.items()})
        _ticks(axes[2 * k + j], w.systems.values(), w.spec.grid)
        r = w.table_rate
        rows = []
        for n, s in w.systems.items():
            p = s.points[r]
            rows.append([n, _gp(s), ratio_text(w.systems[ARROW], s) if n != ARROW else "—", f"{p.attainment:.1%}",
                         f"{p.ttft_p90:.2f}", f"{1e3 * p.tpot_p90:.1f}", f"{p.ttft_ok:.1%}", f"{p.tpot_ok:.1%}"])
        a = w.systems[ARROW].points[r]
        rep.add(f"### {w.spec.label} (table at {r:g} req/s; Arrow: {a.flips} flips, up to {a.max_prefill} "
                "instances on the prefill side)")
        rep.table(["system", "goodput (req/s)", "Arrow / system", "attainment", "P90 TTFT (s)", "P90 TPOT (ms)",
                   "TTFT met", "TPOT met"], rows)
    save(fig, rep.figure_path("fig7_e2e.png"))
    rep.image("fig7_e2e.png", "Fig. 7: P90 TTFT, P90 TPOT and SLO attainment vs rate")


def _fig8(res: Results, rep: Report) -> None:
    abl = [w for w in res.workloads if w.ablation]
    if not abl:
        return
    rep.add("## Request and instance scheduling strategies (Fig. 8)",
            "All on 8 TP1 instances; minimal load and round robin on a static 4P4D split.")
    fig, axes = figure(len(abl), size=(5.2 * len(abl), 4.0))
    for ax, w in zip(axes, abl):
        slo_aware = w.ablation[SLO_AWARE]
        rep.add(f"### {w.spec.label}")
        rep.table(["strategy", "goodput (req/s)", "SLO-aware / strategy", "most attainment over round robin"],
                  [[n, _gp(s), ratio_text(slo_aware, s) if n != SLO_AWARE else "—",
                    f"{_max_gain(s, w.ablation[RR]):+.1f} points" if n != RR else "—"] for n, s in w.ablation.items()])
        curve_panel(ax, {n: [(x, p.attainment) for x, p in s.points.items()] for n, s in w.ablation.items()},
                    xlabel="request rate (req/s)", ylabel="SLO attainment (%)", title=w.spec.label,
                    marks={n: s.goodput.value for n, s in w.ablation.items()})
        _ticks(ax, w.ablation.values(), w.spec.grid)
    save(fig, rep.figure_path("fig8_ablation.png"))
    rep.image("fig8_ablation.png", "Fig. 8: scheduling strategies")


def _fig9(res: Results, rep: Report) -> None:
    if not res.scale:
        return
    label = next(w.spec.label for w in res.workloads if w.spec.trace == res.settings.scale_trace)
    n, r = sorted(res.scale), res.scale_rate
    rep.add("## Scalability with the number of GPUs (Fig. 9)",
            f"{label}; one TP1 instance per GPU (the static strategy splits them half P, half D); SLO "
            f"attainment at {r:g} req/s and goodput per GPU count.")
    rep.table(["GPUs", "SLO-aware goodput", "minimal-load goodput", "SLO-aware / minimal load",
               f"attainment at {r:g} req/s: SLO-aware", "minimal load"],
              [[k, _gp(res.scale[k][SLO_AWARE]), _gp(res.scale[k][MINLOAD]),
                ratio_text(res.scale[k][SLO_AWARE], res.scale[k][MINLOAD]),
                f"{res.scale[k][SLO_AWARE].points[r].attainment:.1%}",
                f"{res.scale[k][MINLOAD].points[r].attainment:.1%}"] for k in n])
    fig, (a, b) = figure(2)
    curve_panel(a, {lab: [(k, res.scale[k][lab].points[r].attainment) for k in n] for lab in SCALE_POLICIES},
                xlabel="GPUs", title=f"{label}: attainment at {r:g} req/s", ylabel="SLO attainment (%)")
    curve_panel(b, {lab: [(k, res.scale[k][lab].goodput.value) for k in n] for lab in SCALE_POLICIES},
                xlabel="GPUs", ylabel="goodput (req/s)", target=None, percent=False, title=f"{label}: goodput")
    for ax in (a, b):
        ax.set_xticks(n)
    save(fig, rep.figure_path("fig9_scalability.png"))
    rep.image("fig9_scalability.png", "Fig. 9: scalability")


def write_report(res: Results, out: Path, *, command: str) -> Path:
    rep = Report(out, "arrow")
    t, rev = res.tally, source_revision()
    assert t is not None, "results without their run's tally"
    rep.add("# Arrow (§7) reproduced in the flowyard simulator",
            f"Generated by `{command}` in {res.wall_s:.0f} s of wall time ({t.runs} simulations, {t.events:,} "
            f"events{', flowyard ' + rev if rev else ''}). Every number below comes from that run; the paper's "
            "numbers are labelled as such. Raw curves: [`arrow/results.json`](arrow/results.json)."
            + (" **Quick mode**: short windows, two-point grids, coarse searches; not the full study."
               if res.settings.quick else ""))
    _headline(res, rep)
    _setup(res, rep)
    _fig7(res, rep)
    _fig8(res, rep)
    _fig9(res, rep)
    rep.add("## Where and why ours differ", differences(res))
    rep.add(NOT_BUILT_HEADING, not_reproduced())
    if t.failures:
        rep.add(f"### Runs that did not finish ({len(t.failures)})",
                "They count as missing the target and are left out of the curves:",
                "\n".join(f"- {f[:300]}" for f in t.failures[:12]) + ("\n- …" if len(t.failures) > 12 else ""))
    rep.write_json(to_json(res))
    rep.changes()
    return rep.write()
