"""Deadline priorities and the TTFT predictor behind them (FlowPrefill §5.2, Eq. 3).

S-EDF ranks by priority = sgn(slack) / deadline with slack = deadline − now − TTFT-hat: among
requests that can still meet their deadline the earliest deadline goes first, and requests
that cannot are pushed behind all of them. We express it as an ascending sort key, which
orders exactly as the formula for positive deadlines but does not depend on where the clock
starts: (0, deadline) when slack ≥ 0, else (1, −deadline). A request without a TTFT SLO has
an infinite deadline (priority 0: after every feasible one, before every late one).

The ablation's variants: EDF (deadline only) and D-EDF (sgn(deadline − now) instead of
sgn(slack): only requests already past their deadline are pushed back).

Rounds must stay cheap with a long queue (an arrival round runs while the GPU works, a
completion round while it idles), so Q_w keeps its keys' inputs in numpy columns
(`WaitingQueue`) and SLO-aware batching prices candidates in bulk (`slo_aware_batch`). Both
take exactly the decisions of the plain per-request code: same keys, same float operations.
"""

from __future__ import annotations

from collections.abc import ValuesView
from typing import Callable, NamedTuple, Sequence

import numpy as np

from flowyard.core.plan import BatchShape, PrefillSlice, StepPlan
from flowyard.core.request import Request, RequestState
from flowyard.costmodel.base import CostModel

INF = float("inf")
PRIORITIES = ("s-edf", "edf", "d-edf")
# Below VECTOR_MIN requests (queued, or candidates left to price) plain Python beats numpy's
# per-call overhead. SCALAR_PROBES: probes on one batch before the rest are priced in one call.
VECTOR_MIN = 24
SCALAR_PROBES = 4


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
    key = (0, d, req.arrival, req.id)
    return given_up(key) if late else key


def given_up(key: tuple) -> tuple:
    """An on-time key (0, deadline, ...) as the slack orders rank a request they have given
    up on: after every on-time one, the latest deadline first."""
    return (1, -key[1], *key[2:])


class TTFTPredictor:
    """TTFT-hat and batch latency from a cost model (the simulator's, a profile of this engine,
    or a deliberately wrong copy via `with_error`).

    A request's own prediction depends only on its progress, so it is cached per (request,
    tokens computed): a scheduling round costs a dictionary lookup per queued request, not a
    cost-model evaluation.
    """

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost
        self.vectorised = True  # cleared when the cost model rejects array-valued prefill fields
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

    # -- SLO-aware batching probes: one candidate slice added to a batch ---------------------
    def probe(self, base: BatchShape, start: int, n: int) -> float:
        """`slices(batch + [slice(start, n)])` without rebuilding the batch's shape."""
        return float(self.cost.step_time(extended(base, start, n)))

    def probes(self, base: BatchShape, start: np.ndarray, n: np.ndarray) -> np.ndarray | None:
        """`probe` for many candidates in one element-wise cost-model call (the `BatchShape`
        contract). The same IEEE operations run per element, so the values are those of
        `probe`. None if this cost model does not evaluate prefill fields element-wise."""
        shape = extended(base, start, n)  # type: ignore[arg-type]
        try:
            out = np.asarray(self.cost.step_time(shape), dtype=float)
        except (TypeError, ValueError):
            out = None
        if out is None or out.shape != n.shape:
            self.vectorised = False
            return None
        return out


def extended(base: BatchShape, start: int, n: int) -> BatchShape:
    """The prefill-only shape `base` plus one slice (element-wise for array start and n). The
    fields are summed in the order `BatchShape.of` sums a list of slices with this one last,
    so every float is bit-identical to rebuilding the shape from the whole list."""
    return BatchShape(base.prefill_tokens + n, base.prefill_seqs + 1,
                      base.prefill_attn + n * (start + (n + 1) / 2), base.prefill_kv + (start + n))


