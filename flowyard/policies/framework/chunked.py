"""Chunked prefill as a composition of parts (`parts`): the prefill selector of vLLM, DynaServe,
flowyard and every baseline on MIXED or PREFILL instances.

`ChunkedSelector(budget, order=..., admission=..., places=..., shedding=..., together=...)`:

- the **budget rule** gives each step's token budget as a value before the decodes are placed
  (an int is vLLM's fixed budget);
- the **order** ranks the queued prompts (FCFS, EDF, priority, S-EDF, D-EDF);
- **vLLM's rule** (`together=False`): started prompts (in the core's running list) continue
  first, then queued ones in order with head-of-line blocking, while the budget,
  `max_num_seqs` and KV allow. **Ranked together** (`together=True`, flowyard; only under a
  slack order, static orders keep vLLM's rule): started and queued prompts are ranked in one
  queue at every step, so a started prompt that ranks lower gets no chunk this step and keeps
  its KV (chunk-level preemption); the `shedding` part may give some up first, and
  `admission.park` lets prompts start while more than max_num_seqs requests run;
- the **decode places** pick the decodes that join a step when more hold KV than there are
  places; the **admission** says whether a chunk may preempt for KV and whether a decode run
  may be promised while prompts wait.

`chunked=False` runs a prompt whole (alone if over the budget); `chunk_cap` bounds one prompt's
tokens in one step. `prefill_first=True` is the scheduler of vLLM V0 and SGLang before mixed
chunks: a step that can run a prompt runs prompts only, so every prefill stalls the decodes (the
interference chunked prefill was made to remove; published serving runs of those engines are
replayed with it).
"""

from __future__ import annotations

import heapq
import itertools
from typing import Callable

from flowyard.core.plan import PrefillSlice, StepOutput, StepPlan
from flowyard.core.request import RequestState, Status
from flowyard.policies.framework.contracts import InstanceSnapshot
from flowyard.policies.framework.order import QueueOrder
from flowyard.policies.framework.parts import (Admission, BudgetRule, DecodePlaces, FirstAdmitted, FixedBudget,
                                               Ranked, Shedding, StepBudget, Urgent, want)
from flowyard.policies.framework.selector import PrefillSelector
from flowyard.policies.framework.slack import deadline


