"""Where the simulator's arrivals come from: open-loop replay or closed-loop clients.

The simulator asks an `ArrivalSource` for ARRIVAL events at three moments and pushes what it
returns onto its heap:

- `initial(states)` when a run starts (the states are the simulator's, bound here by id);
- `on_arrival(state, now)` when an arrival fires (open loop releases its next request then);
- `on_done(state, now)` when a request finishes or is rejected (a closed-loop client sends its
  next request then).

Each returns (time, state) pairs, times not before `now`, each state returned exactly once per
run; the simulator checks at the end that every request finished or was rejected.

Why this shape: both kinds of load are "a request becomes due at time t", and the only
difference is what makes the next one due (the clock of the trace, or the end of the previous
request). Returning (time, state) pairs keeps the heap, its ordering and the event loop in the
simulator; the sources never see the heap or the policies, so they cannot reorder events or
touch scheduling state (one that loses a request fails the simulator's conservation check), and
the simulator keeps no closed-loop bookkeeping of its own. Sources plan
from the immutable `Request`s when they are made (bad settings fail before a run) and bind the
mutable states per run, because the simulator owns those.

The time a source returns is the request's arrival (when its client sent it): the simulator
rewrites `Request.arrival` to it (with `dataclasses.replace`, ids unchanged), so TTFT and
throughput are measured from when a closed-loop client actually sent the request, not from the
trace. The ARRIVAL event fires the cost model's frontend latency later (0 unless it emulates a
serving stack's HTTP frontend), when the request reaches the scheduler.
"""

from __future__ import annotations

import math
from typing import Protocol, Sequence

from flowyard.core.request import Request, RequestState

Due = Sequence[tuple[float, RequestState]]  # (time the request is sent, its state)
_NONE: Due = ()


class ArrivalSource(Protocol):
    """What the simulator needs from a source of arrivals (see the module docstring)."""

    def initial(self, states: Sequence[RequestState]) -> Due:
        """The first arrivals of a run; `states` are this run's states, one per request."""
        ...

    def on_arrival(self, state: RequestState, now: float) -> Due:
        """`state` arrived at `now`: arrivals that become due because of that."""
        ...

    def on_done(self, state: RequestState, now: float) -> Due:
        """`state` finished or was rejected at `now`: arrivals that become due because of that."""
        ...


def _bind(ids: Sequence[int], states: Sequence[RequestState]) -> dict[int, RequestState]:
    """The run's states by id, checked against the requests the source was planned from."""
    by_id = {s.id: s for s in states}
    if len(by_id) != len(states) or sorted(by_id) != sorted(ids):
        raise ValueError("the arrival source was built for other requests than the simulator's")
    return by_id


def _unique_ids(requests: Sequence[Request]) -> list[int]:
    ids = [r.id for r in requests]
    if len(set(ids)) != len(ids):
        raise ValueError("request ids must be unique")
    return ids


class OpenLoop:
    """Replay each request at its trace arrival time (the default).

    Only the next arrival is ever on the heap: a long trace would otherwise fill it with
    hundreds of thousands of future events and slow every push and pop.
    """

    def __init__(self, requests: Sequence[Request]) -> None:
        _unique_ids(requests)
        # Stable sort: equal arrivals keep request order, as the simulator always did.
        self._order = [r.id for r in sorted(requests, key=lambda r: r.arrival)]
        self._pending: list[RequestState] = []
        self._next = 0

    def initial(self, states: Sequence[RequestState]) -> Due:
        by_id = _bind(self._order, states)
        self._pending = [by_id[i] for i in self._order]
        self._next = 0
        return self._release()

    def _release(self) -> Due:
        if self._next >= len(self._pending):
            return _NONE
        st = self._pending[self._next]
        self._next += 1
        return ((st.req.arrival, st),)

    def on_arrival(self, state: RequestState, now: float) -> Due:
        return self._release()

    def on_done(self, state: RequestState, now: float) -> Due:
        return _NONE


class ClosedLoop:
    """`concurrency` clients, each with at most one request in flight (`--max-concurrency`).

    Jobs are the conversations (requests sharing a `session`, sent in (turn, id) order) and
    the single requests without a session, ordered by their first request's id (trace order,
    since workloads number requests by arrival). Every client starts a job at time 0; when its
    request finishes or is rejected it sends the next turn, or takes the next unstarted job,
    `think_time` seconds later. A rejected turn does not end its conversation: the later turns
    already carry their history, and every request must be sent for the run to conserve them.
    Trace arrival times are ignored; the simulator records the send times as arrivals.
    """

    def __init__(self, requests: Sequence[Request], concurrency: int, think_time: float = 0.0) -> None:
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise ValueError(f"concurrency must be an integer >= 1, got {concurrency!r}")
        if not (think_time >= 0 and math.isfinite(think_time)):
            raise ValueError(f"think_time must be a finite number >= 0, got {think_time!r}")
        self.concurrency = concurrency
        self.think_time = float(think_time)
        _unique_ids(requests)
        sessions: dict[str, list[Request]] = {}
        jobs: list[list[Request]] = []
        for r in sorted(requests, key=lambda r: r.id):
            if r.session is None:
                jobs.append([r])
            elif r.session in sessions:
                sessions[r.session].append(r)
            else:
                sessions[r.session] = turns = [r]
                jobs.append(turns)
        self.jobs: list[tuple[int, ...]] = [
            tuple(r.id for r in sorted(job, key=lambda r: (r.turn, r.id))) for job in jobs
        ]
        self._states: dict[int, RequestState] = {}
        self._next_job = 0
        self._client: dict[int, tuple[int, int]] = {}  # id in flight -> (job index, turn index)

    def initial(self, states: Sequence[RequestState]) -> Due:
        self._states = _bind([i for job in self.jobs for i in job], states)
        self._next_job = 0
        self._client = {}
        n = min(self.concurrency, len(self.jobs))
        return [self._send(self._take_job(), 0, 0.0) for _ in range(n)]

    def on_arrival(self, state: RequestState, now: float) -> Due:
        return _NONE

    def on_done(self, state: RequestState, now: float) -> Due:
        job, turn = self._client.pop(state.id)
        if turn + 1 < len(self.jobs[job]):
            return (self._send(job, turn + 1, now + self.think_time),)
        if self._next_job < len(self.jobs):
            return (self._send(self._take_job(), 0, now + self.think_time),)
        return _NONE  # this client is done: no work left

    def _take_job(self) -> int:
        self._next_job += 1
        return self._next_job - 1

    def _send(self, job: int, turn: int, t: float) -> tuple[float, RequestState]:
        rid = self.jobs[job][turn]
        self._client[rid] = (job, turn)
        return t, self._states[rid]
