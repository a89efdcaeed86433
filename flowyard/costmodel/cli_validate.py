"""`flowyard validate`: the cost model against published GPU measurements.

The headline is leave-one-source-out cross-validation: for each source family the terms are
refitted without it (fit.cross_validate) and its points are predicted with that fit, so no
point is judged by a fit that saw it. The in-sample fit (the 'published' calibration stored in
flowyard/data/calibration.json) is printed beside it, never instead of it. Serving runs are
replayed in the simulator. `--no-cv` prints the in-sample table alone (seconds, not minutes);
`--calibration vidur` the old assumed factors; `--engine-profile` prices every point with one
profile instead of its own stack's; `--json PATH` writes the tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from flowyard.costmodel.engines import DEFAULT_ENGINE_PROFILE, engine_profile_names
from flowyard.costmodel.fit import Row, evaluate, summary
from flowyard.costmodel.refit import cross_validate
from flowyard.costmodel.hardware import CALIBRATIONS
from flowyard.costmodel.published import published_points

GROUPS = ("prefill", "decode", "mixed", "serving", "kernel", "cpu")


def add_validate_parser(sub: argparse._SubParsersAction) -> None:
    v = sub.add_parser("validate", help="cost model vs published GPU measurements "
                                        "(leave-one-source-out cross-validated error)")
    v.add_argument("--calibration", default="published", choices=CALIBRATIONS,
                   help="in-sample factor set shown beside the cross-validation (default: published)")
    v.add_argument("--engine-profile", default=None, choices=engine_profile_names(),
                   help="price every point with this engine profile (default: each point's own stack)")
    v.add_argument("--no-cv", action="store_true", help="skip the cross-validation (minutes): in-sample only")
    v.add_argument("--json", default=None, metavar="PATH", help="write the tables as JSON ('-': stdout)")
    v.set_defaults(func=cmd_validate)


def _fmt(v: float, unit: str) -> str:
    return f"{v:.0f} {unit}" if unit == "tokens" else f"{v:.4g} {unit}"


def _measured(row: Row) -> str:
    p, hi = row.point, row.point.hi
    if hi is None:  # a single value, not a range
        return _fmt(p.measured, p.unit)
    return f"<= {_fmt(hi, p.unit)}" if p.measured == 0 else f"{p.measured:.0f}-{_fmt(hi, p.unit)}"


def breakdown(rows: list[Row], key) -> dict[str, dict]:
    """summary() per value of key(point), in first-seen order."""
    out: dict[str, list[Row]] = {}
    for r in rows:
        out.setdefault(key(r.point), []).append(r)
    return {k: summary(v) for k, v in out.items()}


def format_table(cv: list[Row] | None, ins: list[Row], calibration: str) -> str:
    """One line per point (measured, cross-validated and in-sample prediction), then the
    summaries: cross-validated first."""
    head = f"{'point':<58} {'measured':>12} {'cv pred':>11} {'cv err':>7} {'in-sample':>9}"
    lines = [head, "-" * len(head)]
    cvd = {r.point.name: r for r in cv or []}
    for r in ins:
        c = cvd.get(r.point.name)
        lines.append(f"{r.point.name[:58]:<58} {_measured(r):>12} "
                     f"{(_fmt(c.predicted, r.point.unit) if c else '-'):>11} "
                     f"{(f'{c.error:+.1%}' if c else '-'):>7} {r.error:>+9.1%}")
        lines.append(f"    [{r.point.family}, {r.point.engine}] {r.point.source}")
    for label, rows in (("cross-validated (leave one source out)", cv), (f"in-sample ({calibration})", ins)):
        if not rows:
            continue
        s = summary(rows)
        lines.append(f"{label}: {s['points']} points, median |error| {s['median_abs_error']:.1%}, "
                     f"max {s['max_abs_error']:.1%}; within 10 %: {s['within_10pct']}, "
                     f"within 25 %: {s['within_25pct']}")
        for name, key in (("by kind", lambda p: p.group), ("by source", lambda p: p.family)):
            parts = [f"{k} n={v['points']} med {v['median_abs_error']:.1%} max {v['max_abs_error']:.1%}"
                     for k, v in breakdown(rows, key).items()]
            lines.append(f"  {name}: " + "; ".join(parts))
    return "\n".join(lines)


def _rows_json(rows: list[Row]) -> list[dict]:
    return [{"point": r.point.name, "kind": r.point.kind, "group": r.point.group,
             "family": r.point.family, "engine": r.point.engine, "metric": r.point.metric,
             "model": str(getattr(r.point.model, "name", r.point.model)),
             "hardware": r.point.hardware, "tp": r.point.tp, "source": r.point.source,
             "note": r.point.note, "unit": r.point.unit, "measured": r.point.measured,
             "measured_hi": r.point.hi, "predicted": r.predicted, "error": r.error} for r in rows]


def tables_json(cv: list[Row] | None, ins: list[Row], calibration: str, engine: str | None) -> dict:
    out = {"calibration": calibration, "engine_profile": engine or "per point",
           "default_engine_profile": DEFAULT_ENGINE_PROFILE,
           "in_sample": {"summary": summary(ins), "by_kind": breakdown(ins, lambda p: p.group),
                         "by_source": breakdown(ins, lambda p: p.family), "points": _rows_json(ins)}}
    if cv is not None:
        out["cross_validated"] = {"summary": summary(cv), "by_kind": breakdown(cv, lambda p: p.group),
                                  "by_source": breakdown(cv, lambda p: p.family),
                                  "points": _rows_json(cv)}
    return out


def run(calibration: str = "published", engine: str | None = None, cv: bool = True
        ) -> tuple[list[Row] | None, list[Row]]:
    """(cross-validated rows of the checkable points or None, in-sample rows of every point).
    The points no fold can check (fit.checkable) are in-sample only; `run_all` has them too."""
    out = run_all(calibration, engine, cv)
    return out[0], out[1]


def run_all(calibration: str = "published", engine: str | None = None, cv: bool = True
            ) -> tuple[list[Row] | None, list[Row], list[Row]]:
    """(checkable cross-validated rows, in-sample rows, unchecked points' fold rows)."""
    pts = published_points()
    ins = evaluate(calibration, pts, engine=engine)
    if not cv:
        return None, ins, []
    if engine is not None:  # one profile for every point: price the folds with it too
        pts = [dataclasses.replace(p, engine=engine) for p in pts]
    rows, _, unchecked = cross_validate(pts, workers=max(1, min(4, os.cpu_count() or 1)))
    skip = {p.name for p in unchecked}
    return ([r for r in rows if r.point.name not in skip], ins,
            [r for r in rows if r.point.name in skip])


def cmd_validate(args: argparse.Namespace) -> int:
    if not args.no_cv and args.json != "-":
        print("cross-validating: one refit per source family (a few minutes) ...", file=sys.stderr)
    cv, ins, unchecked = run_all(args.calibration, args.engine_profile, not args.no_cv)
    doc = tables_json(cv, ins, args.calibration, args.engine_profile)
    if cv is not None:
        doc["not_cross_validatable"] = {
            "why": "their prediction rests on terms only their own family measures (the eager-2023 "
                   "CPU phases, the one attention kernel Vidur profiled); held out, they are priced "
                   "with the fold's fallbacks",
            "summary_with_fallbacks": summary(unchecked), "points": _rows_json(unchecked)}
    if args.json == "-":
        print(json.dumps(doc, indent=1, default=float))
        return 0
    print(format_table(cv, ins, args.calibration))
    if unchecked:
        s = summary(unchecked)
        print(f"not cross-validatable (only their own family or run measures their terms): {s['points']} "
              f"points, in-sample only above; held out and priced with the fold's fallbacks: median "
              f"{s['median_abs_error']:.1%}, max {s['max_abs_error']:.1%}")
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1, default=float))
    return 0

