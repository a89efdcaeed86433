"""Low-level parsing shared by the loaders: reading (gzip-aware) text and checked fields.

Every helper takes the source name and the 1-based line so that a bad value becomes a
`WorkloadError` saying exactly where and what, instead of a bare ValueError from int().
"""

from __future__ import annotations

import gzip
import math
import re
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path

from flowyard.workloads.workload import WorkloadError

_TS = re.compile(
    r"\s*(\d{4}-\d{2}-\d{2})[T ](\d{1,2}):(\d{2})(?::(\d{2}))?(?:[.,](\d+))?\s*(Z|[+-]\d{2}:?\d{2})?\s*$"
)


def parse_length(src: str, line: int, col: str, text: str) -> int:
    """A token count >= 0; '12.0' is accepted (some exports write floats), '12.5' is not."""
    try:
        v = int(text)
    except ValueError:
        try:
            f = float(text)
        except ValueError:
            raise WorkloadError(src, line, f"column {col!r}: {text!r} is not a number") from None
        if not f.is_integer():
            raise WorkloadError(src, line, f"column {col!r}: {text!r} is not a whole token count")
        v = int(f)
    if v < 0:
        raise WorkloadError(src, line, f"column {col!r}: negative length {v}")
    return v


def parse_seconds(src: str, line: int, col: str, text: str) -> float:
    """A finite float time (relative seconds or ms); NaN/inf would poison the event heap."""
    try:
        v = float(text)
    except ValueError:
        raise WorkloadError(src, line, f"column {col!r}: {text!r} is not a number") from None
    if not math.isfinite(v):
        raise WorkloadError(src, line, f"column {col!r}: {text!r} is not a finite time")
    return v


@lru_cache(maxsize=64)
def _day_epoch(date: str, tz: str | None) -> int:
    """Epoch seconds of 00:00 on `date` in zone `tz` (None/"Z" = UTC); ValueError if invalid."""
    day = datetime.fromisoformat(date).replace(tzinfo=timezone.utc)
    off = 0
    if tz and tz != "Z":
        hh, mm = int(tz[1:3]), int(tz[-2:])
        off = (hh * 3600 + mm * 60) * (1 if tz[0] == "+" else -1)
    return int(day.timestamp()) - off


def parse_wallclock(src: str, line: int, col: str, text: str) -> tuple[float, float]:
    """'YYYY-MM-DD HH:MM:SS.fffffff' → (whole epoch seconds, fraction); naive means UTC.

    Parsed by hand rather than with `datetime.fromisoformat`, which rejects the Azure
    trace's 7 fractional digits on older Pythons and truncates them to microseconds on
    newer ones; the date part is cached, which also makes this ~3x faster.
    """
    m = _TS.match(text)
    if m is None:
        try:
            return parse_seconds(src, line, col, text), 0.0  # plain epoch seconds
        except WorkloadError:
            raise WorkloadError(src, line, f"column {col!r}: {text!r} is not a timestamp") from None
    date, hh, mi, ss, frac, tz = m.groups()
    h, mn, sec = int(hh), int(mi), int(ss or 0)
    try:
        if h > 23 or mn > 59 or sec > 60:
            raise ValueError
        day = _day_epoch(date, tz)
    except ValueError:
        raise WorkloadError(src, line, f"column {col!r}: {text!r} is not a valid date/time") from None
    return float(day + h * 3600 + mn * 60 + sec), float("0." + frac) if frac else 0.0


# ----------------------------------------------------------------------------- reading


def read_text(path: str | Path) -> str:
    """Whole file as text; gzip detected by magic bytes; UTF-8 with optional BOM."""
    src = str(path)
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise WorkloadError(src, None, f"cannot read file: {e.strerror or e}") from None
    if data[:2] == b"\x1f\x8b":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as e:
            raise WorkloadError(src, None, f"corrupt gzip data: {e}") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise WorkloadError(src, None, f"not UTF-8 text (byte {e.start})") from None


__all__ = ["read_text", "parse_length", "parse_seconds", "parse_wallclock"]
