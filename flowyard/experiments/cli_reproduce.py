"""`flowyard reproduce NAME`: rerun one paper's experiments (or all) in the simulator and write
its report and figures, with a progress bar, the sweep's Ray fan-out and its result cache."""

from __future__ import annotations

import argparse
import os
import sys

from flowyard.cli import _bar_on, _progress
from flowyard.cli import _add_engine_flag as add_engine_flag
from flowyard.cliargs import UsageError, nonneg_int
from flowyard.experiments import DEFAULT_OUT, EXPERIMENTS
from flowyard.sweep.jobs import add_sweep_flags


def cmd_reproduce(args: argparse.Namespace) -> int:
    import shlex
    import time

    from flowyard.costmodel.engines import ENV_VAR
    from flowyard.experiments import run_experiment

    name = args.name.strip().lower()
    if args.engine_profile:  # the experiments build their own SimConfigs: the default moves
        saved = os.environ.get(ENV_VAR)
        os.environ[ENV_VAR] = args.engine_profile
        try:
            return cmd_reproduce(argparse.Namespace(**{**vars(args), "engine_profile": None,
                                                        "profile_label": args.engine_profile}))
        finally:
            if saved is None:
                os.environ.pop(ENV_VAR, None)
            else:
                os.environ[ENV_VAR] = saved
    if name == "all":  # the final run: every report on one revision, one after another
        for each in EXPERIMENTS:
            if cmd_reproduce(argparse.Namespace(**{**vars(args), "name": each})) != 0:
                return 1
        return 0
    if name not in EXPERIMENTS:
        raise UsageError(f"unknown experiment {args.name!r}; valid experiments: {', '.join(EXPERIMENTS)}, all")
    command = " ".join(["flowyard reproduce", shlex.quote(name)]
                       + ([f"--out {shlex.quote(args.out)}"] if args.out != DEFAULT_OUT else [])
                       + (["--quick"] if args.quick else []) + ([f"--seed {args.seed}"] if args.seed else [])
                       + ([f"--engine-profile {args.profile_label}"]
                          if getattr(args, "profile_label", None) else [])
                       + (["--allow-dirty"] if args.allow_dirty else []))
    start = time.perf_counter()
    with _progress(_bar_on(args), f"reproduce {name}") as bar:
        logged = 0  # runs logged
        counted: tuple[int, int | None] | None = None  # (computed, asked) of a parallel sweep

        def on_bar(m: str) -> None:
            nonlocal logged
            logged += 1
            done, total = counted if counted is not None else (logged, None)
            if bar is not None:
                bar(done, total, f"{name}: {m.strip()[:70]}")

        def on_sweep(done: int, total: int) -> None:  # a parallel sweep counts simulations
            nonlocal counted
            counted = (done, total)
            if bar is not None:
                bar(done, total)

        log = None if args.quiet else on_bar if bar is not None else (lambda m: print(m, file=sys.stderr, flush=True))
        from flowyard import sweep as sweeps
        from flowyard.sweep.jobs import sweep_from_args

        sweep = sweep_from_args(args, None if bar is None else on_sweep)
        prev = sweeps.use(sweep)
        try:
            path = run_experiment(name, args.out, quick=args.quick, seed=args.seed, command=command, log=log,
                                  allow_dirty=args.allow_dirty)
        finally:
            sweeps.use(prev)
    print(f"wrote {path} in {time.perf_counter() - start:.0f} s")
    return 0


def add_reproduce_parser(sub) -> None:
    r = sub.add_parser("reproduce", help="rerun one paper's experiments in the simulator (report + figures)")
    r.add_argument("name", metavar="NAME", help=f"experiment: {', '.join(EXPERIMENTS)}, or all (each in turn)")
    r.add_argument("--out", default=DEFAULT_OUT, metavar="DIR",
                   help=f"output directory: DIR/NAME.md and DIR/NAME/*.png (default {DEFAULT_OUT})")
    r.add_argument("--quick", action="store_true", help="a small version (one model, few rates; < 1 min)")
    r.add_argument("--seed", type=nonneg_int, default=0, help="workload seed (default 0)")
    r.add_argument("--quiet", action="store_true", help="no per-run progress lines on stderr")
    r.add_argument("--allow-dirty", action="store_true",
                   help="run from a checkout with uncommitted changes (the report's first line then says so)")
    add_sweep_flags(r)
    add_engine_flag(r)
    r.set_defaults(func=cmd_reproduce)