class WaitingQueue:
    """Q_w: request states by id in arrival order (the dict it replaces), plus numpy columns of
    what a priority key needs (deadline, arrival, id, TTFT-hat) and what batching needs
    (history, uncomputed tokens). Why: a round ranks all of Q_w; with 1,000 queued, building
    a key tuple per request costs about a millisecond of Python, a few vector operations cost
    tens of microseconds. Rows are swap-removed; a waiting request's progress cannot change
    while it waits, so its row is written once and its TTFT-hat filled at the first round."""

    _COLS = (("d", float), ("arr", float), ("rid", np.int64), ("hat", float), ("known", bool),
             ("start", np.int64), ("unc", np.int64))

    def __init__(self) -> None:
        self._states: dict[int, RequestState] = {}
        self._row: dict[int, int] = {}
        self.rows: list[RequestState] = []  # the state in each row
        self._cols = {name: np.empty(64, dtype=t) for name, t in self._COLS}  # known: hat is set

    # -- the dict interface ------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._states)

    @property
    def long(self) -> bool:
        """Whether this queue is long enough for vector operations to pay for themselves."""
        return len(self._states) >= VECTOR_MIN

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._states

    def values(self) -> ValuesView[RequestState]:
        return self._states.values()

    def __setitem__(self, req_id: int, st: RequestState) -> None:
        if req_id in self._states:
            del self[req_id]
        self._states[req_id] = st
        i = len(self.rows)
        if i == len(self._cols["d"]):
            self._cols = {k: np.concatenate([c, np.empty_like(c)]) for k, c in self._cols.items()}
        c = self._cols
        c["d"][i], c["arr"][i], c["rid"][i] = deadline(st.req), st.req.arrival, req_id
        c["start"][i], c["unc"][i], c["known"][i] = st.num_computed, st.uncomputed, False
        self._row[req_id] = i
        self.rows.append(st)

    def __delitem__(self, req_id: int) -> None:
        del self._states[req_id]
        i, last = self._row.pop(req_id), len(self.rows) - 1
        moved = self.rows.pop()
        if i != last:
            for c in self._cols.values():
                c[i] = c[last]
            self.rows[i] = moved
            self._row[moved.id] = i

    def pop(self, req_id: int, default: RequestState | None = None) -> RequestState | None:
        st = self._states.get(req_id)
        if st is None:
            return default
        del self[req_id]
        return st

    # -- vector views ------------------------------------------------------------------------
    def column(self, name: str) -> np.ndarray:
        return self._cols[name][: len(self.rows)]

    def keys(self, kind: str, now: float, predict: TTFTPredictor) -> tuple[np.ndarray, np.ndarray]:
        """(late, signed deadline) per row: `priority_key` is (late, signed deadline, arrival,
        id), computed with the same float operations."""
        known, hat = self.column("known"), self.column("hat")
        for i in np.flatnonzero(~known).tolist():  # arrivals since the last vector round
            hat[i] = predict.request(self.rows[i])
        known[:] = True
        d = self.column("d")
        if kind == "edf":
            late = np.zeros(len(d), dtype=bool)
        elif kind == "s-edf":
            late = d - now - self.column("hat") < 0
        else:  # d-edf
            late = d - now < 0
        return late, np.where(late, -d, d)

    def best_row(self, late: np.ndarray, sd: np.ndarray) -> int:
        """Row of the smallest key, by narrowing column by column (no sort)."""
        rows = np.flatnonzero(~late)
        if rows.size == 0:
            rows = np.arange(len(late))
        for col in (sd, self.column("arr")):
            v = col[rows]
            rows = rows[v == v.min()]
            if rows.size == 1:
                return int(rows[0])
        return int(rows[np.argmin(self.column("rid")[rows])])

    def candidates(self, kind: str, now: float, predict: TTFTPredictor, chunk: int | None,
                   room: int | None) -> Candidates:
        """Q_w in priority order, leaving out slices of `room` tokens or more (None: no limit):
        the batch only grows, so Alg. 1 would skip them anyway."""
        if not self.long:
            ranked = sorted(self.values(), key=lambda r: priority_key(kind, r.req, now, predict.request(r)))
            ns = [r.uncomputed if chunk is None else min(r.uncomputed, chunk) for r in ranked]
            return Candidates(ranked, range(len(ranked)), [r.num_computed for r in ranked], ns)
        late, sd = self.keys(kind, now, predict)
        n = self.column("unc") if chunk is None else np.minimum(self.column("unc"), chunk)
        rows = np.arange(len(self)) if room is None else np.flatnonzero(n < room)
        order = rows[np.lexsort((self.column("rid")[rows], self.column("arr")[rows], sd[rows], late[rows]))]
        return Candidates(list(self.rows), order, self.column("start")[order], n[order])


