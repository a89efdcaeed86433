"""The simulator as the cluster core's `Transport` and `ClusterView`: where the local
schedulers live, what a global policy reads of them, and how a request and its KV move.

A snapshot is taken only when the instance's scheduler changed since the last one (`_changed`
drops it); one read in the middle of a multi-step decode run first commits the steps that
ended before now (`_sync`), so it shows what a step-by-step executor would show. With
`snapshot_staleness` > 0 a global policy reads each instance's snapshot as it was up to that
many seconds ago (as from a runtime's periodic reports), with the requests sent to it since
counted in (`InstanceSnapshot.count_in`, the rule asynchronous Ray follows); such snapshots change without a
change of the scheduler, so the score-ordered indexes (`flowyard.cluster.index`) are off and
policies scan instead.

KV moves when the destination admits a moved request: the transfer is priced by the link
(`kv_push.py`, chunk by chunk for micro-requests) and, when it lands, the source frees its
copy and the destination continues the request.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import numpy as np

from flowyard.cluster.index import RankedInstances
from flowyard.core.request import RequestState
from flowyard.policies.framework.contracts import InstanceSnapshot, LocalScheduler, Role
from flowyard.sim.base import KV_DONE, SimBase, SimulationError
from flowyard.sim.instance import SimInstance


class SimTransport(SimBase):
    """A part of `Simulator`: the instances as the cluster core drives and reads them."""

    def instance_ids(self, role: Role | None = None) -> list[int]:
        return self._by_role.get(role, [])

    instances_of = instance_ids

    def is_live(self, instance: int) -> bool:
        """Simulated instances never fail: every id of the cluster is live."""
        return 0 <= instance < len(self.instances)

    @property
    def ranked(self) -> Callable[..., RankedInstances] | None:
        """The score-ordered indexes (None with stale snapshots: policies scan)."""
        return None if self.snapshot_staleness > 0 else self._touched.ranked

    def snapshot(self, instance: int) -> InstanceSnapshot:
        if self.snapshot_staleness > 0:
            cached = self._snap_cache.get(instance)
            if cached is not None and self.now - cached[0] < self.snapshot_staleness:
                return cached[1]
        inst = self.instances[instance]
        if inst.sync_after < self.now:
            self._sync(inst)
        snap = inst.snap  # the same snapshot while the scheduler has not changed
        if snap is None:
            snap = inst.snap = inst.sched.snapshot()
        if self.snapshot_staleness > 0:
            self._snap_cache[instance] = (self.now, snap)
        return snap

    def scheduler(self, instance: int) -> LocalScheduler:
        """Instance's local scheduler, its decode run committed up to now as `snapshot` does
        (an index reads `direct` scores off it without building a snapshot)."""
        inst = self.instances[instance]
        if inst.sync_after < self.now:
            self._sync(inst)
        return inst.sched

    def _changed(self, inst: SimInstance) -> None:
        """inst's scheduler state changed: its snapshot and its index keys are out of date."""
        inst.snap = None
        self._recent.add(inst.id)  # Touched.touch, without the call

    def _sync(self, inst: SimInstance) -> None:
        """Commit the steps of a decode run that ended before now, so the instance's state is
        what a step-by-step executor would show at this moment."""
        ends = inst.ends
        if inst.plan is None or len(ends) < 2 or ends[0] >= self.now:
            return
        done = int(np.searchsorted(ends, self.now, side="left"))
        if 0 < done < len(ends):
            out = self._output(inst, ends[:done])  # while `started` is still the run's start
            if self.on_step is not None:
                self.on_step(inst.id, inst.plan, done)
            if self.timeline is not None:
                self.timeline.step(inst.id, inst.started, float(ends[done - 1]), inst.plan, done)
                inst.started = float(ends[done - 1])
            inst.sched.advance(inst.plan, out)
            self._changed(inst)
            inst.set_ends(ends[done:])
            inst.account(done)
            self.steps += done

    # -- Transport (flowyard.cluster.core) -------------------------------------------------
    def add(self, instance: int, st: RequestState, now: float) -> bool:
        if st.split_to is not None:  # a micro-request: its first segment's KV will be pushed
            self.kv_push.split(st)
        inst = self.instances[instance]
        ok = inst.sched.add_request(st, now)
        self._changed(inst)
        if not ok:
            return False
        cached = self._snap_cache.get(instance) if self.snapshot_staleness > 0 else None
        if cached is not None:  # Ray's rule: a stale snapshot counts what was sent since it was read
            snap = replace(cached[1])
            snap.count_in(st.req)
            self._snap_cache[instance] = (cached[0], snap)
        plan = inst.plan
        if plan is not None and plan.preempt_stride and inst.suspend_at < 0:
            if inst.sched.preempt_check(now):
                self._preempt(inst, plan)
            self._changed(inst)
        self._kick(inst)
        return True

    def hand_off(self, instance: int, st: RequestState) -> bool:
        inst = self.instances[instance]
        self._changed(inst)
        return inst.sched.hand_off(st.id) is not None

    def move(self, src: int, dst: int, st: RequestState, now: float) -> None:
        if src != dst and self._export_s:  # the source copies the KV out before its next step
            until = max(self.instances[src].export_until, now) + self._export_s
            # on one shared device that is the device's time: whichever instance steps next waits
            for inst in (self.instances if self.shared_device else [self.instances[src]]):
                inst.export_until = until
        self.kv_push.handed_off(st)
        target = self.instances[dst]
        target.sched.add_migration(st, now)
        self._changed(target)
        self._interrupt(target)
        self._start_transfers(target)

    def fail(self, instance: int, st: RequestState, reason: str) -> None:
        raise SimulationError(f"request {st.id} on instance {instance}: {reason}")  # no faults here

    def _start_transfers(self, dst: SimInstance) -> None:
        """dst admits the moved requests it has room for; each one's KV starts moving."""
        admitted = dst.sched.admit_migrations(self.now)
        if admitted:
            self._changed(dst)
        for st in admitted:
            src = st.instance
            assert src is not None
            landing = self.kv_push.landing(st, src, dst.id, self.now)
            if self.timeline is not None:
                self.timeline.transfer(st.id, src, dst.id, self.now, landing)
            self._push(landing, KV_DONE, (st, src, dst.id))

    def _kv_landed(self, st: RequestState, src: int, dst: int) -> None:
        """A moved request's KV is on dst: the source frees its copy, dst continues it."""
        source = self.instances[src]
        source.sched.release(st.id)
        self._changed(source)
        self._kick(source)
        target = self.instances[dst]
        target.sched.migration_arrived(st, self.now)
        self._changed(target)
        self._kick(target)

    @property
    def chunked_kv(self) -> bool:
        return self.kv_push.chunked

    @property
    def kv_exposed(self) -> list[float]:
        """Per micro-request hand-off: the KV transfer time computation did not hide."""
        return self.kv_push.exposed
