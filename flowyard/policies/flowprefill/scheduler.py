"""FlowPrefill's prefill-instance scheduler (FlowPrefill §5, Alg. 1 and 2).

Three pieces, named as in the paper:

- the **Request Queue** Q_w of prompts not yet in any execution task;
- the **Execution Pool**: at most one running task E and the preempted-task queue Q_p. A task
  is one batch of prefills run as one `StepPlan` that the executor may suspend at an operator
  boundary (`StepPlan.preempt_stride`) and resume later without recomputation;
- the **Scheduler**: event-driven. A round runs only when an event reaches the instance: an
  arrival (the executor calls `preempt_check`) or a completion or suspension (the executor
  calls `schedule`). It ranks everything by S-EDF priority, batches the winner with SLO-aware
  batching if it is a new request, and keeps E the highest-priority task.

The Request Queue and the Execution Pool are a prefill selector of the local scheduler core
(`local_core.LocalCore`, role PREFILL): the core admits requests, applies finished steps and
hands each request off when its prompt is done; `FlowPrefillSelector` decides what runs and when
to preempt (its configuration and the `Task` type: `flowprefill.task`). Nothing here reads a
clock or knows whether the step runs on a GPU or in the simulator: the same object drives both
executors.
"""

from __future__ import annotations

import itertools

from flowyard.core.kvcache import KVCacheManager
from flowyard.core.plan import PrefillSlice, StepPlan
from flowyard.core.request import RequestState
from flowyard.costmodel.base import LAYER_OPS, CostModel
from flowyard.policies.flowprefill.task import GRANULARITY_STRIDE, FlowPrefillConfig, FlowPrefillStats, Task
from flowyard.policies.framework.contracts import InstanceSnapshot, Role
from flowyard.policies.framework.local_core import LocalCore
from flowyard.policies.framework.parts import CoreView, admit_whole
from flowyard.policies.framework.selector import PrefillSelector
from flowyard.policies.framework.slack import TTFTPredictor, WaitingQueue, priority_key, slo_aware_batch


