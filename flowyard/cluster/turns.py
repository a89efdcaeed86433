"""Instances taking turns on one thread: the order a one-at-a-time executor steps them in.

The simulator's `shared_device` instances take their device first come, first served: an
instance queues when something reaches it (an arrival, a moved request, KV freed, its
batching window closing), one that just ran a step goes to the back of the queue before
whatever its step sent elsewhere, and one that found nothing to run waits for an event or its
scheduler's wake-up time. `LocalCluster` (engines in one process) and `RayCluster` in lockstep
mode (actors stepped one at a time by the driver) keep that order with this one class, which
is why the three executors make the same decisions (tests/test_two_executors.py,
tests/test_three_executors.py).
"""

from __future__ import annotations

import collections


class Turns:
    """The queue of instances waiting to step, the one stepping, and wake-up timers."""

    def __init__(self) -> None:
        self.ready: collections.deque[int] = collections.deque()
        self.running: int | None = None
        self.timers: dict[int, float] = {}  # idle instance -> when its scheduler asked to be woken

    def kick(self, i: int) -> None:
        """Something reached instance i: unless it is stepping or already queued, it queues
        (the simulator's `_kick`)."""
        if i != self.running and i not in self.ready:
            self.ready.append(i)

    def wait(self, i: int, wake: float | None) -> None:
        """Instance i found nothing to run: it waits for an event, or for `wake` (a time)."""
        if wake is not None:
            self.timers[i] = wake

    def wake_due(self, now: float) -> None:
        """Instances whose wake-up time has come queue up, earliest first."""
        for i, t in sorted(self.timers.items(), key=lambda it: (it[1], it[0])):
            if t <= now:
                del self.timers[i]
                self.kick(i)

    def next_wake(self) -> float | None:
        return min(self.timers.values(), default=None)

    def delays(self, now: float) -> list[float]:
        """Seconds until each wake-up time (0 for one already due)."""
        return [max(0.0, t - now) for t in self.timers.values()]
