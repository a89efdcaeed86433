"""Discrete-event cluster simulator: the virtual-clock executor of the shared policies.

Events live in one heap ordered by (time, kind, sequence number): at equal times arrivals come
first, then step ends, then KV landings, timers, and last the SCHEDULE events of instances
that queued for their device, each kind in insertion order, so a run is deterministic. Events:
a request arrives (from an `ArrivalSource`, `flowyard/sim/arrivals.py`: trace replay or
closed-loop clients; its arrival is its send time, and the event fires the cost model's
frontend latency later, when it reaches the scheduler); an instance finishes the step(s) it
was running; a KV transfer lands; a timer fires (a batching window closing, or the global
scheduler's periodic tick on the grid of `flowyard.cluster.ticks`).

What every executor shares is not here: routing, splits, hand-offs, decode routing and ticks
are the cluster core's (`flowyard.cluster.core`), and which instance steps next and when an
idle one wakes are `flowyard.cluster.turns`'s. This module is the virtual clock and the
per-instance driver around each step; the simulator's transport (what the core reads and how
KV moves) is `transport.py`, its step execution (priced by the cost model, with exact
multi-step decode runs and operator-level preemption) `steps.py`, KV transfer times `kv_push.py`.
"""

from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Callable, Sequence, cast

from flowyard.cluster.core import ClusterCore, DecisionLog
from flowyard.cluster.index import Touched
from flowyard.cluster.timeline import Timeline
from flowyard.cluster.turns import Turns
from flowyard.core.kvcache import KVCacheManager
from flowyard.core.plan import StepPlan
from flowyard.core.prefix_cache import PrefixCachingKVManager
from flowyard.core.request import Request, RequestState, Status
from flowyard.costmodel.base import CostModel
from flowyard.policies.framework.contracts import InstanceSnapshot, Role, StepResult
from flowyard.policies.framework.policy import Policy
from flowyard.sim.arrivals import ArrivalSource, Due, OpenLoop
from flowyard.sim.base import ARRIVAL, CLIENT, INF, SCHEDULE, STEP, TIMER, SimulationError
from flowyard.sim.cluster import Topology
from flowyard.sim.instance import SimInstance, SimResult
from flowyard.sim.kv_push import KVPush
from flowyard.sim.steps import StepExecution
from flowyard.sim.transport import SimTransport

if TYPE_CHECKING:
    from flowyard.sim.client_cpu import SharedClient

__all__ = ["SimResult", "SimulationError", "Simulator"]

MAX_IDLE_TICKS = 10_000  # periodic ticks in a row with no other event before a run is declared stuck


