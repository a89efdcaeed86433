"""The declared parts a prefill selector is assembled from, and the narrow view of the local
core that selectors and their parts are given.

A selector (`selector.ChunkedSelector`) is order x budget rule x admission x decode places x
shedding; each policy's builder names the parts it takes, so a reader sees what a policy is
made of without following a chain of subclasses:

- **order** (`order.QueueOrder`): which queued prompt goes first (FCFS, EDF, S-EDF, ...).
- **budget rule** (`BudgetRule`): the step's token budget, returned as a value (`StepBudget`)
  before the step's decodes are placed: vLLM's fixed budget (`FixedBudget`), DynaServe's
  Alg. 2 (`dynaserve.local_batch.TBTBudget`), flowyard's TPOT-slack budget
  (`flowyard.selector.TPOTSlackBudget`). Rules that learn from measured steps hear of every
  planned and executed step.
- **admission** (`Admission`): when a prompt may start or take KV (parking, chunks that wait
  for KV instead of preempting) and whether a decode run may be promised while prompts wait.
- **decode places** (`DecodePlaces`): which running decodes take a step's places when there
  are more than max_num_seqs (first admitted, or least banked TPOT slack).
- **shedding** (`Shedding`): which ranked prompts to give up in an overload (flowyard's
  Moore-Hodgson rule).

`CoreView` is all of the core a selector may use: its KV, role, batch size, running requests,
and the two moves that change them (start a prompt, grow a request's KV).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, Protocol, Sequence

from flowyard.core.kvcache import KVCacheManager
from flowyard.core.plan import PrefillSlice, StepOutput, StepPlan
from flowyard.core.request import RequestState, Status
from flowyard.policies.framework.contracts import Role


class CoreView(Protocol):
    """What a prefill selector and its parts may read and do on the local core."""

    kv: KVCacheManager
    role: Role
    max_num_seqs: int

    @property
    def running(self) -> Sequence[RequestState]:
        """Running requests in admission order: decodes and started prompts."""
        ...

    def start(self, st: RequestState) -> None:
        """Admit a queued prompt into the running list (its KV is allocated)."""
        ...

    def grow(self, st: RequestState, total: int, plan: StepPlan, now: float = 0.0) -> bool:
        """Allocate KV for st up to `total` tokens, preempting from the back of running."""
        ...


@dataclass(frozen=True, slots=True)
class StepBudget:
    """A budget rule's answer for one step, taken before its decodes are placed."""

    decodes: Sequence[RequestState]  # the decodes the budget answers for
    prefill: int  # prefill tokens the rule allows beside them
    tokens: int  # the step's token budget, decodes included
    decode_cap: float  # most decodes that join the step, from the front of their place order


class Urgent(NamedTuple):
    """The top-ranked prompt under a deadline-slack order, as a budget rule may ask for it."""

    state: RequestState
    deadline: float
    given_up: bool  # ranked behind every prompt that can still make its deadline


UrgentQuery = Callable[[float], "Urgent | None"]  # now -> the top-ranked prompt


class BudgetRule(Protocol):
    """The step's token budget (see the module docstring). `urgent(now)` asks the selector for
    its top-ranked prompt (None under a static order or with nothing queued), at a cost: only
    a rule that needs it calls it."""

    def step(self, decodes: Sequence[RequestState], now: float, core: CoreView,
             urgent: UrgentQuery) -> StepBudget: ...

    def planned(self, plan: StepPlan, budget: StepBudget, now: float) -> None: ...

    def executed(self, plan: StepPlan, out: StepOutput) -> None: ...


@dataclass(frozen=True, slots=True)
class FixedBudget:
    """vLLM's rule: every step takes up to `tokens` tokens, decodes first."""

    tokens: int = 2048

    def __post_init__(self) -> None:
        if self.tokens < 1:
            raise ValueError("token budget must be positive")

    def step(self, decodes: Sequence[RequestState], now: float, core: CoreView,
             urgent: UrgentQuery) -> StepBudget:
        return StepBudget(decodes, self.tokens, self.tokens, self.tokens)

    def planned(self, plan: StepPlan, budget: StepBudget, now: float) -> None:
        pass

    def executed(self, plan: StepPlan, out: StepOutput) -> None:
        pass


@dataclass(frozen=True, slots=True)
class Admission:
    """When prompts may start and grow.

    park: under the ranked-together rule (`ChunkedSelector(together=True)`) a prompt may start
      while up to park x max_num_seqs requests run; once prefilled it waits, KV held, for a
      decode place (vLLM's started-first rule admits up to max_num_seqs).
    chunk_preempts: vLLM lets a started prompt's chunk recompute-preempt running requests for
      KV; False: the chunk waits for KV unless the step would otherwise be empty.
    runs_while_queued: whether a multi-step decode run may be promised while prompts wait
      under a static order (a slack order re-ranks every step and never allows it)."""

    park: float = 1.0
    chunk_preempts: bool = True
    runs_while_queued: bool = True

    def __post_init__(self) -> None:
        if self.park < 1:
            raise ValueError(f"park must be >= 1 (a multiple of max_num_seqs), got {self.park}")


class DecodePlaces(Protocol):
    """Which running decodes take the step's places (max_num_seqs of them)."""

    def order(self, decodes: list[RequestState], now: float, places: int) -> list[RequestState]: ...

    def allows_run(self, core: CoreView) -> bool:
        """Whether a multi-step decode run may be promised (the places do not rotate)."""
        ...


class FirstAdmitted:
    """vLLM's places: running decodes in admission order."""

    def order(self, decodes: list[RequestState], now: float, places: int) -> list[RequestState]:
        return decodes

    def allows_run(self, core: CoreView) -> bool:
        return True


class Ranked(NamedTuple):
    """A prompt in the ranked-together queue: its order key, 0 if started (started prompts
    go first on equal keys) or 1 if queued, its position among those, and its state."""

    key: tuple
    queued: int
    seq: int
    state: RequestState

    def sort_key(self) -> tuple:
        return (self.key, self.queued, self.seq)


class Shedding(Protocol):
    """Which prompts of a ranked queue to give up in an overload: return the queue re-ranked
    with them behind every prompt that can still make its deadline."""

    def shed(self, queue: list[Ranked], now: float, budget: StepBudget) -> list[Ranked]: ...


def want(st: RequestState) -> int:
    """Tokens to compute next: the rest of the sequence, or up to a micro-request's split."""
    if st.split_at is not None and st.num_computed < st.split_at:
        return min(st.uncomputed, st.split_at - st.num_computed)
    return st.uncomputed


def admit_whole(kv: KVCacheManager, st: RequestState, n: int, plan: StepPlan) -> bool:
    """For queue-held selectors: add a slice of the next n tokens of st (after any cached
    prefix) to `plan`. KV is reserved for the whole prompt at once: a chunked prompt that went
    back to a queue between chunks then never waits for KV that later arrivals took, so a full
    cache cannot deadlock."""
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
