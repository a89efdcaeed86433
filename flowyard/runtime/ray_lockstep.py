"""`RayCluster` in lockstep: the driver steps one actor at a time, as `LocalCluster` steps its
engines on one thread, so a run is deterministic and, on a virtual clock, decision for
decision the simulator's.

What lockstep changes (the actor side is `flowyard.runtime.lockstep`):

- which actor steps: the head of `Turns` (the simulator's shared device: first come, first
  served, an actor that just stepped to the back), one step at a time, waiting for each;
- when time passes: each step stops after its forward pass and at each operator boundary of
  a preemptible prefill; `on_pause` (set by whoever keeps the clock, e.g. the guard's driver,
  which prices the step with a cost model and delivers the arrivals that fall inside it) runs
  there before the step goes on;
- what the global scheduler reads: fresh snapshots (an actor's is fetched again after any call
  that may have changed it), not the ones returned with the last step;
- arrivals and moves: a request is queued at once (a refusal or a preemption signal is known
  and logged at once), and a moved request's KV is imported as soon as the destination has
  room, after which the source frees it (the Transport contract).
"""

from __future__ import annotations

from typing import Callable

from flowyard.cluster.turns import Turns
from flowyard.core.request import RequestState
from flowyard.engine.sampling import RequestOutput
from flowyard.runtime.lockstep import StepPause
from flowyard.runtime.ray_state import RayState


class RayLockstep(RayState):
    """A part of `RayCluster` (state: `RayState`): one actor steps at a time."""

    def _init_lockstep(self, lockstep: bool, n: int) -> None:
        self.lockstep = lockstep
        self.turns = Turns()  # lockstep: actors waiting to step, the one stepping, wake-ups
        self._stale: set[int] = set()  # lockstep: instances whose snapshot must be fetched again
        self._idle = [True] * n  # lockstep: the actor's last step found nothing to run
        self._kv_home: dict[int, int] = {}  # moving request -> the instance still holding its KV
        #: lockstep: called where a step stops (after its forward pass, at an operator boundary
        #: of a preemptible prefill) by whoever keeps the clock, before the step goes on
        self.on_pause: Callable[[StepPause], None] | None = None

    def _kick(self, i: int) -> None:
        if self.lockstep:
            self.turns.kick(i)

    def wake_due(self, now: float) -> None:
        """Lockstep: actors whose scheduler's wake-up time has come queue up."""
        self.turns.wake_due(now)

    def next_wake(self) -> float | None:
        return self.turns.next_wake()

    def _lockstep_add(self, instance: int, st: RequestState, now: float) -> bool:
        events = self._ray.get(self._call(instance, "lockstep_add", now, self._rid[st.id], st,
                                          self._new[st.id]))
        for event in events:
            if event[0] == "reject":
                st.reject_reason = event[3]
                return False
            self.core.preempted(instance, event[1], event[2])
        self._mark_busy(instance)
        self._kick(instance)
        return True

    def _lockstep_step(self) -> list[RequestOutput]:
        """One actor step, from the head of the queue (actors that find nothing to run are
        passed over), then the cluster core's hand-offs and moves for what it produced."""
        outputs, self._failed = self._failed, []
        self._periodic()
        turns = self.turns
        turns.wake_due(self.now())
        for j in self.instance_ids():  # a safety net, as LocalCluster's
            if self._busy[j] and not self._idle[j]:
                turns.kick(j)
        while (i := turns.pop()) is not None:
            turns.running = i
            try:
                report = self._lockstep_run(i)
            except self._ray.exceptions.RayActorError:
                outputs += self._instance_died(i)
                continue
            finally:
                turns.running = None
            if report.idle and not report.outputs:
                self._snaps[i], self._busy[i] = report.snapshot, report.busy
                self.end_turn(i, False, report.wake, self.now())
                continue
            outputs += self._apply(i, report)
            self.end_turn(i, not report.idle, report.wake, self.now(), report.results)
            break
        return outputs

    # -- the end of a turn (flowyard.cluster.driver) ---------------------------------------
    def _admit_moved(self, i: int) -> None:
        """Instance i takes in what was moved to it and imports the KV it has room for; each
        source then frees its copy."""
        for req_id, src in self._ray.get(self._call(i, "lockstep_admit", self.now())):
            self._released([(req_id, src)])
            self._kick(i)

    def _lockstep_run(self, i: int):
        value = self._ray.get(self._call(i, "lockstep_step", self.now()))
        while isinstance(value, StepPause):
            if self.on_pause is not None:
                self.on_pause(value)
            value = self._ray.get(self._call(i, "lockstep_resume", self.now()))
        self._stale.discard(i)
        self._idle[i] = value.idle or not value.busy
        return value
