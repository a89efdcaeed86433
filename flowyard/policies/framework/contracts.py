"""The two policy contracts every executor drives: a local scheduler per instance and one
global scheduler per cluster.

Policies are plain objects. They read `RequestState`s, the instance's `KVCacheManager` and
`InstanceSnapshot`s, and return decisions (a `StepPlan`, an instance id). They never read a
clock of their own: `now` is passed in, so the same object runs under the simulator's virtual
clock and the runtime's wall clock.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Protocol, Sequence

from flowyard.core.kvcache import KVCacheManager
from flowyard.core.plan import StepOutput, StepPlan
from flowyard.core.request import Request, RequestState
from flowyard.policies.framework.capabilities import Capabilities
from flowyard.policies.framework.slack import deadline


class Role(enum.Enum):
    """What an instance is for. MIXED runs prefill and decode (colocated serving)."""

    MIXED = "mixed"
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(slots=True)
class InstanceSnapshot:
    """Plain-data view of one instance that global policies read.

    Built from the scheduler's committed state: during a multi-step decode run it is as old as
    the start of that run (the runtime's snapshots are likewise a step old).
    """

    instance: int
    role: Role
    num_running: int
    num_waiting: int
    waiting_tokens: int  # uncomputed prompt tokens queued (including partial prefills)
    running_tokens: int  # sum of sequence lengths of running requests (KV held or growing)
    kv_free_blocks: int
    kv_total_blocks: int
    block_size: int
    num_migrating_in: int = 0
    # Instance-monitor counters (cumulative; controllers difference them between ticks):
    busy_s: float = 0.0  # seconds spent running steps
    slo_done: int = 0  # requests with a TTFT SLO that produced their first token here
    slo_late: int = 0  # ... of which missed it
    # Arrow's TTFT predictor and monitor (BatchScheduler fills them; others keep the defaults):
    # (tokens computed, tokens still to compute) of each queued or partially prefilled request,
    # in no particular order: prefill time is quadratic in length, so a token total is not enough
    prefill_queue: tuple[tuple[int, int], ...] = ()
    # the TTFT deadline (arrival + TTFT SLO; inf without one) of each prefill_queue entry, in the
    # same order: under a slack-aware order only the feasible work due earlier is ahead of a prompt
    prefill_deadlines: tuple[float, ...] = ()
    incoming_tokens: int = 0  # sequence tokens of requests queued or in flight to migrate here
    num_decoding: int = 0  # running requests past their prefill
    token_interval: float = 0.0  # recent seconds between steps that decode (a TPOT proxy)

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.kv_free_blocks / self.kv_total_blocks

    def count_in(self, req: Request) -> None:
        """Count a request queued here after this snapshot was taken, until the instance's next
        one (vLLM's router does the same): an executor whose snapshots are a step old (Ray)
        would otherwise show every arrival of that step the same idle queue, and a
        delay-based dispatcher would send them all to one instance."""
        self.num_waiting += 1
        self.waiting_tokens += req.prompt_len
        if len(self.prefill_deadlines) == len(self.prefill_queue):  # keep them aligned (or both empty)
            self.prefill_deadlines = self.prefill_deadlines + (deadline(req),)
        self.prefill_queue = self.prefill_queue + ((0, req.prompt_len),)

    @property
    def num_requests(self) -> int:
        return self.num_running + self.num_waiting + self.num_migrating_in


@dataclass(slots=True)
class StepResult:
    """What `update_from_output` tells the executor after applying a step.

    finished: requests done (EOS, stop, length); their KV is already freed.
    handoffs: requests whose prefill finished on a PREFILL instance; they keep their KV here
      until the executor calls `release` after the transfer to a decode instance.
    """

    finished: list[RequestState] = field(default_factory=list)
    handoffs: list[RequestState] = field(default_factory=list)
    preempted: list[RequestState] = field(default_factory=list)
    # MIXED instances: requests whose prefill finished this step and that decode on here
    # unless the global scheduler (routes_decode) sends them elsewhere
    prefilled: list[RequestState] = field(default_factory=list)


class LocalScheduler(ABC):
    """Per-instance policy: owns the instance's queues and KV accounting (vLLM v1's Scheduler)."""

    kv: KVCacheManager
    role: Role
    instance: int

    @abstractmethod
    def add_request(self, state: RequestState, now: float) -> bool:
        """Queue a new request; False (state rejected, reason set) if it can never run here."""

    @property
    def num_waiting(self) -> int:
        """Requests queued here that have not started: what an engine reports (/metrics, the
        server's queue bound)."""
        raise NotImplementedError

    @property
    def num_running(self) -> int:
        """Requests that have started here and not finished."""
        raise NotImplementedError

    @abstractmethod
    def schedule(self, now: float) -> StepPlan | None:
        """The next step to run, or None when there is nothing runnable."""

    @abstractmethod
    def update_from_output(self, plan: StepPlan, out: StepOutput) -> StepResult:
        """Apply the executed steps (out.steps <= plan.max_repeats) to request progress."""

    def advance(self, plan: StepPlan, out: StepOutput) -> None:
        """Apply the first out.steps steps of a repeated decode plan that keeps running."""
        raise NotImplementedError

    def shorten(self, plan: StepPlan, steps: int) -> None:
        """The executor will run only `steps` (< plan.max_repeats) of `plan`; release whatever
        was reserved for the rest. Default: nothing was reserved."""

    def wake_at(self, now: float) -> float | None:
        """Asked when `schedule` returned None: a time at which to call `schedule` again even if
        no event arrives (a batching window that closes then), or None to wait for events."""
        return None

    def preempt_check(self, now: float) -> bool:
        """An event (an arrival) reached this instance while it runs a preemptible plan: True
        asks the executor to suspend that plan at its next preemption boundary, then to call
        `suspend` and `schedule`. Schedulers without preemption never ask."""
        return False

    def suspend(self, plan: StepPlan, ops_done: int, now: float) -> None:
        """The executor stopped `plan` after `ops_done` operators; it may come back from
        `schedule` later (with plan.ops_done set) to be resumed."""
        raise NotImplementedError(f"{type(self).__name__} does not preempt running steps")

    @abstractmethod
    def add_migration(self, state: RequestState, now: float) -> None:
        """A request whose KV lives on another instance wants to continue here."""

    @abstractmethod
    def admit_migrations(self, now: float) -> list[RequestState]:
        """Migrations for which KV space is now reserved: the executor starts their transfer."""

    @abstractmethod
    def migration_arrived(self, state: RequestState, now: float) -> None:
        """The KV of an admitted migration is here; the request joins the running batch."""

    def hand_off(self, req_id: int) -> RequestState | None:
        """Take a running request off this instance, keeping its KV for a migration."""
        return None

    @abstractmethod
    def release(self, req_id: int) -> None:
        """Free a handed-off request's KV once its transfer is complete."""

    @abstractmethod
    def abort(self, req_id: int) -> RequestState | None:
        """Drop a request wherever it is, freeing its KV."""

    @abstractmethod
    def has_work(self) -> bool:
        """True while anything is queued, running, or holds KV here."""

    @abstractmethod
    def snapshot(self) -> InstanceSnapshot: ...


class ClusterView(Protocol):
    """What a global scheduler may read about the cluster."""

    def instances(self, role: Role | None = None) -> Sequence[int]: ...

    def snapshot(self, instance: int) -> InstanceSnapshot: ...


class GlobalScheduler(ABC):
    """Cluster policy: where each request starts and where it continues after prefill."""

    name: str = "global"
    # What it does beyond these methods (`framework.capabilities`), declared by the class.
    capabilities: Capabilities = Capabilities()
    # Seconds between `tick` calls (pool controllers, instance monitors); None: no ticks.
    period: float | None = None

    @property
    def routes_decode(self) -> bool:
        """True: `route_decode` is also asked for requests that finish prefill on a MIXED
        instance; an answer other than that instance moves the request there with its KV (Arrow's
        stateless instances: where a request decodes is decided when its prefill ends)."""
        return self.capabilities.routes_mixed

    @property
    def chunked_kv(self) -> bool:
        """Whether a split's first micro-request may push its KV chunk by chunk (the simulator)."""
        return self.capabilities.chunked_kv

    def tick(self, view: ClusterView, now: float) -> None:
        """Periodic work of the cluster policy, on the executor's clock."""

    def on_finished(self, state: RequestState, now: float) -> None:
        """A request finished (executors call this for every one, wherever its local scheduler
        runs): predictors learn from it (DynaServe's output lengths)."""

    def pool_moves(self) -> Sequence[tuple[float, int, str, str]]:
        """Every pool or role change of an instance so far, (time, instance, from, to), in
        order: executors log them as flips. Policies without pools have none."""
        return ()

    @abstractmethod
    def route(self, req: Request, view: ClusterView, now: float) -> int | None:
        """Instance that receives a new request; None rejects it."""

    def dispatch(self, req: Request, view: ClusterView, now: float) -> tuple[int | None, tuple[int, int] | None]:
        """Where a new request starts and, if it is split into micro-requests, (s, B): tokens
        1..s run there and the rest on instance B. One decision, so a policy that chooses both
        together (DynaServe) keeps no state between two calls. Default: `route`, then
        `split_point` for the chosen instance."""
        dst = self.route(req, view, now)
        return dst, (None if dst is None else self.split_point(req, dst, view, now))

    def split_point(self, req: Request, dst: int, view: ClusterView, now: float) -> tuple[int, int] | None:
        """For a request just routed to `dst`: split it into micro-requests? (s, B) runs tokens
        1..s on dst and the rest on instance B (DynaServe); None runs it whole."""
        return None

    def route_decode(self, state: RequestState, src: int, view: ClusterView, now: float) -> int:
        """Instance that decodes a request whose prefill finished on PREFILL instance `src`."""
        raise NotImplementedError(f"{self.name} has no decode routing (no PREFILL instances)")
