"""Prefill-selection parts of the local scheduler core (`local_core.LocalCore`).

The core places the step's decodes; a selector owns the queued prompts and decides which
prefill slices join the step. Selectors differ in two ways that matter to the core:

- **where a started prompt lives.** `ChunkedSelector` (vLLM) keeps a started prompt in the
  core's running list: its KV grows chunk by chunk and it can be preempted like a decode.
  Queue-held selectors (`holds_partials`: PLA's AWD short/long queues, FlowPrefill's tasks)
  reserve KV for the whole prompt on admission and take an unfinished prompt back into their
  queue after each chunk; the core sees it again only when its prompt is done.
- **how much prefill a step takes.** A token budget (chunked), a budget from a profile of step
  times (DynaServe Alg. 2, `dynaserve.local_batch`), AWD batches or C_l chunks (PLA), or SLO-aware
  batches under a token budget (FlowPrefill).

The default hooks do nothing, so a selector overrides only what it decides.
"""

from __future__ import annotations

import heapq
import itertools
from typing import TYPE_CHECKING, Callable

from flowyard.core.plan import PrefillSlice, StepOutput, StepPlan
from flowyard.core.request import RequestState, Status
from flowyard.policies.framework.contracts import InstanceSnapshot
from flowyard.policies.framework.order import QueueOrder
from flowyard.policies.framework.slack import deadline

if TYPE_CHECKING:
    from flowyard.policies.framework.local_core import LocalCore

INF = float("inf")


class PrefillSelector:
    """Base of the prefill-selection parts (see the module docstring)."""

    holds_partials = False  # True: a chunked prompt goes back to the selector between chunks
    core: "LocalCore"

    def bind(self, core: "LocalCore") -> None:
        self.core = core

    # -- queue -------------------------------------------------------------------------------
    def add(self, st: RequestState, now: float) -> None:
        """A new request (status WAITING, admitted by the core)."""
        raise NotImplementedError

    def requeue(self, st: RequestState, now: float) -> None:
        """A running request the core preempted (KV dropped, to be recomputed)."""
        self.add(st, now)

    def chunk_done(self, st: RequestState) -> None:
        """Queue-held selectors: a chunk of st's prompt ran; it waits for its next one."""
        raise NotImplementedError

    def remove(self, req_id: int) -> RequestState | None:
        """Take a request out of the queue (abort) and free the KV it holds; None if it is not
        queued here."""
        raise NotImplementedError

    # -- scheduling --------------------------------------------------------------------------
    def decode_order(self, decodes: list[RequestState], now: float) -> list[RequestState]:
        """The order in which the running decodes take the step's places (running order)."""
        return decodes

    def decode_cap(self, now: float, decodes: list[RequestState]) -> float:
        """Asked before the core places decodes (`decodes`: the running ones, in
        `decode_order`): at most this many of them, from the front, join the step."""
        return INF

    def select(self, plan: StepPlan, now: float) -> StepPlan:
        """Add prefill slices to `plan` (holding the step's decodes); return the plan to run."""
        raise NotImplementedError

    def allows_run(self) -> bool:
        """Whether a decode-only step may be promised as a multi-step run (nothing queued
        that the next step could start)."""
        return True

    def planned(self, plan: StepPlan, now: float) -> None:
        """The core will run `plan` (not empty)."""

    def idle(self) -> None:
        """The core has nothing to run."""

    def executed(self, plan: StepPlan, out: StepOutput) -> None:
        """The first `out.steps` steps of `plan` ran (before the core applies them)."""

    def applied(self, plan: StepPlan) -> list[PrefillSlice]:
        """The prefill slices of an executed plan whose progress the core applies."""
        return plan.prefills

    def wake_at(self, now: float) -> float | None:
        return None

    def preempt_check(self, now: float) -> bool:
        return False

    def suspend(self, plan: StepPlan, ops_done: int, now: float) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not preempt running steps")

    # -- views -------------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        raise NotImplementedError

    def held_running(self) -> int:
        """Requests inside a step (running or parked) that the core's running list lacks."""
        return 0

    def has_work(self) -> bool:
        return self.num_waiting > 0

    def fill(self, snap: InstanceSnapshot) -> None:
        """Add this queue to a snapshot the core built from its running requests."""
        raise NotImplementedError

    # -- helpers for queue-held selectors ----------------------------------------------------
    def admit_whole(self, st: RequestState, n: int, plan: StepPlan) -> bool:
        """Add a slice of the next n tokens of st (after any cached prefix). KV is reserved for
        the whole prompt at once: a chunked prompt that went back to a queue between chunks
        then never waits for KV that later arrivals took, so a full cache cannot deadlock."""
        kv = self.core.kv
        cached = kv.match_prefix(st) if st.num_computed == 0 else 0
        st.num_computed += cached
        n = min(n, st.uncomputed)
        if not kv.allocate(st.id, st.seq_len):
            if cached:
                kv.free(st.id)
                st.num_computed = 0
            return False
        st.status = Status.RUNNING
        plan.prefills.append(PrefillSlice(st, st.num_computed, n))
        return True


