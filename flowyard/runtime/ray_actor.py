"""What runs inside each Ray actor process: one engine with the policy's local scheduler.

The actor is asynchronous so that the driver never waits on a busy instance and so that an
arrival reaches a step in flight: `add_request`, `abort` and `put` only append to an inbox;
everything that touches the engine runs on one worker thread, which drains the inbox before
each action. What the driver must log (a refusal, a preemption signal) and the KV the source
still holds for a moved request (released when this instance has imported it) travel back
with the next step's `StepReport`. Ray does not keep the order of calls to an async actor, so the driver numbers
its calls to each actor and every call waits for its turn. During a preemptible step (FlowPrefill) the engine calls
`_at_boundary` between operators, which takes in new requests there, so they can preempt
the running prefill exactly as in one process; anything else waits for the step's end.
"""

from __future__ import annotations

import asyncio
import collections
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from flowyard.cluster.timeline import Timeline
from flowyard.core.request import RequestState
from flowyard.engine.engine_config import EngineConfig
from flowyard.engine.llm_engine import LLMEngine, TrackedRequest
from flowyard.engine.sampling import RequestOutput, SamplingParams
from flowyard.policies.framework.contracts import InstanceSnapshot, StepResult
from flowyard.runtime.lockstep import LockstepActor
from flowyard.runtime.ray_reports import (StepCounters, StepReport, import_kv_chunks,  # noqa: F401 - import_kv_chunks: tests
                                          kv_payload, kv_tensor)


