"""Deadline priorities and the TTFT predictor behind them (FlowPrefill §5.2, Eq. 3).

S-EDF ranks by priority = sgn(slack) / deadline with slack = deadline − now − TTFT-hat: among
requests that can still meet their deadline the earliest deadline goes first, and requests
that cannot are pushed behind all of them. We express it as an ascending sort key, which
orders exactly as the formula for positive deadlines but does not depend on where the clock
starts: (0, deadline) when slack ≥ 0, else (1, −deadline). A request without a TTFT SLO has
an infinite deadline (priority 0: after every feasible one, before every late one).

The ablation's variants: EDF (deadline only) and D-EDF (sgn(deadline − now) instead of
sgn(slack): only requests already past their deadline are pushed back).
"""

from __future__ import annotations

from typing import Sequence

from flowyard.core.plan import BatchShape, PrefillSlice, StepPlan
from flowyard.core.request import Request, RequestState
from flowyard.costmodel.base import CostModel

INF = float("inf")
PRIORITIES = ("s-edf", "edf", "d-edf")


def deadline(req: Request) -> float:
    return req.arrival + req.slo.ttft if req.slo.ttft is not None else INF


def priority_key(kind: str, req: Request, now: float, ttft_hat: float) -> tuple:
    """Ascending key: the smallest key has the highest priority. Ties break by arrival, id."""
    d = deadline(req)
    if kind == "edf":
        late = False
    elif kind == "s-edf":
        late = d - now - ttft_hat < 0
    else:  # d-edf
        late = d - now < 0
    return (1, -d, req.arrival, req.id) if late else (0, d, req.arrival, req.id)


class TTFTPredictor:
    """TTFT-hat and batch latency from a cost model (the simulator's, a profile of this engine,
    or a deliberately wrong copy via `with_error`).

    A request's own prediction depends only on its progress, so it is cached per (request,
    tokens computed): a scheduling round costs a dictionary lookup per queued request, not a
    cost-model evaluation.
    """

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost
        self._cache: dict[int, tuple[int, float]] = {}

    def request(self, st: RequestState) -> float:
        """Time to prefill the rest of st's prompt alone."""
        hit = self._cache.get(st.id)
        if hit is not None and hit[0] == st.num_computed:
            return hit[1]
        t = self.cost.prefill_time(st.uncomputed, history=st.num_computed)
        if len(self._cache) > 65536:
            self._cache.clear()
        self._cache[st.id] = (st.num_computed, t)
        return t

    def slices(self, slices: Sequence[PrefillSlice]) -> float:
        """Latency of one step running these prefill slices together."""
        return float(self.cost.step_time(BatchShape.of([(s.start, s.n) for s in slices], [])))

    def step(self, plan: StepPlan) -> float:
        return float(self.cost.step_time(plan.shape()))
