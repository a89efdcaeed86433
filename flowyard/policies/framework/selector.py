"""The prefill selector: the part of the local scheduler core (`local_core.LocalCore`) that
owns the queued prompts and decides which prefill slices join each step.

The core places the step's decodes and calls the selector's hooks; `PrefillSelector` declares
them with defaults that do nothing, so a selector writes only what it decides. Selectors see
the core through `parts.CoreView` alone. They differ in two ways that matter to the core:

- **where a started prompt lives.** `chunked.ChunkedSelector` (vLLM) keeps a started prompt
  in the core's running list: its KV grows chunk by chunk and it can be preempted like a
  decode. Queue-held selectors (`holds_partials`: PLA's AWD short/long queues, FlowPrefill's
  tasks) reserve KV for the whole prompt on admission (`parts.admit_whole`) and take an
  unfinished prompt back into their queue after each chunk; the core sees it again only when
  its prompt is done.
- **how much prefill a step takes.** A budget rule (`parts.BudgetRule`: vLLM's fixed budget,
  DynaServe's Alg. 2, flowyard's TPOT-slack budget), AWD batches or C_l chunks (PLA), or
  SLO-aware batches under a token budget (FlowPrefill).
"""

from __future__ import annotations

from flowyard.core.plan import PrefillSlice, StepOutput, StepPlan
from flowyard.core.request import RequestState
from flowyard.policies.framework.contracts import InstanceSnapshot
from flowyard.policies.framework.parts import CoreView

INF = float("inf")


class PrefillSelector:
    """Base of the prefill-selection parts (see the module docstring)."""

    holds_partials = False  # True: a chunked prompt goes back to the selector between chunks
    core: CoreView

    def bind(self, core: CoreView) -> None:
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
