"""Report pieces shared by the paper reproductions: number formats, markdown tables, a report
writer, and PNG figures drawn on matplotlib's Agg canvas (no pyplot, no display). Re-exported
by `flowyard.experiments.common`."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Iterable, Mapping, Sequence, TypeVar

import numpy as np

# ------------------------------------------------------------------------------- numbers

def ratio(a: float, b: float) -> float:
    """a / b with the conventions of the reports: inf when only b is 0, nan when both are."""
    if b == 0 or not math.isfinite(b):
        return math.nan if (a == 0 or not math.isfinite(a)) else math.inf
    return a / b


def fmt_x(v: float) -> str:
    return "n/a" if math.isnan(v) else ("∞" if math.isinf(v) else f"{v:.2f}×")


def fmt_range(vals: Iterable[float]) -> str:
    v = [x for x in vals if math.isfinite(x)]
    if not v:
        return "n/a"
    lo, hi = min(v), max(v)
    return f"{lo:.1f}×" if abs(hi - lo) < 0.05 else f"{lo:.1f}×–{hi:.1f}×"


def fmt_ms(v: float) -> str:
    return "n/a" if math.isnan(v) else f"{1e3 * v:.2f}"


#: a reproduction's value counts as "reproduced" within this factor of the paper's range, each way
BAND = 1.5


def band_verdict(ours: float | Iterable[float], lo: float | None, hi: float, band: float = BAND) -> str:
    """"reproduced" when every one of `ours` lies in the paper's range [lo, hi] widened by `band`
    each way. lo None: the paper says "up to hi", its best case, so our best case (the largest of
    `ours`) must lie in [hi / band, hi * band] and none above it: a ratio with no gain is not a
    reproduction of "up to 2x". The band is in the text. A zero, negative or non-finite value is
    "not measured", never reproduced, so a run that produced nothing cannot pass."""
    v = [ours] if isinstance(ours, (int, float)) else list(ours)
    low = hi if lo is None else lo
    if not (band >= 1 and 0 < low <= hi):
        raise ValueError(f"bad band {band} or paper range [{lo}, {hi}]")
    if not v or any(not (math.isfinite(x) and x > 0) for x in v):
        return "not measured (a zero or missing value)"
    a, b = low / band, hi * band
    shown = f"ours {fmt_range(v)}; band {a:.2g}×–{b:.2g}×" + (" for the best" if lo is None else "")
    if lo is None and len(v) > 1:  # "up to": the best cell alone hides how typical it is
        med = float(np.median(v))
        shown += f"; median {med:.2f}×, best {max(v):.2f}×, {sum(x > 1 for x in v)} of {len(v)} cells above 1×"
    judged = [max(v)] if lo is None else v
    wrong = wrong_side(judged, low, hi)
    if wrong:
        return f"not reproduced: {wrong} ({shown})"
    if all(a <= x <= b for x in judged):
        return f"reproduced ({shown})"
    side = "above" if min(judged) > b else "below" if max(judged) < a else "partly outside"
    return f"not reproduced: {side} ({shown})"


def wrong_side(ours: Sequence[float], lo: float, hi: float) -> str:
    """For a ratio over a baseline: "" when ours lies on the paper's side of 1, else why not. A
    paper that claims a gain (its whole range above 1) is never reproduced by a loss or a tie,
    whatever the band's width (0.97x against a paper's 1.1x lies inside a 1.5x band)."""
    if lo > 1 and any(x <= 1 for x in ours):
        return "the other way (the paper reports a gain, ours is no gain)"
    if hi < 1 and any(x >= 1 for x in ours):
        return "the other way (the paper reports a reduction, ours is none)"
    return ""


def gain_verdict(ours: float, paper: float, band: float = BAND, unit: str = "%") -> str:
    """Verdict on an improvement the paper states as one number (a % gain, or points of a rate):
    "reproduced" when ours lies in [paper / band, paper * band], so too large a gain fails as
    surely as too small a one (+70 % against +33 % is above a 1.5x band's +49.5 %). A gain of 0
    or the other way is "not reproduced"; a missing value is "not measured"."""
    if not (band >= 1 and paper > 0):
        raise ValueError(f"bad band {band} or paper value {paper}")
    if not math.isfinite(ours):
        return "not measured (a missing value)"
    a, b = paper / band, paper * band
    shown = f"ours {ours:+.1f} {unit}; band +{a:.3g}–{b:.3g} {unit}"
    if ours <= 0:
        return f"not reproduced: {'none' if ours == 0 else 'the other way'} ({shown})"
    if a <= ours <= b:
        return f"reproduced ({shown})"
    return f"not reproduced: {'above' if ours > b else 'below'} ({shown})"


#: a null or small effect is judged against the spread over at least this many seeds
MIN_SEEDS = 3


K = TypeVar("K")  # a setting: a number, a name


def seed_spread(per_seed: Mapping[K, Sequence[float]]) -> float:
    """The largest relative standard deviation (sample, over seeds) of any setting's values: how far
    one seed's number moves from another's with nothing changed but the draw. NaN under 2 seeds."""
    rel = [float(np.std(v, ddof=1) / np.mean(v)) for v in per_seed.values() if len(v) > 1 and np.mean(v) > 0]
    return max(rel) if rel else math.nan



def null_effect_verdict(per_seed: Mapping[K, Sequence[float]], base: K, band: float, *,
                        min_seeds: int = MIN_SEEDS) -> str:
    """Verdict on a claim that a setting moves a metric by less than ±`band` (a null or small effect),
    judged against seed noise: `per_seed` maps each setting to its metric per seed, `base` is the
    reference setting. The change is the mean over seeds against the base's mean. "reproduced" only
    when every change is within the band AND the seed spread (`seed_spread`) is below it: a ±5 %
    band cannot tell an effect from 7 % noise, so that is "undecided", as is a run of fewer than
    `min_seeds` seeds. A zero, negative or missing value is "not measured"."""
    if not (0 < band < 1):
        raise ValueError(f"band must be a fraction in (0, 1), got {band}")
    vals = {k: [float(x) for x in v] for k, v in per_seed.items()}
    if base not in vals or len(vals) < 2 or any(not v or not all(math.isfinite(x) and x > 0 for x in v)
                                                for v in vals.values()):
        return "not measured (a zero or missing value)"
    ref = float(np.mean(vals[base]))
    ch = {k: float(np.mean(v)) / ref - 1 for k, v in vals.items() if k != base}
    n = min(len(v) for v in vals.values())
    noise = seed_spread(vals)
    shown = (", ".join(f"{100 * c:+.1f} %" for c in ch.values()) + f"; band ±{100 * band:g} %"
             + (f"; seed spread ±{100 * noise:.1f} % (1 s.d. over {n} seeds)" if math.isfinite(noise) else ""))
    if n < min_seeds:
        return f"undecided: {n} seed(s), a ±{100 * band:g} % band needs the spread over ≥ {min_seeds} ({shown})"
    if noise >= band:
        return f"undecided: seed noise ≥ the band, which cannot tell an effect from it ({shown})"
    if all(abs(c) <= band for c in ch.values()):
        return f"reproduced ({shown})"
    return f"not reproduced: beyond ±{100 * band:g} % ({shown})"


def verdict_rows(markdown: str) -> dict[str, str]:
    """claim -> verdict of every table in `markdown` whose last column is "ours vs paper"."""
    out: dict[str, str] = {}
    on = False
    for line in markdown.splitlines():
        if not line.startswith("|"):
            on = False
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and cells[-1] == "ours vs paper":
            on = True
        elif on and not set(cells[0]) <= set("-") and cells[-1]:
            out[cells[0]] = cells[-1]
    return out


def conclusion(verdict: str) -> str:
    """The conclusion a verdict draws, without its numbers or wording: reproduced, not reproduced,
    not measured or undecided. Earlier reports' wordings map onto the same four ("close (within
    15 %)", "within ...", "overlaps ..." were reproductions; "higher", "lower", "same direction,
    smaller" were not)."""
    v = verdict.strip().lower()
    if v.startswith(("not measured", "no number", "not measurable")):
        return "not measured"
    if v.startswith("undecided"):
        return "undecided"
    if v.startswith(("reproduced", "close", "within", "overlaps")):
        return "reproduced"
    if v.startswith(("not reproduced", "higher", "lower", "above", "below", "same direction")):
        return "not reproduced"
    return v.split("(")[0].strip(" :;") or "–"


