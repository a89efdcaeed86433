"""Text and JSON reports of run summaries and goodput searches.

The table mimics `vllm bench serve` (banner, `label: value` rows, one section per latency
metric, times in ms) so numbers can be read side by side with vLLM's. JSON keys follow
DESIGN.md's `--json` contract; write errors become an OSError whose message names the path,
so the CLI can print it and exit instead of showing a traceback.
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import replace
from typing import Iterable, Mapping, Sequence

from flowyard.core.goodput import GoodputResult
from flowyard.core.metrics import Summary

WIDTH = 50
LABEL = 40


def _banner(text: str, fill: str) -> str:
    return f"{text:{fill}^{WIDTH}}"


def _row(label: str, value: object) -> str:
    return f"{label + ':':<{LABEL}} {value:<10}"


def _num(x: float, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{x:.{digits}f}"


def _ms(x: float | None) -> str:
    return "n/a" if x is None or math.isnan(x) else f"{x * 1e3:.2f}"


SECTIONS = (  # (banner title, metric attribute, label used in the rows)
    ("Time to First Token", "ttft", "TTFT"),
    ("Time per Output Token (excl. 1st token)", "tpot", "TPOT"),
    ("Inter-token Latency (TBT)", "itl", "ITL"),
    ("End-to-end Latency", "e2e", "E2EL"),
)


def format_table(summary: Summary) -> str:
    """The results table of one run, in `vllm bench serve` style."""
    s = summary
    lines = [_banner(" Serving Benchmark Result ", "=")]
    if s.policy:
        lines.append(_row("Policy", s.policy))
    lines += [
        _row("Total requests", s.requests),
        _row("Successful requests", s.completed),
        _row("Rejected requests", s.rejected),
        _row("Benchmark duration (s)", _num(s.duration_s)),
        _row("Total input tokens", s.input_tokens),
        _row("Total generated tokens", s.output_tokens),
        _row("Request throughput (req/s)", _num(s.throughput_rps)),
        _row("Output token throughput (tok/s)", _num(s.output_tokens_per_s)),
        _row("SLO attainment", f"{s.slo_attainment * 100:.2f} %"),
        _row("Token goodput (tok/s)", _num(s.token_goodput)),
    ]
    if s.wall_s:
        lines.append(_row("Wall time (s)", _num(s.wall_s)))
    for title, attr, label in SECTIONS:
        d = getattr(s, attr)
        lines.append(_banner(title, "-"))
        lines.append(_row(f"Mean {label} (ms)", _ms(d["mean"])))
        lines.append(_row(f"Median {label} (ms)", _ms(d["p50"])))
        lines.append(_row(f"P90 {label} (ms)", _ms(d["p90"])))
        lines.append(_row(f"P99 {label} (ms)", _ms(d["p99"])))
    lines.append("=" * WIDTH)
    return "\n".join(line.rstrip() for line in lines)


def result_list(results: Mapping[str, GoodputResult] | Iterable[GoodputResult]
             ) -> list[GoodputResult]:
    """Accept {policy: result} or results that carry their own policy name."""
    if isinstance(results, Mapping):
        return [r if r.policy else replace(r, policy=name) for name, r in results.items()]
    return list(results)


def format_goodput_table(results: Mapping[str, GoodputResult] | Sequence[GoodputResult]) -> str:
    """One row per policy: goodput (req/s), points evaluated, and a flag when the search hit
    its cap (goodput is a lower bound) or never met the target."""
    rows = result_list(results)
    width = max([len("policy")] + [len(r.policy) for r in rows])
    head = f"{'policy':<{width}}  {'goodput (req/s)':>15}  {'points':>6}  note"
    lines = [head, "-" * len(head)]
    for r in rows:
        flag = ">= (capped)" if r.capped else ("never met" if r.never_met else "")
        lines.append(f"{r.policy:<{width}}  {r.goodput:>15.3f}  {r.evals:>6}  {flag}".rstrip())
    return "\n".join(lines)


def _write(path: str | os.PathLike, obj: dict) -> None:
    """Write `obj` as JSON to `path`; "-" is standard output."""
    if os.fspath(path) == "-":
        json.dump(obj, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2)
            f.write("\n")
    except OSError as e:
        raise OSError(f"cannot write results to '{os.fspath(path)}': {e.strerror or e}") from e


def write_json(summary: Summary, path: str | os.PathLike, extra: dict | None = None) -> None:
    """Write summary.to_dict() (plus `extra` keys, which may override) as JSON to `path`.
    The directory must exist; failure raises OSError naming the path."""
    obj = summary.to_dict()
    if extra:
        obj.update(extra)
    _write(path, obj)


def write_goodput_json(results: Mapping[str, GoodputResult] | Sequence[GoodputResult],
                       path: str | os.PathLike, extra: dict | None = None) -> None:
    """Write `{"results": [{"policy", "goodput_rps", "curve": [[rate, attainment], ...]}]}`."""
    obj: dict = {"results": [r.to_dict() for r in result_list(results)]}
    if extra:
        obj.update(extra)
    _write(path, obj)
