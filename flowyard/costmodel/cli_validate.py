"""`flowyard validate`: the cost model against published GPU measurements.

Prints one row per point of `flowyard.costmodel.published` (point, source, measured, our
prediction, error) under a calibration, then the median and max absolute error; `--json PATH`
writes the same table. With `--calibration all` (the default) both calibrations are shown, so
switching the default is a decision made on one table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from flowyard.costmodel.fit import Row, evaluate, summary
from flowyard.costmodel.hardware import CALIBRATIONS


def add_validate_parser(sub: argparse._SubParsersAction) -> None:
    v = sub.add_parser("validate", help="cost model vs published GPU measurements (error table)")
    v.add_argument("--calibration", default="all", choices=("all",) + CALIBRATIONS,
                   help="which calibration to price the points with (default: all)")
    v.add_argument("--json", default=None, metavar="PATH", help="write the table as JSON ('-': stdout)")
    v.set_defaults(func=cmd_validate)


def _fmt(v: float, unit: str) -> str:
    return f"{v:.0f} {unit}" if unit == "tokens" else f"{v:.4g} {unit}"


def _measured(row: Row) -> str:
    p = row.point
    if not p.is_range:
        return _fmt(p.measured, p.unit)
    return f"<= {_fmt(p.hi, p.unit)}" if p.measured == 0 else f"{p.measured:.0f}-{_fmt(p.hi, p.unit)}"


def format_table(calibration: str, rows: list[Row]) -> str:
    """The table as text: one line per point, sources underneath, the summary last."""
    head = f"{'point':<52} {'measured':>14} {'predicted':>12} {'error':>7}"
    lines = [f"calibration: {calibration}", head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.point.name[:52]:<52} {_measured(r):>14} "
                     f"{_fmt(r.predicted, r.point.unit):>12} {r.error:>+7.1%}")
        lines.append(f"    source: {r.point.source}" + (f"  ({r.point.note})" if r.point.note else ""))
    s = summary(rows)
    lines.append(f"{s['points']} points: median |error| {s['median_abs_error']:.1%}, "
                 f"max {s['max_abs_error']:.1%}; within 10 %: {s['within_10pct']}, "
                 f"within 25 %: {s['within_25pct']}")
    return "\n".join(lines)


def table_json(calibrations: list[str]) -> dict:
    out = {}
    for cal in calibrations:
        rows = evaluate(cal)
        out[cal] = {"summary": summary(rows), "points": [
            {"point": r.point.name, "kind": r.point.kind, "model": str(getattr(r.point.model, "name",
                                                                               r.point.model)),
             "hardware": r.point.hardware, "tp": r.point.tp, "source": r.point.source,
             "note": r.point.note, "from_figure": r.point.from_figure, "unit": r.point.unit,
             "measured": r.point.measured, "measured_hi": r.point.hi,
             "predicted": r.predicted, "error": r.error} for r in rows]}
    return out


def cmd_validate(args: argparse.Namespace) -> int:
    cals = list(CALIBRATIONS) if args.calibration == "all" else [args.calibration]
    if args.json == "-":
        print(json.dumps(table_json(cals), indent=1))
        return 0
    print("\n\n".join(format_table(cal, evaluate(cal)) for cal in cals))
    if args.json:
        Path(args.json).write_text(json.dumps(table_json(cals), indent=1))
    return 0
