"""A real-cluster row's per-request fidelity point, served more than once (issue 30).

One run of 24 requests does not pin a P50 down on a VM: the same server at the same rate gives
TTFT P50s far apart from one run to the next (the report's "real runs" column shows how far), so
holding the simulator to 15 % of one run measures that run's luck as much as the simulator.
So the point is served `repeats` times on the row's server, each run between two speed checks
(the check after one run is the check before the next) and each simulated at its own speed; P50
and P90 come from the requests of all runs pooled, real and simulated alike, and the row keeps
every run's numbers so that the report shows the real runs' own spread beside the simulator's
error.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Callable

from real_cluster_speed import fixed_checks_cell
from real_cluster_verdicts import _err, _pct

from flowyard.core.metrics import summarize
from flowyard.experiments.report import md_table


def point_of(states: list) -> dict:
    """The numbers a row keeps of a run's requests (every request counts, finished or not)."""
    s = summarize(states)
    return {"attainment": s.slo_attainment, "ttft_p50": s.ttft["p50"], "ttft_p90": s.ttft["p90"],
            "tpot_p50": s.tpot["p50"], "tpot_p90": s.tpot["p90"], "completed": s.completed}


def pooled(runs: list[list]) -> dict:
    """`point_of` over the requests of every run together."""
    return point_of([s for run in runs for s in run])


def geomean(speeds: list[list[float]]) -> list[float]:
    """The geometric mean, kind by kind, of speed vectors ([speed, prompt steps, decodes])."""
    return [round(math.exp(statistics.fmean(math.log(s[k]) for s in speeds)), 3) for k in range(len(speeds[0]))]


def checked_now(check) -> list[float]:
    """[speed, prompt steps' speed, decodes' speed] now; the speed alone from a check without drift."""
    speed = check()
    return [speed, *check.last_drift] if check.last_drift is not None else [speed]


def fixed_row(check, serve: Callable[[], list], simulate: Callable[[float, list | None], list],
              repeats: int = 1) -> dict:
    """The fixed-rate point: `serve()` (a real run's request states) `repeats` times, the
    machine's speed checked before the first and after every run; `simulate(speed, drift)` (the
    simulator's states) once per run at the geometric mean of the checks around it. The row's
    'real' and 'sim' are pooled over the runs; 'fixed_speed' and 'fixed_drift' are the geometric
    mean over the runs; 'fixed_checks' every check in order; 'fixed_runs' (with repeats > 1)
    each run's own real and simulated numbers."""
    if repeats < 1:
        raise ValueError(f"a fixed point is served at least once, got repeats={repeats}")
    checks, real = [checked_now(check)], []
    for _ in range(repeats):
        real.append(serve())
        checks.append(checked_now(check))
    speeds = [geomean([a, b]) for a, b in zip(checks, checks[1:])]
    sim = [simulate(s[0], s[1:] if len(s) == 3 else None) for s in speeds]
    overall = geomean(speeds)
    row = {"real": pooled(real), "sim": pooled(sim), "fixed_speed": overall[0],
           "fixed_drift": overall[1:] if len(overall) == 3 else None, "fixed_checks": checks}
    if repeats > 1:
        row["fixed_runs"] = [{"real": point_of(r), "sim": point_of(s), "speed": sp} for r, s, sp in zip(real, sim, speeds)]
    return row


def resimulate(row: dict, simulate: Callable[[float, list | None], list]) -> None:
    """A row's simulated fixed point again, each run at the speed recorded for it (and from its
    steps' speeds where they were read, `add_observed`), for `--resim`; the real runs stay as
    they were measured."""
    runs = row.get("fixed_runs") or []
    speeds = [r["speed"] for r in runs] or [[row.get("fixed_speed", 1.0), *(row.get("fixed_drift") or [])]]
    sims = [simulate(s[0], s[1:] if len(s) == 3 else None) for s in speeds]
    row["sim"] = pooled(sims)
    for run, states in zip(runs, sims):
        run["sim"] = point_of(states)
    if row.get("observed_speeds"):
        add_observed(row, row["observed_speeds"], simulate)


def mean_context(w) -> float:
    """The context a decode of `w` has on average: its mean prompt plus half its mean output (the
    price of a decode run's steps, which timelines record without their shapes)."""
    reqs = w.workload.requests
    return statistics.mean(r.prompt_len for r in reqs) + statistics.mean(r.target_output for r in reqs) / 2


def timeline_speed(timeline: Path, cost, decode_ctx: float) -> list[float]:
    """[speed, prompt-bearing steps, decodes]: the medians of a served run's step durations over
    the price `cost` puts on the batch its timeline recorded (real_cluster_steps.step_ratios), the
    speed the run's own steps ran at, where the checks only bracket it. `cost` is the clock the
    simulator scales by that speed (the profile with the run's served-step terms): read against
    the bare profile, the per-step serving time would be in the speed and then added again."""
    from real_cluster_steps import real_steps, step_ratios  # it imports this module's importer

    ratios = step_ratios(real_steps(timeline), cost, decode_ctx)
    prompt = ratios.get("prefill", []) + ratios.get("mixed", [])
    decode = ratios.get("decode") or prompt
    if not decode:
        raise ValueError(f"{timeline} records no step to take a speed from")
    p, d = statistics.median(prompt or decode), statistics.median(decode)
    return [round(math.sqrt(p * d), 3), round(p, 3), round(d, 3)]


