"""Goodput and serving capacity: the highest request rate at which a criterion still holds
(SLO attainment >= target, or DynaServe's P99 TBT <= SLO), found by doubling then bisecting,
with every evaluated point kept as the curve a report plots."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from flowyard.core.metrics import EPS, nan_to_none


@dataclass(slots=True)
class GoodputResult:
    """Outcome of a rate search.

    goodput: the highest evaluated rate known to meet the criterion (0 when even `lo` fails).
    curve: every evaluated (rate, value) sorted by rate; value is attainment for
      goodput_search and P99 TBT (s) for serving_capacity.
    capped: the criterion still held at the expansion cap, so the true value may be higher.
    """

    goodput: float
    curve: list[tuple[float, float]]
    policy: str = ""
    target: float = 0.9
    capped: bool = False
    never_met: bool = False
    note: str = ""

    @property
    def evals(self) -> int:
        return len(self.curve)

    def to_dict(self) -> dict:
        """DESIGN.md `goodput --json` entry: policy, goodput_rps, curve [[rate, value], ...]."""
        return {"policy": self.policy, "goodput_rps": self.goodput,
                "curve": [[r, nan_to_none(v)] for r, v in self.curve], "target": self.target,
                "capped": self.capped, "never_met": self.never_met, "note": self.note}


def _search(measure: Callable[[float], float], good: Callable[[float], bool], *, lo: float,
            hi: float, tol: float, max_evals: int, max_hi: float | None, target: float,
            policy: str) -> GoodputResult:
    """Find the largest rate where good(measure(rate)) holds, assuming it holds below some
    threshold and fails above it (roughly monotone). Checks lo, then hi, doubling hi up to
    max_hi while it still holds, then bisects until the bracket is within tol (relative)."""
    if not 0 <= lo < hi:
        raise ValueError(f"need 0 <= lo < hi, got lo={lo}, hi={hi}")
    if max_evals < 2:
        raise ValueError("max_evals must be >= 2")
    cap = max_hi if max_hi is not None else hi * 16
    seen: dict[float, float] = {}

    def probe(rate: float) -> bool:
        if rate not in seen:
            seen[rate] = float(measure(rate))
        return good(seen[rate])

    def result(goodput: float, **kw) -> GoodputResult:
        curve = sorted(seen.items())
        return GoodputResult(goodput, curve, policy=policy, target=target, **kw)

    if not probe(lo):
        return result(0.0, never_met=True, note=f"criterion not met even at the lowest rate {lo:g}")
    ok_rate, bad_rate = lo, hi
    while probe(bad_rate):
        ok_rate = bad_rate
        if bad_rate >= cap or len(seen) >= max_evals:
            return result(ok_rate, capped=True,
                          note=f"criterion still met at {ok_rate:g} (search cap); goodput >= that")
        bad_rate = min(bad_rate * 2, cap)
    while bad_rate - ok_rate > tol * bad_rate and len(seen) < max_evals:
        mid = 0.5 * (ok_rate + bad_rate)
        if probe(mid):
            ok_rate = mid
        else:
            bad_rate = mid
    return result(ok_rate)


def goodput_search(attainment_at: Callable[[float], float], *, lo: float, hi: float,
                   target: float = 0.9, tol: float = 0.01, max_evals: int = 24,
                   max_hi: float | None = None, policy: str = "") -> GoodputResult:
    """Goodput: the highest rate at which SLO attainment stays >= target.

    attainment_at(rate) runs the workload at that rate (or rate scale) and returns attainment
    in [0, 1]. Attainment is assumed roughly monotone (non-increasing) in rate; with noise the
    result is one crossing of the target, not necessarily the highest. tol is relative: the
    search stops when (fail - ok) <= tol * fail. If attainment still meets the target at hi,
    hi doubles up to max_hi (default 16 * hi) and the result is marked `capped` there.
    """
    return _search(attainment_at, lambda a: a >= target - EPS, lo=lo, hi=hi, tol=tol,
                   max_evals=max_evals, max_hi=max_hi, target=target, policy=policy)


def serving_capacity(p99_tbt_at: Callable[[float], float], slo: float, *, lo: float, hi: float,
                     tol: float = 0.01, max_evals: int = 24, max_hi: float | None = None,
                     policy: str = "") -> GoodputResult:
    """DynaServe's serving capacity: the highest rate with P99 TBT <= slo (seconds); same
    search as goodput_search, curve values are P99 TBT. NaN (no gaps measured) fails."""
    return _search(p99_tbt_at, lambda v: v <= slo + EPS, lo=lo, hi=hi, tol=tol,
                   max_evals=max_evals, max_hi=max_hi, target=slo, policy=policy)
