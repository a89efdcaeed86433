"""More measurements for a finished `real_cluster.py` run (its --work-dir): more real rates
for rows whose bracket leaves a verdict open (`--add-rates`), and the per-request fidelity
point again with more requests (`--refix N`): the P50 and P90 of a few dozen requests move by
tens of percent between two real runs of the same rate, more than the error being judged. And
the simulated searches again with this revision's (`--resim`), real points untouched."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path

from real_cluster_fit import export_timeline, serving_scale, with_export
from real_cluster_fixed import add_observed, fixed_row, mean_context, resimulate
from real_cluster_lib import (ExperimentConfig, Server, fixed_workload, make_workload, real_point, real_states,
                              run_slos, served_clock, sim_point, sim_states, write_report)
from real_cluster_observed import ServedRuns, add_served_clock, reread_speeds, served_fixed_point
from real_cluster_points import add_point, parse_add_rates
from real_cluster_speed import SpeedCheck, normalized, row_drift, row_speed

from flowyard.costmodel.profiled import ProfiledCostModel
from flowyard.experiments.report import source_revision


def _finished_run(args, flag: str) -> tuple[Path, list[dict], dict]:
    work = Path(args.work_dir or "")
    if args.work_dir is None or not (work / "rows.json").exists() or not (work / "meta.json").exists():
        sys.exit(f"real_cluster: {flag} needs a --work-dir with rows.json and meta.json from an earlier run")
    return work, json.loads((work / "rows.json").read_text()), json.loads((work / "meta.json").read_text())


def _finish(args, work: Path, rows: list[dict], meta: dict) -> None:
    meta.setdefault("added_commands", []).append(" ".join(sys.argv))
    (work / "meta.json").write_text(json.dumps(meta, indent=1))
    print(f"wrote {write_report(rows, meta, Path(args.out))}", file=sys.stderr)


def add_rates(args) -> None:
    """`--add-rates`: more real points for finished rows, with the run's SLOs and workloads."""
    from real_cluster import machine_speed, profile_engine  # the script's own module: imported when called

    try:
        wanted = parse_add_rates(args.add_rates)
    except ValueError as e:
        sys.exit(f"real_cluster: {e}")
    work, rows, meta = _finished_run(args, "--add-rates")
    executors = args.executors.split(",")
    targets = [r for r in rows if r["executor"] in executors and r["policy"] in wanted
               and (args.workloads is None or r["workload"] in args.workloads.split(","))]
    missing = sorted(set(wanted) - {r["policy"] for r in targets})
    if missing:
        sys.exit(f"real_cluster: --add-rates: no measured row for {missing} in {work}/rows.json")
    cfg = ExperimentConfig(requests=meta["requests_per_point"], model=args.model)
    for executor in sorted({r["executor"] for r in targets}):
        cost = ProfiledCostModel(str(work / f"profile-{executor}.json"))
        slos = run_slos(meta, rows, executor, cost)
        # the machine's speed now against the run's profile: an added point is comparable to
        # the search's points only if the machine has not drifted far since
        now_path = work / f"profile-{executor}-added-{time.strftime('%Y%m%d%H%M%S')}.json"
        print(f"profiling the engine for {executor} before the added rates ...", file=sys.stderr, flush=True)
        profile_engine(now_path, 1 if executor == "ray" else None, args.profile_passes)
        speed = machine_speed(ProfiledCostModel(str(now_path)), cost)
        for policy, rates in wanted.items():
            mine = [r for r in targets if r["executor"] == executor and r["policy"] == policy]
            if not mine:
                continue
            with Server(policy, executor, work / f"profile-{executor}.json", cfg.model,
                        work / f"serve-{policy}-{executor}-added.log") as url:
                for row in mine:
                    w = make_workload(row["workload"], cfg.requests, slos, cost)
                    for rate in rates:
                        got = real_point(url, w, rate, slos)["attainment"]
                        add_point(row, rate, got, source_revision(), speed)
                        print(f"{executor:>5} {policy:>12} {row['workload']:>11}: {rate:.3f} req/s -> {got:.0%}; "
                              f"goodput now {row['real_goodput']:.3f}", file=sys.stderr, flush=True)
                    (work / "rows.json").write_text(json.dumps(rows, indent=1))
    _finish(args, work, rows, meta)


