"""Closed-loop clients that share one processor: a benchmark client is part of what it measures.

A Python benchmark that runs its `concurrency` workers as threads (InferenceBench's closed-loop
driver, each thread iterating a LiteLLM stream) reads every streamed token under one
interpreter lock. Past some load the server emits tokens faster than the threads can read them:
tokens wait in socket buffers, each thread sees its stream late and sends its next request
late, so the measured TTFT and TPOT grow with concurrency while the server idles.

`SharedClient` models that processor: reading a token costs it `chunk_s` seconds, one token at
a time, and the threads with a token waiting take turns (round robin, one token a turn, as
threads trade a lock). A request's observed times (first token, every token, finish) become the
times its thread read them; its worker sends the next request once it has read the last one.
The simulator's clock stays the server's. The source hears of every step's tokens when the step
ends (`reads_tokens`: the simulator then runs single steps and calls `on_tokens`) and wakes when
a read ends (`wake_at`/`on_wake`), so the schedule is exact: a read starts only with what was
emitted by then.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from typing import Sequence

import numpy as np

from flowyard.core.request import Request, RequestState
from flowyard.sim.arrivals import ClosedLoop, Due

INF = float("inf")


class SharedClient(ClosedLoop):
    """`ClosedLoop` whose clients read their streams on one processor (module docstring)."""

    reads_tokens = True  # the simulator calls on_tokens after every step and wakes us (on_wake)

    def __init__(self, requests: Sequence[Request], concurrency: int, chunk_s: float,
                 think_time: float = 0.0) -> None:
        if not (chunk_s > 0 and math.isfinite(chunk_s)):
            raise ValueError(f"client chunk time must be a finite number > 0, got {chunk_s!r}")
        super().__init__(requests, concurrency, think_time)
        self.chunk_s = float(chunk_s)
        self._reset()

    def _reset(self) -> None:
        self._free = 0.0  # when the processor ends its current read
        self._flight: dict[int, RequestState] = {}  # sent, not yet fully read
        self._seen: dict[int, int] = {}  # request id -> tokens handed to the processor
        self._unread: dict[int, deque[float]] = {}  # request id -> emission times not yet read
        self._read: dict[int, list[float]] = {}
        self._served: set[int] = set()  # the server is done with them
        self._ring: deque[int] = deque()  # threads whose next token has arrived, in turn order
        self._later: list[tuple[float, int]] = []  # (next token's emission, id) of the others

    def initial(self, states: Sequence[RequestState]) -> Due:
        self._reset()
        due = super().initial(states)
        self._flight = {st.id: st for _, st in due}
        return due

    def on_done(self, state: RequestState, now: float) -> Due:
        """The server is done with `state` (finished, or rejected with nothing to read)."""
        self._served.add(state.id)
        due = list(self.on_tokens(now))
        if not self._unread.get(state.id) and state.id in self._flight:  # nothing left to read
            due.extend(self._finished(state.id, now))
        return due

    def on_tokens(self, now: float) -> Due:
        """A step ended at `now`: take the tokens it emitted, read what can start by now."""
        for rid, st in self._flight.items():
            seen = self._seen.get(rid, 0)
            if st.num_output > seen:
                new = st.all_token_times()[seen:]
                q = self._unread.setdefault(rid, deque())
                if not q and rid not in self._ring:
                    heapq.heappush(self._later, (float(new[0]), rid))
                q.extend(new.tolist())
                self._seen[rid] = st.num_output
        return self._read_until(now)

    def on_wake(self, now: float) -> Due:
        return self._read_until(now)

    def wake_at(self) -> float | None:
        """When the read in progress ends, if another token waits for the processor."""
        return self._free if (self._ring or self._later) else None

    def _read_until(self, now: float) -> Due:
        """Start every read that can start by `now` (the processor free, a token emitted)."""
        due: list[tuple[float, RequestState]] = []
        ring, later, unread = self._ring, self._later, self._unread
        while True:
            t = max(self._free, later[0][0]) if later and not ring else self._free
            if t > now or not (ring or later):
                return due
            while later and later[0][0] <= t:
                ring.append(heapq.heappop(later)[1])
            if not ring:
                continue
            rid = ring.popleft()
            q = unread[rid]
            q.popleft()
            self._free = t + self.chunk_s
            self._read[rid] = read = self._read.get(rid, [])
            read.append(self._free)
            if q:
                if q[0] <= self._free:
                    ring.append(rid)
                else:
                    heapq.heappush(later, (q[0], rid))
            elif rid in self._served:
                due.extend(self._finished(rid, self._free))

    def _finished(self, rid: int, end: float) -> Due:
        """Thread `rid` has read its last token at `end`: what it observed, and its worker's
        next request."""
        st = self._flight.pop(rid)
        read = self._read.pop(rid, [])
        self._unread.pop(rid, None)
        self._seen.pop(rid, None)
        self._served.discard(rid)
        if read:
            st.token_times = [np.asarray(read)]
            st.first_token_time, st.finish_time = read[0], read[-1]
        due = super().on_done(st, end)
        self._flight.update((nxt.id, nxt) for _, nxt in due)
        return due
