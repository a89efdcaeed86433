"""A real-cluster run clocked by the steps its servers ran (`real_cluster.py --observed-speed`).

The speed checks (real_cluster_speed.py) time reference steps in the bench process while the
server idles. On some evenings they misread the served steps by a factor: decodes timed at
1.7-2.4x their price while the servers' own decodes ran at 1.1-1.3x
(docs/results/real_cluster_conv_mixed_zen3_observed.md). Clocked by the servers' own steps,
taken from runs other than the one predicted, the simulator met the per-request targets there.

So with `--observed-speed` every real point of a row, its search's rates and its fixed point
alike, is served on a fresh server that records a timeline, and each point's step speed is read
from it (real_cluster_fixed.timeline_speed). The row is then simulated again from those speeds,
never from the steps of the point being predicted:

- its goodput, clocked at the search points outside the real bracket (leave the bracket out:
  the two points that locate the goodput give no speed to the simulation judged against them);
- its fixed point, clocked at the search's points (the fixed run is none of them);
- and, as a diagnostic only, each search point at its own steps' speed: what the simulator's
  scheduling and queueing get wrong once the machine's speed is known.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from real_cluster_fixed import geomean, mean_context, point_of, timeline_speed
from real_cluster_verdicts import _err, _pct, bracket, distance

from flowyard.experiments.report import md_table


@dataclass
class ServedRuns:
    """Runs of one row, each on a fresh server (`server(tag)`) that writes a timeline into
    `work`; `speeds` gets each run's [speed, prompt-bearing steps, decodes] in order, read
    against `cost`, the simulator's clock at speed 1 (`timeline_speed`)."""

    server: Callable[[str], object]
    work: Path
    tag: str
    cost: object
    speeds: list[list[float]] = field(default_factory=list)

    def states(self, w, rate: float, slos) -> list:
        from real_cluster_lib import timeline_states

        run = f"{self.tag}-{len(self.speeds)}"
        timeline = self.work / f"timeline-{run}.json"
        timeline.unlink(missing_ok=True)  # a resumed run must not read an earlier attempt's steps
        states = timeline_states(self.server(run), timeline, w, rate, slos)
        self.speeds.append(timeline_speed(timeline, self.cost, mean_context(w)))
        return states


def reread_speeds(row: dict, work: Path, clock, search_ctx: float, fixed_ctx: float) -> bool:
    """A row's served step speeds read again from the timelines its run left in `work`, against
    `clock` (for `--resim`, after the clock's terms changed); False, and the row untouched, where
    any timeline is missing."""
    tag = f"{row['policy']}-{row['executor']}-{row['workload']}"
    observed = row.get("real_observed") or []
    search = [work / f"timeline-{tag}-{i}.json" for i in range(len(observed))]
    fixed = [work / f"timeline-{tag}-fixed-{i}.json" for i in range(len(row.get("observed_speeds") or []))]
    if not search + fixed or not all(p.exists() for p in search + fixed):
        return False
    row["real_observed"] = [[o[0], *timeline_speed(p, clock, search_ctx)] for o, p in zip(observed, search)]
    if fixed:
        row["observed_speeds"] = [timeline_speed(p, clock, fixed_ctx) for p in fixed]
    return True


def bracket_out(row: dict) -> tuple[list[float] | None, int]:
    """The clock of a row's simulated goodput: the geometric mean of the step speeds of its real
    search points other than the two at its bracket's edges, with how many points gave it
    (None, 0: no other point was served)."""
    lo, hi = bracket(row)
    rest = [s for r, *s in row.get("real_observed") or [] if r not in (lo, hi)]
    return (geomean(rest), len(rest)) if rest else (None, 0)