def other_runs(speeds: list[list[float]], i: int) -> list[float]:
    """The geometric mean, kind by kind, of every run's step speed but the i-th's."""
    return geomean([s for j, s in enumerate(speeds) if j != i])


def add_observed(row: dict, speeds: list[list[float]], simulate: Callable[[float, list | None], list]) -> None:
    """The row's runs simulated again from the speeds their steps ran at (`timeline_speed`, one
    per run in order, kept in 'observed_speeds'). 'sim_observed': each run at its own, a
    diagnostic, since the clock is then fitted on the very steps whose requests are compared (what
    error remains is the simulator's scheduling and queueing, not the machine's drift).
    'sim_loro' (two runs or more): each run at the other runs' speeds, leave one run out, so
    the clock comes from served steps of the same point, as a check's does not, and still from
    none of the run it predicts."""
    row["observed_speeds"] = speeds
    row["sim_observed"] = pooled([simulate(s[0], s[1:]) for s in speeds])
    if len(speeds) > 1:
        row["sim_loro"] = pooled([simulate(o[0], o[1:]) for o in (other_runs(speeds, i) for i in range(len(speeds)))])


def observed_table(rows: list[dict]) -> list[str]:
    """The rows simulated from their runs' step speeds (none: nothing): each run at its own, and
    where there are two runs or more, at the others'."""
    mine = [r for r in rows if r.get("sim_observed")]
    if not mine:
        return []
    keys = ("ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90")

    def errs(r: dict, sim: str) -> list[str]:
        return [_pct(_err(r[sim][k], r["real"][k])) if sim in r else "—" for k in keys]

    return ["", "### The same points clocked at the speed served steps ran at", "",
            "Each run's server recorded a timeline; a run's step speed is the median of its prompt-bearing "
            "steps' and of its decodes' durations over their profile price (\"steps\", p and d per run). "
            "\"Own\" clocks each simulated run at its own run's speeds: fitted on the steps of the very run it "
            "is compared with, it is a diagnostic of what remains of the simulator's scheduling and queueing "
            "once the machine's drift is known. \"Others\" clocks each at the geometric mean of the other "
            "runs' speeds (leave one run out): served steps of the same point, none of the run it predicts.", "",
            md_table(["executor", "workload", "policy", *(f"{k.replace('_', ' ').upper()} err own / others"
                                                          for k in keys), "steps (p, d)"],
                     [[r["executor"], r["workload"], f"`{r['policy']}`",
                       *(f"{a} / {b}" for a, b in zip(errs(r, "sim_observed"), errs(r, "sim_loro"))),
                       ", ".join(f"{s[1]:.2f}, {s[2]:.2f}" for s in r["observed_speeds"])] for r in mine])]


def runs_cell(row: dict, key: str) -> str:
    """The real runs' own range of `key` (ms), for the report ('—' for a point served once)."""
    runs = row.get("fixed_runs")
    if not runs:
        return "—"
    vals = [r["real"][key] * 1e3 for r in runs]
    return f"{min(vals):.0f}–{max(vals):.0f}"


def fixed_table(rows: list[dict]) -> list[str]:
    """The report's per-request fidelity table, with the note on how it was measured."""
    out: list[str] = []
    if any(r.get("fixed_checks") for r in rows):
        out += ["\"Machine\" is the speed check right before the point → right after it (→ after each further "
                "run where the point was served more than once); each run is simulated at the geometric mean "
                "of the checks around it.", ""]
    repeated = any(r.get("fixed_runs") for r in rows)
    if repeated:
        out += ["Where a point was served more than once, P50 and P90 pool the requests of all its runs, real "
                "and simulated alike, and \"real runs\" is the range of the single runs' P50s: the "
                "measurement's own spread (benchmarks/real_cluster_fixed.py).", ""]
    runs = (lambda r, k: [runs_cell(r, k)]) if repeated else (lambda r, k: [])
    head = ["executor", "workload", "policy", "rate", "TTFT P50 real / sim (ms)", "err",
            *(["real runs"] if repeated else []), "TTFT P90 err", "TPOT P50 real / sim (ms)", "err",
            *(["real runs"] if repeated else []), "TPOT P90 err", "machine"]
    out.append(md_table(head, [
        [r["executor"], r["workload"], f"`{r['policy']}`", f"{r['fixed_rate']:g}",
         f"{r['real']['ttft_p50'] * 1e3:.0f} / {r['sim']['ttft_p50'] * 1e3:.0f}",
         _pct(_err(r["sim"]["ttft_p50"], r["real"]["ttft_p50"])), *runs(r, "ttft_p50"),
         _pct(_err(r["sim"]["ttft_p90"], r["real"]["ttft_p90"])),
         f"{r['real']['tpot_p50'] * 1e3:.0f} / {r['sim']['tpot_p50'] * 1e3:.0f}",
         _pct(_err(r["sim"]["tpot_p50"], r["real"]["tpot_p50"])), *runs(r, "tpot_p50"),
         _pct(_err(r["sim"]["tpot_p90"], r["real"]["tpot_p90"])), fixed_checks_cell(r)] for r in rows]))
    return out + observed_table(rows)
