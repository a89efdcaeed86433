"""The simulator's per-instance state and its result record."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from flowyard.cluster.turns import Turns
from flowyard.core.plan import BatchShape, StepPlan
from flowyard.core.request import RequestState, Status
from flowyard.policies.framework.contracts import InstanceSnapshot, LocalScheduler


class SimInstance:
    """One simulated serving instance: a local scheduler plus the step it is running."""

    __slots__ = ("id", "sched", "plan", "ends", "version", "busy_s", "turns", "bounds",
                 "suspend_at", "work", "shape", "shape_done", "kv_since", "kv_used", "started",
                 "snap", "sync_after", "export_until")

    def __init__(self, iid: int, sched: LocalScheduler) -> None:
        self.id = iid
        self.sched = sched
        self.plan: StepPlan | None = None
        self.ends: np.ndarray = np.empty(0)
        self.version = 0
        self.busy_s = 0.0
        self.turns: Turns  # its device's queue and wake-up times (set by the simulator)
        self.bounds: np.ndarray | None = None  # operator end times of a preemptible plan
        self.suspend_at = -1  # operators done when a requested preemption takes effect
        self.work = InstanceWork(kv_blocks=sched.kv.num_blocks)
        self.shape: BatchShape | None = None  # of the run in flight, for `work`
        self.shape_done = 0  # its steps already counted in `work`
        self.kv_since, self.kv_used = 0.0, 0  # KV blocks held since then (for work.kv_block_s)
        self.started = 0.0  # when the run in flight (or its uncommitted rest) started, for timelines
        self.snap: InstanceSnapshot | None = None  # the scheduler's snapshot while nothing changed it (None: take a new one)
        # the first step end of a multi-step run in flight (inf: none): a snapshot taken later
        # must commit the steps done by then (a float, so the check costs no numpy scalar)
        self.sync_after = float("inf")
        # busy until then giving up the KV of requests that moved out (CostModel.kv_export_time)
        self.export_until = 0.0

    def set_ends(self, ends: np.ndarray) -> None:
        """The step end times of the run in flight (what is left of it)."""
        self.ends = ends
        self.sync_after = float(ends[0]) if len(ends) > 1 else float("inf")

    def settle(self, now: float) -> None:
        """Integrate the KV held since the last change of step (a launch or a completion)."""
        self.work.kv_block_s += self.kv_used * (now - self.kv_since)
        self.kv_since, self.kv_used = now, self.sched.kv.num_used_blocks

    def launch(self, shape: BatchShape, now: float) -> None:
        self.settle(now)
        self.shape, self.shape_done = shape, 0

    def account(self, steps: int) -> None:
        """Add the work of the next `steps` steps of the run in flight (a decode run is
        committed in pieces when snapshots are read in the middle of it)."""
        shape, w = self.shape, self.work
        if shape is None:
            return
        ctx, done = shape.decode_ctx, self.shape_done
        w.prefill_tokens += float(shape.prefill_tokens) * steps
        w.decode_tokens += float(shape.decode_seqs) * steps
        w.attn_pairs += float(shape.prefill_attn) * steps + float(
            ctx[done:done + steps].sum() if type(ctx) is np.ndarray and ctx.ndim else ctx * steps)
        self.shape_done = done + steps


@dataclass(slots=True)
class InstanceWork:
    """What one instance was given to do over a run, for utilisation reports (MFU, HBM use).

    Counted when a step completes (a preempted step counts once, when it finally completes).
    `kv_block_s` integrates the KV blocks held over time, sampled at every step launch and
    completion."""

    prefill_tokens: float = 0.0
    decode_tokens: float = 0.0
    attn_pairs: float = 0.0  # query-key pairs of attention (causal prefill pairs + decode contexts)
    kv_block_s: float = 0.0
    kv_blocks: int = 0  # the instance's KV capacity in blocks

    def kv_usage(self, makespan: float) -> float:
        """Mean share of the KV cache in use over `makespan` seconds."""
        return self.kv_block_s / (self.kv_blocks * makespan) if self.kv_blocks and makespan > 0 else 0.0


@dataclass
class SimResult:
    states: list[RequestState]
    sim_time: float
    wall_s: float
    events: int
    steps: int
    instance_busy_s: list[float] = field(default_factory=list)
    # FlowPrefill: seconds from each preemption signal to the operator boundary that acked it
    preemption_blocking: list[float] = field(default_factory=list)
    instance_work: list[InstanceWork] = field(default_factory=list)

    @property
    def completed(self) -> list[RequestState]:
        return [s for s in self.states if s.status is Status.FINISHED]

    @property
    def rejected(self) -> list[RequestState]:
        return [s for s in self.states if s.status is Status.REJECTED]
