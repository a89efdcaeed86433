"""Queue-priority parts: the order in which a local scheduler's prefill selector takes queued
requests. One part, used by every selector, so a policy picks its order by name instead of by
subclass: vLLM's FCFS and priority, DistServe's EDF, FlowPrefill's S-EDF and D-EDF (§5.2).

Static orders (fcfs, edf, priority) give a key that never changes while a request waits, so a
heap holds the queue. Deadline-slack orders (s-edf, d-edf) depend on `now` and on the predicted
TTFT (TTFT-hat), so a queue that uses them re-ranks at every round (`QueueOrder.static` says
which). Ties break by arrival, then request id (ids grow with arrival order in every executor),
so a preempted request goes back ahead of later arrivals, as in vLLM.

`moore_hodgson` is the overload rule `flowyard` adds to S-EDF (`shed`): S-EDF gives up on a
request only once it alone can no longer make its deadline, so in a burst it serves requests
in deadline order until each is just in time and lets whole runs of them go late. Moore and
Hodgson's rule (1968) picks the set to give up that leaves the most requests on time: walk the
queue in deadline order and, whenever the one reached would be late, give up the longest taken
so far. Goodput counts requests, so in a burst of mixed lengths this keeps the many short
prompts and lets a few long ones go.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Callable, TypeVar

from flowyard.core.request import RequestState
from flowyard.policies.framework.slack import INF, PRIORITIES, deadline, priority_key

H = TypeVar("H", bound=Hashable)
ORDERS: tuple[str, ...] = ("fcfs", "edf", "priority") + tuple(p for p in PRIORITIES if p != "edf")


@dataclass(frozen=True, slots=True)
class QueueOrder:
    """An ascending sort key over queued requests (smallest first)."""

    name: str = "fcfs"

    def __post_init__(self) -> None:
        if self.name not in ORDERS:
            raise ValueError(f"queue order must be one of {', '.join(ORDERS)}, got {self.name!r}")

    @property
    def static(self) -> bool:
        """Whether a waiting request's key stays fixed (heap-ordered queues need that)."""
        return self.name in ("fcfs", "edf", "priority")

    @property
    def needs_ttft(self) -> bool:
        """S-EDF ranks by slack, which needs a TTFT prediction (D-EDF and EDF do not)."""
        return self.name == "s-edf"

    def key(self, st: RequestState, now: float = 0.0,
            ttft_hat: Callable[[RequestState], float] | None = None) -> tuple:
        req = st.req
        if self.name == "fcfs":
            return (req.arrival, req.id)
        if self.name == "priority":  # vLLM's priority scheduling: lower value first
            return (req.priority, req.arrival, req.id)
        if self.name == "edf":
            return (deadline(req), req.arrival, req.id)
        if self.needs_ttft and ttft_hat is None:
            raise ValueError("s-edf needs a TTFT predictor (the selector's predictor)")
        hat = ttft_hat(st) if self.needs_ttft and ttft_hat is not None else 0.0
        return priority_key(self.name, req, now, hat)


def moore_hodgson(jobs: Iterable[tuple[float, float, H]], now: float) -> set[H]:
    """The jobs (deadline, time, id), given in deadline order and run one after another from
    `now`, to give up so that the most of the others finish by their deadlines (Moore-Hodgson:
    optimal for one server; the rest, in the same order, all finish on time)."""
    t = now
    taken: list[tuple[float, int, H]] = []
    late: set[H] = set()
    for k, (due, time, ident) in enumerate(jobs):
        t += time
        heapq.heappush(taken, (-time, -k, ident))  # ties: give up the later-due one
        if t > due:
            longest, _, gone = heapq.heappop(taken)
            t += longest
            late.add(gone)
    return late


__all__ = ["INF", "ORDERS", "QueueOrder", "moore_hodgson"]
