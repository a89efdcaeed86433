"""The two-panel figure FlowPrefill's end-to-end results share (Fig. 9 per dense model, Fig. 17
for the MoE model): SLO attainment against request rate, and against the SLO scale at one rate,
each system's threshold marked."""

from __future__ import annotations

from typing import Any

from flowyard.experiments.common import Report, curve_panel, figure, log_x, save

SCALE_TICKS = (0.125, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64)


def goodput_and_slo_figure(m: Any, file: str, rep: Report) -> None:
    """m: an end-to-end result with `goodput` and `min_slo` thresholds per system, `label` and
    `slo_rate` (flowprefill.EndToEnd, flowprefill_moe.MoEResult's model result)."""
    fig, (a, b) = figure(2)
    curve_panel(a, {n: t.curve for n, t in m.goodput.items()}, xlabel="request rate (req/s)",
                marks={n: t.value for n, t in m.goodput.items()}, title=f"{m.label}: attainment vs rate")
    curve_panel(b, {n: t.curve for n, t in m.min_slo.items()}, xlabel="SLO scale",
                marks={n: t.value for n, t in m.min_slo.items()},
                title=f"{m.label}: attainment vs SLO scale at {m.slo_rate:.2f} req/s")
    xs = [x for t in m.min_slo.values() for x, _ in t.curve]
    if xs:
        log_x(b, [t for t in SCALE_TICKS if min(xs) / 1.01 <= t <= max(xs) * 1.01])
    save(fig, rep.figure_path(file))
