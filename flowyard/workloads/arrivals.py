"""Synthetic arrival processes, for length-only traces and for re-timing timed ones.

Length datasets (ShareGPT, arXiv) carry no timestamps, so a study has to choose how requests
arrive. Poisson is the usual choice in the papers (DistServe, PLA-Serve, FlowPrefill); a Gamma
renewal process with coefficient of variation `cv` > 1 gives the burstier traffic that Arrow
and ServeGen observe (cv = 1 has the same distribution as Poisson). Everything draws from a
seeded `numpy.random.Generator`, so the same seed gives the same arrivals on every machine.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from flowyard.workloads.workload import Workload

ARRIVAL_PROCESSES: tuple[str, ...] = ("poisson", "gamma")

#: Default rate (req/s) for length-only traces. 4 req/s sits in the range of the real timed
#: traces bundled here (Azure code 2.6, Mooncake 3.4, Azure conv 5.5 req/s), so that a
#: `--rate-scale` means roughly the same load whichever bundled trace is replayed.
DEFAULT_RATE: float = 4.0


def _check(n: int, rate: float) -> None:
    if n < 0:
        raise ValueError(f"number of arrivals must be >= 0, got {n}")
    if not (rate > 0 and np.isfinite(rate)):
        raise ValueError(f"arrival rate must be a positive number of req/s, got {rate!r}")


def _from_gaps(gaps: np.ndarray) -> np.ndarray:
    """n - 1 inter-arrival gaps → n arrival times starting at 0.0."""
    out = np.zeros(len(gaps) + 1)
    np.cumsum(gaps, out=out[1:])
    return out


def poisson_arrivals(n: int, rate: float, seed: int | None = 0) -> np.ndarray:
    """n arrival times (s) of a Poisson process at `rate` req/s; the first is 0.0."""
    _check(n, rate)
    if n == 0:
        return np.zeros(0)
    rng = np.random.default_rng(seed)
    return _from_gaps(rng.exponential(1.0 / rate, n - 1))


def gamma_arrivals(n: int, rate: float, cv: float, seed: int | None = 0) -> np.ndarray:
    """n arrival times of a Gamma renewal process: mean gap 1/rate, gap CV `cv`.

    Shape k = 1/cv², scale = cv²/rate, so mean = 1/rate and std/mean = cv.
    """
    _check(n, rate)
    if not (cv > 0 and np.isfinite(cv)):
        raise ValueError(f"gamma arrival cv must be positive, got {cv!r}")
    if n == 0:
        return np.zeros(0)
    rng = np.random.default_rng(seed)
    shape = 1.0 / (cv * cv)
    return _from_gaps(rng.gamma(shape, 1.0 / (rate * shape), n - 1))


def make_arrivals(
    process: str, n: int, rate: float, seed: int | None = 0, cv: float = 1.0
) -> np.ndarray:
    """Dispatch by name: "poisson" (cv ignored) or "gamma"."""
    p = process.lower()
    if p == "poisson":
        return poisson_arrivals(n, rate, seed)
    if p == "gamma":
        return gamma_arrivals(n, rate, cv, seed)
    raise ValueError(f"unknown arrival process {process!r}; known: {', '.join(ARRIVAL_PROCESSES)}")


def retime(
    workload: Workload,
    process: str = "poisson",
    rate: float = DEFAULT_RATE,
    seed: int | None = 0,
    cv: float = 1.0,
) -> Workload:
    """Same requests in the same order (lengths, SLOs, tags kept), new arrival times.

    Turning a timed trace into a Poisson one at a chosen rate separates the effect of the
    length distribution from that of the trace's real burstiness.
    """
    t = make_arrivals(process, len(workload.requests), rate, seed, cv)
    reqs = [replace(r, id=i, arrival=float(a)) for i, (r, a) in enumerate(zip(workload.requests, t))]
    return workload.derive(reqs, normalize_order=False)


__all__ = [
    "ARRIVAL_PROCESSES",
    "DEFAULT_RATE",
    "poisson_arrivals",
    "gamma_arrivals",
    "make_arrivals",
    "retime",
]
