"""The machine's speed right before each real point of a real-cluster run (issue 30).

On the 2-core VM the engine's steps cost up to ~15 % more than its profile for minutes at a
time: one probe of `vllm` served at 1.2 req/s ran its 300-400-token prefills at 1.15x their
price one day and at 1.02x the next, with the same revision, profile, workload and rate, and
its simulated TTFT P50 was 19 % and then 1 % off. A report's rows take half an hour and are
priced by one profile made at its start, so the simulator was right or wrong by the hour.

So right before each real point the bench process times a few reference steps through the
engine's own step path (the profiler's `time_point` on a scratch runner of an engine it loads
once, on the profile's thread count, while the server idles), and divides by what the profile
measured for the same steps: the machine's speed then, relative to the profile (above 1:
slower). The simulator's clock for that point is the profile, and its served-step terms,
scaled by that speed. The check times no request of the point it scales, so the point remains
a check of the simulator; the policies, the servers' and the simulated ones alike, still
predict with the plain profile, as a deployed server would.

The same check also gives the speed by kind of step (its `drift`): the prompt-bearing reference
steps' speed and the decode step's. The VM does not slow all steps alike (compute-bound prompt
steps more than bandwidth-bound decodes, docs/results/real_cluster_steps_dynaserve_zen3.md),
and a policy whose budget follows measured step times turns that difference into its result
(docs/results/drift_sensitivity.md), so the simulator's clock follows both.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict
from pathlib import Path

from flowyard.core.plan import BatchShape
from flowyard.engine.profiler import GridPoint, spread, step_seconds

# A prefill long enough to leave the small-row kernels, a short one, a decode batch and a mixed
# step: the kinds of step a served run is made of. Each is a point of the quick profile grid.
REFERENCE = (GridPoint(prefill=[(0, 512)]), GridPoint(prefill=[(0, 128)]), GridPoint(decode=spread(1024, 4)),
             GridPoint(prefill=[(0, 64)], decode=spread(256, 4)))
DECODE_REFERENCE = 2  # REFERENCE's decode-only step; the others carry prompt tokens
TIMED_TERMS = ("scale", "row_s", "step_s", "frontend_s", "export_s", "gap_s")  # a served step's times


def profiled_reference(profile: dict) -> list[float]:
    """What the profile measured for each REFERENCE step (the samples of the same shapes)."""
    layers = int(profile["num_layers"])
    by_shape = {json.dumps(s["shape"], sort_keys=True): s["times"] for s in profile["samples"]}
    out = []
    for p in REFERENCE:
        key = json.dumps(asdict(BatchShape.of(p.prefill, p.decode)), sort_keys=True)
        if key not in by_shape:
            raise ValueError(f"the profile has no sample of the reference step {BatchShape.of(p.prefill, p.decode)}; "
                             "make it with `flowyard profile --quick` (or the full grid)")
        out.append(step_seconds(by_shape[key], layers))
    return out


class SpeedCheck:
    """Times REFERENCE on an engine loaded in this process (once, on first use) and returns the
    geometric mean of measured over profiled, so each kind of step counts alike."""

    def __init__(self, profile: Path, model: str | None = None, threads: int | None = None,
                 repeats: int = 3) -> None:
        prof = json.loads(Path(profile).read_text())
        self.profiled = profiled_reference(prof)
        self.layers = int(prof["num_layers"])
        self.model, self.repeats = model, repeats
        self.threads = threads or int(prof.get("machine", {}).get("threads") or 0) or None
        self._runner = None
        self.last_drift: tuple[float, float] | None = None  # (prompt steps, decodes) of the last call

    def against(self, profile: Path) -> "SpeedCheck":
        """The same check (and engine) relative to another profile of the same engine."""
        other = SpeedCheck(profile, self.model, self.threads, self.repeats)
        other._runner = self._runner
        return other

    def _scratch(self):
        if self._runner is None:
            from flowyard.engine.engine_config import EngineConfig
            from flowyard.engine.llm_engine import LLMEngine
            from flowyard.engine.profiler import point_blocks, scratch_runner

            engine = LLMEngine.from_path(self.model, EngineConfig())
            engine.warm_up()
            self._runner = scratch_runner(engine.runner, max(point_blocks(p, engine.runner.bs) for p in REFERENCE))
        return self._runner

    def measure(self) -> list[float]:
        """Seconds of each REFERENCE step now (median of `repeats` after a warm-up run)."""
        import torch

        from flowyard.engine.profiler import time_point

        before = torch.get_num_threads()
        if self.threads:
            torch.set_num_threads(self.threads)
        try:
            runner = self._scratch()
            return [step_seconds(time_point(runner, p, self.repeats), self.layers) for p in REFERENCE]
        finally:
            torch.set_num_threads(before)

    def __call__(self) -> float:
        measured = self.measure()
        self.last_drift = drift_of(measured, self.profiled)
        return speed_of(measured, self.profiled)


def speed_of(measured: list[float], profiled: list[float]) -> float:
    """The geometric mean of measured / profiled over the reference steps, to three decimals."""
    if len(measured) != len(profiled) or not measured or min(*measured, *profiled) <= 0:
        raise ValueError(f"a speed needs positive times of the same steps, got {measured} and {profiled}")
    return round(math.exp(statistics.fmean(math.log(m / p) for m, p in zip(measured, profiled))), 3)


def drift_of(measured: list[float], profiled: list[float]) -> tuple[float, float]:
    """(speed of the prompt-bearing reference steps, speed of the decode step), as `speed_of`."""
    prompt = [i for i in range(len(REFERENCE)) if i != DECODE_REFERENCE]
    return (speed_of([measured[i] for i in prompt], [profiled[i] for i in prompt]),
            speed_of([measured[DECODE_REFERENCE]], [profiled[DECODE_REFERENCE]]))


def row_drift(row: dict) -> tuple[float, float] | None:
    """The drift a row's simulated search is clocked at: the median of each factor over its
    real search's points (None for rows measured before drift checks)."""
    drifts = row.get("real_drifts") or []
    if not drifts:
        return None
    return statistics.median(p for _, p, _ in drifts), statistics.median(d for _, _, d in drifts)