class FlowPrefillSelector(PrefillSelector):
    holds_partials = True

    def __init__(self, config: FlowPrefillConfig, predictor: CostModel) -> None:
        self.config = config
        self.predict = TTFTPredictor(predictor)
        self._stride = GRANULARITY_STRIDE[config.granularity]
        self._ops = predictor.num_layers * len(LAYER_OPS)
        self.waiting = WaitingQueue()  # Q_w, in arrival order
        self.preempted: list[Task] = []  # Q_p
        self.executing: Task | None = None  # E
        self._zombies: set[int] = set()  # aborted while inside a task: freed when it ends
        self.stats = FlowPrefillStats()
        self._seq = itertools.count()

    def bind(self, core: CoreView) -> None:
        if core.role is not Role.PREFILL:
            raise ValueError("FlowPrefill schedules prefill instances (PD disaggregation): its "
                             "operator-level preemption suspends prefill-only steps")
        super().bind(core)

    @property
    def kv(self) -> KVCacheManager:
        return self.core.kv

    # -- priorities ----------------------------------------------------------------------------
    def _key(self, st: RequestState, now: float, ttft_hat: float) -> tuple:
        return priority_key(self.config.priority, st.req, now, ttft_hat)

    def _task_key(self, task: Task, now: float) -> tuple:
        return self._key(task.head, now, task.predicted * task.remaining)

    def _request_key(self, st: RequestState, now: float) -> tuple:
        return self._key(st, now, self.predict.request(st))

    def _best(self, now: float) -> tuple[tuple, RequestState | Task] | None:
        """Highest-priority entry of Q_w and Q_p (one pass, no sort; vectorised on a long Q_w)."""
        best: tuple[tuple, RequestState | Task] | None = None
        if self.waiting.long:
            late, sd = self.waiting.keys(self.config.priority, now, self.predict)
            st = self.waiting.rows[self.waiting.best_row(late, sd)]
            best = (self._request_key(st, now), st)
        else:
            for st in self.waiting.values():
                k = self._request_key(st, now)
                if best is None or k < best[0]:
                    best = (k, st)
        for task in self.preempted:
            k = self._task_key(task, now)
            if best is None or k < best[0]:
                best = (k, task)
        return best

    # -- the event-driven round (Alg. 2) -------------------------------------------------------
    def preempt_check(self, now: float) -> bool:
        """Arrival while E runs: preempt E when something now outranks it (Alg. 2, line 16)."""
        self.stats.rounds += 1
        if self.executing is None or self._stride == 0:
            return False
        best = self._best(now)
        if best is None or not best[0] < self._task_key(self.executing, now):
            return False
        h = best[1]
        if isinstance(h, Task):
            return True
        # a new request only displaces E if its KV fits now (else E would just be resumed)
        return self.kv.blocks_needed(h.id, h.num_computed + self._slice(h)) <= self.kv.num_free_blocks

    def suspend(self, plan: StepPlan, ops_done: int, now: float) -> None:
        task = self.executing
        assert task is not None and task.plan is plan, "suspend: not the running task"
        plan.ops_done = ops_done
        self.executing = None
        self.preempted.append(task)
        self.stats.preemptions += 1

    def select(self, plan: StepPlan, now: float) -> StepPlan:
        """Completion or suspension left the pool idle: submit or resume the best task."""
        return self._round(now) or plan

    def _round(self, now: float) -> StepPlan | None:
        assert self.executing is None, "schedule() while a task runs"
        if self.waiting or self.preempted:  # rounds with something to decide
            self.stats.rounds += 1
        while True:
            best = self._best(now)
            if best is None:
                return None
            _, h = best
            if isinstance(h, Task):
                self.preempted.remove(h)
                self.stats.resumes += 1
                self.executing = h
                return h.plan
            task = self._submit(h, now) or self._holding_kv(now)
            if task is None:
                return None  # wait for a hand-off to free KV
            self.executing = task
            return task.plan

    def _holding_kv(self, now: float) -> Task | None:
        """H's KV does not fit: run the best of what already holds its KV (a preempted task, or
        a chunked prompt between chunks), so work that can finish is never stuck behind it."""
        best: tuple[tuple, RequestState | Task] | None = None
        for task in self.preempted:
            k = self._task_key(task, now)
            if best is None or k < best[0]:
                best = (k, task)
        for st in self.waiting.values():
            if st.num_computed and self.kv.num_held(st.id):
                k = self._request_key(st, now)
                if best is None or k < best[0]:
                    best = (k, st)
        if best is None:
            return None
        if isinstance(best[1], Task):
            self.preempted.remove(best[1])
            self.stats.resumes += 1
            return best[1]
        return self._submit(best[1], now)

    def _slice(self, st: RequestState) -> int:
        n = st.uncomputed
        return n if self.config.chunk_size is None else min(n, self.config.chunk_size)

    def _admit(self, st: RequestState, n: int, plan: StepPlan) -> bool:
        if not admit_whole(self.kv, st, n, plan):
            return False
        del self.waiting[st.id]
        return True

    def _submit(self, head: RequestState, now: float) -> Task | None:
        """SLO-aware batching (Alg. 1): H plus candidates, in priority order, while H's remaining
        time covers the predicted batch latency and the batch stays under the token budget G.
        The loop lives in `slo_aware_batch`, which ranks and prices a long Q_w in bulk (a round
        at 1,000 queued would otherwise sort 1,000 keys and price ~700 probes one by one)."""
        plan = StepPlan(preempt_stride=self._stride)
        if not self._admit(head, self._slice(head), plan):
            return None
        budget = self.config.batch_token_budget
        deadline = head.req.arrival + head.req.slo.ttft if head.req.slo.ttft is not None else float("inf")
        if budget != 0 and self.waiting:
            cands = self.waiting.candidates(self.config.priority, now, self.predict, self.config.chunk_size,
                                            None if budget is None else budget - plan.num_tokens)
            slo_aware_batch(plan, cands, deadline - now, budget, self.config.max_num_seqs, self.predict,
                            self._admit)
        self.stats.submits += 1
        self.stats.batched.append(len(plan.prefills))
        return Task(plan, head, self._ops, self.predict.step(plan))

    # -- applying results ------------------------------------------------------------------------
    def applied(self, plan: StepPlan) -> list[PrefillSlice]:
        """The task ended (completed its step): its slices, less those aborted meanwhile,
        whose KV is freed now that the forward pass no longer writes it."""
        task = self.executing
        assert task is not None and task.plan is plan, "update_from_output: not the running task"
        self.executing = None
        live = []
        for s in plan.prefills:
            if s.state.id in self._zombies:
                self._zombies.discard(s.state.id)
                self.kv.free(s.state.id)
            else:
                live.append(s)
        return live

    def chunk_done(self, st: RequestState) -> None:
        self.waiting[st.id] = st  # a chunk of a longer prompt: back to the queue

    # -- queue management ------------------------------------------------------------------------
    def add(self, st: RequestState, now: float) -> None:
        self.waiting[st.id] = st

    def _in_task(self, req_id: int) -> RequestState | None:
        for task in self._tasks():
            for s in task.plan.prefills:
                if s.state.id == req_id:
                    return s.state
        return None

    def remove(self, req_id: int) -> RequestState | None:
        st = self.waiting.pop(req_id, None)
        if st is not None:
            self.kv.free(req_id)
            return st
        # inside a task whose forward pass may still write its KV: free when it ends
        st = self._in_task(req_id)
        if st is None or req_id in self._zombies:
            return None
        self._zombies.add(req_id)
        self._drop_dead_tasks()
        return st

    def _drop_dead_tasks(self) -> None:
        """A parked task whose requests were all aborted is never resumed: free its KV now."""
        for task in list(self.preempted):
            ids = [s.state.id for s in task.plan.prefills]
            if all(i in self._zombies for i in ids):
                self.preempted.remove(task)
                for i in ids:
                    self._zombies.discard(i)
                    self.kv.free(i)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def held_running(self) -> int:
        return sum(len(t.plan.prefills) for t in self._tasks())

    def _tasks(self) -> list[Task]:
        return ([self.executing] if self.executing else []) + self.preempted

    def has_work(self) -> bool:
        return bool(self.waiting or self.preempted or self.executing)

    def fill(self, snap: InstanceSnapshot) -> None:
        in_tasks = [s for t in self._tasks() for s in t.plan.prefills]
        snap.num_running += len(in_tasks)
        snap.num_waiting = len(self.waiting)
        snap.waiting_tokens = sum(r.uncomputed for r in self.waiting.values()) + sum(s.n for s in in_tasks)
        snap.running_tokens += sum(s.state.seq_len for s in in_tasks)


class FlowPrefillScheduler(LocalCore):
    """FlowPrefill's prefill-instance scheduler: the core (role PREFILL) with its selector."""

    def __init__(self, instance: int, role: Role, kv: KVCacheManager, config: FlowPrefillConfig,
                 predictor: CostModel, *, max_model_len: int | None = None, max_repeats: int = 512) -> None:
        super().__init__(instance, role, kv, FlowPrefillSelector(config, predictor),
                         max_num_seqs=config.max_num_seqs, max_model_len=max_model_len, max_repeats=max_repeats)
