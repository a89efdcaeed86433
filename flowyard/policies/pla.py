"""PLA-Serve's prefill-instance scheduler: length-aware, mutually exclusive short and long
prefill steps (PLA-Serve §3.2, temporal disaggregation).

Every request is classified once, on arrival, by its new tokens L = prompt - cached history
against the compute-memory boundary L_m (§2.1, `pla_boundary`). Short ones wait in Q_s and
leave in AWD batches (`awd`), padded to a captured (L, B) shape when one holds them; long ones
wait in Q_l and advance one request at a time by chunks of C_l tokens. A step is either all
short or all long, never mixed, so a memory-bound batch never shares a step with a
compute-bound chunk.

Which class runs next (SLA-first): a short batch as soon as AWD says it is ready; else a long
chunk when one is waiting and the chunk's predicted time fits inside the tightest short slack
(a chunk started now would otherwise make a short request late); else nothing until the AWD
window closes (`wake_at`). In deadline-free ("token-max") mode there are no deadlines: short
batches leave when they reach the token budget or the window closes.

With spatial disaggregation (`pla_router`) an instance belongs to the short or the long pool
and receives mostly one class; it still serves whatever is in its queues, so an instance that
changes pool drains its old class first.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace

from flowyard.core.kvcache import KVCacheManager
from flowyard.core.plan import PrefillSlice, StepOutput, StepPlan
from flowyard.core.request import Request, RequestState, Status
from flowyard.costmodel.base import CostModel
from flowyard.policies.awd import AWDConfig, AWDState
from flowyard.policies.base import InstanceSnapshot, Role, StepResult
from flowyard.policies.prefill_only import PrefillOnlyScheduler
from flowyard.policies.pla_boundary import LengthModel, classify, fit_length_model, samples_from_cost_model
from flowyard.policies.slack import TTFTPredictor, deadline


@dataclass(frozen=True, slots=True)
class PLAConfig:
    awd: AWDConfig = field(default_factory=AWDConfig)
    long_chunk: int = 2048  # C_l
    deadline_free: bool = False  # token-max mode (offline jobs)
    graphs: bool = True  # pad short batches to captured shapes (CUDA graphs on GPU)
    spatial: bool = False  # short and long pools across prefill instances (policy pla-spatial)
    boundary: int | None = None  # L_m override (tokens); None: fitted from the predictor
    max_num_seqs: int = 256
    # Session-affine routing (pla_router): a later turn goes back to the prefill instance that
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
    busy_s: float = 0.0  # sum of predicted step times: the controller's utilisation signal


class PLAPrefillScheduler(PrefillOnlyScheduler):
    policy_name = "PLA-Serve"

    def __init__(self, instance: int, role: Role, kv: KVCacheManager, config: PLAConfig,
                 predictor: CostModel, lengths: LengthModel) -> None:
        super().__init__(instance, role, kv)
        self.config = config
        self.predict = TTFTPredictor(predictor)
        self.lengths = lengths
        self.short: dict[int, RequestState] = {}  # Q_s in arrival order
        self.long: deque[RequestState] = deque()  # Q_l
        self.awd = AWDState(config.awd)
        self.stats = PLAStats()
        self._slo_done = self._slo_late = 0  # the controller's SLA-deviation signal
        self._inflight: list[PrefillSlice] = []  # the step being executed (for snapshots)

    # -- queues ------------------------------------------------------------------------------
    def add_request(self, state: RequestState, now: float) -> bool:
        if not self._fits(state):
            return False
        if self._classify_short(state):
            self.short[state.id] = state
            self.awd.arrived(now)
        else:
            self.long.append(state)
        return True

    def _classify_short(self, st: RequestState) -> bool:
        """By what this instance really has to compute: the history counts only if its KV is
        in this instance's prefix cache (a turn routed away from its history is not short)."""
        if st.req.history_len == 0:
            return self.is_short(st.req)
        cached = min(self.kv.peek_prefix(st), st.req.prompt_len - 1)
        return is_short(replace(st.req, history_len=cached), self.lengths, self.config.boundary)

    def is_short(self, r: Request) -> bool:
        return is_short(r, self.lengths, self.config.boundary)

    def _min_slack(self, now: float, est: float) -> float | None:
        if self.config.deadline_free:
            return None
        slacks = [deadline(s.req) - now - est for s in self.short.values() if s.req.slo.ttft is not None]
        return min(slacks) if slacks else None

    def _short_estimate(self) -> float:
        """S_hat: predicted time of a short batch of the current target depth."""
        if not self.short:
            return 0.0
        batch = list(self.short.values())[: max(1, self.awd.depth)]
        todo = [self._todo(s) for s in batch]
        lb = self.config.awd.bucket(max(todo)) or max(todo)
        return self.predict.slices([PrefillSlice(s, s.seq_len - t, lb) for s, t in zip(batch, todo)])

    # -- scheduling --------------------------------------------------------------------------
    def schedule(self, now: float) -> StepPlan | None:
        plan = self._choose(now)
        self._inflight = plan.prefills if plan is not None else []
        return plan

    def _choose(self, now: float) -> StepPlan | None:
        if self.short:
            est = self._short_estimate()
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
        est = self._short_estimate()
        hol = next(iter(self.short.values())).req.arrival
        return self.awd.wake(now, len(self.short), self._min_slack(now, est), hol)

    def _todo(self, st: RequestState) -> int:
        """Tokens a waiting request will really compute here (its cached prefix excluded)."""
        return st.uncomputed - (self.kv.peek_prefix(st) if st.num_computed == 0 else 0)

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
            if not self._admit(st, st.uncomputed, plan):
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
        """Requests one step may prefill (mix mode subtracts its running decodes)."""
        return self.config.max_num_seqs

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
            if not self._admit(st, min(budget, st.uncomputed), plan):
                break
            self.long.popleft()  # an unfinished prompt goes back to the head after the step
            budget -= plan.prefills[-1].n
        if not plan.prefills:
            return None
        self.stats.long_chunks += 1
        self.stats.busy_s += self.predict.step(plan)
        return plan

    # -- results -----------------------------------------------------------------------------
    def update_from_output(self, plan: StepPlan, out: StepOutput) -> StepResult:
        self._inflight = []
        result = StepResult()
        for s in plan.prefills:
            st = s.state
            st.num_computed += s.n
            self.kv.register(st)
            if not s.samples:  # a long prompt's chunk: it goes back to the head of Q_l
                st.status = Status.WAITING
                self.long.appendleft(st)
                continue
            self._prefilled(st, out, result)
            if st.req.slo.ttft is not None and st.num_output == 1:  # not a recompute (mix mode)
                self._slo_done += 1
                self._slo_late += st.first_token_time > deadline(st.req)
        return result

    def abort(self, req_id: int) -> RequestState | None:
        st = self.short.pop(req_id, None) or self._handed_off.pop(req_id, None)
        if st is None:
            st = next((s for s in self.long if s.id == req_id), None)
            if st is None:
                return None
            self.long.remove(st)
        self.kv.free(req_id)
        st.status = Status.ABORTED
        return st

    # -- views -------------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.short) + len(self.long)

    @property
    def num_running(self) -> int:
        return len(self._inflight)

    def has_work(self) -> bool:
        return bool(self.short or self.long or self._handed_off)

    def snapshot(self) -> InstanceSnapshot:
        return InstanceSnapshot(
            instance=self.instance, role=self.role, num_running=len(self._inflight),
            num_waiting=self.num_waiting,
            waiting_tokens=self._short_tokens() + sum(s.uncomputed for s in self.long)
            + sum(s.n for s in self._inflight),
            running_tokens=sum(s.state.seq_len for s in self._inflight),
            kv_free_blocks=self.kv.num_free_blocks,
            kv_total_blocks=self.kv.num_blocks, block_size=self.kv.block_size,
            busy_s=self.stats.busy_s, slo_done=self._slo_done, slo_late=self._slo_late,
        )
