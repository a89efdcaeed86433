"""Engine instances as Ray actors, one process each: the deployment form of `LocalCluster`.

The driver (the server process) runs the cluster core (`flowyard.cluster`) with the policy's
global scheduler; every actor (`ray_actor.py`) runs its own engine with the policy's own local
scheduler for its instance, so every registry policy runs here as it does in one process:
FlowPrefill's preemption inside an actor, Arrow's decode routing and flips, DynaServe's
splits, PLA's pools and sessions. All busy actors step concurrently (one Ray call each per
round). A request that moves (a hand-off, a decode routed elsewhere, a migration) travels as
its record plus KV blocks through the Ray object store; the destination imports them as soon
as it has room.

Snapshots for the global scheduler are the ones each actor returned with its last step, so
they are at most one step old (the simulator can model the same staleness).

`lockstep=True` (with an optional virtual `clock`) steps one actor at a time in the order of
the simulator's shared device instead, with fresh snapshots: the deterministic form the
three-executor guard runs (`flowyard.runtime.ray_lockstep`).
"""

from __future__ import annotations

import itertools
import time
from typing import Any, Callable

from flowyard.cluster.core import DecisionLog
from flowyard.cluster.timeline import Timeline
from flowyard.core.request import SLO, RequestState
from flowyard.engine.engine_config import EngineConfig
from flowyard.engine.llm_engine import new_request
from flowyard.engine.preemption import PreemptionStats
from flowyard.engine.protocol import EngineUnavailableError
from flowyard.engine.sampling import RequestOutput, SamplingParams
from flowyard.policies.framework.contracts import InstanceSnapshot, Role
from flowyard.policies.framework.policy import Policy
from flowyard.runtime.ray_actor import EngineActor
from flowyard.runtime.ray_faults import RayFaults
from flowyard.runtime.ray_lockstep import RayLockstep
from flowyard.runtime.ray_reports import RayReports


