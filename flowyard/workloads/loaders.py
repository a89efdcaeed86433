"""Readers for every real trace format in ../shared/traces, detected from the content.

The format is taken from the CSV header or the JSON keys, never from the file name, so a
renamed or user-made file in a known format loads the same way (`--trace PATH`). gzip is
detected from the magic bytes. Reading uses the csv/json modules and plain lists: the 19k-row
Azure conv trace loads in about 0.1 s, with no pandas dependency.

Rows are dropped (and counted in `Workload.dropped`) when a request has zero prompt or zero
output tokens: BurstGPT marks failed requests that way, and a request that produces nothing
cannot be timed. Everything else that is wrong (a missing column, a value that is not a
number, a negative length, an empty file, an unknown header) raises `WorkloadError`, naming
the file, the 1-based line and the reason, because silently skipping bad rows would change
the load a study measures.
"""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from flowyard.workloads.arrivals import DEFAULT_RATE, make_arrivals
from flowyard.workloads.fields import parse_length, parse_seconds, parse_wallclock, read_text
from flowyard.workloads.workload import Workload, WorkloadError, build_requests

#: Known formats and what identifies them (shown in "unknown format" errors).
FORMATS: dict[str, str] = {
    "azure": "Azure LLM inference 2023 CSV (TIMESTAMP,ContextTokens,GeneratedTokens)",
    "vidur": "Vidur splitwise CSV (arrived_at,num_prefill_tokens,num_decode_tokens)",
    "burstgpt": "BurstGPT CSV v1/v3 (Timestamp,Model,Request tokens,Response tokens[,Session ID])",
    "lengths": "length-only CSV (num_prefill_tokens,num_decode_tokens; synthetic arrivals)",
    "mooncake": "Mooncake JSONL (timestamp ms, input_length, output_length[, hash_ids])",
}
TIMED_FORMATS = ("azure", "vidur", "burstgpt", "mooncake")
MOONCAKE_BLOCK = 512  # tokens per Mooncake hash_ids block (FAST'25 release)

# Required CSV columns (lower-cased) and the column whose presence identifies each format.
_REQUIRED: dict[str, tuple[str, ...]] = {
    "azure": ("timestamp", "contexttokens", "generatedtokens"),
    "vidur": ("arrived_at", "num_prefill_tokens", "num_decode_tokens"),
    "burstgpt": ("timestamp", "model", "request tokens", "response tokens"),
    "lengths": ("num_prefill_tokens", "num_decode_tokens"),
}
_SIGNATURE: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("azure", ("contexttokens", "generatedtokens")),
    ("burstgpt", ("request tokens", "response tokens", "log type")),
    ("vidur", ("arrived_at",)),
    ("lengths", ("num_prefill_tokens", "num_decode_tokens")),
)


@dataclass
class _Columns:
    """Parsed rows, column-wise; `secs` + `frac` keep wall-clock timestamps exact."""

    secs: list[float] = field(default_factory=list)
    frac: list[float] = field(default_factory=list)
    prompt: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    task: list[str | None] | None = None
    session: list[str | None] | None = None
    hashes: list[tuple[int, ...]] | None = None
    dropped: int = 0

    def keep(self, prompt: int, output: int) -> bool:
        if prompt == 0 or output == 0:
            self.dropped += 1
            return False
        self.prompt.append(prompt)
        self.output.append(output)
        return True

    def arrivals(self) -> list[float]:
        if not self.secs:
            return []
        s0, f0 = self.secs[0], self.frac[0] if self.frac else 0.0
        if not self.frac:
            return [s - s0 for s in self.secs]
        return [(s - s0) + (f - f0) for s, f in zip(self.secs, self.frac)]


def _first_line(text: str) -> tuple[int, str]:
    for i, ln in enumerate(text.splitlines(), 1):
        if ln.strip():
            return i, ln
    return 1, ""


def _unknown(src: str, line: int, what: str) -> WorkloadError:
    known = "; ".join(f"{k}: {v}" for k, v in FORMATS.items())
    return WorkloadError(src, line, f"unknown trace format ({what}); known formats: {known}")


