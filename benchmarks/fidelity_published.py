"""Write docs/results/fidelity_published.md: the cost model against published GPU measurements,
leave-one-source-out cross-validated, with the in-sample fit beside it, and a predicted-vs-
published plot (docs/results/fidelity_published.png).

Every number in the report is computed here from flowyard/data/published_points.json (points
and sources), flowyard/data/calibration.json (the in-sample fit) and fit.cross_validate (one
refit per source family). Run: python benchmarks/fidelity_published.py [--out PATH]
(a few minutes on two cores: seven refits and the serving replays).
"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

from flowyard.costmodel.cli_validate import breakdown, run_all
from flowyard.costmodel.engines import DEFAULT_ENGINE_PROFILE, engine_profiles
from flowyard.costmodel.fit import Row, current_fit, summary
from flowyard.costmodel.hardware import DEFAULT_CALIBRATION

OUT = Path(__file__).resolve().parents[1] / "docs" / "results" / "fidelity_published.md"


def closed_loop_rates() -> list[str]:
    """For each closed-loop serving series, the output rate its published numbers imply
    (clients / P50 TPOT): where it stops growing with the clients, something other than the
    engine's steps (client, frontend) bounds the run, which a step model cannot predict."""
    from flowyard.costmodel.published import published_points

    series: dict[tuple, dict[int, float]] = {}
    for p in published_points():
        c = (p.workload or {}).get("concurrency") if p.kind == "serving" else None
        if c and p.metric == "tpot_p50":
            series.setdefault((p.family, str(p.model), p.hardware, p.tp), {})[int(c)] = c / p.measured * 1e3
    out = []
    for (fam, model, hw, tp), rates in series.items():
        steps = ", ".join(f"{c} → {r:,.0f}" for c, r in sorted(rates.items()))
        out.append(f"Closed-loop series {fam} {model} {hw} TP{tp}: clients → output tokens/s implied "
                   f"by the published P50 TPOT: {steps}.")
    return out


def revision() -> str:
    here = Path(__file__).parent
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                         cwd=here).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, cwd=here).stdout.strip()
    return rev + (" (uncommitted changes)" if dirty else "")


