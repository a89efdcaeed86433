"""The one local scheduler: a MIXED-capable core plus a prefill-selection part.

Every policy's instances run a `LocalCore`. What differs between policies is configuration,
not subclasses:

- `role`: MIXED decodes what it prefilled; PREFILL hands a request off once its prompt is
  done (the KV stays until `release`); DECODE only takes migrations.
- `selector` (`selector.PrefillSelector`, seeing the core only as `parts.CoreView`): which
  prompts join a step and how much of them: chunked prefill composed of a budget rule, an
  order, admission, decode places and shedding (`chunked.ChunkedSelector`: vLLM, DynaServe's
  Alg. 2, flowyard), PLA-Serve's AWD short/long batches, FlowPrefill's SLO-aware batches with
  operator preemption.
- knobs: `max_num_seqs`, `max_model_len`, `max_repeats` (longest multi-step decode run a
  simulator may fold), `migration_patience_s` (DynaServe's deadlock breaker).

What the core does for all of them, once: decodes first (vLLM), KV growth with recompute
preemption of the most recently admitted running request, multi-step decode runs with KV
reserved ahead (`decode_run`), finishing, hand-offs and micro-request splits, migrations in and
out, and the instance monitor behind snapshots (token interval, busy time, TTFT SLO outcomes).
"""

from __future__ import annotations

from flowyard.core.kvcache import KVCacheManager, cdiv
from flowyard.core.plan import StepOutput, StepPlan
from flowyard.core.request import RequestState, Status
from flowyard.policies.framework.contracts import InstanceSnapshot, LocalScheduler, Role, StepResult
from flowyard.policies.framework.decode_run import reserve_run
from flowyard.policies.framework.migrations import Migrations
from flowyard.policies.framework.step_monitor import StepMonitor
from flowyard.policies.framework.selector import PrefillSelector