class ChunkedSelector(PrefillSelector):
    """Chunked prefill composed of a budget rule, an order, admission, decode places and
    shedding (module docstring)."""

    def __init__(self, budget: int | BudgetRule = 2048, chunked: bool = True, order: QueueOrder | str = "fcfs",
                 ttft_hat: Callable[[RequestState], float] | None = None, chunk_cap: int | None = None, *,
                 admission: Admission = Admission(), places: DecodePlaces | None = None,
                 shedding: Shedding | None = None, together: bool = False, prefill_first: bool = False) -> None:
        self.budget: BudgetRule = FixedBudget(budget) if isinstance(budget, int) else budget
        self.chunked = chunked
        self.order = order if isinstance(order, QueueOrder) else QueueOrder(order)
        if self.order.needs_ttft and ttft_hat is None:
            raise ValueError(f"queue order {self.order.name} needs a TTFT predictor")
        self.ttft_hat = ttft_hat
        self.chunk_cap = chunk_cap  # most tokens of one prompt in one step (None: the budget)
        self.admission = admission
        self.places: DecodePlaces = places if places is not None else FirstAdmitted()
        self.shedding = shedding
        self.together = together and not self.order.static  # static orders keep vLLM's rule
        self.prefill_first = prefill_first
        self.step: StepBudget | None = None  # the budget rule's answer for the step being planned
        self._waiting: list[tuple[tuple, int, RequestState, int]] = []  # (key, seq, state, tokens)
        self._waiting_tokens = 0
        self._seq = itertools.count()

    # -- queue -------------------------------------------------------------------------------
    def add(self, st: RequestState, now: float) -> None:
        key = self.order.key(st) if self.order.static else ()
        entry = (key, next(self._seq), st, st.uncomputed)
        if self.order.static:
            heapq.heappush(self._waiting, entry)
        else:
            self._waiting.append(entry)
        self._waiting_tokens += st.uncomputed

    def _rank(self, now: float) -> None:
        """Dynamic orders: put the queue in key order for this round (a sorted list is a heap)."""
        if not self.order.static and len(self._waiting) > 1:
            key = self.order.key
            self._waiting.sort(key=lambda w: (key(w[2], now, self.ttft_hat), w[1]))

    def _pop(self) -> RequestState:
        _, _, st, tokens = heapq.heappop(self._waiting) if self.order.static else self._waiting.pop(0)
        self._waiting_tokens -= tokens
        return st

    def remove(self, req_id: int) -> RequestState | None:
        entry = next((w for w in self._waiting if w[2].id == req_id), None)
        if entry is None:
            return None
        self._waiting.remove(entry)
        if self.order.static:
            heapq.heapify(self._waiting)
        self._waiting_tokens -= entry[3]
        self.core.kv.free(req_id)
        return entry[2]

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def waiting_states(self) -> list[RequestState]:
        return [w[2] for w in self._waiting]

    def queued(self, now: float) -> list[tuple[int, RequestState]]:
        """The queued prompts as (arrival number, state), ranked for this round."""
        self._rank(now)
        return [(w[1], w[2]) for w in self._waiting]

    def dequeue(self, started: list[RequestState]) -> None:
        """Take prompts started out of queue order off the queue."""
        gone = {id(st) for st in started}
        self._waiting_tokens -= sum(w[3] for w in self._waiting if id(w[2]) in gone)
        self._waiting = [w for w in self._waiting if id(w[2]) not in gone]

    def urgent(self, now: float) -> Urgent | None:
        """The top-ranked started or queued prompt under a slack order (None under a static
        order or with no prompt): what a budget rule may answer for (flowyard's TTFT rescue)."""
        if self.order.static:
            return None
        cands = [r for r in self.core.running if r.in_prefill and r.status is Status.RUNNING]
        cands += self.waiting_states()
        if not cands:
            return None
        key, head = min(((self.order.key(st, now, self.ttft_hat), st) for st in cands), key=lambda e: e[0])
        return Urgent(head, key[1], bool(key[0]))

    # -- scheduling --------------------------------------------------------------------------
    def decode_order(self, decodes: list[RequestState], now: float) -> list[RequestState]:
        return self.places.order(decodes, now, self.core.max_num_seqs)

    def decode_cap(self, now: float, decodes: list[RequestState]) -> float:
        self.step = self.budget.step(decodes, now, self.core, self.urgent)
        if self.prefill_first and self._prompt_can_run():
            return 0
        return self.step.decode_cap

    def _prompt_can_run(self) -> bool:
        """Whether a started prompt or the queue's head can take a chunk now (prefill-first:
        else the decodes run, as vLLM V0 runs them when no prompt fits)."""
        core = self.core
        if any(r.in_prefill and r.status is Status.RUNNING for r in core.running):
            return True
        if not self._waiting or len(core.running) >= core.max_num_seqs:
            return False
        st = self._waiting[0][2]  # the head under a static order; the last ranking's otherwise
        n = min(want(st), self.step.tokens) if self.chunked and self.step else want(st)
        return core.kv.can_allocate(st.id, st.num_computed + n)

    def allows_run(self) -> bool:
        """A slack order (s-edf, d-edf) re-ranks the queue at every step, so the head that KV
        refused in this step may be another one in the next: no multi-step decode run while
        prompts wait under such an order (static orders keep their head, unless the admission
        says otherwise); and none while the decode places rotate."""
        if self._waiting and not (self.order.static and self.admission.runs_while_queued):
            return False
        return self.places.allows_run(self.core)

    def planned(self, plan: StepPlan, now: float) -> None:
        assert self.step is not None, "planned() before decode_cap()"
        self.budget.planned(plan, self.step, now)

    def executed(self, plan: StepPlan, out: StepOutput) -> None:
        self.budget.executed(plan, out)

    def select(self, plan: StepPlan, now: float) -> StepPlan:
        assert self.step is not None, "select() before decode_cap()"
        if self.together:
            return self._select_together(plan, self.step, now)
        core = self.core
        budget_total = self.step.tokens
        for st in [r for r in core.running if r.in_prefill]:
            budget = budget_total - plan.num_tokens
            if st.status is not Status.RUNNING or budget <= 0:
                continue
            self.continue_prompt(st, budget, plan, now)
        budget = budget_total - plan.num_tokens
        self._rank(now)
        while self._waiting and budget > 0 and len(core.running) < core.max_num_seqs:
            n = self.start_prompt(self._waiting[0][2], budget, plan)
            if not n:
                break
            self._pop()
            budget -= n
        return plan

    def _select_together(self, plan: StepPlan, step: StepBudget, now: float) -> StepPlan:
        """Started and queued prompts ranked together in `order` (module docstring)."""
        core = self.core
        key = self.order.key
        queued = self.queued(now)
        started = [r for r in core.running if r.in_prefill and r.status is Status.RUNNING]
        queue = [Ranked(key(st, now, self.ttft_hat), 0, k, st) for k, st in enumerate(started)]
        queue += [Ranked(key(st, now, self.ttft_hat), 1, seq, st) for seq, st in queued]
        queue.sort(key=Ranked.sort_key)
        if self.shedding is not None:
            queue = self.shedding.shed(queue, now, step)
        budget = step.tokens - plan.num_tokens
        limit = core.max_num_seqs * self.admission.park
        taken: list[RequestState] = []
        admit = True  # False once a queued prompt found no KV: no later one overtakes it
        for q in queue:
            if budget <= 0:
                break
            st = q.state
            if not q.queued:  # started: its KV grows chunk by chunk (held while it waits)
                if st.status is Status.RUNNING:  # else preempted by an earlier grow this step
                    budget -= self.continue_prompt(st, budget, plan, now)
                continue
            if not admit or len(core.running) >= limit:
                continue
            n = self.start_prompt(st, budget, plan)
            if not n:
                admit = False  # started prompts still get their chunks (they hold KV already)
                continue
            taken.append(st)
            budget -= n
        if taken:
            self.dequeue(taken)
        return plan

    def continue_prompt(self, st: RequestState, budget: int, plan: StepPlan, now: float) -> int:
        """Give a started prompt its next chunk within `budget` (growing its KV); the tokens
        taken, 0 if none (`admission.chunk_preempts`: whether growing may preempt others)."""
        n = self._chunk(want(st), budget, plan)
        waits = not self.admission.chunk_preempts and not plan.empty
        if n and waits and not self.core.kv.can_allocate(st.id, st.num_computed + n):
            return 0
        if n and self.core.grow(st, st.num_computed + n, plan, now):
            plan.prefills.append(PrefillSlice(st, st.num_computed, n))
            return n
        return 0

    def start_prompt(self, st: RequestState, budget: int, plan: StepPlan) -> int:
        """Start a queued prompt with its first chunk after any cached prefix; the tokens
        taken, or 0 when no chunk or no KV is left for it."""
        kv = self.core.kv
        cached = kv.match_prefix(st) if st.num_computed == 0 else 0
        st.num_computed += cached
        n = self._chunk(want(st), budget, plan)
        if not n or not kv.allocate(st.id, st.num_computed + n):
            if cached:  # give the shared prefix back; it is matched again next time
                kv.free(st.id)
                st.num_computed = 0
            return 0
        self.core.start(st)
        plan.prefills.append(PrefillSlice(st, st.num_computed, n))
        return n

    def _chunk(self, want: int, budget: int, plan: StepPlan) -> int:
        if self.chunk_cap is not None:
            want = min(want, self.chunk_cap)
        if self.chunked:
            return min(want, budget)
        if want <= budget or plan.empty:
            return want  # an over-budget prompt runs whole, alone
        return 0

    # -- views -------------------------------------------------------------------------------
    def fill(self, snap: InstanceSnapshot) -> None:
        started = [r for r in self.core.running
                   if r.req.prompt_len + r.num_output - r.num_computed > 1 or r.num_output == 0]  # in_prefill
        snap.num_waiting = len(self._waiting)
        if not started and not self._waiting:  # nothing queued: the snapshot's empty defaults
            snap.waiting_tokens = self._waiting_tokens
            return
        snap.waiting_tokens = self._waiting_tokens + sum(r.uncomputed for r in started)
        snap.prefill_queue = tuple((r.num_computed, r.uncomputed) for r in started) \
            + tuple((w[2].num_computed, w[3]) for w in self._waiting)
        snap.prefill_deadlines = tuple(deadline(r.req) for r in started) + tuple(deadline(w[2].req) for w in self._waiting)
