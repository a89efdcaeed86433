"""Sweeps of independent simulations over Ray, with a resumable result cache (docs/scale.md)."""

from flowyard.sweep.cache import ResultCache, code_revision
from flowyard.sweep.runner import Pending, Sweep, current, digest, use

__all__ = ["Pending", "ResultCache", "Sweep", "code_revision", "current", "digest", "use"]