class LocalCore(LocalScheduler):
    def __init__(self, instance: int, role: Role, kv: KVCacheManager, selector: PrefillSelector, *,
                 max_num_seqs: int = 256, max_model_len: int | None = None, max_repeats: int = 512,
                 migration_patience_s: float | None = None) -> None:
        if max_num_seqs < 1 or max_repeats < 1:
            raise ValueError("max_num_seqs and max_repeats must be positive")
        self.instance, self.role, self.kv = instance, role, kv
        self.selector = selector
        self.max_num_seqs = max_num_seqs
        limit = kv.capacity_tokens
        self.max_model_len = min(limit, max_model_len or limit)
        self.max_repeats = max_repeats
        self.running: list[RequestState] = []  # admission order: decodes and started prompts
        self.migrations = Migrations(kv, max_num_seqs, migration_patience_s)
        self._handed_off: dict[int, RequestState] = {}  # prefill done, KV held until release
        self.last_preempted: list[RequestState] = []
        self.preempted = 0  # recompute preemptions so far
        self._run: StepPlan | None = None  # decode run in flight with KV reserved ahead
        self.monitor = StepMonitor()  # busy time, token interval, TTFT SLO outcomes
        selector.bind(self)

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, state: RequestState, now: float) -> bool:
        if state.req.prompt_len + 1 > self.max_model_len:
            state.status = Status.REJECTED
            state.reject_reason = (f"prompt of {state.req.prompt_len} tokens does not fit this "
                                   f"instance (max_model_len {self.max_model_len})")
            return False
        state.instance = self.instance
        state.status = Status.WAITING
        self.selector.add(state, now)
        return True

    def start(self, st: RequestState) -> None:
        """A selector admitted st into the running list (its KV grows there chunk by chunk)."""
        st.status = Status.RUNNING
        self.running.append(st)

    @property
    def num_waiting(self) -> int:
        return self.selector.num_waiting

    @property
    def num_running(self) -> int:
        return len(self.running) + self.selector.held_running()

    # -- scheduling ----------------------------------------------------------------------------
    def _preempt(self, victim: RequestState, plan: StepPlan, now: float) -> None:
        """Recompute preemption: drop the KV and requeue; outputs so far are kept. A victim
        already placed in this step's plan is taken out of it again."""
        self.running.remove(victim)
        self.kv.free(victim.id)
        if victim in plan.decodes:
            plan.decodes.remove(victim)
        plan.prefills = [s for s in plan.prefills if s.state is not victim]
        victim.num_computed = 0
        victim.status = Status.PREEMPTED
        victim.preemptions += 1
        self.preempted += 1
        self.selector.requeue(victim, now)
        self.last_preempted.append(victim)

    def grow(self, st: RequestState, total: int, plan: StepPlan, now: float = 0.0) -> bool:
        """Allocate KV for st up to total tokens, preempting from the back of running."""
        while not self.kv.allocate(st.id, total):
            victim = self.running[-1]
            self._preempt(victim, plan, now)
            if victim is st:
                return False
        return True

    def schedule(self, now: float) -> StepPlan | None:
        plan = StepPlan()
        self.last_preempted = []
        decodes = self.selector.decode_order([r for r in self.running if r.status is Status.RUNNING
                                              and not r.in_prefill], now)
        cap = self.selector.decode_cap(now, decodes)
        for st in decodes:
            if st.status is Status.RUNNING and len(plan.decodes) < cap:  # a grow may preempt one
                if self.grow(st, st.num_computed + 1, plan, now):
                    plan.decodes.append(st)
        plan = self.selector.select(plan, now)
        if plan.empty:
            self.monitor.idle()
            self.selector.idle()
            return None
        self.monitor.planned(now)
        if not plan.prefills and self.selector.allows_run() and not self.migrations.fits(len(self.running)):
            plan.max_repeats = reserve_run(self.kv, plan.decodes, self.max_repeats, self.max_model_len)
            self._run = plan if plan.max_repeats > 1 else None
        for s in plan.prefills:  # the end of its queueing (vLLM's request phases)
            if s.state.first_scheduled is None:
                s.state.first_scheduled = now
        self.selector.planned(plan, now)
        return plan

    def shorten(self, plan: StepPlan, steps: int) -> None:
        """The executor will run only `steps` of a decode run: free the KV reserved beyond."""
        for d in plan.decodes:
            self.kv.trim(d.id, d.num_computed + steps)
        plan.max_repeats = steps

    def wake_at(self, now: float) -> float | None:
        return self.selector.wake_at(now)

    def preempt_check(self, now: float) -> bool:
        return self.selector.preempt_check(now)

    def suspend(self, plan: StepPlan, ops_done: int, now: float) -> None:
        self.selector.suspend(plan, ops_done, now)

    # -- applying results ----------------------------------------------------------------------
    def advance(self, plan: StepPlan, out: StepOutput) -> None:
        """Apply the first out.steps steps of a decode run that goes on (the run was cut into
        pieces so a snapshot reflects the steps already done)."""
        self.selector.executed(plan, out)
        for d in plan.decodes:
            d.num_computed += out.steps
            d.record_tokens(out.end_times)
        self.monitor.steps(plan, out.end_times)
        plan.max_repeats -= out.steps

    def update_from_output(self, plan: StepPlan, out: StepOutput) -> StepResult:
        self.selector.executed(plan, out)
        self._run = None
        steps, times, sampled = out.steps, out.end_times, out.sampled
        result = StepResult(preempted=self.last_preempted)
        self.monitor.steps(plan, times)
        touched: list[RequestState] = []
        done_here: set[int] = set()  # queue-held prompts that finished here (not yet running)
        for d in plan.decodes:
            d.num_computed += steps
            d.record_tokens(times)
            if sampled is not None:
                d.output_tokens.extend(sampled.get(d.id, ()))
            if steps < plan.max_repeats:
                self.kv.trim(d.id, d.num_computed)
            self.kv.register(d)
            touched.append(d)
        held = self.selector.holds_partials
        for s in self.selector.applied(plan):
            st = s.state
            st.num_computed += s.n
            self.kv.register(st)
            if s.samples:
                st.record_tokens(times[:1])
                if sampled is not None:
                    st.output_tokens.extend(sampled.get(st.id, ()))
                self.monitor.first_token(st)
                touched.append(st)
                if held:
                    done_here.add(st.id)
            elif st.split_at is not None and st.num_computed >= st.split_at:
                touched.append(st)  # a micro-request's first segment ends inside the prompt
            elif held:
                st.status = Status.WAITING
                self.selector.chunk_done(st)
        removed = False
        for st in touched:
            split = st.split_at is not None and st.num_computed >= st.split_at
            if st.num_output and (st.done or st.id in out.stopped or st.seq_len >= self.max_model_len):
                self._finish(st)
                result.finished.append(st)
                removed = True
            elif self.role is Role.PREFILL or split:
                st.split_at = None  # the rest runs on the next instance as a plain request
                st.status = Status.MIGRATING
                self._handed_off[st.id] = st
                result.handoffs.append(st)
                removed = True
            else:
                if st.id in done_here:
                    self.start(st)  # a queue-held prompt is done: it decodes here now
                if st.num_output == 1:
                    result.prefilled.append(st)
        if removed:
            self.running = [r for r in self.running if r.status is Status.RUNNING]
        return result

    def _finish(self, st: RequestState) -> None:
        st.status = Status.FINISHED
        st.finish_time = float(st.token_times[-1][-1]) if st.token_times else None
        self.kv.free(st.id)

    # -- migration -----------------------------------------------------------------------------
    def add_migration(self, state: RequestState, now: float) -> None:
        if self.role is Role.PREFILL:
            raise ValueError(f"prefill instance {self.instance} does not take migrations")
        self.migrations.add(state, now)

    def admit_migrations(self, now: float) -> list[RequestState]:
        return self.migrations.admit(len(self.running), now)

    def migration_arrived(self, state: RequestState, now: float) -> None:
        self.migrations.arrived(state)
        state.instance = self.instance
        state.status = Status.RUNNING
        self.running.append(state)

    @property
    def recomputed(self) -> int:
        return self.migrations.recomputed

    def hand_off(self, req_id: int) -> RequestState | None:
        """Stop running a request here without freeing its KV, so it can continue on another
        instance from exactly where it is (mid-prefill, at prefill end, or mid-decode). Only
        between steps; a request with nothing computed yet is simply re-routed instead."""
        st = next((r for r in self.running if r.id == req_id), None)
        if st is None or st.num_computed == 0:
            return None
        self.running.remove(st)
        st.status = Status.MIGRATING
        self._handed_off[st.id] = st
        return st

    def release(self, req_id: int) -> None:
        del self._handed_off[req_id]
        self.kv.free(req_id)

    def abort(self, req_id: int) -> RequestState | None:
        st = next((r for r in self.running if r.id == req_id), None)
        if st is not None:
            self.running.remove(st)
        else:
            st = self.migrations.remove(req_id) or self._handed_off.pop(req_id, None)
        if st is not None:
            self.kv.free(req_id)
        else:  # queued: the selector frees what it holds (or defers it while a step writes it)
            st = self.selector.remove(req_id)
            if st is None:
                return None
        st.status = Status.ABORTED
        return st

    # -- views ---------------------------------------------------------------------------------
    def _reserved_ahead(self) -> int:
        """Blocks a decode run holds for steps after the one in flight: free as far as a
        step-by-step scheduler is concerned, so snapshots count them as free."""
        if self._run is None:
            return 0
        bs = self.kv.block_size
        return sum(self.kv.num_held(d.id) - cdiv(d.num_computed + 1, bs) for d in self._run.decodes)

    def has_work(self) -> bool:
        return bool(self.running or self.migrations or self._handed_off
                    or self.selector.has_work())

    def snapshot(self) -> InstanceSnapshot:
        # in_prefill and seq_len written out: global policies take a snapshot of every
        # instance that changed, on every arrival
        partial = tokens = 0
        for r in self.running:
            seq = r.req.prompt_len + r.num_output
            tokens += seq
            if seq - r.num_computed > 1 or r.num_output == 0:
                partial += 1
        m = self.monitor
        snap = InstanceSnapshot(
            instance=self.instance, role=self.role, num_running=len(self.running), num_waiting=0,
            waiting_tokens=0, running_tokens=tokens,
            kv_free_blocks=self.kv.num_free_blocks + self._reserved_ahead(),
            kv_total_blocks=self.kv.num_blocks, block_size=self.kv.block_size,
            num_migrating_in=len(self.migrations), incoming_tokens=self.migrations.tokens(),
            num_decoding=len(self.running) - partial, token_interval=m.token_interval or 0.0,
            busy_s=m.busy_s, slo_done=m.slo_done, slo_late=m.slo_late,
        )
        self.selector.fill(snap)
        return snap
