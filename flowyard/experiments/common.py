"""Shared machinery of the paper reproductions: simulation points, searches, figures, reports.

- `Scenario`: one cluster (model, hardware, TP, instances) with one unscaled workload and its
  cost model; `point(policy, rate, ...)` runs the simulator at a request rate (Arrow's
  timestamp scaling of that workload) and an SLO scale, with optional FlowPrefill knobs, and
  memoises the result, so a curve and the search that refines it share their runs.
- `threshold_search`: evaluate a grid (the plotted curve), then bisect the first crossing of
  the attainment target: the highest rate (goodput) or the lowest SLO scale that meets it.
- `Report`, tables, number formats and figure panels live in `report.py`, re-exported here.

Everything is deterministic for a seed: workloads are seeded, the simulator is exact.
"""

from __future__ import annotations

import math
from pathlib import Path
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from flowyard.core.metrics import EPS, meets_slo, summarize, tbt, ttft
from flowyard.core.request import RequestState, Status
from flowyard.costmodel.base import CostModel
from flowyard.policies.flowprefill.scheduler import FlowPrefillConfig
from flowyard.policies.registry import build_policy
from flowyard.sim.run import SimConfig, build_simulator, policy_options
from flowyard.sim.simulator import SimulationError
from flowyard.sweep import Pending, current, digest
from flowyard.experiments.report import (BAND, Report, band_verdict, bar_panel, curve_panel,  # noqa: F401
                                         figure, gain_verdict, fmt_ms, fmt_range, fmt_x, log_x, md_table, ratio, save, source_revision)
from flowyard.workloads import Workload

Log = Callable[[str], None]


def stderr_log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass(frozen=True, slots=True)
class Point:
    """One simulation's numbers (what reports need; no request states are kept)."""

    attainment: float
    throughput_rps: float  # completed requests / makespan
    input_tokens_per_s: float  # prompt tokens / makespan
    ttft_p50: float
    ttft_p99: float
    by_task: dict[str, float]  # attainment per request task tag
    blocking: tuple[float, ...]  # preemption blocking times (s), FlowPrefill only
    wall_s: float
    events: int
    error: str = ""  # the run did not finish (SimulationError): attainment is NaN, counted as a miss
    # attainment of each objective alone ("ttft", "tbt"), over the requests that carry it
    by_objective: dict[str, float] = field(default_factory=dict)

    def blocking_stats(self) -> dict[str, float]:
        b = np.asarray(self.blocking, float)
        if not len(b):
            return {"count": 0, "mean": math.nan, "p99": math.nan, "max": math.nan}
        return {"count": len(b), "mean": float(b.mean()), "p99": float(np.percentile(b, 99)),
                "max": float(b.max())}


def run_point(cfg: SimConfig, workload: Workload, cost: CostModel,
              flowprefill: FlowPrefillConfig | None = None) -> Point:
    """One simulation as `flowyard.sim.run.simulate` assembles it, plus FlowPrefill's knobs.
    A run that ends with requests stuck (a scheduler deadlock) gives a Point with NaN numbers
    and the error, so a sweep records it as a miss instead of stopping."""
    policy = build_policy(cfg.policy, policy_options(cfg, cost, flowprefill=flowprefill))
    sim = build_simulator(cfg, workload, cost_model=cost, policy=policy)
    try:
        res = sim.run()
    except SimulationError as e:
        nan = math.nan
        return Point(nan, nan, nan, nan, nan, {}, (), 0.0, 0, error=f"{type(e).__name__}: {e}")
    s = summarize(res.states, policy=cfg.policy, wall_s=res.wall_s)
    tasks: dict[str, list[bool]] = {}
    for st in res.states:
        tasks.setdefault(st.req.task or "-", []).append(meets_slo(st))
    return Point(s.slo_attainment, s.throughput_rps,
                 s.input_tokens / s.duration_s if s.duration_s > 0 else 0.0,
                 s.ttft["p50"], s.ttft["p99"], {k: float(np.mean(v)) for k, v in sorted(tasks.items())},
                 tuple(res.preemption_blocking), res.wall_s, res.events, by_objective=objective_attainment(res.states))


def objective_attainment(states: Sequence[RequestState]) -> dict[str, float]:
    """Per objective (TTFT, TBT), the share of the requests carrying it that finished and met it
    alone (`meets_slo` judges all of a request's objectives together): a colocated scheduler
    trades one against the other (FlowPrefill Fig. 16 plots each)."""
    out: dict[str, float] = {}
    for name in ("ttft", "tbt"):
        carry = [st for st in states if getattr(st.req.slo, name) is not None]
        if not carry:
            continue
        met = 0
        for st in carry:
            limit = float(getattr(st.req.slo, name)) + EPS
            if st.status is not Status.FINISHED or st.first_token_time is None:
                continue
            if name == "ttft":
                t = ttft(st)
                met += int(t is not None and t <= limit)
            else:
                gaps = tbt(st)
                met += int(not len(gaps) or float(gaps.max()) <= limit)
        out[name] = float(met / len(carry))
    return out


@dataclass
class Tally:
    """Work done by all scenarios of one experiment (for the report's footer)."""

    runs: int = 0
    events: int = 0
    sim_wall_s: float = 0.0
    failures: list[str] = field(default_factory=list)  # "what: error" of runs that did not finish

    def record(self, what: str, wall_s: float, error: str | None, events: int = 0) -> None:
        """Count one simulation; keep "what: error" when it did not finish."""
        self.runs += 1
        self.events += events
        self.sim_wall_s += wall_s
        if error:
            self.failures.append(f"{what}: {error}")