def plot(cv: list[Row], ins: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 5), sharex=True, sharey=True)
    marks = {"prefill": "o", "decode": "s", "mixed": "D", "serving": "*", "kernel": "^", "cpu": "v"}
    for ax, rows, title in ((axes[0], cv, "leave-one-source-out"), (axes[1], ins, "in-sample")):
        for g, m in marks.items():
            sel = [r for r in rows if r.point.group == g and not r.point.is_range]
            if sel:
                ax.scatter([r.point.measured for r in sel], [r.predicted for r in sel], marker=m,
                           label=g, alpha=0.75)
        ax.set_xscale("log")
        ax.set_yscale("log")
        lo, hi = 1e-3, 1e4
        ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
        ax.plot([lo, hi], [1.25 * lo, 1.25 * hi], "k:", lw=0.6)
        ax.plot([lo, hi], [lo / 1.25, hi / 1.25], "k:", lw=0.6)
        ax.set_title(f"{title}: median {summary(rows)['median_abs_error']:.1%}, "
                     f"max {summary(rows)['max_abs_error']:.1%}")
        ax.set_xlabel("published (ms or req/s; ranges left out)")
        ax.legend(fontsize=8, loc="upper left")
    axes[0].set_ylabel("predicted (same unit)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _table(title: str, cv: dict, ins: dict) -> list[str]:
    lines = [f"| {title} | points | CV median | CV max | in-sample median | in-sample max |",
             "|---|---|---|---|---|---|"]
    for k, v in cv.items():
        i = ins[k]
        lines.append(f"| {k} | {v['points']} | {v['median_abs_error']:.1%} | {v['max_abs_error']:.1%} "
                     f"| {i['median_abs_error']:.1%} | {i['max_abs_error']:.1%} |")
    return lines


def _meas(r: Row) -> str:
    p = r.point
    if p.is_range:
        return f"≤ {p.hi:.4g}" if p.measured == 0 else f"{p.measured:.4g}–{p.hi:.4g}"
    return f"{p.measured:.4g}"


def report(out: Path) -> str:
    rev = revision()  # before this run writes its plot, which would read as a dirty tree
    cv, ins, unchecked = run_all(DEFAULT_CALIBRATION, None, True)
    assert cv is not None
    sun = summary(unchecked)
    png = out.with_suffix(".png")
    plot(cv, ins, png)
    scv, sin = summary(cv), summary(ins)
    by_cv = {r.point.name: r for r in cv + unchecked}
    pairs = [(by_cv[i.point.name], i) for i in ins]  # (held-out row, in-sample row) per point
    serving = [(c, i) for c, i in pairs if c.point.kind == "serving"
               and c.point.metric in ("ttft_p50", "tpot_p50")]
    cv_names = {r.point.name for r in cv}
    serving_cv = [(c, i) for c, i in serving if c.point.name in cv_names]
    fams = list(dict.fromkeys(r.point.family for r in ins))
    lines = [
        "# Cost-model fidelity against published GPU measurements",
        "",
        f"Generated by `python benchmarks/fidelity_published.py` at revision {rev}; the same "
        "tables print with `flowyard validate` (`--json PATH` writes them). Every measured value is "
        "someone else's GPU measurement (source column, flowyard/data/published_points.json); every "
        "predicted value is our roofline on that batch, or the simulator replaying that serving run. "
        "Error = predicted / measured − 1; for a range, the distance outside it.",
        "",
        "## Headline: leave-one-source-out cross-validation",
        "",
        f"For each of the {len(fams)} source families ({', '.join(fams)}) the fitted terms are refitted "
        "without it and its points predicted with that fit. In-sample is the 'published' calibration "
        "(fitted on every non-serving point, and each profile's frontend latency on its lone-request "
        "serving TTFTs) on the same points. A fold whose profile has no tensor-parallel step left fits "
        "its all-reduce latency on that profile's burst TPOTs (every request sent at once, TP > 1).",
        "",
        "| | points | median abs. error | max abs. error | within 10 % | within 25 % |",
        "|---|---|---|---|---|---|",
        f"| **cross-validated** | {scv['points']} | **{scv['median_abs_error']:.1%}** | "
        f"**{scv['max_abs_error']:.1%}** | {scv['within_10pct']} | {scv['within_25pct']} |",
        f"| in-sample | {sin['points']} | {sin['median_abs_error']:.1%} | {sin['max_abs_error']:.1%} | "
        f"{sin['within_10pct']} | {sin['within_25pct']} |",
        f"| not cross-validatable, held out anyway | {sun['points']} | {sun['median_abs_error']:.1%} | "
        f"{sun['max_abs_error']:.1%} | {sun['within_10pct']} | {sun['within_25pct']} |",
        "",
        f"The cross-validated row covers the {scv['points']} points a fold can price without terms "
        f"that only their own family measures. The other {sun['points']}: "
        f"{sum(r.point.family == 'vidur' for r in unchecked)} are Vidur's (its CPU-phase "
        "rows are the only measurements of the eager-2023 engine profile and its attention rows the "
        "only timings of the one attention kernel it profiled; a term of that kernel, "
        "attn_causal_extra, prices them), "
        f"{sum(r.point.family != 'vidur' and not r.point.workload.get('client') for r in unchecked)} are "
        "TTFTs of a stack whose frontend latency no other family's lone-request TTFT measures, and "
        f"{sum(bool(r.point.workload.get('client')) for r in unchecked)} are the closed-loop run whose "
        "published output tokens/s fits its benchmark client's per-token time (sim/client_cpu.py). "
        "Held out, nothing else defines those terms; the last row "
        "prices them anyway with the fold's fallbacks (the default profile, the prior kernel term) "
        "so the cost of that gap is on the page, not hidden. They enter the in-sample row.",
        "",
        f"Targets (issue 27): cross-validated median ≤ 10 % — "
        f"{'met' if scv['median_abs_error'] <= 0.10 else 'missed'}; no point above 25 % — "
        f"{'met' if scv['max_abs_error'] <= 0.25 else 'missed (%d points above)' % (len(cv) - scv['within_25pct'])}; "
        "serving P50 TTFT and TPOT within 15 % — "
        f"{sum(abs(c.error) <= 0.15 for c, _ in serving_cv)} of {len(serving_cv)} within (cross-validated; "
        f"{len(serving) - len(serving_cv)} more cannot be: in-sample "
        f"{sum(abs(i.error) <= 0.15 for c, i in serving if c.point.name not in cv_names)} of them within).",
        "",
        f"![predicted vs published]({png.name})",
        "",
        "## By kind", "",
        *_table("kind", breakdown(cv, lambda p: p.group), breakdown(ins, lambda p: p.group)),
        "", "## By source family", "",
        *_table("source", breakdown(cv, lambda p: p.family), breakdown(ins, lambda p: p.family)),
        "", "## Engine profiles (in-sample fit)", "",
        "| profile | step_overhead_s | seq_overhead_s | seq_overhead_layer_s | frontend_s | ar_latency_s "
        "| fitted on | frontend fitted on | stack |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    fit = current_fit()
    for name, e in engine_profiles().items():
        lines.append(f"| {name}{' (default)' if name == DEFAULT_ENGINE_PROFILE else ''} | "
                     f"{e.step_overhead_s:.3g} | {e.seq_overhead_s:.3g} | {e.seq_overhead_layer_s:.3g} | "
                     f"{e.frontend_s:.3g} | "
                     f"{'—' if e.ar_latency_s is None else format(e.ar_latency_s, '.3g')} | {', '.join(e.fitted_on) or '—'} | "
                     f"{', '.join(fit.fitted_on.get('frontend:' + name, ())) or '—'} | {e.description} |")
    lines += ["", *closed_loop_rates()]
    lines += ["", "A100 attention terms: " + ", ".join(f"{k} {v:.4g}" for k, v in fit.kernel.items())
              + "; Vidur's profiled kernel only: " + ", ".join(
                  f"{k} {v:.4g}" for d in fit.kernel_only.values() for k, v in d.items()) + ".",
              "", "## Serving runs replayed (P50 TTFT / TPOT)", "",
              "| run | measured ms | CV predicted | CV error | in-sample error |", "|---|---|---|---|---|"]
    for c, i in serving:
        lines.append(f"| {c.point.name} | {c.point.measured:.4g} | {c.predicted:.4g} | {c.error:+.1%} | "
                     f"{i.error:+.1%} |")
    worst = sorted(cv, key=lambda r: -abs(r.error))[:8]
    lines += ["", "## Largest cross-validated errors", ""]
    lines += [f"- {r.point.name} [{r.point.family}]: {r.error:+.1%} ({r.point.note or r.point.source})"
              for r in worst]
    lines += ["", "## Every point", "",
              "Points marked † cannot be cross-validated (see the headline); their held-out "
              "prediction uses the fold's fallbacks.", "",
              "| point | family | engine | GPU | measured | unit | held-out pred | held-out err | "
              "in-sample err | source |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    skip = {r.point.name for r in unchecked}
    for c, i in pairs:
        p = c.point
        lines.append(f"| {p.name}{' †' if p.name in skip else ''} | {p.family} | {p.engine} | "
                     f"{p.hardware} TP{p.tp} | {_meas(c)} | {p.unit} | {c.predicted:.4g} | "
                     f"{c.error:+.1%} | {i.error:+.1%} | {p.source} |")
    lines += ["", "## Notes on derived points", ""]
    lines += [f"- {r.point.name}: {r.point.note}" for r in ins if r.point.note]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    out = Path(args.out)
    text = report(out)
    out.write_text(text)
    print(text.split("## By kind")[0])
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
