"""The served-step terms of a real-cluster run (`--fit-serving`): the fit run, its KV export
run, and the report's note on them. What serving adds to the profile's steps is fitted on one
served run before any row is measured (flowyard.costmodel.serving); rows of that workload are
then not a check of it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from real_cluster_lib import EngineSLOs, RealWorkload, Server, timeline_point
from real_cluster_speed import normalized


def fit_serving_run(workload: "RealWorkload", executor: str, profile: Path, out: Path, slos: EngineSLOs,
                    model: str | None, work: Path, policy: str = "vllm", check=None) -> dict:
    """One served run of `workload` at its fixed rate with a timeline, and the profile's serving
    terms fitted on it (flowyard.costmodel.serving), written to `out` with the profile. With a
    speed `check` (real_cluster_speed.SpeedCheck) the machine's speed is measured before each
    run and the terms are stored at the profile's speed (`normalized`): the rows scale them by
    their own points' speeds."""
    from flowyard.costmodel.serving import fit_serving_files

    tl = work / f"fit-serving-{executor}-{workload.name}-{policy}.json"
    srv = Server(policy, executor, profile, model, work / f"fit-serving-{executor}-{policy}.log")
    speed = check() if check else 1.0
    rp = timeline_point(srv, tl, workload, workload.fixed_rate, slos)
    terms = fit_serving_files(profile, tl, out, client_ttft_p50=rp["ttft_p50"], scale=serving_scale(executor, speed))
    # the time a source spends giving up each moved request's KV: a run of a policy that moves
    # every request (DistServe's prefill to decode hand-off), with a timeline, loaded enough
    # that prompts queue behind the moves (the fit reads only gaps while there was work)
    xtl = export_timeline(work, executor)
    export_speed = check() if check else 1.0
    timeline_point(Server(EXPORT_POLICY, executor, profile, model, work / f"fit-export-{executor}.log"),
                   xtl, workload, EXPORT_LOAD * workload.fixed_rate, slos)
    fit = {**terms.to_dict(), "workload": workload.name, "policy": policy, "rate": workload.fixed_rate}
    return with_export(normalized(fit, speed), xtl, export_speed)


def serving_scale(executor: str, speed: float = 1.0) -> float | None:
    """The served-step scale held in the fit (costmodel.serving.fit_serving): in one process the
    instances take turns on one thread, so serving adds only the loop around a step (times the
    machine's speed during the fit run); Ray's actors run at once on shared cores, and the fit
    finds how much they slow each other."""
    from flowyard.costmodel.serving import SHARED_THREAD_SCALE

    return SHARED_THREAD_SCALE * speed if executor == "local" else None


EXPORT_POLICY = "distserve"
EXPORT_LOAD = 2.0  # the export run's rate over the fit workload's fixed rate


def export_timeline(work: Path, executor: str) -> Path:
    return work / f"fit-export-{executor}.json"


def with_export(fit: dict, timeline: Path, speed: float = 1.0) -> dict:
    """`fit` with the KV export time fitted on `timeline` (flowyard.costmodel.serving.fit_export),
    at the profile's speed (the machine ran `speed` times slower during that run), when the run
    has one; runs made before it have none and keep 0."""
    from flowyard.costmodel.serving import fit_export

    if not timeline.exists():
        return {**fit, "export_s": 0.0, "export_fitted_on": ""}
    try:
        return {**fit, "export_s": fit_export(json.loads(timeline.read_text())) / speed, "export_speed": speed,
                "export_fitted_on": str(timeline)}
    except ValueError as e:  # e.g. no move was followed by queued work: the run says so and charges none
        print(f"real_cluster: no KV export time from {timeline}: {e}", file=sys.stderr, flush=True)
        return {**fit, "export_s": 0.0, "export_fitted_on": "", "export_unfitted": str(e)}


def _held(sv: dict, executor: str) -> bool:
    held = serving_scale(executor)
    return held is not None and abs(sv["scale"] - held) < 1e-9


def serving_note(meta: dict) -> list[str]:
    fits = meta.get("serving") or {}
    out = [f"Served-step terms for {ex} (`--fit-serving`): fitted on one `{sv['policy']}` run of `{sv['workload']}` at "
           f"{sv['rate']:.3g} req/s ({sv['steps']} steps), before any row was measured: served step = "
           f"{sv['scale']:.3f} × the profile's price"
           + (" (held: the instances take turns on one thread)" if _held(sv, ex) else "")
           + f" + {sv['row_s'] * 1e3:.2f} ms per sampled row + "
           f"{sv['step_s'] * 1e3:.2f} ms per step"
           + (f" (its last {sv['gap_s'] * 1e3:.1f} ms, the median gap to the next step, is the serving loop, after "
              "the step's tokens)" if sv.get("gap_s") else "")
           + f", frontend {sv['frontend_s'] * 1e3:.1f} ms"
           + (f" (the machine ran {sv['speed']:.2f}× the profile's step times during the fit run; the terms are "
              "given at the profile's speed)" if "speed" in sv else "")
           + "; median |step error| "
           f"{sv['median_error_before']:.0%} → {sv['median_error_after']:.0%} on those steps"
           + (f"; a moved request's KV costs its source {sv['export_s'] * 1e3:.1f} ms before its next step (fitted "
              f"on the timeline `{Path(sv['export_fitted_on']).name}`, a served run whose requests move)"
              if sv.get("export_s") else "")
           + (f" (refitted on the same timeline at {sv['refit_revision']}, `--resim`)." if sv.get("refit_revision") else ".")
           for ex, sv in fits.items()]
    if out:
        out.append("The simulator clocks every step of that executor with these terms; its policies, like the "
                   "servers', predict with the plain profile. Rows of the fit's workload are not a check of it.")
    return ["", " ".join(out)] if out else []
