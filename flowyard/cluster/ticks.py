"""When the global scheduler's periodic work runs: one rule for every executor.

The global scheduler's `tick` (pool controllers, instance monitors, the regime controller)
runs every `period` seconds on a fixed grid that starts at the first request's arrival:
first + period, first + 2 period, ..., idle or not, for as long as the executor serves (the
simulator: until every request of its workload has ended; a server: while it runs).

Each executor delivers the ticks on that grid with its own clock: the simulator as timer
events at their exact times; the runtimes whenever their loop looks (`ClusterCore.tick_due`,
at each step and while idle at each poll), so a tick may come late, by at most one loop turn.
A tick that fell due before an arrival or a step's results is delivered before the core acts
on them (`ClusterCore.catch_up`), which is the order the simulator's event heap gives; ticks
missed while the loop slept are not delivered in a burst (the next one is the grid's next).
"""

from __future__ import annotations


class Ticks:
    """The grid of periodic ticks: `next` is when the next one is due (None: not started,
    ended, or no periodic work)."""

    __slots__ = ("period", "next")

    def __init__(self, period: float | None) -> None:
        if period is not None and not period > 0:
            raise ValueError(f"a global scheduler's period must be positive, got {period}")
        self.period = period
        self.next: float | None = None

    def start(self, first_arrival: float) -> None:
        """The first request arrived at `first_arrival`: the grid starts there (later calls
        leave a started grid as it is)."""
        if self.period is not None and self.next is None:
            self.next = first_arrival + self.period

    def due(self, now: float, *, before: bool = False) -> bool:
        """Whether a tick is due at `now` (before: strictly before now, i.e. one a step-wise
        executor should have delivered ahead of an event at now). If so it is taken: `next`
        moves to the first grid point after it (and after now)."""
        nxt = self.next
        if nxt is None or now < nxt or (before and now == nxt):
            return False
        period = self.period
        assert period is not None
        nxt += period
        while nxt <= now:  # the loop slept through several: deliver one, keep the grid
            nxt += period
        self.next = nxt
        return True

    def end(self) -> None:
        """No more ticks (the simulated workload is over); a later arrival starts none."""
        self.next = self.period = None

    def delay(self, now: float) -> float | None:
        """Seconds until the next tick is due (a serving loop sleeps no longer), or None."""
        return None if self.next is None else max(0.0, self.next - now)
