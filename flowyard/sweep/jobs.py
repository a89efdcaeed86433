"""The simulations sweeps fan out: module-level functions of plain settings, so a Ray worker
(or a cache file) can hold them, and a command-line front end for the sweep flags."""

from __future__ import annotations

import argparse
from functools import lru_cache
from typing import Callable

from flowyard.sweep.cache import DEFAULT_DIR, ResultCache
from flowyard.sweep.runner import Pending, Sweep, current, digest


@lru_cache(maxsize=8)
def _cost(model: str, hardware: str, tp: int, calibration: str, profile: str | None, engine_profile: str | None):
    from flowyard.sim.run import SimConfig, build_cost_model

    return build_cost_model(SimConfig(model=model, hardware=hardware, tp=tp, calibration=calibration,
                                      profile=profile, engine_profile=engine_profile))


def attainment(cfg, workload) -> float:
    """SLO attainment of one `flowyard simulate` run (the cost model from cfg, built once per
    process)."""
    from flowyard.sim.run import simulate

    cost = _cost(cfg.model, cfg.hardware, cfg.tp, cfg.calibration, cfg.profile, cfg.engine_profile)
    summary, _ = simulate(cfg, workload, cost_model=cost)
    return summary.slo_attainment


def goodput_searches(base, policies: list[str], workload, *, lo: float, hi: float, target: float, tol: float,
                     on_point: Callable[[str, float, float, float], None] | None = None) -> list:
    """`flowyard goodput`: one goodput search per policy over the current sweep; on Ray the
    policies' searches advance together, one rate each per round."""
    from flowyard.core.goodput import goodput_search

    sweep = current()
    mean_rate = len(workload.requests) / max(workload.duration, 1e-9)
    shown: set = set()

    def body() -> list | None:
        results, missing = [], False
        for name in policies:
            cfg = base.replace(policy=name)

            def at(rate: float, cfg=cfg) -> float:
                run = cfg.replace(rate_scale=rate / mean_rate)
                key = repr(("attainment", run.as_dict(), digest(workload)))
                a = sweep.value(key, attainment, run, workload)
                if on_point is not None and key not in shown:
                    shown.add(key)
                    on_point(name, rate, rate / mean_rate, a)
                return a

            try:
                results.append(goodput_search(at, lo=lo, hi=hi, target=target, tol=tol, policy=name))
            except Pending:
                missing = True
        return None if missing else results

    return sweep.run(body)


def add_sweep_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sweeps (docs/scale.md)")
    g.add_argument("--ray", action="store_true", help="run the independent simulations on a local Ray cluster")
    g.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="run them on an existing Ray cluster (host:port, or 'auto')")
    g.add_argument("--ray-workers", type=int, default=None, metavar="N",
                   help="worker processes of the local Ray cluster (default: one per CPU)")
    g.add_argument("--cache", nargs="?", const=str(DEFAULT_DIR), default=None, metavar="DIR",
                   help=f"keep every simulation's result in DIR (default {DEFAULT_DIR}), keyed by code "
                        "revision and settings: a killed sweep resumes, a finished one reruns instantly")


def sweep_from_args(args: argparse.Namespace, progress=None) -> Sweep:
    workers = getattr(args, "ray_workers", None)
    if workers is not None and workers < 1:
        raise ValueError(f"--ray-workers must be at least 1, got {workers}")
    cache = ResultCache(args.cache) if getattr(args, "cache", None) else None
    return Sweep(ray=bool(getattr(args, "ray", False)), ray_address=getattr(args, "ray_address", None),
                 workers=workers, cache=cache, progress=progress)
