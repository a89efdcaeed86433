"""argparse value types shared by every `flowyard` subcommand: one wording for bad values."""

from __future__ import annotations

import argparse
import math
import os


class UsageError(Exception):
    """A bad name or flag value: `flowyard` prints it as one line and exits with code 2. It lives
    here, not in `flowyard.cli`, so `python -m flowyard.cli` (which runs that module as
    `__main__`) catches the same class the subcommands' modules raise."""


def positive_float(text: str, *, allow_inf: bool = False) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if math.isnan(v) or not v > 0 or (math.isinf(v) and not allow_inf):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return v


def rate(text: str) -> float:
    """A positive rate, where 'inf' means 'all at once'."""
    return positive_float(text, allow_inf=True)


def _int_at_least(text: str, lo: int) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < lo:
        raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {text!r}")
    return v


def positive_int(text: str) -> int:
    return _int_at_least(text, 1)


def nonneg_int(text: str) -> int:
    return _int_at_least(text, 0)


def fraction(text: str) -> float:
    """A share in (0, 1], such as an SLO-attainment target: 1.5 can never be met."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1] (a share, e.g. 0.9 for 90 %), got {text!r}")
    return v


def check_output_path(path: str | None, flag: str) -> None:
    """Fail before any work on an output file that cannot be written: the parent folder must
    exist and be writable and the path must not be a folder (`-`, standard output, is fine).
    Raises ValueError naming the flag, so a long run never ends in a lost result."""
    if path is None or path == "-":
        return
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path!r} is a folder; give a file path")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ValueError(f"{flag} {path!r}: folder {parent!r} does not exist")
    if not os.access(parent, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise ValueError(f"{flag} {path!r}: not writable")
