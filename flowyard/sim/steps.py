"""How the simulator executes a step: on the virtual clock, priced by the cost model.

A planned step's end time is the cost model's step time after its start. Speed comes from one
exact shortcut: when a local scheduler promises a decode-only run (`StepPlan.max_repeats`),
all of its steps are priced in one vectorised cost-model call and the instance sleeps until
the first request finishes. Any event that reaches the instance before then cuts the run at
the end of the step in flight (`_interrupt`), which is exactly when a step-by-step executor
would have let the scheduler see that event, so results equal those of stepping one token at
a time (tests/test_sim.py). A preemptible plan (FlowPrefill) runs on its operator timeline,
so a preemption signal stops it at the next operator boundary (`_preempt`).
"""

from __future__ import annotations

import numpy as np

from flowyard.core.plan import StepPlan
from flowyard.sim.base import STEP, SimBase
from flowyard.sim.instance import SimInstance


class StepExecution(SimBase):
    """A part of `Simulator`: steps started, cut short and preempted on the virtual clock."""

    def _start_step(self, inst: SimInstance) -> None:
        if inst.plan is not None:
            return
        plan = inst.sched.schedule(self.now)
        self._changed(inst)
        if plan is None:  # nothing to run: wait for an event or the scheduler's wake-up time
            self.end_turn(inst.id, False, inst.sched.wake_at(self.now), self.now)
            return
        k = plan.max_repeats
        if k > 1:  # the simulator knows when each request stops: end the run at the first
            k = min(k, min(d.remaining_output for d in plan.decodes))
            if k < plan.max_repeats:
                inst.sched.shorten(plan, k)
        shape = plan.shape(k)
        if plan.preempt_stride:  # operator timeline, so a preemption can stop at a boundary
            rel = self.cost.op_boundaries(shape)
            start = self.now - (float(rel[plan.ops_done - 1]) if plan.ops_done else 0.0)
            inst.bounds = start + rel
            ends = inst.bounds[-1:]
        elif k > 1:  # same additions, in the same order, as stepping one at a time
            durations = self.cost.step_time(shape)
            ends = np.cumsum(np.concatenate(([self.now], durations)))[1:]
        else:
            ends = np.array([self.now + float(self.cost.step_time(shape))])
        if inst.export_until > self.now:  # still copying out the KV of requests that moved
            ends = ends + (inst.export_until - self.now)
            if inst.bounds is not None:
                inst.bounds = inst.bounds + (inst.export_until - self.now)
        inst.plan = plan
        inst.set_ends(ends)
        inst.started = self.now
        inst.launch(shape, self.now)
        inst.version += 1
        inst.busy_s += float(ends[-1] - self.now)
        self._device_free = float(ends[-1])
        self._push(float(ends[-1]), STEP, (inst, inst.version))

    def _interrupt(self, inst: SimInstance) -> bool:
        """An event reached `inst`: if it is in a multi-step run, end that run with the step in
        flight and hand the unused KV reservation back. Returns whether inst is busy."""
        if inst.plan is None:
            return False
        ends = inst.ends
        if len(ends) > 1 and ends[-1] > self.now:
            cut = int(np.searchsorted(ends, self.now, side="left")) + 1
            if cut < len(ends):
                inst.busy_s -= float(ends[-1] - ends[cut - 1])
                inst.set_ends(ends[:cut])
                self._device_free = float(ends[cut - 1])
                inst.version += 1
                inst.sched.shorten(inst.plan, cut)
                self._changed(inst)
                self._push(float(inst.ends[-1]), STEP, (inst, inst.version))
        return True

    def _preempt(self, inst: SimInstance, plan: StepPlan) -> None:
        """Suspend inst's plan at the first preemption boundary not before now (the rest of the
        operator in flight is the blocking time); a plan that ends first just completes."""
        bounds = inst.bounds
        assert bounds is not None
        nops = len(bounds) - 1
        stride = plan.preempt_stride
        k = max(int(np.searchsorted(bounds[:nops], self.now, side="left")) + 1, plan.ops_done + 1)
        k = -(-k // stride) * stride
        if k >= nops:
            return
        t = float(bounds[k - 1])
        inst.busy_s -= float(inst.ends[-1]) - t
        inst.set_ends(np.array([t]))
        self._device_free = t
        inst.suspend_at = k
        inst.version += 1
        self.preemption_blocking.append(t - self.now)
        self.core.preempted(inst.id, self.now, k)
        self._push(t, STEP, (inst, inst.version))
