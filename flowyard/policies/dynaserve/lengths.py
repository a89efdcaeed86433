"""Output-length predictors for DynaServe's split search (§3.1, §5 "Prediction length").

The split point s = ρ·N needs N = P + D̂, so the global scheduler must guess how many tokens a
request will produce before it has produced any. The paper uses prior length-prediction work
and adds a safety margin (20 tokens) because under-estimating pushes decode work onto an
instance the search did not budget for. Predictors here are pluggable behind one protocol:

- `EmpiricalLengthPredictor` (default): the mean (or a quantile) of the output lengths of
  finished requests of the same `Request.task`, shrunk towards a prior while few are known.
  The local schedulers feed it (`observe`) as requests finish, on whichever executor.
- `OracleLengthPredictor`: the request's true `target_output`, for experiments that isolate
  the scheduler from prediction error.
- `NoisyLengthPredictor`: another predictor times a multiplicative error (fixed factor and/or
  log-normal noise, deterministic per request id) for the sensitivity study (Table 4).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from flowyard.core.request import Request


class LengthPredictor(Protocol):
    """Predicted output tokens D̂ of a request (margin included), and feedback from finishes."""

    def predict(self, req: Request) -> int: ...

    def observe(self, req: Request, output_tokens: int) -> None: ...


def _cap(req: Request, d: float) -> int:
    """At least one token and never more than the request may produce (max_tokens)."""
    d = max(1, int(round(d)))
    return min(d, req.max_tokens) if req.max_tokens is not None else d


@dataclass
class _TaskStats:
    window: deque
    total: float = 0.0
    cached: float | None = None  # the quantile of the current window, until the next observe


class EmpiricalLengthPredictor:
    """Per-task empirical output-length distribution with a prior and a margin.

    predict = statistic of the task's last `window` finished lengths, blended with
    `prior_mean` as `prior_weight` pseudo-observations, plus `margin`. `quantile=None` uses
    the mean (O(1)); a quantile (e.g. 0.5) is recomputed lazily after each new observation.
    Tasks never seen fall back to the pooled statistics of all tasks, then to the prior.
    """

    def __init__(self, prior_mean: float = 256.0, prior_weight: float = 4.0, margin: int = 20,
                 window: int = 1024, quantile: float | None = None) -> None:
        if prior_mean <= 0 or prior_weight < 0 or margin < 0 or window < 1:
            raise ValueError("prior_mean > 0, prior_weight >= 0, margin >= 0 and window >= 1 required")
        if quantile is not None and not 0.0 <= quantile <= 1.0:
            raise ValueError(f"quantile must be in [0, 1], got {quantile}")
        self.prior_mean, self.prior_weight, self.margin = prior_mean, prior_weight, margin
        self.window, self.quantile = window, quantile
        self._tasks: dict[str | None, _TaskStats] = {}
        self._all = _TaskStats(deque(maxlen=window))

    def _add(self, s: _TaskStats, x: float) -> None:
        if len(s.window) == s.window.maxlen:
            s.total -= s.window[0]
        s.window.append(x)
        s.total += x
        s.cached = None

    def observe(self, req: Request, output_tokens: int) -> None:
        s = self._tasks.get(req.task)
        if s is None:
            s = self._tasks[req.task] = _TaskStats(deque(maxlen=self.window))
        self._add(s, float(output_tokens))
        self._add(self._all, float(output_tokens))

    def estimate(self, task: str | None) -> float:
        """The blended statistic for `task` (no margin, no cap)."""
        s = self._tasks.get(task) or (self._all if self._all.window else None)
        if s is None or not s.window:
            return self.prior_mean
        n = len(s.window)
        if self.quantile is None:
            stat = s.total / n
        else:
            if s.cached is None:
                s.cached = float(np.quantile(np.fromiter(s.window, float, n), self.quantile))
            stat = s.cached
        w = self.prior_weight
        return (w * self.prior_mean + n * stat) / (w + n)

    def predict(self, req: Request) -> int:
        return _cap(req, self.estimate(req.task) + self.margin)


class OracleLengthPredictor:
    """The true output length (plus an optional margin): the upper bound on prediction."""

    def __init__(self, margin: int = 0) -> None:
        self.margin = margin

    def predict(self, req: Request) -> int:
        return _cap(req, req.target_output + self.margin)

    def observe(self, req: Request, output_tokens: int) -> None:
        pass


class FixedLengthPredictor:
    """One length for every request (plus the margin): DynaServe's sensitivity study (Table 4)
    assumes a fixed 1467 tokens while the true lengths vary around it."""

    def __init__(self, length: float, margin: int = 0) -> None:
        if not length > 0:
            raise ValueError(f"a fixed output length must be positive, got {length}")
        self.length, self.margin = length, margin

    def predict(self, req: Request) -> int:
        return _cap(req, self.length + self.margin)

    def observe(self, req: Request, output_tokens: int) -> None:
        pass


class NoisyLengthPredictor:
    """`base`'s prediction times factor · exp(sigma · z), z ~ N(0, 1) drawn from the request id
    (the same request gets the same error in every run and under every policy)."""

    def __init__(self, base: LengthPredictor, factor: float = 1.0, sigma: float = 0.0, seed: int = 0) -> None:
        if not factor > 0 or sigma < 0:
            raise ValueError("factor must be positive and sigma non-negative")
        self.base, self.factor, self.sigma, self.seed = base, factor, sigma, seed

    def multiplier(self, req: Request) -> float:
        if self.sigma == 0:
            return self.factor
        z = np.random.default_rng((self.seed, req.id & 0xFFFFFFFF)).standard_normal()
        return self.factor * math.exp(self.sigma * z)

    def predict(self, req: Request) -> int:
        return _cap(req, self.base.predict(req) * self.multiplier(req))

    def observe(self, req: Request, output_tokens: int) -> None:
        self.base.observe(req, output_tokens)


def make_length_predictor(kind: str = "empirical", *, margin: int = 20, error: float = 1.0,
                          sigma: float = 0.0, prior_mean: float = 256.0, seed: int = 0) -> LengthPredictor:
    """By name: "empirical" (default), "oracle" or "fixed" (always `prior_mean`, plus the
    margin); error/sigma != identity wraps it in noise."""
    if kind == "empirical":
        p: LengthPredictor = EmpiricalLengthPredictor(prior_mean=prior_mean, margin=margin)
    elif kind == "oracle":
        p = OracleLengthPredictor(margin=0)
    elif kind == "fixed":
        p = FixedLengthPredictor(prior_mean, margin=margin)
    else:
        raise ValueError(f"unknown length predictor {kind!r}; valid: empirical, oracle, fixed")
    if error != 1.0 or sigma > 0:
        p = NoisyLengthPredictor(p, factor=error, sigma=sigma, seed=seed)
    return p