class Candidates(NamedTuple):
    """Batching candidates by position in priority order: the state at position i is
    rows[order[i]] (a copy of Q_w's rows: admitting a candidate reorders Q_w), with history
    start[i] and slice length n[i]. numpy arrays for a long queue, plain lists for a short one."""

    rows: list[RequestState]
    order: np.ndarray | range
    start: np.ndarray | list[int]
    n: np.ndarray | list[int]


Admit = Callable[[RequestState, int, StepPlan], bool]


def slo_aware_batch(plan: StepPlan, c: Candidates, remain: float, budget: int | None, max_seqs: int,
                    predict: TTFTPredictor, admit: Admit) -> None:
    """Alg. 1's loop over c after H: admit each candidate whose slice keeps the batch under the
    token budget and whose probe (the batch's predicted latency with it) fits in H's remaining
    time. Skipped without pricing: slices over the budget left; and, once SCALAR_PROBES probes
    on one batch failed (under load H is the most urgent request, so most probes fail), every
    candidate that one element-wise probe of all the rest shows too slow. An admission changes
    the batch, and the candidates after it are probed against the new one."""
    j, short = 0, isinstance(c.n, list)  # a few candidates: plain Python beats numpy calls
    ns = c.n if short else []
    base = plan.shape()
    while len(plan.prefills) < max_seqs:
        left = INF if budget is None else budget - plan.num_tokens
        if short:
            idx, arr = [k for k in range(j, len(ns)) if ns[k] < left], None
        else:
            arr = np.flatnonzero(np.asarray(c.n)[j:] < left) + j
            idx = arr[:SCALAR_PROBES].tolist()
        i = _admit_first(plan, c, idx[:SCALAR_PROBES], remain, base, predict, admit)
        if i is None and arr is not None and arr.size > SCALAR_PROBES:
            rest = arr[SCALAR_PROBES:]
            lat = None
            if rest.size >= VECTOR_MIN and predict.vectorised:
                lat = predict.probes(base, np.asarray(c.start)[rest], np.asarray(c.n)[rest])
            todo = rest.tolist() if lat is None else rest[remain > lat].tolist()
            i = _admit_first(plan, c, todo, remain, base if lat is None else None, predict, admit)
        elif i is None:
            i = _admit_first(plan, c, idx[SCALAR_PROBES:], remain, base, predict, admit)
        if i is None:
            return
        j, last = i + 1, plan.prefills[-1]
        base = extended(base, last.start, last.n)  # == plan.shape(), bit for bit


def _admit_first(plan: StepPlan, c: Candidates, todo: list[int], remain: float, base: BatchShape | None,
                 predict: TTFTPredictor, admit: Admit) -> int | None:
    """Admit the first position of `todo` whose probe fits in `remain` (nothing to price when
    base is None: they are known to fit) and whose KV can be allocated; that position."""
    for i in todo:
        n = int(c.n[i])
        if base is not None and not remain > predict.probe(base, int(c.start[i]), n):
            continue
        if admit(c.rows[int(c.order[i])], n, plan):
            return i
    return None
