"""The policies on a real cluster, and the simulator's prediction of it (issue 30).

Two instances of the embedded model serve workloads where prefill and decode interfere on
this CPU as they do on GPUs: long prompts (up to 1.5 k tokens, many decode steps' worth of
prefill) beside short chats, with a real trace's bursty arrivals. SLOs are scaled to the
engine from its own profile: TPOT a few decode steps, TTFT by prompt length a few times the
prompt's prefill. For every policy and workload:

- the real goodput: a search over request rates, each point a `flowyard bench` run (requests
  carry their SLOs as `x-slo-*` headers) against `flowyard serve --instances 2 --policy P`, in
  one process (`local`) or as Ray actors (`ray`);
- the simulator's goodput for the same workload, with the engine's profiled cost model
  (`shared_device` for the in-process instances, which take turns on the cores);
- per-request fidelity at one fixed rate: P50/P90 TTFT and TPOT, simulated vs real.

The report (`--out`, default docs/results/real_cluster.md) records revision, machine and
configuration, and judges the issue's targets from the numbers it prints.

    python benchmarks/real_cluster.py --quick                 # smoke run: 2 policies, 1 workload
    python benchmarks/real_cluster.py                         # all policies, 3 workloads, both executors
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from real_cluster_lib import (POLICIES, WORKLOADS, ExperimentConfig, engine_slos,  # noqa: E402
                              fixed_workload, make_workload, run_slos, sim_point, write_report)
from real_cluster_speed import SpeedCheck  # noqa: E402

from flowyard.experiments.provenance import machine  # noqa: E402
from flowyard.experiments.report import source_revision  # noqa: E402

from flowyard.core.goodput import goodput_search  # noqa: E402

FLOOR = 0.02  # req/s: the lowest rate a search tries
SIM_EVALS, SIM_TOL = 16, 0.02  # the simulated search: rates at most, relative bracket width
from flowyard.core.plan import BatchShape  # noqa: E402
from flowyard.costmodel.profiled import ProfiledCostModel  # noqa: E402


def profile_engine(path: Path, threads: int | None, passes: int = 3) -> None:
    """`flowyard profile` of the engine as the servers will run it (quick grid, `passes` passes:
    one pass's samples scatter by ~20 % on this VM)."""
    cmd = [sys.executable, "-m", "flowyard.cli", "profile", "--quick", "--passes", str(passes), "--out", str(path)]
    env = None
    if threads is not None:  # a Ray actor runs its engine on one thread
        import os

        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)


def machine_speed(now: ProfiledCostModel, first: ProfiledCostModel) -> float:
    """How much slower (> 1) or faster the engine's steps were when `now` was profiled than when
    the SLOs' profile was: the geometric mean of their price ratio over a prefill, a decode and a
    mixed step. Rows measured far apart are compared through it (drift, not policy)."""
    shapes = (BatchShape.chunk(0, 512), BatchShape(decode_seqs=8, decode_ctx=8 * 512),
              BatchShape.chunk(0, 256, decode_seqs=4, decode_ctx=4 * 400))
    prod = 1.0
    for s in shapes:
        prod *= float(now.step_time(s)) / float(first.step_time(s))
    return round(prod ** (1 / len(shapes)), 3)


def search(measure, guess: float, evals: int, policy: str, tol: float = 0.15):
    """Goodput around the simulator's guess: 4 evaluations find it within ~15 % when the guess
    is within 2x of the truth. When even the lowest rate misses (a guess too high), the search
    steps down, a quarter each time, while evaluations remain, so it still brackets the goodput
    instead of reporting 0 after one point."""
    seen: dict[float, float] = {}

    def memo(rate: float) -> float:  # a rate measured once is not measured again
        if rate not in seen:
            seen[rate] = measure(rate)
        return seen[rate]

    lo, hi = max(guess * 0.5, FLOOR), max(guess * 1.25, 0.05)
    while True:
        budget = evals - len(seen) + (1 if seen else 0)  # after a step down, hi is the rate that missed: known
        res = goodput_search(memo, lo=lo, hi=hi, tol=tol, max_evals=max(2, budget), policy=policy)
        if not res.never_met or evals - len(seen) < 1 or lo <= FLOOR:
            return replace(res, curve=sorted(seen.items()))
        lo, hi = max(lo / 4, FLOOR), lo


