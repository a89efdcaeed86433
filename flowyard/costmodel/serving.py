"""What serving adds to the steps a profile prices: fitted on a served run's timeline.

`flowyard profile` times the engine's forward pass alone, in a tight loop. A step of a
server also pays for what runs around it and beside it on the same cores: streaming each
sampled token (detokenizing it, an SSE chunk, the client reading it), the serving loop
between steps, and the client's own work stealing a core from the step's threads. On a slow
engine that is noise; on a fast one it is a large share of every decode step (issue 30). So
a profile may carry a `serving` block, fitted on one served run and then used for others:

    served step = scale * profiled price + row_s * sampled rows + step_s
    client TTFT = server TTFT + frontend_s
    the step's tokens exist gap_s before its served time ends (the loop after it)
    an instance a request's KV moves out of is busy export_s more before its next step

The step includes the gap to the next step while the server is busy (the serving loop's
share). `fit_serving` fits the three step terms by non-negative least squares on relative
error over every step of a `flowyard serve --timeline` trace, pricing each step's exact batch
shape (the timeline records it), and takes `frontend_s` from the client's and the server's
TTFT medians. The fit names the run it came from (`fitted_on`), so a report can keep the
fitted run apart from the ones it predicts. `fit_export` takes `export_s` from a run whose
requests move between instances (a disaggregated policy): on Ray the source actor copies each
moved request's KV into the object store on the thread that runs its steps.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from flowyard.core.plan import BatchShape
from flowyard.costmodel.base import CostModel

BUSY_GAP_S = 0.05  # a longer pause between steps means the server had nothing to run
SHARED_THREAD_SCALE = 1.0  # the scale of instances that take turns on one thread (fit_serving)


@dataclass(frozen=True)
class ServingTerms:
    scale: float = 1.0  # served step over the profiled price, beyond the per-row and per-step terms
    row_s: float = 0.0  # seconds per sampled row per step (streaming its token)
    step_s: float = 0.0  # seconds per step (the serving loop)
    frontend_s: float = 0.0  # HTTP, tokenization and the first chunk's way back
    fitted_on: str = ""
    steps: int = 0  # served steps the fit saw
    median_error_before: float = 0.0  # median |served / profiled - 1| over those steps
    median_error_after: float = 0.0  # ... and with these terms
    export_s: float = 0.0  # the source's time per request whose KV moves out (fit_export)
    gap_s: float = 0.0  # median busy gap after a step: the loop's share of a served step

    @classmethod
    def from_dict(cls, d: dict) -> "ServingTerms":
        if not isinstance(d, dict):
            raise ValueError(f"a serving block is a JSON object, got {d!r}")
        try:
            fields: dict[str, Any] = {k: (str(v) if k == "fitted_on" else int(v) if k == "steps" else float(v))
                                      for k, v in d.items() if k in cls.__dataclass_fields__}
            t = cls(**fields)
        except (TypeError, ValueError) as e:
            raise ValueError(f"malformed serving block {d}: {e}") from None
        if t.scale <= 0 or min(t.row_s, t.step_s, t.frontend_s, t.export_s, t.gap_s) < 0:
            raise ValueError(f"serving block needs scale > 0 and non-negative times, got {d}")
        return t

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ServedStep:
    shape: BatchShape
    seconds: float  # the step plus the busy gap after it
    rows: int  # rows that sampled a token
    gap: float = 0.0  # that busy gap (0 when the server then had nothing to run)


def _step_lanes(trace: dict | list) -> tuple[dict[Any, list[dict]], bool]:
    """The timeline's steps, in time order, per lane, and whether steps of different instances
    overlap. Instances of one process share its thread: one lane, where the next step anywhere
    is what a gap delayed. Where steps overlap (Ray actors, one process each), a lane per
    instance, whose own next step it is."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    steps = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == "step"), key=lambda e: e["ts"])
    overlap = any(b["ts"] < a["ts"] + a["dur"] - 1e3 for a, b in zip(steps, steps[1:]))
    lanes: dict[Any, list[dict]] = {}
    for e in steps:
        lanes.setdefault(e.get("pid") if overlap else None, []).append(e)
    return lanes, overlap


def served_steps(trace: dict | list) -> list[ServedStep]:
    """Every single step of a Chrome-trace timeline that records its batch shape, with the gap
    to the next step of its lane (`_step_lanes`) when that gap is short."""
    lanes, _ = _step_lanes(trace)
    pairs: list[tuple[dict, dict | None]] = [(e, nxt) for st in lanes.values() for e, nxt in zip(st, [*st[1:], None])]
    pairs.sort(key=lambda p: p[0]["ts"])
    out = []
    for e, nxt in pairs:
        a = e.get("args", {})
        if "shape" not in a or int(a.get("steps", 1)) != 1 or "preempted" in e.get("name", ""):
            continue
        gap = (nxt["ts"] - e["ts"] - e["dur"]) / 1e6 if nxt is not None else 1.0
        busy = gap if 0 < gap < BUSY_GAP_S else 0.0
        shape = BatchShape(**a["shape"])
        out.append(ServedStep(shape, e["dur"] / 1e6 + busy, int(shape.prefill_seqs + shape.decode_seqs), busy))
    return out


