"""More real rates for rows a finished search left open (`real_cluster.py --add-rates`).

A search of four rates brackets a goodput, often too widely to decide a verdict: flowyard's
bracket may overlap the best other policy's only at its upper end. Measuring that policy once
more, at the rate that decides the verdict, is cheaper than a new search. Added points join the
row's curve, and the goodput is read again from the whole curve with a rule that a lucky point
cannot raise: the highest rate that met the SLOs below the lowest rate that did not. A rate
measured twice with different outcomes counts as a miss there. Each added point records its
revision, when it ran and the machine's step price then relative to the run's profile, since
the machine's speed drifts over hours (`machine_speed`).
"""

from __future__ import annotations

import math
import time

from real_cluster_verdicts import TARGET


def parse_add_rates(spec: str) -> dict[str, list[float]]:
    """'flowprefill=1.9/2.0,flowyard=2.3' -> {'flowprefill': [1.9, 2.0], 'flowyard': [2.3]}."""
    out: dict[str, list[float]] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        policy, sep, rates = part.partition("=")
        try:
            values = [float(r) for r in rates.split("/")] if sep else []
        except ValueError:
            values = []
        if not policy or not values or any(not math.isfinite(v) or v <= 0 for v in values):
            raise ValueError(f"--add-rates: {part!r} is not POLICY=RATE[/RATE...] with positive rates in req/s")
        out.setdefault(policy, []).extend(values)
    if not out:
        raise ValueError("--add-rates: no POLICY=RATE given")
    return out


def goodput_of(curve: list) -> float:
    """The highest rate that met the target below the lowest rate that missed it (0 if none met
    there). On the curve of one search this is the goodput the search reported."""
    missed = [r for r, a in curve if a < TARGET - 1e-9]
    first_miss = min(missed, default=math.inf)
    met = [r for r, a in curve if a >= TARGET - 1e-9 and r < first_miss]
    return max(met, default=0.0)


def add_point(row: dict, rate: float, attainment: float, revision: str | None, speed: float) -> None:
    """Put one measured rate into a row: its curve, its goodput, and its list of added points."""
    row["real_curve"] = sorted([*row["real_curve"], [rate, attainment]])
    row["real_goodput"] = goodput_of(row["real_curve"])
    row.setdefault("added", []).append({
        "rate": rate, "attainment": attainment, "revision": revision,
        "at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "step_price_vs_slo_profile": speed})


def added_note(rows: list[dict]) -> list[str]:
    """The report's lines on added points (none: no lines)."""
    lines = []
    for r in rows:
        for p in r.get("added", []):
            lines.append(f"- {r['executor']} {r['workload']} `{r['policy']}`: {p['rate']:.3f} req/s → "
                         f"{p['attainment']:.0%}, measured {p['at']} at {p['revision'] or 'unknown'}; the machine's "
                         f"steps then cost {p['step_price_vs_slo_profile']:.2f}× the run's profile")
    if not lines:
        return []
    return ["", "Rates added after the searches (`--add-rates`), in the curves above; goodput read again "
            "from each whole curve (the highest rate that met the SLOs below the lowest that did not):", "",
            *lines]