def _detect(src: str, text: str) -> str:
    line, first = _first_line(text)
    if not first:
        raise WorkloadError(src, 1, "empty file (no header and no requests)")
    if first.lstrip().startswith("{"):
        return "mooncake"
    cols = {c.strip().lower() for c in next(csv.reader([first]))}
    for fmt, marks in _SIGNATURE:
        if any(m in cols for m in marks):
            return fmt
    raise _unknown(src, line, f"header {first.strip()[:120]!r}")


def detect_format(path: str | Path) -> str:
    """Name of the format of `path` (a key of FORMATS); WorkloadError if none fits."""
    return _detect(str(path), read_text(path))


def _csv(src: str, text: str, fmt: str) -> tuple[dict[str, int], Iterator[tuple[int, list[str]]]]:
    """Header → {lower-cased column: index}, checked against the format; then (line, row)."""
    reader = csv.reader(io.StringIO(text))
    header: list[str] = []
    for header in reader:
        if any(c.strip() for c in header):
            break
    hline = reader.line_num
    cols = {c.strip().lower(): i for i, c in enumerate(header)}
    for need in _REQUIRED[fmt]:
        if need not in cols:
            have = ",".join(c.strip() for c in header)
            raise WorkloadError(src, hline, f"missing column {need!r} for {fmt} format (header: {have})")
    width = len(header)

    def rows() -> Iterator[tuple[int, list[str]]]:
        for row in reader:
            if not row or (len(row) == 1 and not row[0].strip()):
                continue
            if len(row) != width:
                raise WorkloadError(
                    src, reader.line_num, f"expected {width} fields like the header, got {len(row)}"
                )
            yield reader.line_num, row

    return cols, rows()


def _parse_csv(src: str, text: str, fmt: str) -> _Columns:
    cols, rows = _csv(src, text, fmt)
    c = _Columns()
    if fmt == "azure":
        it, ip, io_ = cols["timestamp"], cols["contexttokens"], cols["generatedtokens"]
        for ln, r in rows:
            t = parse_wallclock(src, ln, "TIMESTAMP", r[it])
            if c.keep(parse_length(src, ln, "ContextTokens", r[ip]), parse_length(src, ln, "GeneratedTokens", r[io_])):
                c.secs.append(t[0])
                c.frac.append(t[1])
    elif fmt in ("vidur", "lengths"):
        ip, io_ = cols["num_prefill_tokens"], cols["num_decode_tokens"]
        iat = cols.get("arrived_at") if fmt == "vidur" else None
        for ln, r in rows:
            at = parse_seconds(src, ln, "arrived_at", r[iat]) if iat is not None else 0.0
            p = parse_length(src, ln, "num_prefill_tokens", r[ip])
            if c.keep(p, parse_length(src, ln, "num_decode_tokens", r[io_])):
                c.secs.append(at)
    else:  # burstgpt v1 / v3
        its, im = cols["timestamp"], cols["model"]
        ip, io_ = cols["request tokens"], cols["response tokens"]
        isess = cols.get("session id")
        task: list[str | None] = []
        session: list[str | None] | None = [] if isess is not None else None  # v1 has no sessions
        c.task, c.session = task, session
        for ln, r in rows:
            ts = parse_seconds(src, ln, "Timestamp", r[its])
            p = parse_length(src, ln, "Request tokens", r[ip])
            if c.keep(p, parse_length(src, ln, "Response tokens", r[io_])):
                c.secs.append(ts)
                task.append(r[im].strip() or None)
                if session is not None and isess is not None:
                    session.append(r[isess].strip() or None)  # empty for API-log rows
    return c


def _parse_mooncake(src: str, text: str) -> _Columns:
    hashes: list[tuple[int, ...]] = []
    c = _Columns(hashes=hashes)
    for ln, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            raise WorkloadError(src, ln, f"invalid JSON: {e.msg} (column {e.colno})") from None
        if not isinstance(obj, dict):
            raise WorkloadError(src, ln, "expected a JSON object per line")
        for key in ("timestamp", "input_length", "output_length"):
            if key not in obj:
                raise WorkloadError(src, ln, f"missing key {key!r} for mooncake format")
        t = parse_seconds(src, ln, "timestamp", str(obj["timestamp"])) / 1000.0
        p = parse_length(src, ln, "input_length", str(obj["input_length"]))
        h = obj.get("hash_ids", [])
        if not isinstance(h, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in h):
            raise WorkloadError(src, ln, "key 'hash_ids' must be a list of integers")
        if c.keep(p, parse_length(src, ln, "output_length", str(obj["output_length"]))):
            c.secs.append(t)
            hashes.append(tuple(h))
    return c