def server_ttfts(trace: dict | list) -> list[float]:
    """Seconds from each request's arrival at the cluster to its first token, as the server's
    timeline records them (no HTTP, tokenization, streaming or client time)."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [e["dur"] / 1e6 for e in events if e.get("cat") == "request" and e.get("name") == "waiting for first token"]


def fit_serving(cost: CostModel, trace: dict | list, fitted_on: str,
                client_ttft_p50: float | None = None, scale: float | None = None) -> ServingTerms:
    """The serving terms that make `cost` (a profile without them) price the steps of `trace`.

    `scale` given: held there, and only the per-row and per-step terms fitted. In one process
    the instances take turns on the thread the profile was timed on, so nothing runs beside a
    step and what serving adds is the loop around it (SHARED_THREAD_SCALE); the free scale is
    for instances that run at once on shared cores (Ray actors), where each slows the other's
    kernels. On one thread a free scale also trades against the per-step term, and a run of
    short prompts cannot tell them apart: a fit there then mis-prices the long chunks of others."""
    from flowyard.costmodel.profiled import nnls

    if getattr(cost, "serving", ServingTerms()) != ServingTerms():
        raise ValueError("fit serving terms on a profile without them (its serving block would be counted twice)")
    steps = served_steps(trace)
    if len(steps) < 8:
        raise ValueError(f"the timeline has {len(steps)} steps with their batch shapes; a fit needs at least 8 "
                         "(serve with --timeline on this version, and send it some requests)")
    price = np.array([float(cost.step_time(s.shape)) for s in steps])
    real = np.array([s.seconds for s in steps])
    x = np.column_stack([price, [s.rows for s in steps], np.ones(len(steps))])
    w = 1.0 / real
    if scale is None:
        scale, row_s, step_s = (float(v) for v in nnls(x * w[:, None], real * w))
    else:
        row_s, step_s = (float(v) for v in nnls(x[:, 1:] * w[:, None], (real - scale * price) * w))
    if scale <= 0:
        raise ValueError("the served steps do not grow with the profile's price: is the timeline from this engine?")
    after = scale * price + row_s * x[:, 1] + step_s
    ttfts = server_ttfts(trace)
    server = statistics.median(ttfts) if ttfts else None
    frontend = max(0.0, client_ttft_p50 - server) if client_ttft_p50 is not None and server is not None else 0.0
    gaps = [s.gap for s in steps if s.gap > 1e-6]  # a timeline's clock ticks in microseconds
    return ServingTerms(scale, row_s, step_s, frontend, fitted_on, len(steps),
                        float(np.median(np.abs(real / price - 1))), float(np.median(np.abs(real / after - 1))),
                        gap_s=float(np.median(gaps)) if gaps else 0.0)


def _read_json(path: str | Path, what: str):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{what} {str(path)!r} is not a readable JSON file: {e}") from None


def fit_serving_files(profile: str | Path, timeline: str | Path, out: str | Path,
                      client_ttft_p50: float | None = None, export_timeline: str | Path | None = None,
                      scale: float | None = None) -> ServingTerms:
    """Fit on the `timeline` of an engine served with `profile` (any serving block it has is
    dropped first; `scale` as fit_serving), and the KV export time on `export_timeline` when
    given, and write the profile with the fitted block to `out`."""
    from flowyard.costmodel.profiled import ProfiledCostModel

    prof = _read_json(profile, "profile")
    if not isinstance(prof, dict):
        raise ValueError(f"profile {str(profile)!r} is not a JSON object")
    prof.pop("serving", None)
    terms = fit_serving(ProfiledCostModel(prof), _read_json(timeline, "timeline"), str(timeline), client_ttft_p50,
                        scale)
    if export_timeline is not None:
        terms = replace(terms, export_s=fit_export(_read_json(export_timeline, "export timeline")))
    prof["serving"] = terms.to_dict()
    Path(out).write_text(json.dumps(prof, indent=1))
    return terms


def fit_export(trace: dict | list, busy_gap_s: float = 0.1) -> float:
    """Seconds an instance spends per request whose KV moves out, before its next step: the
    gaps between steps while there was work (shorter than `busy_gap_s`) that follow moves, less
    the median busy gap that follows no move (the serving loop, which `step_s` already prices),
    summed over those gaps and divided by the moves in them. Where instances run steps at once
    (Ray actors) a gap is to the source's own next step; where they take turns on one thread
    (one process) it is to the next step anywhere (`_step_lanes`, as `served_steps`)."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    moves = [e for e in events if e.get("cat") == "decision" and e.get("name") in ("handoff", "decode", "migrate")
             and e.get("args", {}).get("src") is not None and e["args"].get("dst") != e["args"]["src"]]
    lanes, overlap = _step_lanes(trace)
    after: list[tuple[float, int]] = []  # (busy gap in s, moves decided as the step before it ended)
    for lane, st in lanes.items():
        at = sorted(e["ts"] for e in moves if not overlap or e["args"]["src"] == lane)
        for a, b in zip(st, st[1:]):
            end, gap = a["ts"] + a["dur"], (b["ts"] - a["ts"] - a["dur"]) / 1e6
            if 0 < gap < busy_gap_s:
                after.append((gap, sum(1 for t in at if end - 2e3 <= t < b["ts"])))
    base = [g for g, k in after if not k]
    moved = [(g, k) for g, k in after if k]
    if not moves or not base:
        raise ValueError("fitting the KV export time needs a timeline where requests move and some busy steps "
                         "are followed by no move (a disaggregated policy, served with --timeline)")
    if not moved:
        raise ValueError("no move in the timeline was followed by a step while there was work")
    base_gap = statistics.median(base)
    return max(0.0, sum(g - base_gap for g, _ in moved) / sum(k for _, k in moved))
