"""Instances taking turns on a device: the per-instance bookkeeping every executor shares.

Which instance steps next, and when an idle one looks at its queue again, is decided here
once for the simulator, `LocalCluster` and `RayCluster` in lockstep:

- something reaches an instance (an arrival, a moved request, KV freed or landed, its
  batching window closing): unless it is stepping or already queued, it queues (`kick`);
- instances that share a device take it first come, first served (`pop`);
- after its turn (`stepped`), an instance that ran a step goes to the back of the queue,
  before whatever its step sent elsewhere; one that found nothing to run waits for an event,
  or for the wake-up time its scheduler asked for (`wait`: the earliest one still to come
  is kept), after which it queues again (`due`, `wake_due`).

The simulator holds one `Turns` per device (all instances on one device with
`shared_device`, which is how `LocalCluster` steps its engines on one thread and a lockstep
driver steps its actors), and turns each new queueing and each new wake-up time into an event
of its heap through `on_queued` / `on_timer`; the runtimes poll `ready` and `next_wake`. The
executors therefore keep one order (tests/test_two_executors.py, tests/test_three_executors.py).
"""

from __future__ import annotations

import collections
from typing import Callable


class Turns:
    """The instances waiting for a device, the one stepping on it, and their wake-up times."""

    __slots__ = ("ready", "running", "timers", "on_queued", "on_timer")

    def __init__(self, on_queued: Callable[[int], None] | None = None,
                 on_timer: Callable[[int, float], None] | None = None) -> None:
        """on_queued(i): instance i just joined the queue; on_timer(i, t): i now wants to be
        woken at t (an event-driven executor schedules both; a polling one leaves them out)."""
        self.ready: collections.deque[int] = collections.deque()
        self.running: int | None = None
        self.timers: dict[int, float] = {}  # idle instance -> when its scheduler asked to be woken
        self.on_queued = on_queued
        self.on_timer = on_timer

    def kick(self, i: int) -> bool:
        """Something reached instance i: unless it is stepping or already queued, it queues.
        Returns whether it joined the queue now."""
        if i == self.running or i in self.ready:
            return False
        self.ready.append(i)
        if self.on_queued is not None:
            self.on_queued(i)
        return True

    def pop(self) -> int | None:
        """The instance whose turn it is (first come, first served), or None."""
        return self.ready.popleft() if self.ready else None

    def stepped(self, i: int, ran: bool, wake: float | None = None, now: float = 0.0) -> None:
        """Instance i's turn is over. ran: it ran a step (or part of one): to the back of the
        queue. Otherwise it found nothing to run and waits for an event, or for `wake`."""
        if ran:
            self.kick(i)
        else:
            self.wait(i, wake, now)

    def wait(self, i: int, wake: float | None, now: float) -> None:
        """Instance i found nothing to run at `now`: it waits for an event, or for `wake` if
        that is still to come and earlier than the wake-up time it already has."""
        if wake is None or wake <= now:
            return
        t = self.timers.get(i)
        if t is not None and t <= wake:
            return
        self.timers[i] = wake
        if self.on_timer is not None:
            self.on_timer(i, wake)

    def due(self, i: int, now: float) -> bool:
        """Whether instance i's wake-up time has come (it is then forgotten; the caller kicks i)."""
        t = self.timers.get(i)
        if t is None or t > now:
            return False
        del self.timers[i]
        return True

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
