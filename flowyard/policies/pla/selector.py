"""PLA-Serve's prefill selector: length-aware, mutually exclusive short and long prefill steps
(PLA-Serve §3.2, temporal disaggregation), a part of the local scheduler core.

Every request is classified once, on arrival, by its new tokens L = prompt - cached history
against the compute-memory boundary L_m (§2.1, `pla.boundary`). Short ones wait in Q_s and
leave in AWD batches (`awd`), padded to a captured (L, B) shape when one holds them; long ones
wait in Q_l and advance one request at a time by chunks of C_l tokens. A step is either all
short or all long, never mixed, so a memory-bound batch never shares a step with a
compute-bound chunk.

Which class runs next (SLA-first): a short batch as soon as AWD says it is ready; else a long
chunk when one is waiting and the chunk's predicted time fits inside the tightest short slack
(a chunk started now would otherwise make a short request late); else nothing until the AWD
window closes (`wake_at`). In deadline-free ("token-max") mode there are no deadlines: short
batches leave when they reach the token budget or the window closes.

With spatial disaggregation (`pla.router`) an instance belongs to the short or the long pool
and receives mostly one class; it still serves whatever is in its queues, so an instance that
changes pool drains its old class first.

The same selector runs PD prefill instances (`pla`, `pla-spatial`: role PREFILL, the core hands
each request off when its prompt is done) and colocated ones (`pla-mix`: role MIXED, the core
keeps the request and every step carries all running decodes plus the prefill part chosen here;
a decode preempted for KV is recomputed through Q_s or Q_l by the tokens it must recompute).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace

from flowyard.core.kvcache import KVCacheManager
from flowyard.core.plan import PrefillSlice, StepPlan
from flowyard.core.request import Request, RequestState
from flowyard.costmodel.base import CostModel
from flowyard.policies.framework.contracts import InstanceSnapshot, Role
from flowyard.policies.framework.local_core import LocalCore
from flowyard.policies.framework.parts import admit_whole
from flowyard.policies.framework.selector import PrefillSelector
from flowyard.policies.framework.slack import TTFTPredictor, deadline
from flowyard.policies.pla.awd import AWDConfig, AWDState
from flowyard.policies.pla.boundary import LengthModel, classify, fit_length_model, samples_from_cost_model


@dataclass(frozen=True, slots=True)
class PLAConfig:
    awd: AWDConfig = field(default_factory=AWDConfig)
    long_chunk: int = 2048  # C_l
    deadline_free: bool = False  # token-max mode (offline jobs)
    graphs: bool = True  # pad short batches to captured shapes (CUDA graphs on GPU)
    spatial: bool = False  # short and long pools across prefill instances (policy pla-spatial)
    boundary: int | None = None  # L_m override (tokens); None: fitted from the predictor
    max_num_seqs: int = 256
    # Session-affine routing (pla.router): a later turn goes back to the prefill instance that
    # holds its history unless its predicted wait + fill there exceeds the best alternative's
    # by more than this many seconds; None routes every turn by load alone.
    affinity_tolerance: float | None = 0.05

    def __post_init__(self) -> None:
        if self.long_chunk < 1 or self.max_num_seqs < 1:
            raise ValueError("long_chunk and max_num_seqs must be positive")
        if self.affinity_tolerance is not None and not self.affinity_tolerance >= 0:
            raise ValueError("affinity_tolerance must be >= 0 seconds (or None: no affinity)")


def is_short(r: Request, lengths: LengthModel, boundary: int | None = None) -> bool:
    """Short when the new tokens (prompt minus cached history) are below L_m at its history."""
    return fill_is_short(r.prompt_len - r.history_len, r.history_len, lengths, boundary)


def fill_is_short(new: int, history: int, lengths: LengthModel, boundary: int | None = None) -> bool:
    """Short when a fill of `new` tokens over `history` cached ones is below L_m(history)."""
    new = max(1, new)
    if boundary is not None:
        return new < boundary
    return classify(new, history, lengths) == "short"


def length_model_of(predictor: CostModel) -> LengthModel:
    """The §2.1 model fitted on the predictor's prices of prefills and re-prefills."""
    grid_l = [8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
    grid_h = [0, 512, 2048, 8192]
    return fit_length_model(samples_from_cost_model(predictor, grid_l, grid_h))


@dataclass(slots=True)
class PLAStats:
    short_batches: int = 0
    short_requests: int = 0
    graphed: int = 0
    long_chunks: int = 0
    busy_s: float = 0.0  # sum of predicted prefill step times: PD instances' utilisation signal


class PLASelector(PrefillSelector):
    holds_partials = True

    def __init__(self, config: PLAConfig, predictor: CostModel, lengths: LengthModel) -> None:
        self.config = config
        self.predict = TTFTPredictor(predictor)
        self.lengths = lengths
        self.short: dict[int, RequestState] = {}  # Q_s in arrival order
        self.long: deque[RequestState] = deque()  # Q_l
        self.awd = AWDState(config.awd)
        self.stats = PLAStats()
        self._inflight: list[PrefillSlice] = []  # the step being executed (for snapshots)

    # -- queues ------------------------------------------------------------------------------
    def add(self, st: RequestState, now: float) -> None:
        if self._classify_short(st):
            self.short[st.id] = st
            self.awd.arrived(now)
        else:
            self.long.append(st)

    def requeue(self, st: RequestState, now: float) -> None:
        """A decode preempted for KV: prompt and outputs so far are recomputed, short or long
        by the tokens this instance must really compute."""
        cached = self.core.kv.peek_prefix(st)
        if fill_is_short(st.seq_len - cached, cached, self.lengths, self.config.boundary):
            self.short[st.id] = st
            self.awd.arrived(now)
        else:
            self.long.append(st)

    def chunk_done(self, st: RequestState) -> None:
        self.long.appendleft(st)  # a long prompt's chunk: back to the head of Q_l

    def remove(self, req_id: int) -> RequestState | None:
        st = self.short.pop(req_id, None)
        if st is None:
            st = next((s for s in self.long if s.id == req_id), None)
            if st is not None:
                self.long.remove(st)
        if st is not None:
            self.core.kv.free(req_id)  # a long prompt between chunks holds KV for all of it
        return st

    def _classify_short(self, st: RequestState) -> bool:
        """By what this instance really has to compute: the history counts only if its KV is
        in this instance's prefix cache (a turn routed away from its history is not short)."""
        if st.req.history_len == 0:
            return self.is_short(st.req)
        cached = min(self.core.kv.peek_prefix(st), st.req.prompt_len - 1)
        return is_short(replace(st.req, history_len=cached), self.lengths, self.config.boundary)

    def is_short(self, r: Request) -> bool:
        return is_short(r, self.lengths, self.config.boundary)

    def _min_slack(self, now: float, est: float) -> float | None:
        if self.config.deadline_free:
            return None
        slacks = [deadline(s.req) - now - est for s in self.short.values() if s.req.slo.ttft is not None]
        return min(slacks) if slacks else None

    def short_estimate(self) -> float:
        """S_hat: predicted time of a short batch of the current target depth."""
        if not self.short:
            return 0.0
        batch = list(self.short.values())[: max(1, self.awd.depth)]
        todo = [self._todo(s) for s in batch]
        lb = self.config.awd.bucket(max(todo)) or max(todo)
        return self.predict.slices([PrefillSlice(s, s.seq_len - t, lb) for s, t in zip(batch, todo)])

    # -- scheduling --------------------------------------------------------------------------
    def select(self, plan: StepPlan, now: float) -> StepPlan:
        pre = self._choose(now)
        if pre is not None:
            plan.prefills = pre.prefills
            if pre.graph is not None and plan.decodes:
                self.stats.graphed -= 1  # decode rows do not fit a captured prefill shape
            else:
                plan.graph = pre.graph
        self._inflight = plan.prefills
        return plan

    def allows_run(self) -> bool:
        return not self.short and not self.long

    def _choose(self, now: float) -> StepPlan | None:
        if self.short:
            est = self.short_estimate()
            slack = self._min_slack(now, est)
            hol = next(iter(self.short.values())).req.arrival
            if self.config.deadline_free:
                ready = self._short_tokens() >= self.config.awd.memory_budget or \
                    now >= self.awd.window_end(now, len(self.short), None) - 1e-12
            else:
                ready = self.awd.ready(now, len(self.short), slack, hol)
            if ready:
                plan = self._short_batch(now)
                if plan is not None:
                    return plan
                if self.long:  # no short prompt fits now: work that may hold the KV goes on
                    return self._long_chunk()
            if self.long and (slack is None or self._long_time() <= slack - self.config.awd.sigma):
                return self._long_chunk()
            return None
        if self.long:
            return self._long_chunk()
        return None

    def wake_at(self, now: float) -> float | None:
        if not self.short:
            return None
        est = self.short_estimate()
        hol = next(iter(self.short.values())).req.arrival
        return self.awd.wake(now, len(self.short), self._min_slack(now, est), hol)

    def _todo(self, st: RequestState) -> int:
        """Tokens a waiting request will really compute here (its cached prefix excluded)."""
        return st.uncomputed - (self.core.kv.peek_prefix(st) if st.num_computed == 0 else 0)

    def _short_tokens(self) -> int:
        return sum(self._todo(s) for s in self.short.values())

    def _short_batch(self, now: float) -> StepPlan | None:
        """Most urgent first (oldest when deadline-free), then the same length bucket, then the
        nearest buckets, up to the depth D and the memory budget M (padded tokens)."""
        cfg = self.config.awd
        order = sorted(self.short.values(), key=lambda s: (deadline(s.req), s.req.arrival, s.id))
        todo = {s.id: self._todo(s) for s in order}
        hb = cfg.bucket(todo[order[0].id]) or cfg.lengths[-1]
        order[1:] = sorted(order[1:], key=lambda s: abs((cfg.bucket(todo[s.id]) or 10**9) - hb))
        plan = StepPlan()
        longest, cap = 0, min(self.awd.depth, self._seq_room())
        for st in order:
            if len(plan.prefills) >= cap:
                break
            want = max(longest, todo[st.id])
            if plan.prefills and (cfg.bucket(want) or want) * (len(plan.prefills) + 1) > cfg.memory_budget:
                continue
            if not admit_whole(self.core.kv, st, st.uncomputed, plan):
                continue
            del self.short[st.id]
            longest = max(longest, plan.prefills[-1].n)
        if not plan.prefills:
            return None
        graph = cfg.graph(longest, len(plan.prefills)) if self.config.graphs else None
        plan.graph = graph
        self.stats.short_batches += 1
        self.stats.short_requests += len(plan.prefills)
        self.stats.graphed += graph is not None
        self.stats.busy_s += self.predict.step(plan)
        self.awd.dispatched(now, len(plan.prefills), bool(self.short))
        return plan

    def _seq_room(self) -> int:
        """Requests one step may prefill: what the running decodes leave of max_num_seqs."""
        return self.config.max_num_seqs - len(self.core.running)

    def _long_time(self) -> float:
        """Predicted time of the next long step (a full chunk of C_l tokens at most)."""
        st = self.long[0]
        n = min(self.config.long_chunk, sum(s.uncomputed for s in self.long))
        return self.predict.slices([PrefillSlice(st, st.num_computed, n)])

    def _long_chunk(self) -> StepPlan | None:
        """Chunked prefill of Q_l in arrival order under a budget of C_l tokens: the head's
        next chunk, then whole or partial prompts behind it while the budget lasts."""
        plan = StepPlan()
        budget = self.config.long_chunk
        while self.long and budget > 0 and len(plan.prefills) < self._seq_room():
            st = self.long[0]
            if not admit_whole(self.core.kv, st, min(budget, st.uncomputed), plan):
                break
            self.long.popleft()  # an unfinished prompt goes back to the head after the step
            budget -= plan.prefills[-1].n
        if not plan.prefills:
            return None
        self.stats.long_chunks += 1
        self.stats.busy_s += self.predict.step(plan)
        return plan

    def executed(self, plan: StepPlan, out) -> None:
        self._inflight = []

    # -- views -------------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.short) + len(self.long)

    def held_running(self) -> int:
        return len(self._inflight)

    def fill(self, snap: InstanceSnapshot) -> None:
        inflight = self._inflight
        snap.num_running += len(inflight)
        snap.num_waiting = self.num_waiting
        snap.waiting_tokens = (self._short_tokens() + sum(s.uncomputed for s in self.long)
                               + sum(s.n for s in inflight))
        snap.running_tokens += sum(s.state.seq_len for s in inflight)
        if self.core.role is Role.PREFILL:
            snap.busy_s = self.stats.busy_s  # predicted: PD prefill instances' controller signal


def pla_scheduler(instance: int, role: Role, kv: KVCacheManager, config: PLAConfig, predictor: CostModel,
                  lengths: LengthModel, *, max_model_len: int | None = None, max_repeats: int = 512) -> LocalCore:
    """PLA-Serve's local scheduler: the core with the AWD short/long selector. Role PREFILL for
    PD (`pla`, `pla-spatial`), MIXED for `pla-mix`."""
    if role is Role.DECODE:
        raise ValueError("PLA-Serve's selector schedules prefill or colocated (MIXED) instances")
    return LocalCore(instance, role, kv, PLASelector(config, predictor, lengths), max_num_seqs=config.max_num_seqs,
                     max_model_len=max_model_len, max_repeats=max_repeats)