# ------------------------------------------------------------------------------- report

def source_revision(root: Path | None = None) -> str:
    """The flowyard checkout's commit, "+ uncommitted changes" when its sources or benchmark
    scripts (the code behind benchmarks' reports) differ from it; "" outside a git checkout
    (`provenance.git_state`). root: the checkout (None: this package's)."""
    from flowyard.experiments.provenance import BENCHMARK_PATHS, git_state

    g = git_state(root, BENCHMARK_PATHS)
    return "" if not g.revision else g.short + (" + uncommitted changes" if g.dirty else "")


def heading(title: str, rev: str) -> str:
    """A report's first line, marked when `rev` (source_revision) is not a clean commit: numbers
    from uncommitted code are no revision's, and a reader must see that before any of them."""
    mark = "" if rev and "uncommitted" not in rev else "**Made from uncommitted code.**\n\n"
    return f"{mark}# {title}"


def md_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    out = ["| " + " | ".join(map(str, headers)) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(map(str, r)) + " |" for r in rows]
    return "\n".join(out)


class Report:
    """A markdown document under `out_dir`, with figures in `out_dir/<name>/`."""

    def __init__(self, out_dir: Path, name: str) -> None:
        from flowyard.experiments.provenance import current

        #: the run's record (revision, command, seeds, machine, wall time, cost model): the report's
        #: first line when the code was not committed, its "Provenance" section, and results.json's
        self.provenance = current()
        self.out_dir, self.name = Path(out_dir), name
        self.fig_dir = self.out_dir / name
        self.fig_dir.mkdir(parents=True, exist_ok=True)
        self.parts: list[str] = []
        old = self.out_dir / f"{name}.md"
        #: the report this one replaces (its text), for `changes`
        self.previous = old.read_text(encoding="utf-8") if old.exists() else ""

    def add(self, *texts: str) -> None:
        self.parts.extend(texts)

    def table(self, headers: Sequence[str], rows: Iterable[Sequence[object]]) -> None:
        self.parts.append(md_table(headers, rows))

    def changes(self) -> None:
        """A closing section: the conclusions that changed from the report this run overwrites
        (read from both reports' "ours vs paper" columns, compared by `conclusion`), and the
        claims new or gone."""
        old, new = verdict_rows(self.previous), verdict_rows("\n\n".join(self.parts))
        import re

        m = re.search(r"(?:flowyard|revision) ([0-9a-f]{7,40}(?: \+ uncommitted changes)?)", self.previous)
        rev = m.group(1) if m else ""
        lines = [f"- {c}: {conclusion(old[c])} → **{conclusion(v)}** (was: {old[c]}; now: {v})"
                 for c, v in new.items() if c in old and conclusion(old[c]) != conclusion(v)]
        lines += [f"- new claim: {c}: {v}" for c, v in new.items() if c not in old]
        lines += [f"- no longer a claim: {c} (was: {v})" for c, v in old.items() if c not in new]
        same = sum(1 for c, v in new.items() if c in old and conclusion(old[c]) == conclusion(v))
        self.add("## What changed since the previous report",
                 ("No previous report at this path." if not self.previous else
                  f"Against the report this run replaced{f' ({rev})' if rev else ''}: {same} conclusion(s) "
                  f"unchanged, {len(lines)} change(s) (claims new or gone included)" + (":\n\n" + "\n".join(lines) if lines else ".")))

    def figure_path(self, file: str) -> Path:
        return self.fig_dir / file

    def image(self, file: str, alt: str) -> None:
        self.parts.append(f"![{alt}]({self.name}/{file})")

    def write_json(self, data: dict, file: str = "results.json", default=None) -> Path:
        """`data` as `file` in the figure directory, with the run's provenance under "provenance"."""
        path = self.figure_path(file)
        path.write_text(json.dumps({"provenance": self.provenance.as_dict(), **data}, indent=1, default=default),
                        encoding="utf-8")
        return path

    def write(self) -> Path:
        """The markdown file, opening with the uncommitted-code warning when there is one and
        closing with the provenance section."""
        path = self.out_dir / f"{self.name}.md"
        first = self.provenance.first_line()
        parts = ([first] if first else []) + self.parts + ["## Provenance", self.provenance.section()]
        path.write_text("\n\n".join(parts).rstrip() + "\n", encoding="utf-8")
        return path


