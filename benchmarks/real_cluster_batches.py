"""Real vs simulated steps of a real-cluster run's fixed-rate point, instance by instance, and how
steeply the simulated TPOT percentiles move with the clock.

Why: in the Zen 3 conv-mixed run clocked by served steps, the simulated fixed-point TPOT of
`distserve` and `pla` sat about 40 % above the real one while the prefill instance's busy time
agreed; the simulated decode instance ran fewer, dearer steps. This tells the two possible causes
apart. It reads a finished `real_cluster.py --observed-speed` run (every served run left a
timeline) and simulates each fixed run again at the speed its own served steps ran at, recording
a timeline too: if the simulated instances then run the steps the real ones ran (count, batch
sizes, busy time), the scheduling model is right and the gap was the clock. Then it simulates the
run across a range of clock speeds: the slope of ln P50 over ln speed says how far a percentile
of this many requests moves for a clock a few percent off, which bounds how closely the
fixed point can be checked at all.

    python benchmarks/real_cluster_batches.py --work WORK [--timelines DIR] --policies distserve,pla \
        --out docs/results/real_cluster_decode_batches.md

WORK is the run's work dir (rows.json, meta.json, its profiles); --timelines the dir holding
its timelines when they are elsewhere (a `--resim` copy keeps the rows, the original the
timelines).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from real_cluster_fixed import point_of
from real_cluster_lib import fixed_workload, make_workload, run_slos, served_clock, sim_states
from real_cluster_steps import steps_of

from flowyard.cluster.timeline import Timeline
from flowyard.core.metrics import tpot
from flowyard.core.plan import BatchShape
from flowyard.costmodel.profiled import ProfiledCostModel
from flowyard.experiments.provenance import machine
from flowyard.experiments.report import heading, md_table, source_revision

SPEEDS = (0.8, 0.85, 0.9, 0.95, 1.0, 1.05, 1.1)


def by_instance(trace: dict) -> dict[int, list]:
    """`steps_of` each instance (a timeline's pid) of a Chrome trace."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    pids = sorted({e.get("pid", 0) for e in events if e.get("ph") == "X" and e.get("pid", 0) < 1_000_000})
    return {p: steps_of({"traceEvents": [e for e in events if e.get("pid", 0) == p]}) for p in pids}


def step_rows(label: str, instances: dict[int, list]) -> list[tuple]:
    """One row per instance and step kind: steps, busy seconds, median step, mean decodes."""
    rows = []
    for pid, steps in instances.items():
        kinds: dict[str, list] = {}
        for kind, dur, _p, n, _t, _s in steps:
            kinds.setdefault(kind, []).append((dur, n))
        for kind, v in sorted(kinds.items()):
            durs = [d for d, _ in v]
            rows.append((label, pid, kind, len(v), f"{sum(durs):.1f}", f"{1e3 * statistics.median(durs):.1f}",
                         f"{statistics.mean(n for _, n in v):.2f}", f"{max(n for _, n in v)}"))
    return rows


def slope(speeds: list[float], values: list[float]) -> tuple[float, float]:
    """(overall, steepest adjacent) d ln value / d ln speed: 1 means the percentile moves as the
    clock does, more means the clock's error is amplified."""
    pts = [(math.log(s), math.log(v)) for s, v in zip(speeds, values) if v > 0]
    if len(pts) < 2:
        raise ValueError("a slope needs two positive values")
    overall = (pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0])
    steep = max(abs(b[1] - a[1]) / (b[0] - a[0]) for a, b in zip(pts, pts[1:]))
    return overall, steep


