"""What a Ray actor's step sends its driver, and what the driver does with it.

An actor step (`ray_actor.EngineActor.step`, or a lockstep step) ends with a `StepReport`: the
tokens it produced, the `StepResult`s the cluster core routes, a fresh snapshot, and what the
driver must know that happened inside the actor: decisions to log (a refusal, a preemption
signal) and moved requests whose KV it imported, whose sources then free their copies (the
Transport contract: a source keeps a moved request's KV until the destination admits it).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from flowyard.engine.preemption import PreemptionStats
from flowyard.engine.sampling import RequestOutput
from flowyard.policies.framework.contracts import InstanceSnapshot, StepResult
from flowyard.runtime.ray_state import RayState


class StepCounters(NamedTuple):
    """Counters an actor reports with every step, beside its snapshot."""

    prefix_queries: int  # prompt tokens looked up in this instance's prefix cache, ever
    prefix_hits: int  # of which found
    adds_applied: int  # the driver's call number of the last add_request now in the engine


@dataclass
class StepReport:
    """What one actor step sends the driver. events: ("reject", t, request, reason) for a
    request this instance refused, ("preempt", t, operators done) for an arrival that signalled
    the running prefill to stop; admitted: (request, source instance) for each moved request
    whose KV this instance imported, so the driver tells the source to release it; idle: the
    step found nothing to run (wake: when its scheduler asked to be called again; wake_in: how
    long from the end of this step, so an asynchronous driver on another clock can wait it out)."""

    outputs: list[RequestOutput]
    results: list[StepResult]
    snapshot: InstanceSnapshot
    busy: bool
    preemption: PreemptionStats
    steps: list = field(default_factory=list)  # timeline spans, on the cluster's clock
    transfers: list = field(default_factory=list)
    events: list[tuple] = field(default_factory=list)
    admitted: list[tuple[int, int]] = field(default_factory=list)
    idle: bool = False
    wake: float | None = None
    counters: StepCounters | None = None  # prefix cache and adds taken in (EngineActor._report)
    wake_in: float | None = None


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def kv_payload(t: torch.Tensor) -> tuple[str, np.ndarray]:
    """A KV chunk as the object store takes it fastest: its bits as a NumPy array, which Ray
    pickles out of band (one copy into the store), and its dtype. A torch tensor is pickled in
    band, several times slower, and the put runs on the source's worker thread before its next
    step (a prefill instance hands off every prompt; docs/benchmarks.md has the measurement)."""
    return str(t.dtype).removeprefix("torch."), t.contiguous().view(_BITS[t.element_size()]).numpy()


def kv_tensor(payload: Any) -> torch.Tensor:
    """The chunk `kv_payload` made (its dtype's name and its bits), read in place from the
    object store (read-only: the importer only copies out of it)."""
    dtype, bits = payload
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(bits).view(getattr(torch, dtype))


def import_kv_chunks(runner, table: list[int], chunks: list, num_computed: int, fetch) -> int:
    """Import the KV blocks a migrated request was admitted with: those covering its first
    `num_computed` tokens, from the source's chunks (`fetch(chunk)` gives the tensor). A
    migration admitted without its KV (DynaServe's patience ran out: num_computed 0, to be
    recomputed here) imports nothing and fetches nothing. Returns the blocks imported."""
    need, start = -(-num_computed // runner.bs), 0
    for ref in chunks:
        if start >= need:
            break
        chunk = fetch(ref)
        n = min(chunk.shape[2], need - start)
        runner.import_kv(table[start:start + n], chunk[:, :, :n])
        start += n
    return start



class RayReports(RayState):
    """A part of `RayCluster` (state: `RayState`): applying the actors' reports."""

    _ray: Any
    _busy: list[bool]
    _wake_at: list[float | None]

    def _apply(self, i: int, report: StepReport) -> list[RequestOutput]:
        """What one actor step produced, up to its step results (`InstanceDriver`): its
        outputs, the decisions it took (logged), the KV its sources may free."""
        # Work sent while this step ran is not in its report: stay busy for it, and count the
        # adds the actor had not taken in yet (else a burst that arrives during one step
        # would vanish from the queue the policy and the --max-waiting bound read).
        snap, counters = report.snapshot, report.counters
        if counters is not None:
            self._prefix[i] = counters.prefix_queries, counters.prefix_hits
            self._unapplied[i] = {s: r for s, r in self._unapplied[i].items() if s > counters.adds_applied}
            for req in self._unapplied[i].values():
                snap.count_in(req)
        self._snaps[i], self._busy[i] = snap, report.busy or i in self._sent_during_step
        # A scheduler that found nothing to run and named a time (a batching window) is stepped
        # again then, or at the next event (`_mark_busy`), as in the simulator: not polled.
        later = report.idle and report.wake_in is not None and i not in self._sent_during_step
        self._wake_at[i] = self.now() + report.wake_in if later else None  # type: ignore[operator]
        self._preemption[i] = report.preemption
        self._sent_during_step.discard(i)
        for rid, src, dst, start, end in report.transfers:
            self._transferred(start, rid, src, dst, end - start)
        if self.timeline is not None:
            self.timeline.steps += report.steps
            self.timeline.transfers += report.transfers
        for event in report.events:
            if event[0] == "preempt":
                self.core.preempted(i, event[1], event[2])
            else:  # a refusal
                _, t, req_id, reason = event
                st = self._states.get(req_id)
                if st is not None:
                    self.core.refused(i, st, reason, t)
                self._ended(req_id, "rejected")
        self._released(report.admitted)
        outputs = report.outputs
        for o in outputs:
            self._inputs.pop(o.request_id, None)  # started (or refused): its KV now matters
            if o.finished:
                self._where.pop(o.request_id, None)
        return outputs

    def _finished_here(self, i: int, result: StepResult) -> None:
        self._finished(result.finished)
        for st in result.finished:
            self._rid.pop(st.id, None)
            self._states.pop(st.id, None)

    def _released(self, admitted: list[tuple[int, int]]) -> None:
        """The destination imported these requests' KV: their sources free their copies."""
        for req_id, _ in admitted:
            home = self._kv_home.pop(req_id, None)
            if home is not None and home not in self._down:
                self._call(home, "release", req_id)
                self._mark_busy(home)  # it steps once, so its snapshot shows the KV free
                self._kick(home)