class Scenario:
    """A cluster and an unscaled workload whose mean arrival rate is `base_rate` req/s."""

    def __init__(self, name: str, cfg: SimConfig, workload: Workload, cost: CostModel, *,
                 tally: Tally | None = None, log: Log | None = None) -> None:
        self.name, self.cfg, self.workload, self.cost = name, cfg, workload, cost
        t = workload.arrivals()
        self.base_rate = (len(t) - 1) / (t[-1] - t[0]) if len(t) > 1 and t[-1] > t[0] else 1.0
        self.tally = tally if tally is not None else Tally()
        self.log = log
        self._cache: dict[tuple, Point] = {}
        self._slo_scaled: dict[float, Workload] = {1.0: workload}

    def _with_slo(self, factor: float) -> Workload:
        if factor not in self._slo_scaled:
            from flowyard.workloads.multitask import scale_slo

            self._slo_scaled[factor] = scale_slo(self.workload, factor)
        return self._slo_scaled[factor]

    def point(self, policy: str, rate: float, *, slo_scale: float = 1.0,
              flowprefill: FlowPrefillConfig | None = None, label: str | None = None) -> Point:
        key = (policy, round(rate, 9), round(slo_scale, 9), flowprefill)
        if key not in self._cache:
            if math.isnan(rate) or math.isnan(slo_scale):
                current().blocked()  # asked at a stand-in of a pending search
            cfg = self.cfg.replace(policy=policy, rate_scale=rate / self.base_rate)
            w = self._with_slo(slo_scale)
            p = current().value(("run_point", cfg.as_dict(), repr(flowprefill), digest(w), repr(self.cost)),
                                run_point, cfg, w, self.cost, flowprefill)
            self.tally.record(f"{self.name}, {label or policy}, {rate:.3f} req/s, SLO x{slo_scale:g}", p.wall_s,
                              p.error, p.events)
            if self.log is not None:
                self.log(f"  {self.name:>12} {label or policy:>16}  rate {rate:7.3f}  slo x{slo_scale:5.2f}"
                         f"  attainment {p.attainment:6.1%}  ({p.wall_s:.2f} s)")
            self._cache[key] = p
        return self._cache[key]


@dataclass
class Threshold:
    """Result of `threshold_search`: `value` is the best x meeting the target (0 for a max
    search / inf for a min search when none does); `curve` every evaluated (x, attainment)."""

    value: float
    curve: list[tuple[float, float]] = field(default_factory=list)
    capped: bool = False  # still met at the last point tried: the true value lies beyond
    never_met: bool = False

    def text(self, fmt: str = "{:.2f}") -> str:
        if self.never_met:
            return "not met"
        return (">= " if self.capped and math.isfinite(self.value) and self.value > 0 else "") + fmt.format(self.value)


def threshold_search(f: Callable[[float], float], grid: Sequence[float], target: float = 0.9, *,
                     find: str = "max", tol: float = 0.03, extend: int = 3) -> Threshold:
    """find="max": the largest x with f(x) >= target, f non-increasing (rate -> attainment);
    find="min": the smallest such x, f non-decreasing (SLO scale -> attainment).

    Every grid point is evaluated (the curve). Scanning from the easy end, the first failing
    point and the passing point before it bracket the crossing, which is bisected until the
    bracket is within `tol` (relative). If every grid point passes, the search extends
    beyond (x2 / x0.5) up to `extend` times; if none does, it retreats likewise."""
    if find not in ("max", "min"):
        raise ValueError(f"find must be 'max' or 'min', got {find!r}")
    seen: dict[float, float] = {}

    def ok(x: float) -> bool:
        if x not in seen:
            seen[x] = float(f(x))
        return seen[x] >= target - 1e-9

    def done(**kw) -> Threshold:
        return Threshold(curve=sorted(seen.items()), **kw)

    harder = (lambda x: x * 2) if find == "max" else (lambda x: x / 2)
    easier = (lambda x: x / 2) if find == "max" else (lambda x: x * 2)
    pts = sorted(grid, reverse=(find == "min"))  # easy end first
    if not pts:
        raise ValueError("threshold_search needs a grid of at least one point")
    flags, pending = [], None
    for x in pts:  # every grid point is asked for before any is waited on (parallel sweeps)
        try:
            flags.append(ok(x))
        except Pending as e:
            pending = e
    if pending is not None:
        raise pending
    good: float | None = None
    bad: float | None = None
    for x, passed in zip(pts, flags):
        if not passed:
            bad = x
            break
        good = x
    if bad is None:  # all pass: push on
        assert good is not None  # the grid is not empty
        x = good
        for _ in range(extend):
            x = harder(x)
            if not ok(x):
                bad = x
                break
            good = x
        else:
            return done(value=good, capped=True)
    if good is None:  # the easiest grid point fails: retreat
        assert bad is not None  # the grid is not empty
        x = bad
        for _ in range(extend):
            x = easier(x)
            if ok(x):
                good = x
                break
            bad = x
        else:
            return done(value=0.0 if find == "max" else math.inf, never_met=True)
    assert good is not None and bad is not None  # the scans above bracket the crossing
    while abs(bad - good) > tol * max(abs(bad), abs(good)):
        mid = 0.5 * (good + bad)
        if ok(mid):
            good = mid
        else:
            bad = mid
    return done(value=good)


class Stopwatch:
    def __init__(self) -> None:
        self.start = time.perf_counter()

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start


def output_dir(out: str | Path) -> Path:
    """The report directory; an existing file in its place is an error that says so."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise OSError(f"--out '{out}' exists and is not a directory")
    return out


def reproduce_command(name: str, quick: bool, seed: int, out: Path) -> str:
    """The command line that reproduces a report (printed in it)."""
    parts = [f"flowyard reproduce {name}"] + ([f"--out {out}"] if str(out) != "docs/results" else [])
    return " ".join(parts + (["--quick"] if quick else []) + ([f"--seed {seed}"] if seed else []))