class Simulator(SimTransport, StepExecution):
    """Replays requests through a `Policy` on `num_instances` simulated instances."""

    def __init__(
        self,
        requests: Sequence[Request],
        policy: Policy,
        cost_model: CostModel,
        topology: Topology,
        *,
        block_size: int = 16,
        progress: Callable[[int, int], None] | None = None,
        on_step: Callable[[int, StepPlan, int], None] | None = None,
        prefix_caching: bool = False,
        snapshot_staleness: float = 0.0,
        arrivals: ArrivalSource | None = None,
        chunked_kv: bool | None = None,
        shared_device: bool = False,
        decisions: DecisionLog | None = None,
        timeline: Timeline | None = None,
    ) -> None:
        self.requests = list(requests)
        self.arrivals = arrivals if arrivals is not None else OpenLoop(self.requests)
        # A source that reads the tokens as they stream (`client_cpu.SharedClient`) hears of
        # every step and wakes when it asks to: steps run one at a time so it hears of each.
        self._reader = cast("SharedClient", self.arrivals) if getattr(self.arrivals, "reads_tokens", False) else None
        self._client_wake = INF
        self.policy = policy
        self.cost = cost_model
        # A request reaches the scheduler this long after its client sent it (its arrival):
        # the emulated stack's frontend, which the client's TTFT includes.
        self.frontend = cast(float, cost_model.frontend_latency())  # a scalar (Seconds may be an array)
        self._gap = float(cost_model.step_gap())
        # An instance a request's KV moves out of is busy this long more (Ray's export to its
        # object store, fitted on a served timeline; 0 for executors that move KV for free).
        self._export_s = cast(float, cost_model.kv_export_time())
        self.topology = topology
        self.progress = progress
        self.on_step = on_step  # (instance, plan, steps) after each executed plan: tracing
        # global policies see snapshots up to this old, as from a runtime's periodic reports
        self.snapshot_staleness = snapshot_staleness
        self._snap_cache: dict[int, tuple[float, InstanceSnapshot]] = {}
        # score-ordered instance indexes for global policies (`flowyard.cluster.index`): every
        # change of an instance's scheduler touches them. Stale snapshots change without a
        # touch (when they expire), so policies scan instead.
        self._touched = Touched(self.snapshot, self.scheduler)
        self._recent = self._touched.recent
        num_blocks = max(1, cost_model.kv_capacity_tokens() // block_size)
        kv_cls = PrefixCachingKVManager if prefix_caching else KVCacheManager
        # All instances time-share one device (several engines stepped in turn by one thread,
        # as `LocalCluster` does on a CPU): a step waits for the device and runs one at a time.
        self.shared_device = shared_device
        self._device_free = 0.0  # when the step in flight ends (only `shared_device` waits for it)
        self.instances = [SimInstance(i, policy.make_local(i, kv_cls(num_blocks, block_size),
                                                        single_step=shared_device or self._reader is not None))
                          for i in range(len(policy.roles))]
        # who steps next on each device, and when idle instances wake (`flowyard.cluster.turns`):
        # one queue for a shared device, else one per instance; a new place in a queue is a
        # SCHEDULE event (after every other event of this instant, as an engine drains its
        # input queue before a step), a new wake-up time a TIMER event
        shared = Turns(self._queued, self._wake_at) if shared_device else None
        for inst in self.instances:
            inst.turns = shared or Turns(self._queued, self._wake_at)
        self._by_role: dict[Role | None, list[int]] = {None: [i.id for i in self.instances]}
        for inst in self.instances:
            self._by_role.setdefault(inst.sched.role, []).append(inst.id)
        # Chunk-by-chunk KV push of micro-requests' first segments (None: the policy decides)
        chunked = policy.global_scheduler.capabilities.chunked_kv if chunked_kv is None else chunked_kv
        self.kv_push = KVPush(topology, cost_model.kv_bytes_per_token(), chunked)
        self._heap: list[tuple[float, int, int, object]] = []  # (time, kind, seq, payload)
        self._seq = itertools.count()
        self.now = 0.0
        self.steps = self._done = 0  # steps executed; requests finished or rejected
        self.preemption_blocking: list[float] = []
        # routing, splits, hand-offs, decode routing, ticks: the orchestration every executor
        # shares; this class is its virtual clock and its transport (`flowyard.cluster`)
        self.timeline = timeline  # steps, KV transfers, decisions and request spans, for Perfetto
        if timeline is not None:
            decisions = decisions or timeline.log
            timeline.roles.update({i.id: i.sched.role.value for i in self.instances})
        self.core = ClusterCore(policy, self, decisions)

    # -- event plumbing ------------------------------------------------------------------
    def _push(self, t: float, kind: int, payload: object) -> None:
        heapq.heappush(self._heap, (t, kind, next(self._seq), payload))

    def run(self) -> SimResult:
        start = time.perf_counter()
        states = [RequestState(r) for r in self.requests]
        first = self.arrivals.initial(states)
        self._send(first)
        ticks = self.core.ticks  # the global scheduler's periodic controllers, monitors
        if first:
            ticks.start(min(t for t, _ in first))
            if ticks.next is not None:
                self._push(ticks.next, TIMER, None)
        events = 0
        self._idle_ticks = 0
        heap = self._heap
        while heap:
            t, kind, _, payload = heapq.heappop(heap)
            self.now = t
            events += 1
            if kind == STEP:
                inst, version = cast("tuple[SimInstance, int]", payload)
                if version == inst.version:
                    self._complete(inst, len(inst.ends))
            elif kind == SCHEDULE:
                self._take_turns(payload)  # type: ignore[arg-type]
            elif kind == ARRIVAL:
                self._send(self.arrivals.on_arrival(payload, t))  # type: ignore[arg-type]
                self._arrive(payload)  # type: ignore[arg-type]
            elif kind == TIMER:
                self._timer(payload, len(states))  # type: ignore[arg-type]
            elif kind == CLIENT:
                assert self._reader is not None
                self._client_wake = INF
                self._send(self._reader.on_wake(t))
            else:
                self._kv_landed(*payload)  # type: ignore[misc]
            if self.progress is not None and events % 4096 == 0:
                self.progress(self._done, len(states))
        if self.progress is not None:
            self.progress(self._done, len(states))
        self._check_conservation(states)
        return SimResult(
            states=states, sim_time=self.now, wall_s=time.perf_counter() - start,
            events=events, steps=self.steps, instance_busy_s=[i.busy_s for i in self.instances],
            preemption_blocking=self.preemption_blocking,
            instance_work=[i.work for i in self.instances],
        )

    def _send(self, due: Due) -> None:
        for t, st in due:
            if st.req.arrival != t:  # sent by a closed-loop client: arrival = send time
                st.req = replace(st.req, arrival=t)
            self._push(t + self.frontend, ARRIVAL, st)
        if self._reader is not None:
            wake = self._reader.wake_at()
            if wake is not None and wake < self._client_wake:
                self._client_wake = wake
                self._push(wake, CLIENT, None)

    def _ended(self, st: RequestState, reject: str | None = None) -> None:
        """st finished, or is rejected for `reject`: count it; the arrival source may send more."""
        if reject is not None:
            st.status, st.reject_reason = Status.REJECTED, reject
        if self.timeline is not None:
            self.timeline.finished(st)
        self._done += 1
        self._send(self.arrivals.on_done(st, self.now))

    # -- handlers ------------------------------------------------------------------------
    def _arrive(self, st: RequestState) -> None:
        if self.core.arrive(st, self.now) is None:
            self._ended(st, st.reject_reason or "rejected")

    def _complete(self, inst: SimInstance, steps: int) -> None:
        plan = inst.plan
        assert plan is not None
        ends = inst.ends[:steps]
        inst.plan = None
        inst.sync_after = INF  # no run left to commit
        inst.bounds = None
        self._changed(inst)
        if self.timeline is not None:
            self.timeline.step(inst.id, inst.started, self.now, plan, steps, preempted=inst.suspend_at >= 0)
        if inst.suspend_at >= 0:  # a preempted plan acked at an operator boundary
            k, inst.suspend_at = inst.suspend_at, -1
            inst.sched.suspend(plan, k, self.now)
            self.end_turn(inst.id, True, None, self.now)
            return
        self.steps += steps
        inst.account(steps)
        if self.on_step is not None:
            self.on_step(inst.id, plan, steps)
        result = inst.sched.update_from_output(plan, self._output(inst, ends))
        inst.settle(self.now)
        self.kv_push.computed(inst.id, ends)
        self.end_turn(inst.id, True, None, self.now, (result,))
        if self._reader is not None:
            self._send(self._reader.on_tokens(self.now))

    # -- the end of a turn (flowyard.cluster.driver) ---------------------------------------
    def _turns_of(self, i: int) -> Turns:
        return self.instances[i].turns

    def _finished_here(self, i: int, result: StepResult) -> None:
        for st in result.finished:
            self.kv_push.finished(st)
            st.compact()  # its token times only: the batch's shared run arrays can go
            self._ended(st)

    def _admit_moved(self, i: int) -> None:
        self._start_transfers(self.instances[i])

    def _kick(self, inst: SimInstance) -> None:
        """Something reached `inst`: a multi-step run in flight is cut short; an idle instance
        queues for its device (`Turns.kick`)."""
        if not self._interrupt(inst):
            inst.turns.kick(inst.id)

    def _queued(self, i: int) -> None:
        self._push(self.now, SCHEDULE, self.instances[i])

    def _wake_at(self, i: int, t: float) -> None:
        self._push(t, TIMER, self.instances[i])

    def _timer(self, inst: SimInstance | None, total: int) -> None:
        """A local scheduler's wake-up time (a batching window closing), or, for None, the
        global scheduler's periodic tick, which goes on while requests remain."""
        if inst is None:
            ticks = self.core.ticks
            self.core.tick_due(self.now)  # due exactly now: timer events keep the grid
            # Only ticks left, tick after tick, while requests remain: nothing else can ever
            # happen, so the run is stuck; say so rather than tick forever.
            self._idle_ticks = self._idle_ticks + 1 if not self._heap else 0
            if self._idle_ticks > MAX_IDLE_TICKS:
                raise SimulationError(f"{total - self._done} request(s) can make no progress: for "
                                      f"{MAX_IDLE_TICKS} periodic ticks nothing else happened (a deadlock)")
            if self._done < total and ticks.next is not None:
                self._push(ticks.next, TIMER, None)
            else:
                ticks.end()
        elif inst.turns.due(inst.id, self.now):
            self._kick(inst)

    def _take_turns(self, inst: SimInstance) -> None:
        """A SCHEDULE event of `inst`: with its own device it plans its step now; on a
        shared device the queue's head plans its step whenever the device is free (first
        come, first served, as `LocalCluster` steps its engines on one thread)."""
        turns = inst.turns
        if not self.shared_device:
            turns.pop()
            self._start_step(inst)
            return
        while turns.ready and self._device_free <= self.now:
            self._start_step(self.instances[turns.ready.popleft()])

    def _check_conservation(self, states: list[RequestState]) -> None:
        stuck = [s.id for s in states if s.status not in (Status.FINISHED, Status.REJECTED)]
        if stuck:
            raise SimulationError(f"{len(stuck)} request(s) neither finished nor rejected, "
                                  f"e.g. ids {stuck[:5]}")
        for inst in self.instances:
            leaked = inst.sched.kv.leaked()
            if leaked or inst.sched.has_work():
                raise SimulationError(f"instance {inst.id} still holds KV or work: {leaked}")