class RayCluster(RayReports, RayLockstep, RayFaults):
    """`LocalCluster`'s surface over Ray actors (what `AsyncLLMEngine` and the server drive).

    Failures: every actor has a `watch` call outstanding that only returns when the actor
    dies, so a death is noticed by `poll` (the serving loop calls it when idle) or `step`
    without any traffic. Then what had not started there is dispatched again, what had KV
    there fails with a retryable error (`RequestOutput.retry_after`: the server answers 503),
    the cluster core routes nothing more to it (`ClusterCore._live_substitute`), and a
    replacement starts, which rejoins once it has loaded.
    """

    #: A handed-off request may continue on the instance that holds its KV (take, then put
    #: to the same actor) when its planned destination died and no other can take it.
    moves_in_place = True
    #: What a client is told to wait before retrying a request an instance's death failed.
    RETRY_AFTER_S = 1.0

    def __init__(self, model: str | None, policy: Policy, config: EngineConfig = EngineConfig(),
                 address: str | None = None, *, decisions: DecisionLog | None = None,
                 timeline: Timeline | None = None, lockstep: bool = False,
                 clock: Callable[[], float] | None = None, actors: list | None = None) -> None:
        """lockstep: step one actor at a time, in the simulator's order, with fresh snapshots
        (deterministic; see `flowyard.runtime.ray_lockstep`); clock: seconds since some
        origin (default the wall clock; the guard injects a virtual one); actors: running
        actors another cluster gave up (`detach`), which serve this one with the model they
        have loaded (instance i takes actors[i]; more are started if there are too few)."""
        from flowyard.optional import require

        ray = require("ray", "running instances as Ray actors (--ray)")
        if not ray.is_initialized():
            ray.init(address=address, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
        self._ray = ray
        self._init_core(policy, decisions, timeline)
        self.config = config
        self._clock = clock or time.monotonic
        self._t0 = self._clock()
        self._init_lockstep(lockstep, len(policy.roles))
        self._actor_cls = ray.remote(num_cpus=0)(EngineActor)
        self._model = model
        self._policy_ref = ray.put(policy)  # each actor builds its own local scheduler from it
        self._seq: list[itertools.count] = []
        reuse = list(actors or [])
        self.actors = [self._spawn(i, reuse[i] if i < len(reuse) else None) for i in range(len(policy.roles))]
        infos = ray.get([a.info.remote() for a in self.actors])
        self.model_name = infos[0][0]
        self.max_model_len = min(i[1] for i in infos)
        # The driver tokenises prompts: it takes the tokenizer from an actor rather than
        # loading (and dequantising) the whole checkpoint a second time.
        self.tokenizer = ray.get(self.actors[0].tokenizer.remote())
        self._snaps = ray.get([self._call(i, "snapshot") for i in range(len(self.actors))])
        self._busy = [False] * len(self.actors)
        self._wake_at: list[float | None] = [None] * len(self.actors)  # asynchronous: step again then
        self._ids = itertools.count()
        self._rid: dict[int, str] = {}  # int id -> request id, while the request lives
        self._states: dict[int, RequestState] = {}  # the driver's copy, for spans of abnormal ends
        self._new: dict[int, SamplingParams] = {}  # being routed
        self._inputs: dict[str, tuple] = {}  # add_request's arguments until the first token
        self._down: dict[int, Any] = {}  # instance -> ObjectRef of its replacement's start-up
        self._inflight: dict[int, Any] = {}  # instance -> ObjectRef of the step it is running
        self._sent_during_step: set[int] = set()  # got work after its in-flight step started
        self._failed: list[RequestOutput] = []  # ended by the driver, reported with the next step
        self._preemption: dict[int, PreemptionStats] = {}  # each instance's, as of its last step
        self._prefix: dict[int, tuple[int, int]] = {}  # each instance's (queries, hits), as of its last step
        self._prefix_retired = (0, 0)  # counted by instances that died: counters never go down
        self.migrations = 0
        self.failures = 0
        self.restarts = 0

    def _spawn(self, i: int, actor=None):
        if actor is None:
            actor = self._actor_cls.remote(self._model, self.config, i, self._policy_ref, self._t0, self.lockstep)
        else:
            self._ray.get(actor.reset.remote(self.config, i, self._policy_ref, self._t0, self.lockstep))
        if not hasattr(self, "_watch"):
            self._watch: dict[int, Any] = {}
            # instance -> {call number: request} of adds its last snapshot did not count yet
            self._unapplied: dict[int, dict[int, Any]] = {}
        self._watch[i] = actor.watch.remote()  # returns (with an error) only when the actor dies
        if i < len(self._seq):
            self._seq[i] = itertools.count()
        else:
            self._seq.append(itertools.count())
        self._unapplied[i] = {}
        return actor

    def _call(self, i: int, method: str, *args):
        """Call an actor method with its place in this driver's order of calls to that actor."""
        if method != "snapshot":
            self._stale.add(i)  # lockstep reads a fresh snapshot after anything else
        return getattr(self.actors[i], method).remote(next(self._seq[i]), *args)

    @property
    def health_detail(self) -> str:
        return ", ".join(f"instance {i} is down (restarting)" for i in sorted(self._down))

    def now(self) -> float:
        return self._clock() - self._t0

    # -- Transport for the cluster core ---------------------------------------------------------
    def instance_ids(self, role: Role | None = None) -> list[int]:
        return [i for i, r in enumerate(self.policy.roles)
                if (role is None or r is role) and i not in self._down]

    def snapshot(self, instance: int) -> InstanceSnapshot:
        if self.lockstep and instance in self._stale:
            self._snaps[instance] = self._ray.get(self._call(instance, "snapshot"))
            self._stale.discard(instance)
        return self._snaps[instance]

    def add(self, instance: int, st: RequestState, now: float) -> bool:
        """Refusals come back with the actor's next step (the driver never waits on it), in
        lockstep at once."""
        if instance in self._down:  # a policy that kept its own view of the instances
            st.reject_reason = f"instance {instance} is down (restarting); retry"
            return False
        if self.lockstep:
            return self._lockstep_add(instance, st, now)
        seq = next(self._seq[instance])
        self._stale.add(instance)  # as _call does
        self.actors[instance].add_request.remote(seq, self._rid[st.id], st, self._new[st.id])
        self._unapplied[instance][seq] = st.req
        self._mark_busy(instance)
        self._snaps[instance].count_in(st.req)
        return True

    def hand_off(self, instance: int, st: RequestState) -> bool:
        try:
            return self._ray.get(self._call(instance, "hand_off", st.id)) is not None
        except self._ray.exceptions.RayActorError:  # died meanwhile: `watch` reports it
            return False

    def move(self, src: int, dst: int, st: RequestState, now: float) -> None:
        """The destination's `put` receives the source's `take` by reference, so neither call
        blocks the driver; the driver's decisions on the request travel with it."""
        fields = {"split_to": st.split_to, "prefill_instance": st.prefill_instance}
        rid = self._rid[st.id]
        if dst in self._down:  # nowhere to go: fail it now rather than leave it waiting
            self.fail(src, st, f"instance {dst}, where the request was to continue, is down; retry")
            return
        # src keeps the KV until dst has imported it (dst's report says so: `_released`)
        self._call(dst, "put", rid, [self._call(src, "take", st.id, fields, src != dst)])
        if src != dst:
            self._kv_home[st.id] = src
        self._where[rid] = dst
        self._mark_busy(dst)
        self.migrations += 1
        if self.lockstep:
            self._admit_moved(dst)

    def fail(self, instance: int, st: RequestState, reason: str) -> None:
        rid = self._rid[st.id]
        self._ended(st.id, "failed")
        self._call(instance, "abort", rid)
        self._where.pop(rid, None)
        self._failed.append(RequestOutput(rid, finished=True, finish_reason="error", error=reason,
                                          retry_after=self.RETRY_AFTER_S))

    # -- the engine surface ---------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    slo: SLO | None = None, arrival: float | None = None, *,
                    session: str | None = None, task: str | None = None, priority: int = 0) -> None:
        if request_id in self._where:
            raise ValueError(f"duplicate request id {request_id!r}")
        now = self.now()
        arrived = now if arrival is None else min(now, arrival - self._t0)
        req = new_request(next(self._ids), arrived, prompt_ids, params, slo, self.max_model_len, task=task,
                          priority=priority, **self.sessions.fields(prompt_ids, session))
        st = RequestState(req)
        if not self.accepting:  # every instance that takes new requests is restarting
            raise EngineUnavailableError(f"{self.health_detail}: no instance can take a new request now; retry",
                                         self.RETRY_AFTER_S)
        self._rid[st.id], self._new[st.id], self._states[st.id] = request_id, params, st
        try:
            dst = self.core.arrive(st, now)
        except Exception as e:
            if not self._down:
                raise
            # a policy that cannot route around a missing instance: still not the client's fault
            self._ended(st.id, "rejected")
            raise EngineUnavailableError(f"{self.health_detail}; retry ({type(e).__name__}: {e})",
                                         self.RETRY_AFTER_S) from e
        finally:
            del self._new[st.id]
        if dst is None:
            self._ended(st.id, "rejected")
            if self._down:  # not the request's fault: an instance is restarting
                raise EngineUnavailableError(st.reject_reason or "no live instance can take this request now; retry",
                                             self.RETRY_AFTER_S)
            raise ValueError(st.reject_reason or "no instance can take this request now")
        self._where[request_id] = dst
        self._inputs[request_id] = (prompt_ids, params, slo, arrival, session, task, priority)

    def abort(self, request_id: str) -> RequestOutput | None:
        where = self._where.pop(request_id, None)
        if where is None:
            return None
        self._inputs.pop(request_id, None)
        for k in [k for k, v in self._rid.items() if v == request_id]:
            self._ended(k, "aborted")
            self._released([(k, where)])  # still moving: its source frees the KV it kept
        self._call(where, "abort", request_id)
        return RequestOutput(request_id, finished=True, finish_reason="abort")

    def has_unfinished(self) -> bool:
        return any(self._busy) or bool(self._inflight) or bool(self._failed)

    def snapshots(self) -> list[InstanceSnapshot]:
        return self._snaps

    def prefix_counts(self) -> tuple[int, int]:
        """(queries, hits) of the actors' prefix caches, in prompt tokens, as of their last
        steps, plus what instances that since died had counted."""
        q, h = self._prefix_retired
        return q + sum(c[0] for c in self._prefix.values()), h + sum(c[1] for c in self._prefix.values())

    def prefix_hit_rate(self) -> float:
        q, h = self.prefix_counts()
        return h / q if q else 0.0

    @property
    def preemption_stats(self) -> PreemptionStats:
        """Operator-level preemptions inside the actors (FlowPrefill), as of their last steps."""
        return PreemptionStats.merged(list(self._preemption.values()))

    def fresh_snapshots(self) -> list[InstanceSnapshot]:
        """Every live instance's snapshot now (waits for steps in flight), e.g. after a drain."""
        return self._ray.get([self._call(i, "snapshot") for i in self.instance_ids()])

    def step(self, timeout: float | None = 0.005) -> list[RequestOutput]:
        """Apply whichever instance steps have finished and start the next step of each such
        instance at once: instances progress independently, a short decode step never waits
        for a long prefill step elsewhere. Waits at most `timeout` seconds for a step to end
        (None: until one does), so that a serving loop dispatches new arrivals while steps run:
        they reach a running prefill at its next operator boundary (FlowPrefill)."""
        self._check_restarts()
        self._check_deaths()
        if self.lockstep:
            return self._lockstep_step()
        self._periodic()
        outputs, self._failed = self._failed, []
        now = self.now()
        for i, busy in enumerate(self._busy):
            wake = self._wake_at[i]
            if busy and i not in self._down and i not in self._inflight and (wake is None or wake <= now):
                self._wake_at[i] = None
                self._inflight[i] = self._call(i, "step")
        if not self._inflight:
            self._sleep_until_a_wake(now, timeout)
            return outputs
        refs = list(self._inflight.values())
        ready, rest = self._ray.wait(refs, num_returns=1, timeout=timeout)
        if rest and ready:
            ready += self._ray.wait(rest, num_returns=len(rest), timeout=0)[0]
        by_ref = {ref: i for i, ref in self._inflight.items()}
        for ref in ready:
            i = by_ref[ref]
            del self._inflight[i]
            try:
                report = self._ray.get(ref)
            except self._ray.exceptions.RayActorError:
                if i not in self._down:
                    outputs += self._instance_died(i)
                continue
            outputs += self._apply(i, report)
            self.apply_results(i, report.results, self.now())  # the actor admitted moved requests itself
        return outputs

    def _sleep_until_a_wake(self, now: float, timeout: float | None) -> None:
        """Nothing runs and every instance with work waits for its wake-up time: sleep until
        the first (at most `timeout`), so neither the actors nor this loop spin meanwhile."""
        wakes = [w for i, w in enumerate(self._wake_at) if w is not None and self._busy[i] and i not in self._down]
        if wakes:
            pause = min(wakes) - now
            time.sleep(max(0.0, pause if timeout is None else min(pause, timeout)))

    def migrate(self, request_id: str, dst: int) -> bool:
        """Move a running request to instance `dst` at whatever token it has reached; it
        continues there without recomputation. False if it is not running anywhere (yet)."""
        src = self._where.get(request_id)
        ids = [k for k, v in self._rid.items() if v == request_id]
        if src is None or src == dst or dst in self._down or not ids:
            return False
        st = self._ray.get(self._call(src, "hand_off", ids[0]))
        return st is not None and self.core.migrate(st, src, dst, self.now(), handed_off=True)

    def _mark_busy(self, i: int) -> None:
        self._busy[i] = True
        self._wake_at[i] = None  # an event: step at once, as after a wake-up
        self._idle[i] = False
        if i in self._inflight:
            self._sent_during_step.add(i)

    def shutdown(self) -> None:
        for a in self.actors:
            self._ray.kill(a)

    def detach(self) -> list:
        """Give up the actors without stopping them, for another `RayCluster(actors=...)`:
        it reuses the processes and the model they have loaded."""
        actors, self.actors = self.actors, []
        return actors