class Run:
    """A finished run's fixed-rate point of one policy, ready to simulate again."""

    def __init__(self, work: Path, policy: str) -> None:
        rows = json.loads((work / "rows.json").read_text())
        self.meta = json.loads((work / "meta.json").read_text())
        row = next((r for r in rows if r["policy"] == policy and r.get("observed_speeds")), None)
        if row is None:
            raise SystemExit(f"real_cluster_batches: {work}/rows.json has no --observed-speed row of {policy!r}")
        self.row, self.executor = row, row["executor"]
        serving = work / f"serving-{self.executor}.json"  # a --resim's refit, else the run's own
        self.fit = json.loads(serving.read_text()) if serving.exists() else self.meta["serving"][self.executor]
        slo_cost = ProfiledCostModel(str(work / f"profile-{self.executor}.json"))
        slos = run_slos(self.meta, rows, self.executor, slo_cost)
        self.path = work / row.get("profile", f"profile-{self.executor}.json")
        self.cost = ProfiledCostModel(str(self.path))
        n = self.meta.get("fixed_requests") or self.meta["requests_per_point"]
        self.workload = fixed_workload(row["workload"], n, row["fixed_rate"], slos, slo_cost)
        self.search = make_workload(row["workload"], self.meta["requests_per_point"], slos, slo_cost)

    def clock(self, speed: float, drift=None, row_s: float = 0.0):
        """The served clock at `speed`, with `row_s` more seconds per sampled row (at the
        profile's speed) than the run's served-step terms."""
        fit = {**self.fit, "row_s": float(self.fit.get("row_s", 0.0)) + row_s} if row_s else self.fit
        return served_clock(self.path, fit, self.cost, speed, drift)

    def simulate(self, speed: float, drift=None, timeline: Timeline | None = None, rate: float | None = None,
                 row_s: float = 0.0) -> list:
        """The fixed point (or, given a `rate`, the search's workload at that rate) on the served
        clock at `speed` (`row_s`: see `clock`)."""
        clock = self.clock(speed, drift, row_s)
        w = self.workload if rate is None else self.search
        return sim_states(w, self.row["fixed_rate"] if rate is None else rate, self.row["policy"], clock,
                          self.executor == "local", self.cost, timeline)


def section(run: Run, timelines: Path, i: int) -> list[str]:
    """The i-th fixed run: its real steps beside the simulated ones at its own served speed."""
    r = run.row
    name = f"timeline-{r['policy']}-{run.executor}-{r['workload']}-fixed-{i}.json"
    speed = r["observed_speeds"][i]
    tl = Timeline()
    sim = run.simulate(speed[0], speed[1:], tl)
    real_point = (r.get("fixed_runs") or [{"real": r["real"]}])[i]["real"]  # one run: the row's own
    rows = step_rows("real", by_instance(json.loads((timelines / name).read_text())))
    rows += step_rows("simulated", by_instance(tl.to_chrome()))
    sim_point = point_of(sim)
    return [f"### `{r['policy']}`, fixed run {i} (served steps at {speed[0]:.3f}× the clock: prompt-bearing "
            f"{speed[1]:.3f}, decodes {speed[2]:.3f})", "",
            md_table(("run", "instance", "kind", "steps", "busy s", "median step ms", "mean decodes", "max decodes"),
                     rows), "",
            f"TPOT P50 / P90: real {real_point['tpot_p50'] * 1e3:.0f} / {real_point['tpot_p90'] * 1e3:.0f} ms, "
            f"simulated at this speed {sim_point['tpot_p50'] * 1e3:.0f} / {sim_point['tpot_p90'] * 1e3:.0f} ms.", ""]


def search_section(run: Run, timelines: Path, i: int) -> list[str]:
    """The i-th point of the real goodput search beside its simulation at the point's own served
    speed (attainment, percentiles and every instance's steps)."""
    r = run.row
    rate, *speed = r["real_observed"][i]
    name = f"timeline-{r['policy']}-{run.executor}-{r['workload']}-{i}.json"
    tl = Timeline()
    sim = point_of(run.simulate(speed[0], speed[1:], tl, rate=rate))
    real = next((p for p in r["real_curve"] if abs(p[0] - rate) < 1e-9), None)
    rows = step_rows("real", by_instance(json.loads((timelines / name).read_text())))
    rows += step_rows("simulated", by_instance(tl.to_chrome()))
    said = f"real attainment {real[1]:.0%}, " if real else ""
    return [f"### `{r['policy']}` at {rate:.3f} req/s, search point {i} (served steps at {speed[0]:.3f}× the clock)",
            "", md_table(("run", "instance", "kind", "steps", "busy s", "median step ms", "mean decodes",
                          "max decodes"), rows), "",
            f"{said}simulated at this speed {sim['attainment']:.0%}; simulated TTFT P50 {sim['ttft_p50']:.2f} s, "
            f"TPOT P50 {sim['tpot_p50'] * 1e3:.0f} ms.", ""]


BUCKETS = ((1, 1), (2, 2), (3, 3), (4, 4), (5, 8), (9, 12), (13, 64))


