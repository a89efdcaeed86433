"""The end of an instance's turn: one rule for the simulator, `LocalCluster` and lockstep Ray.

An executor runs a step its own way (priced by a cost model, run by an engine, run by an
actor); what follows is the same everywhere, and was three hand copies until a difference
between them deadlocked Arrow (a moved request waited for KV on an instance that had room but
nothing to step, so nothing ever admitted it):

1. the instance's turn is over (`Turns.stepped`): one that ran goes to the back of its device's
   queue before whatever its step sends elsewhere; one that found nothing waits for an event or
   its wake-up time;
2. each step result reaches the executor (finished requests leave, `_finished_here`) and the
   cluster core (`ClusterCore.stepped`: the global scheduler hears of finished requests,
   hand-offs and prefills that ended go where it says);
3. the instance admits the moved requests it now has room for, whether or not it ran: KV freed
   by a release (a request that moved away) makes room as a finished step does.

The executor supplies its queue (`_turns_of`), what a finished request means to it, and how a
moved request's KV starts moving (`_admit_moved`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from flowyard.policies.framework.contracts import StepResult

if TYPE_CHECKING:
    from flowyard.cluster.core import ClusterCore
    from flowyard.cluster.turns import Turns


class InstanceDriver:
    """A part of every executor: what happens when an instance's turn ends."""

    core: ClusterCore
    turns: Turns

    def end_turn(self, i: int, ran: bool, wake: float | None, now: float,
                 results: Sequence[StepResult] = ()) -> None:
        """Instance i's turn is over (ran: it ran a step or part of one; wake: the time its
        scheduler asked to look again, if it found nothing to run)."""
        self._turns_of(i).stepped(i, ran, wake, now)
        self.apply_results(i, results, now)
        self._admit_moved(i)

    def apply_results(self, i: int, results: Sequence[StepResult], now: float) -> None:
        """What instance i's step produced reaches the executor, then the cluster core."""
        for result in results:
            self._finished_here(i, result)
            self.core.stepped(i, result, now)

    # -- supplied by the executor ----------------------------------------------------------
    def _turns_of(self, i: int) -> Turns:
        """The queue instance i takes turns in: the executor's one queue (the runtimes step
        every instance from one thread); the simulator keeps one per device."""
        return self.turns

    def _finished_here(self, i: int, result: StepResult) -> None:
        """The executor's own bookkeeping of the requests that finished in this step."""
        raise NotImplementedError

    def _admit_moved(self, i: int) -> None:
        """Instance i reserves KV for the moved requests it has room for; their KV starts
        moving (and, when it lands, the source frees its copy)."""
        raise NotImplementedError