class ChunkedSelector(PrefillSelector):
    """vLLM v1's prefill side: started prompts (in the core's running list) continue first,
    then queued ones in queue order with head-of-line blocking, while the step's token budget,
    `max_num_seqs` and KV allow. `chunked=False` runs a prompt whole (alone if over budget)."""

    # vLLM: a started prompt's chunk may recompute-preempt running requests to get its KV.
    # False (flowyard): the chunk waits for KV unless the step would otherwise be empty.
    prefill_preempts = True

    def __init__(self, token_budget: int = 2048, chunked: bool = True, order: QueueOrder | str = "fcfs",
                 ttft_hat: Callable[[RequestState], float] | None = None, chunk_cap: int | None = None) -> None:
        if token_budget < 1:
            raise ValueError("token budget must be positive")
        self.token_budget = token_budget
        self.chunked = chunked
        self.order = order if isinstance(order, QueueOrder) else QueueOrder(order)
        if self.order.needs_ttft and ttft_hat is None:
            raise ValueError(f"queue order {self.order.name} needs a TTFT predictor")
        self.ttft_hat = ttft_hat
        self.chunk_cap = chunk_cap  # most tokens of one prompt in one step (None: the budget)
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
        heapq.heapify(self._waiting) if self.order.static else None
        self._waiting_tokens -= entry[3]
        self.core.kv.free(req_id)
        return entry[2]

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def allows_run(self) -> bool:
        """A deadline-slack order (s-edf, d-edf) re-ranks the queue at every step, so the head
        that KV refused in this step may be another one in the next: no multi-step decode run
        while prompts wait under such an order (static orders keep their head)."""
        return self.order.static or not self._waiting

    def waiting_states(self) -> list[RequestState]:
        return [w[2] for w in self._waiting]

    def queued(self, now: float) -> list[tuple[int, RequestState]]:
        """The queued prompts as (arrival number, state), ranked for this round: for a subclass
        that interleaves them with started prompts in its own order (flowyard's S-EDF)."""
        self._rank(now)
        return [(w[1], w[2]) for w in self._waiting]

    def dequeue(self, started: list[RequestState]) -> None:
        """Take prompts a subclass started out of queue order off the queue."""
        gone = {id(st) for st in started}
        self._waiting_tokens -= sum(w[3] for w in self._waiting if id(w[2]) in gone)
        self._waiting = [w for w in self._waiting if id(w[2]) not in gone]

    # -- scheduling --------------------------------------------------------------------------
    def decode_cap(self, now: float, decodes: list[RequestState]) -> float:
        return self.token_budget

    def select(self, plan: StepPlan, now: float) -> StepPlan:
        core = self.core
        budget_total = self.token_budget
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

    def continue_prompt(self, st: RequestState, budget: int, plan: StepPlan, now: float) -> int:
        """Give a started prompt its next chunk within `budget` (growing its KV); the tokens
        taken, 0 if none (`prefill_preempts`: whether growing may preempt others)."""
        n = self._chunk(self.want(st), budget, plan)
        waits = not self.prefill_preempts and not plan.empty
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
        n = self._chunk(self.want(st), budget, plan)
        if not n or not kv.allocate(st.id, st.num_computed + n):
            if cached:  # give the shared prefix back; it is matched again next time
                kv.free(st.id)
                st.num_computed = 0
            return 0
        self.core.start(st)
        plan.prefills.append(PrefillSlice(st, st.num_computed, n))
        return n

    @staticmethod
    def want(st: RequestState) -> int:
        """Tokens to compute next: the rest of the sequence, or up to a micro-request's split."""
        if st.split_at is not None and st.num_computed < st.split_at:
            return min(st.uncomputed, st.split_at - st.num_computed)
        return st.uncomputed

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
