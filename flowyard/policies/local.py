"""Continuous batching with (optionally chunked) prefill: the local scheduler of the baselines.

One class covers vLLM's colocated scheduler, DistServe's prefill and decode instances and the
chunked-prefill + EDF variants, because they differ only in role, token budget, chunking and
queue order. It follows vLLM v1's scheduler: running requests first (decodes, then partial
prefills), then waiting requests while the token budget, `max_num_seqs` and KV allow; when a
running request cannot get a KV block, the most recently admitted running request is preempted
and later recomputed.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

import numpy as np

from flowyard.core.kvcache import KVCacheManager, cdiv
from flowyard.core.plan import PrefillSlice, StepOutput, StepPlan
from flowyard.core.request import RequestState, Status
from flowyard.policies.base import InstanceSnapshot, LocalScheduler, Role, StepResult
from flowyard.policies.decode_run import reserve_run

INF = float("inf")
TOKEN_INTERVAL_ALPHA = 0.1  # EWMA weight of one decode step in the monitor's token interval


@dataclass(frozen=True, slots=True)
class BatchConfig:
    """Knobs of `BatchScheduler`, named as in vLLM where vLLM has them."""

    max_num_batched_tokens: int = 2048  # token budget of one step (the chunk size)
    max_num_seqs: int = 256
    chunked_prefill: bool = True  # False: a prompt runs whole (alone if over the budget)
    order: str = "fcfs"  # "fcfs", "edf" (earliest TTFT deadline first) or "priority" (vLLM's)
    max_model_len: int | None = None  # sequences stop ("length") when they reach it
    max_repeats: int = 512  # longest decode-only run promised in one plan

    def __post_init__(self) -> None:
        if self.order not in ("fcfs", "edf", "priority"):
            raise ValueError(f"order must be 'fcfs', 'edf' or 'priority', got {self.order!r}")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1 or self.max_repeats < 1:
            raise ValueError("token budget, max_num_seqs and max_repeats must be positive")


class BatchScheduler(LocalScheduler):
    def __init__(self, instance: int, role: Role, kv: KVCacheManager, config: BatchConfig) -> None:
        self.instance = instance
        self.role = role
        self.kv = kv
        self.config = config
        limit = kv.capacity_tokens
        self.max_model_len = min(limit, config.max_model_len or limit)
        self._waiting: list[tuple[tuple[float, ...], int, RequestState, int]] = []
        self._waiting_tokens = 0
        self._seq = itertools.count()
        self.running: list[RequestState] = []
        self._migrations: list[RequestState] = []  # want to come here, no KV reserved yet
        self._incoming: dict[int, RequestState] = {}  # KV reserved, transfer in flight
        self._handed_off: dict[int, RequestState] = {}  # prefill done, KV held until release
        self.last_preempted: list[RequestState] = []
        self._run: StepPlan | None = None  # decode run in flight with KV reserved ahead
        # Instance monitor (Arrow): EWMA of the time between consecutive steps that decode
        self._plan_start: float | None = None  # `now` of the last schedule() that made a plan
        self._decode_end: float | None = None  # end of the last step that decoded, None after a gap
        self._token_interval: float | None = None

    # -- queue -----------------------------------------------------------------------------
    def _key(self, st: RequestState) -> tuple[float, ...]:
        """Queue order. Ties on time break by request id (ids grow with arrival order in both
        executors), so a preempted request goes back ahead of later arrivals, as in vLLM."""
        req = st.req
        if self.config.order == "edf":
            deadline = req.arrival + req.slo.ttft if req.slo.ttft is not None else INF
            return (deadline, req.arrival, req.id)
        if self.config.order == "priority":  # vLLM's priority scheduling: lower value first
            return (req.priority, req.arrival, req.id)
        return (req.arrival, req.id)

    def _push_waiting(self, st: RequestState) -> None:
        heapq.heappush(self._waiting, (self._key(st), next(self._seq), st, st.uncomputed))
        self._waiting_tokens += st.uncomputed

    def _pop_waiting(self) -> RequestState:
        _, _, st, tokens = heapq.heappop(self._waiting)
        self._waiting_tokens -= tokens
        return st

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def add_request(self, state: RequestState, now: float) -> bool:
        need = state.req.prompt_len + 1
        if need > self.max_model_len:
            state.status = Status.REJECTED
            state.reject_reason = (
                f"prompt of {state.req.prompt_len} tokens does not fit this instance "
                f"(max_model_len {self.max_model_len})"
            )
            return False
        state.instance = self.instance
        state.status = Status.WAITING
        self._push_waiting(state)
        return True

    # -- scheduling ------------------------------------------------------------------------
    def _preempt(self, victim: RequestState, plan: StepPlan) -> None:
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
        self._push_waiting(victim)
        self.last_preempted.append(victim)

    def _grow(self, st: RequestState, total: int, plan: StepPlan) -> bool:
        """Allocate KV for st up to total tokens, preempting from the back of running."""
        while not self.kv.allocate(st.id, total):
            victim = self.running[-1]
            self._preempt(victim, plan)
            if victim is st:
                return False
        return True

    def schedule(self, now: float) -> StepPlan | None:
        cfg = self.config
        plan = StepPlan()
        self.last_preempted = []
        # 1. running requests in admission order: decodes, then partial prefills
        for st in [r for r in self.running if not r.in_prefill]:
            if st.status is Status.RUNNING and len(plan.decodes) < cfg.max_num_batched_tokens:
                if self._grow(st, st.num_computed + 1, plan):
                    plan.decodes.append(st)
        for st in [r for r in self.running if r.in_prefill]:
            budget = cfg.max_num_batched_tokens - plan.num_tokens
            if st.status is not Status.RUNNING or budget <= 0:
                continue
            n = self._chunk(self._want(st), budget, plan)
            if n and self._grow(st, st.num_computed + n, plan):
                plan.prefills.append(PrefillSlice(st, st.num_computed, n))
        # 2. waiting requests in queue order, head-of-line blocking
        budget = cfg.max_num_batched_tokens - plan.num_tokens
        while self._waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
            st = self._waiting[0][2]
            cached = self.kv.match_prefix(st) if st.num_computed == 0 else 0
            st.num_computed += cached
            n = self._chunk(self._want(st), budget, plan)
            if not n or not self.kv.allocate(st.id, st.num_computed + n):
                if cached:  # give the shared prefix back; it is matched again next time
                    self.kv.free(st.id)
                    st.num_computed = 0
                break
            self._pop_waiting()
            st.status = Status.RUNNING
            self.running.append(st)
            plan.prefills.append(PrefillSlice(st, st.num_computed, n))
            budget -= n
        if plan.empty:
            self._decode_end = None  # idle: the next decode's interval starts at its plan
            return None
        self._plan_start = now
        if not plan.prefills and not self._migration_fits():
            plan.max_repeats = self._reserve_run(plan)
            self._run = plan if plan.max_repeats > 1 else None
        return plan

    @staticmethod
    def _want(st: RequestState) -> int:
        """Tokens to compute next: the rest of the sequence, or up to a micro-request's split."""
        if st.split_at is not None and st.num_computed < st.split_at:
            return min(st.uncomputed, st.split_at - st.num_computed)
        return st.uncomputed

    def _chunk(self, want: int, budget: int, plan: StepPlan) -> int:
        if self.config.chunked_prefill:
            return min(want, budget)
        if want <= budget or plan.empty:
            return want  # an over-budget prompt runs whole, alone
        return 0

    def _migration_fits(self) -> bool:
        """Whether a pending migration could be admitted at the end of the next step; if so the
        scheduler must get control back then, so no multi-step run is promised."""
        if not self._migrations:
            return False
        head = self._migrations[0]
        if len(self.running) + len(self._incoming) >= self.config.max_num_seqs:
            return False
        return self.kv.blocks_needed(head.id, head.num_computed + 1) <= self.kv.num_free_blocks

    def _reserve_run(self, plan: StepPlan) -> int:
        return reserve_run(self.kv, plan.decodes, self.config.max_repeats, self.max_model_len)

    def shorten(self, plan: StepPlan, steps: int) -> None:
        """The executor will run only `steps` of a decode run: free the KV reserved beyond."""
        for d in plan.decodes:
            self.kv.trim(d.id, d.num_computed + steps)
        plan.max_repeats = steps

    # -- applying results ------------------------------------------------------------------
    def advance(self, plan: StepPlan, out: StepOutput) -> None:
        """Apply the first out.steps steps of a decode run that goes on (the run was cut into
        pieces so a snapshot reflects the steps already done)."""
        for d in plan.decodes:
            d.num_computed += out.steps
            d.record_tokens(out.end_times)
        self._note_steps(plan, out.end_times)
        plan.max_repeats -= out.steps

    def _note_steps(self, plan: StepPlan, times) -> None:
        """Monitor: fold the token intervals of these steps into the EWMA. An interval is the
        time from the previous decoding step's end (or from this plan's start, when the step
        before did not decode) to this step's end: what a decoding user waits per token."""
        if not plan.decodes or not len(times):
            self._decode_end = None
            return
        prev = self._decode_end if self._decode_end is not None else self._plan_start
        if prev is None:
            prev = float(times[0])  # a plan made elsewhere: no start to measure from
        a = TOKEN_INTERVAL_ALPHA
        if len(times) == 1:
            x = float(times[0]) - prev
            e = self._token_interval
            self._token_interval = x if e is None else (1 - a) * e + a * x
        else:
            xs = np.diff(np.concatenate(([prev], np.asarray(times, dtype=float))))
            k = len(xs)
            e = self._token_interval if self._token_interval is not None else float(xs[0])
            w = a * (1 - a) ** np.arange(k - 1, -1, -1)
            self._token_interval = float((1 - a) ** k * e + w @ xs)
        self._decode_end = float(times[-1])

    def update_from_output(self, plan: StepPlan, out: StepOutput) -> StepResult:
        self._run = None
        steps = out.steps
        times = out.end_times
        result = StepResult(preempted=self.last_preempted)
        sampled = out.sampled
        self._note_steps(plan, times)
        touched: list[RequestState] = []
        for d in plan.decodes:
            d.num_computed += steps
            d.record_tokens(times)
            if sampled is not None:
                d.output_tokens.extend(sampled.get(d.id, ()))
            if steps < plan.max_repeats:
                self.kv.trim(d.id, d.num_computed)
            self.kv.register(d)
            touched.append(d)
        for s in plan.prefills:
            st = s.state
            st.num_computed += s.n
            self.kv.register(st)
            if s.samples:
                st.record_tokens(times[:1])
                if sampled is not None:
                    st.output_tokens.extend(sampled.get(st.id, ()))
                touched.append(st)
            elif st.split_at is not None and st.num_computed >= st.split_at:
                touched.append(st)  # a micro-request's first segment ends inside the prompt
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
            elif st.num_output == 1:
                result.prefilled.append(st)
        if removed:
            self.running = [r for r in self.running if r.status is Status.RUNNING]
        return result

    def _finish(self, st: RequestState) -> None:
        st.status = Status.FINISHED
        st.finish_time = float(st.token_times[-1][-1]) if st.token_times else None
        self.kv.free(st.id)

    # -- migration -------------------------------------------------------------------------
    def add_migration(self, state: RequestState, now: float) -> None:
        state.status = Status.MIGRATING
        self._migrations.append(state)

    def admit_migrations(self, now: float) -> list[RequestState]:
        admitted = []
        while self._migrations and len(self.running) + len(self._incoming) < self.config.max_num_seqs:
            st = self._migrations[0]
            if not self.kv.allocate(st.id, st.num_computed + 1):
                break
            self._migrations.pop(0)
            self._incoming[st.id] = st
            admitted.append(st)
        return admitted

    def migration_arrived(self, state: RequestState, now: float) -> None:
        del self._incoming[state.id]
        state.instance = self.instance
        state.status = Status.RUNNING
        self.running.append(state)

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
        for st in list(self.running) + [w[2] for w in self._waiting] + self._migrations:
            if st.id == req_id:
                break
        else:
            st = self._incoming.pop(req_id, None) or self._handed_off.pop(req_id, None)
            if st is None:
                return None
        if st in self.running:
            self.running.remove(st)
        if st in self._migrations:
            self._migrations.remove(st)
        entries = [w for w in self._waiting if w[2] is not st]
        if len(entries) != len(self._waiting):
            self._waiting_tokens -= next(w[3] for w in self._waiting if w[2] is st)
            self._waiting = entries
            heapq.heapify(self._waiting)
        self.kv.free(req_id)
        st.status = Status.ABORTED
        return st

    # -- views -----------------------------------------------------------------------------
    def _reserved_ahead(self) -> int:
        """Blocks a decode run holds for steps after the one in flight: free as far as a
        step-by-step scheduler is concerned, so snapshots count them as free."""
        if self._run is None:
            return 0
        bs = self.kv.block_size
        return sum(self.kv.num_held(d.id) - cdiv(d.num_computed + 1, bs) for d in self._run.decodes)

    def has_work(self) -> bool:
        return bool(self.running or self._waiting or self._migrations or self._incoming or self._handed_off)

    def snapshot(self) -> InstanceSnapshot:
        partial = [(r.num_computed, r.uncomputed) for r in self.running if r.in_prefill]
        return InstanceSnapshot(
            instance=self.instance,
            role=self.role,
            num_running=len(self.running),
            num_waiting=len(self._waiting),
            waiting_tokens=self._waiting_tokens + sum(n for _, n in partial),
            running_tokens=sum(r.seq_len for r in self.running),
            kv_free_blocks=self.kv.num_free_blocks + self._reserved_ahead(),
            kv_total_blocks=self.kv.num_blocks,
            block_size=self.kv.block_size,
            num_migrating_in=len(self._migrations) + len(self._incoming),
            incoming_tokens=sum(r.seq_len for r in self._migrations)
            + sum(r.seq_len for r in self._incoming.values()),
            prefill_queue=tuple(partial) + tuple((w[2].num_computed, w[3]) for w in self._waiting),
            num_decoding=len(self.running) - len(partial),
            token_interval=self._token_interval or 0.0,
        )
