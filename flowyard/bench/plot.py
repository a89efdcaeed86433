"""Figures: attainment-vs-rate curves (goodput) and latency CDFs, as PNG files.

matplotlib is imported inside the functions (the CLI's start-up time matters) and drives a
bare `Figure` with the Agg canvas, never pyplot, so no display or global backend is touched.
"""

from __future__ import annotations

import os
from typing import Mapping, Sequence

import numpy as np

from flowyard.core.goodput import GoodputResult
from flowyard.core.metrics import ttft_values
from flowyard.core.request import RequestState


def _figure(size: tuple[float, float] = (6.4, 4.2)):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, dpi=120)
    FigureCanvasAgg(fig)
    return fig


def _save(fig, path: str | os.PathLike) -> None:
    try:
        fig.savefig(path, format="png")
    except OSError as e:
        raise OSError(f"cannot write figure to '{os.fspath(path)}': {e.strerror or e}") from e


def plot_goodput(results: Mapping[str, GoodputResult] | Sequence[GoodputResult],
                 path: str | os.PathLike, target: float = 0.9,
                 title: str = "SLO attainment vs request rate") -> None:
    """Attainment against rate for each policy, with the target line and each policy's goodput
    marked; the usual goodput figure of the papers."""
    from flowyard.bench.report import result_list

    fig = _figure()
    ax = fig.add_subplot(1, 1, 1)
    for r in result_list(results):
        if not r.curve:
            continue
        rates, att = zip(*r.curve)
        line, = ax.plot(rates, np.asarray(att, dtype=float) * 100, marker="o", ms=3,
                        label=f"{r.policy or '?'} ({r.goodput:.2f} req/s)")
        if r.goodput > 0:
            ax.axvline(r.goodput, color=line.get_color(), ls=":", lw=1)
    ax.axhline(target * 100, color="grey", ls="--", lw=1, label=f"{target:.0%} target")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_ylim(-2, 102)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    _save(fig, path)


def plot_cdf(samples: Mapping[str, Sequence[RequestState] | np.ndarray],
             path: str | os.PathLike, *, xlabel: str = "TTFT (s)", slo: float | None = None,
             title: str = "TTFT CDF") -> None:
    """Empirical CDF per policy. Values are seconds, or request states (their TTFTs)."""
    fig = _figure()
    ax = fig.add_subplot(1, 1, 1)
    for name, v in samples.items():
        if not isinstance(v, np.ndarray):
            v = list(v)
            v = ttft_values(v) if v and isinstance(v[0], RequestState) else np.asarray(v, float)
        x = np.sort(np.asarray(v, dtype=float))
        if len(x):
            ax.step(x, np.arange(1, len(x) + 1) / len(x), where="post", label=name)
    if slo is not None:
        ax.axvline(slo, color="grey", ls="--", lw=1, label="SLO")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    _save(fig, path)