class EngineActor(LockstepActor):
    def __init__(self, model: str | None, config: EngineConfig, instance: int, policy: Any, t0: float,
                 lockstep: bool = False) -> None:
        """lockstep: the driver steps this actor one step at a time on its own clock
        (`flowyard.runtime.lockstep`); otherwise it steps whenever asked, on the wall clock."""
        import torch

        torch.set_num_threads(max(1, config.threads or 1))
        self._base = LLMEngine.from_path(model, config)
        self._base.warm_up()  # as `flowyard serve` warms its engine: the first client pays no setup
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="flowyard-instance")
        self._setup(config, instance, policy, t0, lockstep)

    async def reset(self, config: EngineConfig, instance: int, policy: Any, t0: float, lockstep: bool) -> None:
        """Serve a new driver (another policy, configuration or clock) with the model already
        loaded: everything else starts afresh. The previous driver has stopped calling."""
        await asyncio.get_running_loop().run_in_executor(self._worker, self._setup, config, instance, policy, t0,
                                                         lockstep)

    def _setup(self, config: EngineConfig, instance: int, policy: Any, t0: float, lockstep: bool) -> None:
        base = self._base
        self.vnow = 0.0  # lockstep: the driver's clock, as of its last call
        self.engine = LLMEngine(base.model, base.tokenizer, config, base.model_name, instance=instance,
                                role=policy.roles[instance], t0=0.0 if lockstep else t0,
                                clock=(lambda: self.vnow) if lockstep else None,
                                scheduler=lambda kv, max_len: policy.make_local(
                                    instance, kv, max_model_len=max_len, single_step=True))
        self.engine.boundary_hook = self._at_boundary
        self.inbox: collections.deque = collections.deque()
        self.pending: list[tuple[RequestState, list]] = []  # migrations waiting for KV room
        self.errors: list[RequestOutput] = []  # refusals and lost migrations, sent with the next step
        self.arriving: list[tuple[str, Any]] = []  # (request id, the source's `take`) not there yet
        self.trace = Timeline()  # steps and KV imports since the last report
        self._src: dict[int, int] = {}  # migrating request -> the instance its KV comes from
        self.held: set[int] = set()  # requests taken from here whose KV stays until the driver releases it
        self.released_early: set[int] = set()  # released before their `take` ran (see _apply_release)
        self.events: list[tuple] = []  # for the driver's decision log (see StepReport)
        self.admitted: list[tuple[int, int]] = []
        self._next = 0  # number of the driver's next call
        self._applied = -1  # call number of the last add_request taken into the engine
        self._turns: asyncio.Condition | None = None
        if lockstep:
            self._lockstep_hooks()

    async def _turn(self, seq: int) -> None:
        """Wait until every call the driver made before this one has started."""
        if self._turns is None:
            self._turns = asyncio.Condition()
        async with self._turns:
            await self._turns.wait_for(lambda: self._next == seq)
            self._next += 1
            self._turns.notify_all()

    async def _run(self, seq: int, fn, *args):
        await self._turn(seq)
        return await asyncio.get_running_loop().run_in_executor(self._worker, fn, *args)

    # -- commands: queued in call order, applied by the worker ---------------------------------
    async def add_request(self, seq: int, rid: str, state: RequestState, params: SamplingParams) -> None:
        await self._turn(seq)
        self.inbox.append(("add", rid, state, params, seq))

    async def abort(self, seq: int, rid: str) -> None:
        await self._turn(seq)
        self.inbox.append(("abort", rid))

    async def release(self, seq: int, req_id: int) -> None:
        """Free the KV of a request taken from here: its destination has imported it."""
        await self._turn(seq)
        self.inbox.append(("release", req_id))

    async def put(self, seq: int, rid: str, payload: list) -> None:
        """Take in a migrated request: [the source's `take`], by reference, so this call never
        waits for the source; the KV is imported once it is in the object store."""
        await self._turn(seq)
        self.inbox.append(("put", rid, payload[0]))

    # -- calls that answer -----------------------------------------------------------------------
    async def info(self) -> tuple[str, int]:
        return self.engine.model_name, self.engine.max_model_len

    async def tokenizer(self):
        return self.engine.tokenizer

    async def watch(self) -> None:
        """Never returns: the driver keeps one call outstanding, which Ray fails with
        RayActorError the moment this actor dies (a death notification that needs no traffic)."""
        await asyncio.Event().wait()

    async def snapshot(self, seq: int) -> InstanceSnapshot:
        return await self._run(seq, self._snapshot)

    async def step(self, seq: int) -> StepReport:
        return await self._run(seq, self._step)

    async def hand_off(self, seq: int, req_id: int) -> RequestState | None:
        """Stop running a request here, keeping its KV for a migration (any token position)."""
        return await self._run(seq, self._hand_off, req_id)

    async def take(self, seq: int, req_id: int, fields: dict, keep: bool = True,
                   chunk_blocks: int = 16) -> tuple[dict, list] | None:
        """Give up a handed-off request: its record (with the driver's `fields` decisions) and
        its KV blocks in chunks of `chunk_blocks` blocks, each its own object in the store.
        keep: the blocks stay allocated here until `release` (the destination admitted it);
        otherwise (the request continues here) they are freed now."""
        return await self._run(seq, self._take, req_id, fields, keep, chunk_blocks)

    # -- on the worker thread --------------------------------------------------------------------
    def _snapshot(self) -> InstanceSnapshot:
        self._drain()
        return self.engine.scheduler.snapshot()

    def _step(self, admit: bool = True) -> StepReport:
        """One engine step, then (admit) the migrations that now have room. In lockstep the
        driver admits them itself, after it has routed what this step produced."""
        import ray

        self._drain()
        e = self.engine
        if self.arriving and not e.has_unfinished():  # only waiting for KV: do not spin
            ray.wait([ref for _, ref in self.arriving], num_returns=1, timeout=0.01)
            self._drain()
        outputs, self.errors = self.errors, []
        start, preempted = e.now(), e.pool.stats.count
        e.last_plan = None
        if e.has_unfinished():
            outputs += e.step()
        if e.last_plan is not None:  # for the driver's timeline, in the cluster's clock
            self.trace.step(e.instance, start, e.now(), e.last_plan, preempted=e.pool.stats.count > preempted)
        results, e.results = e.results, []
        idle = e.idle and not results and not self.arriving and not self.inbox
        if admit:
            self._admit()
        return self._report(outputs, results, idle)

    def _report(self, outputs: list[RequestOutput], results: list[StepResult], idle: bool = False) -> StepReport:
        e = self.engine
        outputs, self.errors = outputs + self.errors, []
        busy = e.has_unfinished() or bool(self.inbox) or bool(self.arriving)
        trace, self.trace = self.trace, Timeline()
        events, self.events = self.events, []
        admitted, self.admitted = self.admitted, []
        # The prefix cache lives in this process: its counters travel with every step so that
        # the driver's /metrics (vllm:prefix_cache_queries/hits) sees them. `adds_applied` tells
        # the driver which of its adds this snapshot already counts (the rest reached the inbox
        # during the step, or are still on their way), so it counts those in itself.
        counters = StepCounters(getattr(e.kv, "queries", 0), getattr(e.kv, "hits", 0), self._applied)
        wake = e.wake_time if idle else None
        return StepReport(outputs, results, e.scheduler.snapshot(), busy, e.preemption_stats, trace.steps,
                          trace.transfers, events, admitted, idle, wake, counters,
                          None if wake is None else max(0.0, wake - e.now()))

    def _at_boundary(self) -> None:
        """New requests, and KV releases, which concern requests that left long ago: a release
        ahead of an add held every arrival to the step's end on a prefill instance whose KV moves
        out after each prompt, so FlowPrefill on Ray all but never preempted (issue 30)."""
        self._drain(only_adds=True)

    def _drain(self, only_adds: bool = False) -> None:
        if self.arriving and not only_adds:
            self._receive()
        while self.inbox:
            if only_adds and self.inbox[0][0] not in ("add", "release"):
                return  # keep the order of an abort or a migration and what follows it
            cmd = self.inbox.popleft()
            getattr(self, "_apply_" + cmd[0])(*cmd[1:])

    def _apply_add(self, rid: str, state: RequestState, params: SamplingParams, seq: int | None = None) -> None:
        """seq: the driver's call number of this add (None in lockstep, where the driver reads a
        fresh snapshot after every add)."""
        if seq is not None:
            self._applied = seq
        e = self.engine
        signalled = e.pool.signalled
        try:
            e.add_tracked(e.track(rid, state, params))
        except ValueError as err:
            self.events.append(("reject", e.now(), state.id, str(err)))
            self.errors.append(RequestOutput(rid, finished=True, finish_reason="rejected", error=str(err)))
            return
        if e.pool.signalled and not signalled:  # it preempts the prefill in flight here
            self.events.append(("preempt", e.now(), e.pool.ops))

    def _apply_release(self, req_id: int) -> None:
        """A release can overtake its `take`: commands reach the inbox as soon as their turn
        comes, while a take waits for the worker, and the take's own drain applies what came
        meanwhile (the driver releases at once when the destination dies right after a move).
        Then the take must not keep the KV it is told, before it runs, to free."""
        if req_id in self.held:
            self.held.discard(req_id)
            self.engine.scheduler.release(req_id)
        elif self.engine.holds(req_id):
            self.released_early.add(req_id)

    def _apply_abort(self, rid: str) -> None:
        t = self.engine.tracked(rid)
        if t is not None:
            self.pending = [(st, kv) for st, kv in self.pending if st.id != t.state.id]
        self.engine.abort(rid)

    def _apply_put(self, rid: str, ref: Any) -> None:
        self.arriving.append((rid, ref))
        self._receive()

    def _receive(self, block: bool = False) -> None:
        """Take in the migrations whose record has reached the object store (block: wait for
        all of them). One whose source died on the way fails with a clear error."""
        import ray

        refs = [ref for _, ref in self.arriving]
        ready = set(ray.wait(refs, num_returns=len(refs), timeout=None if block else 0)[0])
        waiting = []
        for rid, ref in self.arriving:
            if ref not in ready:
                waiting.append((rid, ref))
                continue
            try:
                payload = ray.get(ref)
            except ray.exceptions.RayError as err:
                self.errors.append(RequestOutput(rid, finished=True, finish_reason="error", retry_after=1.0, error=(
                    f"the instance handing this request over failed; its KV cache was lost ({type(err).__name__}); "
                    "retry")))
                continue
            if payload is not None:  # None: it finished or was aborted before it could leave
                self._attach(payload)
        self.arriving = waiting

    def _attach(self, payload: tuple[dict, list]) -> None:
        import torch

        from flowyard.engine.tokenizer import IncrementalDetokenizer

        record, kv = payload
        e = self.engine
        st = record["state"]
        detok = IncrementalDetokenizer(e.tokenizer)
        detok.ids, detok.prefix_offset, detok.read_offset, detok.text = record["detok"]
        gen = None
        if record["generator"] is not None:
            gen = torch.Generator()
            gen.set_state(record["generator"])
        e.attach(TrackedRequest(record["request_id"], st, record["params"], detok, gen, text=record["text"],
                                emitted=record["emitted"], emitted_tokens=record["emitted_tokens"]))
        e.scheduler.add_migration(st, e.now())
        self.pending.append((st, kv))
        self._src[st.id] = record["src"]

    def _hand_off(self, req_id: int) -> RequestState | None:
        self._drain()
        if not self.engine.holds(req_id):
            return None
        return self.engine.scheduler.hand_off(req_id)

    def _take(self, req_id: int, fields: dict, keep: bool, chunk_blocks: int) -> tuple[dict, list] | None:
        import ray

        self._drain()
        e = self.engine
        if not e.holds(req_id):
            return None  # finished or aborted meanwhile
        t = e.detach(req_id)
        st = t.state
        for k, v in fields.items():
            setattr(st, k, v)
        table = e.kv.block_table(st.id)[: -(-st.num_computed // e.kv.block_size)]
        kv = [ray.put(kv_payload(e.runner.export_kv(table[i:i + chunk_blocks])))
              for i in range(0, len(table), chunk_blocks)]
        # the Transport contract: the source frees the KV once the destination admits it
        if keep and st.id not in self.released_early:
            self.held.add(st.id)
        else:
            self.released_early.discard(st.id)
            e.scheduler.release(st.id)
        record = {"request_id": t.request_id, "state": st, "params": t.params, "text": t.text, "src": e.instance,
                  "emitted": t.emitted, "emitted_tokens": t.emitted_tokens,
                  "generator": None if t.generator is None else t.generator.get_state(),
                  "detok": (t.detok.ids, t.detok.prefix_offset, t.detok.read_offset, t.detok.text)}
        return record, kv

    def _admit(self) -> None:
        """Import the KV of migrations this instance has room for, chunk by chunk in block
        order. KV lost on the way (its source died) fails that request with a clear error."""
        import ray

        e = self.engine
        kv_of = {st.id: kv for st, kv in self.pending}
        for st in e.scheduler.admit_migrations(e.now()):
            t0, src = e.now(), self._src.pop(st.id, -1)
            self.admitted.append((st.id, src))  # imported or lost: the source may free its copy
            try:
                import_kv_chunks(e.runner, e.kv.block_table(st.id), kv_of.pop(st.id), st.num_computed,
                                 lambda ref: kv_tensor(ray.get(ref)))
            except Exception as err:  # noqa: BLE001 - any loss of the KV objects
                rid = e.tracked_by_id(st.id).request_id
                e.scheduler.migration_arrived(st, e.now())
                e.abort(rid)
                self.errors.append(RequestOutput(rid, finished=True, finish_reason="error", retry_after=1.0, error=(
                    f"the request's KV cache was lost in transfer from instance {src}, which went down "
                    f"({type(err).__name__}); retry")))
                continue
            e.scheduler.migration_arrived(st, e.now())
            self.trace.transfer(st.id, src, e.instance, t0, e.now())
        self.pending = [(st, kv) for st, kv in self.pending if st.id in kv_of]