def figure(ncols: int = 1, nrows: int = 1, size: tuple[float, float] | None = None):
    """(fig, axes list) on an Agg canvas."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size or (5.0 * ncols, 3.8 * nrows), dpi=110)
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(nrows, ncols, i + 1) for i in range(ncols * nrows)]
    return fig, axes


def save(fig, path: str | os.PathLike) -> None:
    fig.tight_layout()
    try:
        fig.savefig(path, format="png")
    except OSError as e:
        raise OSError(f"cannot write figure to '{os.fspath(path)}': {e.strerror or e}") from e


def curve_panel(ax, series: Mapping[str, Sequence[tuple[float, float]]], *, xlabel: str,
                ylabel: str = "TTFT SLO attainment (%)", marks: dict[str, float] | None = None,
                target: float | None = 0.9, title: str = "", percent: bool = True) -> None:
    """Lines of (x, y) per series; `marks` draws a dotted vertical line per series (goodput,
    min SLO scale) in the series' colour; `target` a grey dashed horizontal line."""
    k = 100.0 if percent else 1.0
    for name, pts in series.items():
        pts = [(x, y) for x, y in sorted(pts) if not math.isnan(y)]  # NaN: a run that did not finish
        if not pts:
            continue
        x, y = zip(*pts)
        line, = ax.plot(x, np.asarray(y, float) * k, marker="o", ms=3, lw=1.4, label=name)
        m = (marks or {}).get(name)
        if m is not None and math.isfinite(m) and m > 0:
            ax.axvline(m, color=line.get_color(), ls=":", lw=1.2)
    if target is not None:
        ax.axhline(target * k, color="grey", ls="--", lw=0.8)
    if percent:
        ax.set_ylim(-2, 102)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize="medium")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # a run with nothing to plot draws no legend
        ax.legend(fontsize="x-small")