def at_speed(fit: dict | None, speed: float) -> dict | None:
    """Served-step terms for a machine `speed` times slower than the profile: every time they
    add, and the profile's price through `scale`, multiplied by it. None and speed 1: as given."""
    if speed == 1.0:
        return fit
    if not speed > 0:
        raise ValueError(f"a machine speed is positive, got {speed}")
    base = dict(fit or {"scale": 1.0})
    return {**base, **{k: float(base[k]) * speed for k in TIMED_TERMS if k in base}}


def normalized(fit: dict, speed: float) -> dict:
    """Terms fitted on a run during which the machine ran at `speed`, as they would be at the
    profile's speed (at_speed's inverse); the speed is kept in the dict."""
    return {**at_speed(fit, 1.0 / speed), "speed": speed}


def row_speed(row: dict) -> float:
    """The speed a row's simulated search is clocked at: the median over its real search's
    points (1 for rows measured before speed checks)."""
    speeds = [s for _, s in row.get("real_speeds") or []]
    return statistics.median(speeds) if speeds else 1.0


def checked_point(check, speeds: list, rate: float, serve, drifts: list | None = None) -> dict:
    """`serve(rate)`, a real point's numbers, with the machine's speed measured right before it
    (kept in `speeds`, and its drift by kind of step in `drifts`)."""
    speeds.append([rate, check()])
    if drifts is not None and check.last_drift is not None:
        drifts.append([rate, *check.last_drift])
    return serve(rate)


def fixed_checks_cell(row: dict) -> str:
    """A row's checks around its fixed-rate point, for the report ('—' before they were made)."""
    checks = row.get("fixed_checks")
    if not checks:
        return "—"
    return " → ".join(f"{c[0]:.2f}×" + (f" (p {c[1]:.2f}, d {c[2]:.2f})" if len(c) == 3 else "") for c in checks)


def speed_cell(row: dict) -> str:
    """The machine's speeds during a row's real points, for the report ('—' before checks)."""
    speeds = [s for _, s in row.get("real_speeds") or []] + ([row["fixed_speed"]] if "fixed_speed" in row else [])
    if not speeds:
        return "—"
    lo, hi = min(speeds), max(speeds)
    drift = row_drift(row)
    return (f"{lo:.2f}×" if lo == hi else f"{lo:.2f}–{hi:.2f}×") + (
        f" (p {drift[0]:.2f}, d {drift[1]:.2f})" if drift else "")
