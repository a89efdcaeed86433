"""Shared catalog plumbing: the error a bad model/hardware name raises, and name lookup.

The CLI turns a `CatalogError` into a one-line message plus exit status 2, so the message
itself must list the valid names: the user sees nothing else.
"""

from __future__ import annotations

from typing import Mapping, TypeVar

T = TypeVar("T")


class CatalogError(ValueError):
    """An unknown model or hardware name; the message lists the valid names."""


def lookup(kind: str, name: str, table: Mapping[str, T], extra: str = "") -> T:
    """Case-insensitive lookup of `name` in `table`, or a CatalogError listing the keys."""
    key = name.strip().lower()
    if key in table:
        return table[key]
    valid = ", ".join(table)
    raise CatalogError(f"unknown {kind} {name!r}; valid {kind}s: {valid}{extra}")