def log_x(ax, ticks: Sequence[float]) -> None:
    """Logarithmic x axis labelled at `ticks` in plain numbers."""
    from matplotlib.ticker import NullFormatter

    ax.set_xscale("log")
    ax.set_xticks(list(ticks), [f"{t:g}" for t in ticks])
    ax.xaxis.set_minor_formatter(NullFormatter())


def bar_panel(ax, groups: Sequence[str], series: dict[str, Sequence[float]], *, ylabel: str,
              title: str = "", log: bool = False, fmt: str = "{:.2f}") -> None:
    """Grouped bars: one group per entry of `groups`, one bar per series, values annotated."""
    n = max(1, len(series))
    width = 0.8 / n
    x = np.arange(len(groups))
    for i, (name, vals) in enumerate(series.items()):
        v = np.asarray([x_ if math.isfinite(x_) else 0.0 for x_ in vals], float)
        bars = ax.bar(x + (i - (n - 1) / 2) * width, v, width, label=name)
        for b, val in zip(bars, vals):
            ax.annotate(fmt.format(val) if math.isfinite(val) else "n/a",
                        (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom",
                        fontsize="x-small")
    ax.set_xticks(x, groups)
    if log and any(math.isfinite(v) and v > 0 for vals in series.values() for v in vals):
        ax.set_yscale("log")  # all zero (nothing reproduced): a log axis has nothing to show
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize="medium")
    ax.grid(alpha=0.3, axis="y")
    if len(series) > 1:
        ax.legend(fontsize="x-small")