def decode_ratios(run: Run, timelines: Path) -> list[str]:
    """Every search point's decode-only steps over their price on the served clock at the point's
    own speed, by how many sequences the step decoded: a speed read as one median hides a price
    that is right for small batches and wrong for large ones."""
    r = run.row
    by: dict[tuple[int, int], list[float]] = {b: [] for b in BUCKETS}
    for i, (_rate, speed, prompt, decode) in enumerate(r.get("real_observed") or []):
        clock = run.clock(speed, [prompt, decode])
        trace = json.loads((timelines / f"timeline-{r['policy']}-{run.executor}-{r['workload']}-{i}.json").read_text())
        for kind, dur, _p, n, _t, shape in steps_of(trace):
            if kind != "decode" or shape is None:
                continue
            bucket = next(b for b in BUCKETS if b[0] <= n <= b[1])
            by[bucket].append(dur / float(clock.step_time(BatchShape(**shape))))
    rows = [(f"{lo}" if lo == hi else f"{lo}-{hi}", len(v), f"{statistics.median(v):.2f}",
             f"{sorted(v)[len(v) // 10]:.2f} – {sorted(v)[(9 * len(v)) // 10]:.2f}") for (lo, hi), v in by.items() if v]
    return [f"### `{r['policy']}`: served decode steps over their price, by batch (every search point, each at "
            "its own speed)", "", md_table(("decodes in the step", "steps", "median", "P10 – P90"), rows), ""]


def sensitivity(run: Run) -> list[str]:
    """The simulated fixed point across clock speeds (every kind of step at the same speed)."""
    points, tpots = [], []
    for s in SPEEDS:
        states = run.simulate(s, [s, s])
        points.append(point_of(states))
        tpots.append(sorted(x for x in map(tpot, states) if x is not None))
    p50 = [p["tpot_p50"] for p in points]
    overall, steep = slope(list(SPEEDS), p50)
    rows = [(f"{s:.2f}", f"{p['tpot_p50'] * 1e3:.0f}", f"{p['tpot_p90'] * 1e3:.0f}", f"{p['ttft_p50']:.2f}",
             " ".join(f"{1e3 * x:.0f}" for x in t)) for s, p, t in zip(SPEEDS, points, tpots)]
    return [f"### `{run.row['policy']}`: the simulated fixed point by clock speed", "",
            md_table(("speed", "TPOT P50 ms", "TPOT P90 ms", "TTFT P50 s", "every request's TPOT, ms"), rows), "",
            f"d ln(TPOT P50) / d ln(speed): {overall:.2f} from {SPEEDS[0]} to {SPEEDS[-1]}, "
            f"{steep:.2f} between the steepest adjacent speeds.", ""]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, required=True, help="a finished --observed-speed run's work dir")
    ap.add_argument("--timelines", type=Path, help="where its timelines are (default: --work)")
    ap.add_argument("--policies", default="distserve,pla")
    ap.add_argument("--search", action="store_true",
                    help="also every point of each policy's real goodput search, at its own served speed")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    if not (a.work / "rows.json").exists():
        ap.error(f"{a.work} holds no rows.json: not a finished real_cluster.py run")
    timelines = a.timelines or a.work
    runs = [Run(a.work, p) for p in a.policies.split(",")]
    rev, host = source_revision(), machine()
    lines = [heading(f"Real vs simulated steps of a real-cluster run's fixed points (report at {rev or 'unknown revision'})",
                     rev), "",
             f"Generated by `python benchmarks/real_cluster_batches.py --work {a.work} --timelines {timelines} "
             f"--policies {a.policies}` on {host['arch']}, {host['cpu']}. The run: "
             f"`{runs[0].meta.get('command', '?')}`. Each fixed run is simulated again at the speed its own served "
             "steps ran at (a diagnostic: the clock then comes from the very steps compared), with a timeline, so "
             "the instances' steps can be set side by side; then the fixed point is simulated at a range of clock "
             "speeds. The real prompt instance runs two steps more than the simulated one: the benchmark client's "
             "two one-token probes that fit its prompts to the server's token counts.", ""]
    for run in runs:
        for i in range(len(run.row["observed_speeds"])):
            lines += section(run, timelines, i)
        if a.search:
            for i in range(len(run.row.get("real_observed") or [])):
                lines += search_section(run, timelines, i)
            lines += decode_ratios(run, timelines)
        lines += sensitivity(run)
    a.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {a.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