# ----------------------------------------------------------------------------- public API


def load_file(
    path: str | Path,
    *,
    name: str | None = None,
    fmt: str | None = None,
    rate: float | None = None,
    arrival: str = "poisson",
    cv: float = 1.0,
    seed: int | None = 0,
    num_requests: int | None = None,
) -> Workload:
    """Load a trace file in any known format (detected unless `fmt` is given).

    Length-only files get synthetic arrivals: `arrival` ("poisson" or "gamma" with `cv`) at
    `rate` req/s (DEFAULT_RATE when None), drawn with `seed`. For timed traces the real
    arrivals are kept; if `rate` is given they are rescaled (Arrow's method: timestamps times
    a constant) so that the mean rate equals `rate`. `num_requests` keeps the first N.
    """
    src = str(path)
    if fmt is not None and fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; known: {', '.join(FORMATS)}")
    text = read_text(path)
    if not _first_line(text)[1]:
        raise WorkloadError(src, 1, "empty file (no header and no requests)")
    fmt = fmt or _detect(src, text)
    cols = _parse_mooncake(src, text) if fmt == "mooncake" else _parse_csv(src, text, fmt)
    if not cols.prompt:
        last = len(text.rstrip().splitlines())  # last non-blank line
        if cols.dropped:
            raise WorkloadError(src, last, f"all {cols.dropped} rows dropped (zero tokens) in {fmt} file")
        raise WorkloadError(src, last + 1, f"no requests in {fmt} file (only a header)")
    if num_requests is not None and num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if rate is not None and not (rate > 0 and math.isfinite(rate)):
        raise ValueError(f"rate must be a positive number of req/s, got {rate!r}")
    arrivals: np.ndarray | list[float]
    if fmt == "lengths":
        n = len(cols.prompt) if num_requests is None else min(num_requests, len(cols.prompt))
        arrivals = make_arrivals(arrival, n, DEFAULT_RATE if rate is None else rate, seed, cv)
        cols.prompt, cols.output = cols.prompt[:n], cols.output[:n]
    else:
        arrivals = cols.arrivals()
    reqs = build_requests(
        arrivals, cols.prompt, cols.output, task=cols.task, session=cols.session,
        block_hashes=cols.hashes, hash_block_size=MOONCAKE_BLOCK if cols.hashes is not None else 0,
    )
    if fmt != "lengths":
        reqs = reqs[:num_requests] if num_requests is not None else reqs
        if rate is not None and len(reqs) > 1 and reqs[-1].arrival > 0:
            k = (len(reqs) - 1) / reqs[-1].arrival / rate
            reqs = [replace(r, arrival=r.arrival * k) for r in reqs]
    stem = Path(src).name.removesuffix(".gz").rsplit(".", 1)[0]
    return Workload(name or stem, reqs, src, cols.dropped, fmt)


def _loader(fmt: str) -> Callable[..., Workload]:
    """Per-format entry points: skip detection, so a wrong file fails on its header."""

    def load(path: str | Path, **kw: Any) -> Workload:
        return load_file(path, fmt=fmt, **kw)

    load.__name__ = f"load_{fmt}"
    load.__doc__ = f"Load a file as {FORMATS[fmt]}; keywords as `load_file`."
    return load


load_azure = _loader("azure")
load_vidur = _loader("vidur")
load_burstgpt = _loader("burstgpt")
load_mooncake = _loader("mooncake")
load_lengths = _loader("lengths")

__all__ = [
    "FORMATS", "TIMED_FORMATS", "MOONCAKE_BLOCK", "read_text", "detect_format", "load_file",
    "load_azure", "load_vidur", "load_burstgpt", "load_mooncake", "load_lengths",
]