def sim_search(w, policy: str, clock, shared: bool, predictor=None):
    """The simulator's goodput to within SIM_TOL: a simulated rate costs seconds, so unlike the
    real search it can afford to resolve the crossing, and a coarse simulated bracket would be
    read as simulator error (its lower edge lies up to the tolerance below the crossing)."""
    return search(lambda r: sim_point(w, r, policy, clock, shared, predictor)["attainment"], w.guess, SIM_EVALS,
                  policy, tol=SIM_TOL)


def sim_table(ws: dict, policies: list[str], cost, executor: str) -> str:
    """The simulator's goodput of every policy on every workload, with flowyard over the best
    other: where the real searches are worth their hours."""
    lines = [f"| executor | workload | {' | '.join(policies)} | flowyard / best other |",
             "|---|---|" + "---|" * (len(policies) + 1)]
    for name, w in ws.items():
        g = {p: sim_search(w, p, cost, executor == "local").goodput for p in policies}
        others = [v for p, v in g.items() if p != "flowyard"]
        best = max(others, default=0.0)
        ratio = f"{g['flowyard'] / best:.2f}×" if "flowyard" in g and best > 0 else "—"
        lines.append(f"| {executor} | {name} | " + " | ".join(f"{g[p]:.3f}" for p in policies) + f" | {ratio} |")
    return "\n".join(lines)


