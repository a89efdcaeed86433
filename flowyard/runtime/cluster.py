"""Several engine instances in one process, under one policy: the real-clock cluster.

The policy is the very object the simulator runs (`flowyard.policies.registry.build_policy`),
and so is the orchestration around it (`flowyard.cluster.ClusterCore`): this class is only
its wall clock and its transport. Each instance's local scheduler is the policy's own for its
role; KV moves between instances by block range (an in-process copy here; the interface is the
same for a transport between processes).

`LocalCluster` has the surface `AsyncLLMEngine` drives (add_request, abort, step,
has_unfinished, ...), so the OpenAI server serves a cluster exactly as it serves one engine.

The engines share one thread, so they take turns on it exactly as the simulator's
`shared_device` instances take turns on their device: first come, first served, an engine
that just ran a step going to the back of the queue before whatever its step sent elsewhere.
With a virtual clock (`clock=`) and the hooks the two-executor guard uses, both executors
therefore make the same decisions at the same times (tests/test_two_executors.py).
"""

from __future__ import annotations

import itertools
import time
from typing import Callable

from flowyard.cluster.core import DecisionLog
from flowyard.cluster.timeline import Timeline
from flowyard.cluster.turns import Turns
from flowyard.core.kvcache import KVCacheManager, cdiv
from flowyard.core.request import SLO, RequestState
from flowyard.engine.engine_config import EngineConfig
from flowyard.engine.llm_engine import LLMEngine, TrackedRequest
from flowyard.engine.model import CausalLM
from flowyard.engine.preemption import PreemptionStats
from flowyard.engine.sampling import RequestOutput, SamplingParams
from flowyard.engine.tokenizer import Tokenizer
from flowyard.policies.framework.contracts import InstanceSnapshot, LocalScheduler, Role, StepResult
from flowyard.policies.framework.policy import Policy
from flowyard.runtime.base import ClusterBase