def refix(args) -> None:
    """`--refix N`: every row's fixed-rate point again, real and simulated, on the first N
    requests of its workload at the row's fixed rate, with the run's profile, SLOs and served-step
    terms. The goodput searches are kept as they were."""
    work, rows, meta = _finished_run(args, "--refix")
    if args.refix < 2:
        sys.exit(f"real_cluster: --refix needs at least 2 requests, got {args.refix}")
    executors = args.executors.split(",")
    targets = [r for r in rows if r["executor"] in executors]
    if not targets:
        sys.exit(f"real_cluster: --refix: no rows for executors {executors} in {work}/rows.json")
    model, repeats = ExperimentConfig(model=args.model).model, getattr(args, "fixed_repeats", 1)
    observe = getattr(args, "observed_speed", False)
    for executor in dict.fromkeys(r["executor"] for r in targets):
        path = work / f"profile-{executor}.json"
        cost = ProfiledCostModel(str(path))
        slos = run_slos(meta, rows, executor, cost)
        fit = (meta.get("serving") or {}).get(executor)
        check = SpeedCheck(path, model, 1 if executor == "ray" else None)
        for policy in dict.fromkeys(r["policy"] for r in targets if r["executor"] == executor):
            mine = [r for r in targets if r["executor"] == executor and r["policy"] == policy]
            log = work / f"serve-{policy}-{executor}-refix.log"
            # observed: a fresh server per run (below), recording the timeline its step speed is read from
            with contextlib.nullcontext() if observe else Server(policy, executor, path, model, log) as url:
                for row in mine:
                    w = fixed_workload(row["workload"], args.refix, row["fixed_rate"], slos, cost)
                    rate = row["fixed_rate"]
                    for k in ("fixed_runs", "sim_observed", "sim_loro", "observed_speeds"):  # an earlier --refix's
                        row.pop(k, None)
                    runs = ServedRuns(lambda tag: Server(policy, executor, path, model, work / f"serve-{tag}-refix.log"),
                                      work, f"{policy}-{executor}-{row['workload']}-fixed",
                                      served_clock(path, fit, cost)) if observe else None

                    def serve() -> list:
                        return runs.states(w, rate, slos) if runs else real_states(url, w, rate, slos)

                    def simulate(speed: float, drift: list | None) -> list:
                        return sim_states(w, rate, policy, served_clock(path, fit, cost, speed, drift),
                                          executor == "local", cost)

                    row.update(fixed_row(check, serve, simulate, repeats))
                    if runs is not None:
                        add_observed(row, runs.speeds, simulate)
                    served_fixed_point(row, simulate)  # at the search's served steps, where it recorded them
                    print(f"{executor:>5} {policy:>12} {row['workload']:>11}: TTFT P50 real {row['real']['ttft_p50']:.3f} "
                          f"sim {row['sim']['ttft_p50']:.3f} s", file=sys.stderr, flush=True)
                    (work / "rows.json").write_text(json.dumps(rows, indent=1))
    meta.update(fixed_requests=args.refix, fixed_repeats=repeats, fixed_revision=source_revision(),
                fixed_at=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    _finish(args, work, rows, meta)


def refit_serving(work: Path, executor: str, fit: dict) -> dict:
    """The executor's served-step terms fitted again, with this revision's cost model, on the
    timeline the run fitted them on (kept in the work dir): the same steps, measured before any
    row was. The frontend latency comes from the client's TTFT, which the timeline lacks, and
    does not depend on the model: it is kept. The KV export time is fitted on the work dir's
    `fit-export-<executor>.json` timeline where there is one."""
    from flowyard.costmodel.serving import fit_serving

    timeline = work / f"fit-serving-{executor}-{fit['workload']}-{fit['policy']}.json"
    if not timeline.exists():
        sys.exit(f"real_cluster: --resim: the served-step fit's timeline {timeline} is missing")
    prof = json.loads((work / f"profile-{executor}.json").read_text())
    prof.pop("serving", None)
    speed = fit.get("speed", 1.0)  # the machine's speed during the fit run, where it was measured
    terms = fit_serving(ProfiledCostModel(prof), json.loads(timeline.read_text()), fit["fitted_on"],
                        scale=serving_scale(executor, speed))
    refit = {**normalized({**fit, **terms.to_dict()}, speed), "frontend_s": fit["frontend_s"],  # stored normalized
             "refit_revision": source_revision()}
    return with_export(refit, export_timeline(work, executor), fit.get("export_speed", 1.0))


def resim(args) -> None:
    """`--resim`: what the run simulated, again with this revision's simulator and cost model:
    the served-step terms refitted on the run's own fit timeline, then every row's simulated
    goodput searched again (real_cluster.sim_search) and its simulated fixed-rate point, on the
    profile the row was simulated with and the SLOs its real requests carried. Real points stay."""
    from real_cluster import SIM_TOL, sim_search  # the script's own module: imported when called

    work, rows, meta = _finished_run(args, "--resim")
    executors = args.executors.split(",")
    targets = [r for r in rows if r["executor"] in executors]
    if not targets:
        sys.exit(f"real_cluster: --resim: no rows for executors {executors} in {work}/rows.json")
    serving = meta.get("serving") or {}
    for executor in {r["executor"] for r in targets} & set(serving):
        serving[executor] = refit_serving(work, executor, serving[executor])
        (work / f"serving-{executor}.json").write_text(json.dumps(serving[executor]))
        print(f"{executor:>5} served-step terms refitted: scale {serving[executor]['scale']:.3f}, "
              f"{serving[executor]['row_s'] * 1e3:.2f} ms per row", file=sys.stderr, flush=True)
    judged = {}  # executor -> the profile its SLOs came from and those SLOs, read once
    for executor in {r["executor"] for r in targets}:
        slo_cost = ProfiledCostModel(str(work / f"profile-{executor}.json"))
        judged[executor] = slo_cost, run_slos(meta, rows, executor, slo_cost)
    workloads: dict[tuple[str, str], object] = {}  # (executor, workload) -> the run's workload, built once
    for row in targets:
        executor = row["executor"]
        slo_cost, slos = judged[executor]
        if (executor, row["workload"]) not in workloads:
            workloads[executor, row["workload"]] = make_workload(row["workload"], meta["requests_per_point"], slos,
                                                                 slo_cost)
        w = workloads[executor, row["workload"]]
        path = work / row.get("profile", f"profile-{executor}.json")
        pcost = ProfiledCostModel(str(path))
        fit = serving.get(executor)
        before = row["sim_goodput"]
        sim = sim_search(w, row["policy"], served_clock(path, fit, pcost, row_speed(row), row_drift(row)),
                         executor == "local", pcost)
        fixed = fixed_workload(row["workload"], meta.get("fixed_requests") or meta["requests_per_point"],
                               row["fixed_rate"], slos, slo_cost)
        row.update(sim_goodput=sim.goodput, sim_curve=sim.curve, sim_tol=SIM_TOL)
        shared = executor == "local"

        def clocked(sp: float, dr) -> object:
            return served_clock(path, fit, pcost, sp, dr)

        def fixed_at(sp: float, dr) -> list:
            return sim_states(fixed, row["fixed_rate"], row["policy"], clocked(sp, dr), shared, pcost)

        if reread_speeds(row, work, clocked(1.0, None), mean_context(w), mean_context(fixed)):
            print(f"{executor:>5} {row['policy']:>12} {row['workload']:>11}: served step speeds read again from "
                  "the run's timelines", file=sys.stderr, flush=True)
        resimulate(row, fixed_at)
        add_served_clock(row, lambda sp, dr: sim_search(w, row["policy"], clocked(sp, dr), shared, pcost),
                         lambda r, sp, dr: sim_point(w, r, row["policy"], clocked(sp, dr), shared, pcost)["attainment"],
                         fixed_at)
        print(f"{executor:>5} {row['policy']:>12} {row['workload']:>11}: simulated goodput {before:.3f} -> "
              f"{sim.goodput:.3f} req/s", file=sys.stderr, flush=True)
    (work / "rows.json").write_text(json.dumps(rows, indent=1))
    meta.update(sim_revision=source_revision(), serving=serving)
    _finish(args, work, rows, meta)