from real_cluster_fit import fit_serving_run  # noqa: E402
from real_cluster_more import add_rates, refix, resim  # noqa: E402  (they use profile_engine above)
from real_cluster_row import RowSetup, measure_row  # noqa: E402  (it uses search above)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 policies, 1 workload, few requests, one executor")
    ap.add_argument("--policies", default=None, help=f"comma-separated (default: {','.join(POLICIES)})")
    ap.add_argument("--workloads", default=None, help=f"comma-separated (default: {','.join(WORKLOADS)})")
    ap.add_argument("--executors", default="local,ray", help="local (one process), ray (actors)")
    ap.add_argument("--requests", type=int, default=None, help="requests per point (default 24; quick 10)")
    ap.add_argument("--evals", type=int, default=4, help="real rates tried per goodput search")
    ap.add_argument("--fixed-requests", type=int, default=None,
                    help="requests of the per-request fidelity point (default: --requests); the P50 and P90 "
                         "of a few dozen requests move by tens of percent between two real runs")
    ap.add_argument("--fixed-repeats", type=int, default=1, metavar="K",
                    help="serve the per-request fidelity point K times (with --refix too), each run between speed "
                         "checks and simulated at its own speed; P50 and P90 pool the runs' requests and the "
                         "report shows the single runs' spread (default 1)")
    ap.add_argument("--observed-speed", action="store_true",
                    help="serve every real point on a fresh server that records a timeline, and simulate each row "
                         "again clocked at the speeds its served steps ran at, never the predicted point's own "
                         "(real_cluster_observed.py); with --refix, its fixed runs only")
    ap.add_argument("--out", default="docs/results/real_cluster.md")
    ap.add_argument("--work-dir", default=None, help="profiles and per-run JSON (default: a temp dir); "
                                                     "rerunning with the same one resumes")
    ap.add_argument("--model", default=None, help="served model (default: the embedded SmolLM2-135M)")
    ap.add_argument("--slo-factor", type=float, default=4.0,
                    help="SLOs as this many times the engine's own step (TPOT) and prefill (TTFT) (default 4)")
    ap.add_argument("--reprofile", action="store_true",
                    help="profile again before each policy's runs and simulate it with that profile "
                         "(default: the run's one profile for every policy, whose age each row records)")
    ap.add_argument("--profile-passes", type=int, default=3,
                    help="passes over the profile's grid, median kept (default 3)")
    ap.add_argument("--fit-serving", default=None, metavar="WORKLOAD",
                    help="before any row: serve WORKLOAD once (vllm, at its fixed rate) with a "
                         "timeline, fit what serving adds to the profile's steps on it, and price the simulator's "
                         "steps with it (flowyard.costmodel.serving; policies still predict with the plain "
                         "profile, as the servers do); once per executor")
    ap.add_argument("--sim-only", action="store_true",
                    help="measure nothing real: print the simulator's goodput per workload and policy, and "
                         "flowyard over the best other (to choose workloads where scheduling matters)")
    ap.add_argument("--add-rates", default=None, metavar="POLICY=RATE[/RATE],...",
                    help="measure these rates more for rows already in --work-dir, to decide a verdict a "
                         "bracket leaves open (real_cluster_points.py); then write the report")
    ap.add_argument("--refix", type=int, default=None, metavar="N",
                    help="measure the per-request fidelity point of every row in --work-dir again, with N "
                         "requests at its fixed rate, real and simulated; then write the report")
    ap.add_argument("--resim", action="store_true",
                    help="search every row's simulated goodput in --work-dir again (to within 2 %%, with the row's "
                         "profile and the run's served-step terms), keeping every real point; then write the report")
    ap.add_argument("--render-only", action="store_true",
                    help="measure nothing: write the report from --work-dir's rows.json and meta.json")
    args = ap.parse_args()
    if args.fixed_repeats < 1:
        sys.exit(f"real_cluster: --fixed-repeats must be at least 1, got {args.fixed_repeats}")
    if args.render_only:
        if args.work_dir is None or not (Path(args.work_dir) / "rows.json").exists():
            sys.exit("real_cluster: --render-only needs a --work-dir with rows.json from an earlier run")
        work = Path(args.work_dir)
        meta = json.loads((work / "meta.json").read_text())
        path = write_report(json.loads((work / "rows.json").read_text()), meta, Path(args.out))
        print(f"wrote {path} from {work}", file=sys.stderr)
        return
    if args.add_rates is not None:
        add_rates(args)
        return
    if args.refix is not None:
        refix(args)
        return
    if args.resim:
        resim(args)
        return
    quick = args.quick
    policies = (args.policies or ("vllm,flowyard" if quick else ",".join(POLICIES))).split(",")
    workloads = (args.workloads or ("code-long" if quick else ",".join(WORKLOADS))).split(",")
    executors = args.executors.split(",") if not quick or args.executors != "local,ray" else ["local"]
    named = workloads + ([args.fit_serving] if args.fit_serving else [])
    bad = [p for p in named if p not in WORKLOADS] + [e for e in executors if e not in ("local", "ray")]
    if bad:
        sys.exit(f"real_cluster: unknown workload or executor {bad}; workloads: {', '.join(WORKLOADS)}")
    if args.slo_factor <= 0:
        sys.exit("real_cluster: --slo-factor must be positive")
    if args.evals < 2 or (args.requests is not None and args.requests < 2):
        sys.exit("real_cluster: --evals and --requests must be at least 2 (a search brackets the goodput)")
    import tempfile

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="real-cluster-"))
    work.mkdir(parents=True, exist_ok=True)
    cfg = ExperimentConfig(requests=args.requests or (10 if quick else 24), evals=args.evals, model=args.model)
    fixed_n = args.fixed_requests or cfg.requests
    if fixed_n < 2:
        sys.exit(f"real_cluster: --fixed-requests must be at least 2, got {fixed_n}")
    started = time.time()
    done = work / "rows.json"  # a rerun with the same --work-dir resumes: finished cells are kept
    rows: list[dict] = json.loads(done.read_text()) if done.exists() else []
    have = {(r["executor"], r["policy"], r["workload"]) for r in rows}
    serving: dict[str, dict] = {}  # executor -> its fitted serving terms (--fit-serving)
    slos_by: dict[str, dict] = {}  # executor -> the SLOs its requests carry
    prev_meta = json.loads((work / "meta.json").read_text()) if rows and (work / "meta.json").exists() else {}
    for executor in executors:
        prof_path = work / f"profile-{executor}.json"
        if not prof_path.exists():
            print(f"profiling the engine for {executor} ...", file=sys.stderr, flush=True)
            profile_engine(prof_path, 1 if executor == "ray" else None, args.profile_passes)
        cost = ProfiledCostModel(str(prof_path))
        # a resumed run keeps the SLOs its rows were judged by (run_slos), whatever this revision's model says
        slos = run_slos(prev_meta, rows, executor, cost) if prev_meta else engine_slos(cost, args.slo_factor)
        slos_by[executor] = {"tpot_s": slos.tpot, "ttft_by_length": slos.spec}
        # ... and the fixed rate its rows were measured at, so every policy's point is at one rate
        kept = {r["workload"]: r["fixed_rate"] for r in rows if r["executor"] == executor}
        ws = {name: make_workload(name, cfg.requests, slos, cost) for name in workloads}
        ws = {name: replace(w, fixed_rate=kept[name]) if name in kept else w for name, w in ws.items()}
        # the fixed-rate point: the same trace prefix, --fixed-requests long, at the search's fixed rate
        fixed_ws = {name: fixed_workload(name, fixed_n, w.fixed_rate, slos, cost) for name, w in ws.items()}
        check = SpeedCheck(prof_path, cfg.model, 1 if executor == "ray" else None)  # before every real point
        if args.fit_serving:  # a model of the served steps for the simulator's clock only
            fit_path = work / f"serving-{executor}.json"
            if not fit_path.exists():
                print(f"fitting serving terms on {args.fit_serving} ...", file=sys.stderr, flush=True)
                fw = make_workload(args.fit_serving, cfg.requests, slos, cost)
                fit = fit_serving_run(fw, executor, prof_path, work / f"profile-{executor}-served.json", slos,
                                      cfg.model, work, check=check)
                fit_path.write_text(json.dumps(fit))
            serving[executor] = json.loads(fit_path.read_text())
        if args.sim_only:
            print(sim_table(ws, policies, cost, executor))
            continue
        for policy in policies:
            if all((executor, policy, name) in have for name in ws):
                continue
            # The machine's speed drifts between sessions (the same steps cost 1.16-1.29x more
            # than the evening before), so a resumed run's profile may describe another day's
            # machine: rows record its age. --reprofile gives each policy its own profile, made
            # just before its runs (the SLOs stay those of the first), even where an earlier
            # attempt left one (a row measured again must not be simulated on a stale machine).
            pol_path = work / f"profile-{executor}-{policy}.json"
            if args.reprofile:
                print(f"profiling the engine before {policy} ...", file=sys.stderr, flush=True)
                profile_engine(pol_path, 1 if executor == "ray" else None, args.profile_passes)
            if not args.reprofile:
                pol_path = prof_path
            age_min = (time.time() - pol_path.stat().st_mtime) / 60
            # The servers' policies and the simulated ones predict with the plain profile; with
            # --fit-serving the simulator's clock also prices what serving adds to each step.
            pcost = ProfiledCostModel(str(pol_path))
            fit, pcheck = serving.get(executor), check.against(pol_path)
            speed = machine_speed(pcost, cost)
            setup = RowSetup(policy, executor, pol_path, pcost, fit, pcheck, cfg.model, work, cfg.evals,
                             args.fixed_repeats, args.observed_speed)
            # observed: a fresh server per point (real_cluster_row), recording the timeline its speed is read from
            with contextlib.nullcontext() if setup.observe else setup.server(f"{policy}-{executor}") as url:
                for name, w in ws.items():
                    if (executor, policy, name) in have:
                        continue
                    row = measure_row(setup, name, w, fixed_ws[name], slos, url)
                    rows.append({**row, "executor": executor, "policy": policy, "workload": name,
                                 "fixed_rate": w.fixed_rate,
                                 "revision": source_revision(),
                                 "profile": pol_path.name, "step_price_vs_slo_profile": speed,
                                 "profile_age_min": round(age_min, 1), "sim_tol": SIM_TOL})
                    print(f"{executor:>5} {policy:>12} {name:>11}: goodput real {row['real_goodput']:.3f} "
                          f"sim {row['sim_goodput']:.3f} req/s", file=sys.stderr, flush=True)
            (work / "rows.json").write_text(json.dumps(rows, indent=1))
    if args.sim_only:
        return
    host = machine()  # the VM's host changes between sessions: family and model tell them apart
    meta = {"wall_s": time.time() - started, "slo_factor": args.slo_factor, "machine": f"{host['arch']}, {host['cpu']}",
            "command": " ".join(sys.argv), "slos": {"tpot_s": slos.tpot, "ttft_by_length": slos.spec},
            "slos_by": slos_by,
            "requests_per_point": cfg.requests, "fixed_requests": fixed_n, "serving": serving}
    if prev_meta:  # a resumed run adds to the one before: keep its story
        meta.update(command=prev_meta["command"], wall_s=(prev_meta.get("wall_s") or 0) + meta["wall_s"],
                    added_commands=prev_meta.get("added_commands", []) + [meta["command"]],
                    serving={**(prev_meta.get("serving") or {}), **serving},
                    slos_by={**(prev_meta.get("slos_by") or {}), **slos_by})
    (work / "meta.json").write_text(json.dumps(meta, indent=1))
    path = write_report(rows, meta, Path(args.out))
    print(f"wrote {path} in {meta['wall_s'] / 60:.1f} min", file=sys.stderr)


if __name__ == "__main__":
    main()
