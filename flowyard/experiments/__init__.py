"""`flowyard reproduce NAME`: one paper's experiments rerun in the simulator, written up as a
markdown report with figures. `run_experiment` is the one way to run one: module X gives
QUICK/FULL settings and run_experiments(settings, seed, log) -> results, X_report.write_report
turns the results into the report, and X_notes computes its prose from them.

Every simulation is assembled by `flowyard.sim.run.build_simulator` (what `flowyard simulate`
uses); shared machinery (memoised points, threshold searches, tables, figures, the band verdict)
is in `common.py` and `report.py`.
"""

from __future__ import annotations

import importlib
import time
from pathlib import Path
from typing import Callable

#: experiment name -> module (imported only when that experiment runs). Each module X defines
#: QUICK and FULL settings and run_experiments(settings, seed, log) -> results; X_report writes
#: the report from the results and X_notes computes its prose from them. Imports go one way
#: (X_report -> X_notes -> X), never in a circle.
EXPERIMENTS: dict[str, str] = {
    "flowprefill": "flowyard.experiments.flowprefill",
    "pla-serve": "flowyard.experiments.pla_serve",
    "arrow": "flowyard.experiments.arrow",
    "dynaserve": "flowyard.experiments.dynaserve",
    "flowyard": "flowyard.experiments.flowyard_suite",  # not a paper: the composed policy (issue 16)
}

DEFAULT_OUT = "docs/results"


class UnknownExperimentError(ValueError):
    pass


def run_experiment(name: str, out: str | Path = DEFAULT_OUT, *, quick: bool = False, seed: int = 0,
                   command: str = "", log: Callable[[str], None] | None = None, allow_dirty: bool = False) -> Path:
    """Run experiment `name`, write its report under `out`; the report's path. `log` gets one
    line per simulation (None: silent). A checkout with uncommitted source changes is refused
    (provenance.DirtyTreeError) unless `allow_dirty`; the report and results.json record the run's
    provenance (revision, command, seeds, machine, wall time, cost-model settings)."""
    key = name.strip().lower()
    if key not in EXPERIMENTS:
        raise UnknownExperimentError(
            f"unknown experiment {name!r}; valid experiments: {', '.join(EXPERIMENTS)}")
    from flowyard.experiments.common import output_dir, reproduce_command

    from flowyard.experiments import provenance

    module = importlib.import_module(EXPERIMENTS[key])
    report = importlib.import_module(EXPERIMENTS[key] + "_report")
    out = output_dir(Path(out))
    from flowyard.sweep import current

    sweep = current()
    if sweep.parallel and log is not None:  # every pass re-reads the runs it knows: say each once
        said: set[str] = set()
        inner = log

        def once(m: str) -> None:
            if m not in said:
                said.add(m)
                inner(m)
        log = once
    settings = module.QUICK if quick else module.FULL
    command = command or reproduce_command(key, quick, seed, out) + (" --allow-dirty" if allow_dirty else "")
    repeats = getattr(settings, "seeds", 1)  # an experiment that repeats draws uses seeds seed..seed+n-1
    record = provenance.begin(command, tuple(range(seed, seed + (repeats if isinstance(repeats, int) else 1))),
                              allow_dirty=allow_dirty)
    start = time.perf_counter()
    results = sweep.run(lambda: module.run_experiments(settings, seed, log))
    if sweep.parallel and hasattr(results, "wall_s"):  # all passes, not just the last one
        results.wall_s = time.perf_counter() - start
    with provenance.recording(record.finish()):
        return report.write_report(results, out, command=command)


__all__ = ["DEFAULT_OUT", "EXPERIMENTS", "UnknownExperimentError", "run_experiment"]