class LocalCluster(ClusterBase):
    def __init__(self, model: CausalLM, tokenizer: Tokenizer, policy: Policy,
                 config: EngineConfig = EngineConfig(), name: str = "model", *,
                 decisions: DecisionLog | None = None, clock: Callable[[], float] | None = None,
                 timeline: Timeline | None = None) -> None:
        """decisions: log every scheduling decision there; clock: seconds since some origin
        (default the wall clock; a test injects a virtual one); timeline: record steps, KV
        transfers, decisions and request spans there."""
        ids, t0 = itertools.count(), (clock or time.monotonic)()
        self._init_core(policy, decisions, timeline)
        self.config = config
        self.model_name = name
        self.tokenizer = tokenizer
        self.engines = [
            LLMEngine(model, tokenizer, config, name, instance=i, role=role, ids=ids, t0=t0, clock=clock,
                      scheduler=_local_scheduler(policy, i))
            for i, role in enumerate(policy.roles)
        ]
        self.max_model_len = min(e.max_model_len for e in self.engines)
        self._new: dict[int, TrackedRequest] = {}  # being routed, not yet queued anywhere
        self._kv_home: dict[int, int] = {}  # migrating request (int id) -> instance holding its KV
        self._failed: list[RequestOutput] = []  # ended by the cluster, reported with the next step
        self.turns = Turns()  # engines waiting for the thread, the one on it, wake-up times
        self.migrations = 0

    # -- Transport for the cluster core ---------------------------------------------------------
    def instance_ids(self, role: Role | None = None) -> list[int]:
        return [e.instance for e in self.engines if role is None or e.scheduler.role is role]

    def snapshot(self, instance: int) -> InstanceSnapshot:
        return self.engines[instance].scheduler.snapshot()

    def add(self, instance: int, st: RequestState, now: float) -> bool:
        engine = self.engines[instance]
        signalled = engine.pool.signalled
        try:
            engine.add_tracked(self._new[st.id])
        except ValueError as e:
            st.reject_reason = str(e)
            return False
        if engine.pool.signalled and not signalled:  # it preempts the prefill in flight there
            self.core.preempted(instance, now, engine.pool.ops)
        self._kick(instance)
        return True

    def hand_off(self, instance: int, st: RequestState) -> bool:
        return self.engines[instance].scheduler.hand_off(st.id) is not None

    def move(self, src: int, dst: int, st: RequestState, now: float) -> None:
        """The request's record moves now; its KV stays on src until dst has room."""
        source, target = self.engines[src], self.engines[dst]
        tracked = source.detach(st.id)
        target.attach(tracked)
        self._where[tracked.request_id] = dst
        self._kv_home[st.id] = src
        target.scheduler.add_migration(st, now)
        self._admit_moved(dst)

    def fail(self, instance: int, st: RequestState, reason: str) -> None:
        engine = self.engines[instance]
        rid = engine.tracked_by_id(st.id).request_id
        engine.abort(rid)
        if self.timeline is not None:
            self.timeline.ended(st, self.now(), "failed")
        self._where.pop(rid, None)
        self._failed.append(RequestOutput(rid, finished=True, finish_reason="error", error=reason, retry_after=1.0))

    def _admit_moved(self, i: int) -> None:
        dst = self.engines[i]
        for st in dst.scheduler.admit_migrations(self.now()):
            src = self.engines[self._kv_home.pop(st.id)]
            n = cdiv(st.num_computed, src.kv.block_size)
            start = self.now()
            data = src.runner.export_kv(src.kv.block_table(st.id)[:n])
            dst.runner.import_kv(dst.kv.block_table(st.id)[:n], data)
            self._transferred(start, st.id, src.instance, dst.instance, self.now() - start)
            if self.timeline is not None:
                self.timeline.transfer(st.id, src.instance, dst.instance, start, self.now())
            src.scheduler.release(st.id)
            self._kick(src.instance)
            dst.scheduler.migration_arrived(st, self.now())
            self._kick(dst.instance)
            self.migrations += 1

    def _kick(self, i: int) -> None:
        self.turns.kick(i)

    def wake_due(self, now: float) -> None:
        """Engines whose scheduler's wake-up time (a batching window closing) has come queue up."""
        self.turns.wake_due(now)

    def next_wake(self) -> float | None:
        return self.turns.next_wake()

    # -- the engine surface ---------------------------------------------------------------------
    def now(self) -> float:
        return self.engines[0].now()

    def wake_delay(self) -> float | None:
        """Seconds until `step` has something to do: 0 while an engine is queued, else the
        next wake-up time or periodic tick (due idle or not), None if only an event can help."""
        if self.turns.ready:
            return 0.0
        now = self.now()
        delays = self.turns.delays(now)
        if (tick := self._tick_delay()) is not None:
            delays.append(tick)
        return min(delays) if delays else None

    @property
    def preemption_stats(self) -> PreemptionStats:
        return PreemptionStats.merged([e.preemption_stats for e in self.engines])

    @property
    def cpu_threads(self) -> int:
        return self.engines[0].cpu_threads  # one process: one thread count

    @property
    def boundary_hook(self) -> Callable[[], None] | None:
        return self.engines[0].boundary_hook

    @boundary_hook.setter
    def boundary_hook(self, hook: Callable[[], None] | None) -> None:
        for e in self.engines:
            e.boundary_hook = hook

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    slo: SLO | None = None, arrival: float | None = None, *,
                    session: str | None = None, task: str | None = None, priority: int = 0) -> None:
        """Route the request (the policy sees it whole: SLO, task, session and the history it
        shares with the session's last turn) and queue it where the policy says."""
        if request_id in self._where:
            raise ValueError(f"duplicate request id {request_id!r}")
        t = self.engines[0].make_request(request_id, prompt_ids, params, slo, arrival, task=task,
                                         priority=priority, **self.sessions.fields(prompt_ids, session))
        self._new[t.state.id] = t
        try:
            dst = self.core.arrive(t.state, self.now())
        finally:
            del self._new[t.state.id]
        if dst is None:
            if self.timeline is not None:
                self.timeline.ended(t.state, self.now(), "rejected")
            raise ValueError(t.state.reject_reason or "no instance can take this request now")
        self._where[request_id] = dst

    def abort(self, request_id: str) -> RequestOutput | None:
        where = self._where.pop(request_id, None)
        if where is None:
            return None
        engine = self.engines[where]
        tracked = engine.tracked(request_id)
        if tracked is not None and tracked.state.id in self._kv_home:  # KV still at the source
            home = self._kv_home.pop(tracked.state.id)
            self.engines[home].scheduler.abort(tracked.state.id)
            self._kick(home)
        self._kick(where)  # the KV it frees may let queued work run
        if tracked is not None and self.timeline is not None:
            self.timeline.ended(tracked.state, self.now(), "aborted")
        return engine.abort(request_id)

    def has_unfinished(self) -> bool:
        return any(e.has_unfinished() for e in self.engines) or bool(self._failed)

    def snapshots(self) -> list[InstanceSnapshot]:
        return [e.scheduler.snapshot() for e in self.engines]

    def prefix_counts(self) -> tuple[int, int]:
        return (sum(getattr(e.kv, "queries", 0) for e in self.engines), sum(getattr(e.kv, "hits", 0) for e in self.engines))

    def prefix_hit_rate(self) -> float:
        return sum(getattr(e.kv, "hit_rate", 0.0) for e in self.engines) / len(self.engines)

    def step(self) -> list[RequestOutput]:
        """One step of the engine at the head of the queue (engines with nothing to run are
        passed over), then the cluster core's hand-offs, decode routing and moves for what
        that step produced."""
        outputs, self._failed = self._failed, []
        self._periodic()
        self.wake_due(self.now())
        turns = self.turns
        for e in self.engines:  # a safety net: work that reached an engine some other way
            if not e.idle:
                turns.kick(e.instance)
        while (i := turns.pop()) is not None:
            engine = self.engines[i]
            turns.running = i
            start, preempted = self.now(), engine.pool.stats.count
            try:
                outs = engine.step()
            finally:
                turns.running = None
            if self.timeline is not None and engine.last_plan is not None:
                self.timeline.step(i, start, self.now(), engine.last_plan,
                                   preempted=engine.pool.stats.count > preempted)

            ran = not engine.idle or bool(engine.results)
            outputs += outs
            for out in outs:
                if out.finished:
                    self._where.pop(out.request_id, None)
            results, engine.results = engine.results, []
            self.end_turn(i, ran, engine.wake_time, self.now(), results)
            if ran or outs:
                break
        return outputs

    # -- the end of a turn (flowyard.cluster.driver) ---------------------------------------
    def _finished_here(self, i: int, result: StepResult) -> None:
        self._finished(result.finished)

    def migrate(self, request_id: str, dst: int) -> bool:
        """Move a running request to instance `dst` now, at whatever token it has reached
        (mid-prefill, at the end of prefill, mid-decode); it continues there without
        recomputation. Call between steps. False if it is not running anywhere (yet)."""
        where = self._where.get(request_id)
        if where is None:
            return False
        tracked = self.engines[where].tracked(request_id)
        return tracked is not None and self.core.migrate(tracked.state, where, dst, self.now())


def _local_scheduler(policy: Policy, i: int) -> Callable[[KVCacheManager, int], LocalScheduler]:
    """Instance i's scheduler factory: the engine builds it once it knows its KV and length."""
    return lambda kv, max_len: policy.make_local(i, kv, max_model_len=max_len, single_step=True)
