"""argparse value types shared by every `flowyard` subcommand: one wording for bad values."""

from __future__ import annotations

import argparse
import math


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


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return v