def add_served_clock(row: dict, search_at: Callable[[float, list], object],
                     attainment_at: Callable[[float, float, list], float],
                     fixed_at: Callable[[float, list], list]) -> None:
    """The row simulated from its points' served step speeds ('real_observed': [rate, speed,
    prompt steps, decodes] per search point): 'sim_goodput_served' and 'sim_curve_served'
    (`search_at(speed, drift)`, leave the bracket out), 'sim_served' (the fixed point at the
    search points' speeds, `fixed_at`) and 'sim_own_curve' (each search point at its own speed,
    `attainment_at(rate, speed, drift)`, a diagnostic)."""
    observed = row.get("real_observed") or []
    if not observed:
        return
    row["sim_own_curve"] = [[r, attainment_at(r, s, [p, d])] for r, s, p, d in observed]
    served_fixed_point(row, fixed_at)
    clock, n = bracket_out(row)
    row["served_clock"], row["served_clock_points"] = clock, n
    if clock is None:
        row.pop("sim_goodput_served", None)
        return
    sim = search_at(clock[0], clock[1:])
    row["sim_goodput_served"], row["sim_curve_served"] = sim.goodput, sim.curve


def served_fixed_point(row: dict, fixed_at: Callable[[float, list], list]) -> None:
    """'sim_served': the row's fixed point simulated at the geometric mean of its search points'
    served step speeds (nothing for a row without them)."""
    observed = row.get("real_observed") or []
    if observed:
        clock = geomean([o[1:] for o in observed])
        row["sim_served"] = point_of(fixed_at(clock[0], clock[1:]))


def served_section(rows: list[dict]) -> list[str]:
    """The report's section on rows clocked by their served steps (none: nothing)."""
    mine = [r for r in rows if r.get("real_observed")]
    if not mine:
        return []

    def curve(pairs: list) -> str:
        return ", ".join(f"{r:.2f}: {a:.0%}" for r, a in sorted(pairs))

    def points(r: dict) -> str:
        got = dict((rate, a) for rate, a in r["real_curve"])
        return ", ".join(f"{o[0]:.2f}: {got[o[0]]:.0%} ({o[2]:.2f}, {o[3]:.2f})" for o in sorted(r["real_observed"]))

    def span(r: dict) -> str:
        lo, hi = bracket(r)
        return f"{lo:.3f} – {hi:.3f}" if hi != float("inf") else f"{lo:.3f} – ∞"

    def goodput(r: dict) -> list[str]:
        if "sim_goodput_served" not in r:
            return ["—", "—", "—"]
        c = r["served_clock"]
        return [f"{r['sim_goodput_served']:.3f}", _pct(distance(r["sim_goodput_served"], *bracket(r))),
                f"p {c[1]:.2f}, d {c[2]:.2f} ({r['served_clock_points']} points)"]

    fixed = [[r["executor"], r["workload"], f"`{r['policy']}`",
              *(_pct(_err(r["sim_served"][k], r["real"][k])) for k in ("ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90"))]
             for r in mine if r.get("sim_served")]
    return ["", "## Clocked by the served steps (`--observed-speed`)", "",
            "Every real point of these rows was served on a fresh server that recorded a timeline, and its step "
            "speed read from it: the median duration over the profile's price of its prompt-bearing steps (p) and "
            "of its decodes (d) (benchmarks/real_cluster_observed.py). The simulated goodput here is clocked at "
            "the geometric mean of the search points outside the real bracket (the two points that locate the "
            "goodput lend it no speed); the fixed point at the search points' (none of its own steps). \"Own "
            "speed\" simulates each real point at its own steps' speed: a diagnostic of the simulator's scheduling "
            "and queueing once the machine's speed is known, not a prediction.", "",
            md_table(["executor", "workload", "policy", "real (bracket)", "simulated, served clock", "sim outside",
                      "clock", "real points (rate: attainment, p, d)", "own speed (simulated)"],
                     [[r["executor"], r["workload"], f"`{r['policy']}`",
                       span(r), *goodput(r), points(r), curve(r.get("sim_own_curve") or [])] for r in mine]),
            "", "Per-request error at the fixed rate, clocked at the search points' served step speeds:", "",
            md_table(["executor", "workload", "policy", "TTFT P50 err", "TTFT P90 err", "TPOT P50 err",
                      "TPOT P90 err"], fixed)]
