"""The instance monitor every local scheduler core keeps (its numbers reach global policies
through `InstanceSnapshot`): time busy running steps, the recent token interval of steps that
decode (Arrow's TPOT proxy), and the TTFT SLO outcomes of first tokens produced here (PLA's
SLA-deviation signal)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from flowyard.core.plan import StepPlan
from flowyard.core.request import RequestState
from flowyard.policies.framework.slack import deadline

TOKEN_INTERVAL_ALPHA = 0.1  # EWMA weight of one decode step in the monitor's token interval
# k -> the EWMA weights of k steps, oldest first: a run of k steps always folds with the same
# array (k is at most a core's max_repeats), so it is computed once per k, not once per run
_WEIGHTS: dict[int, np.ndarray] = {}


def _weights(k: int) -> np.ndarray:
    w = _WEIGHTS.get(k)
    if w is None:
        a = TOKEN_INTERVAL_ALPHA
        w = _WEIGHTS[k] = a * (1 - a) ** np.arange(k - 1, -1, -1)
    return w


class StepMonitor:
    def __init__(self) -> None:
        self.plan_start: float | None = None  # `now` of the last plan made (or the last step's end)
        self._decode_end: float | None = None  # end of the last step that decoded, None after a gap
        self.token_interval: float | None = None
        self.busy_s = 0.0
        self.slo_done = self.slo_late = 0

    def planned(self, now: float) -> None:
        self.plan_start = now

    def idle(self) -> None:
        self._decode_end = None  # the next decode's interval starts at its plan

    def first_token(self, st: RequestState) -> None:
        """st produced a token from its prompt: count its TTFT SLO outcome (not recomputes)."""
        if st.req.slo.ttft is not None and st.num_output == 1:
            self.slo_done += 1
            first = st.first_token_time  # set: st has its first token
            self.slo_late += first is not None and first > deadline(st.req)

    def steps(self, plan: StepPlan, times: Sequence[float] | np.ndarray) -> None:
        """Busy time, and the token intervals of these steps folded into the EWMA. An interval
        is the time from the previous decoding step's end (or from this plan's start, when the
        step before did not decode) to this step's end: what a decoding user waits per token."""
        if not len(times):
            self._decode_end = None
            return
        end = float(times[-1])
        if self.plan_start is not None:
            self.busy_s += end - self.plan_start
        if not plan.decodes:
            self._decode_end = None
            self.plan_start = end
            return
        prev = self._decode_end if self._decode_end is not None else self.plan_start
        if prev is None:
            prev = float(times[0])  # a plan made elsewhere: no start to measure from
        a = TOKEN_INTERVAL_ALPHA
        if len(times) == 1:
            x = float(times[0]) - prev
            e = self.token_interval
            self.token_interval = x if e is None else (1 - a) * e + a * x
        else:
            t = np.asarray(times, dtype=float)
            k = len(t)
            xs = np.empty(k)  # np.diff of [prev, *t]: the same subtractions, without two copies
            xs[0] = prev
            xs[1:] = t[:-1]
            np.subtract(t, xs, out=xs)
            e = self.token_interval if self.token_interval is not None else float(xs[0])
            self.token_interval = float((1 - a) ** k * e + _weights(k) @ xs)
        self._decode_end = end
        self.plan_start = end
