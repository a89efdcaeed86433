"""The local scheduler of the `flowyard` policy: one `LocalCore` per (MIXED) instance whose
prefill selector takes FlowPrefill's queue order and DynaServe's TBT-bounded step budget.

- **Order (FlowPrefill §5.2, S-EDF).** Queued prompts are ranked by sgn(slack)/deadline with
  slack = TTFT deadline − now − TTFT-hat: among requests that can still make their TTFT SLO,
  the earliest deadline goes first; hopeless ones go last instead of blocking feasible ones.
  Under SLOs that depend on the prompt length (short prompts tight, long ones loose) this is
  what lets short prompts overtake a long prompt's chunks. Operator-level preemption is a
  PREFILL-instance feature (`flowprefill.FlowPrefillSelector`); on these MIXED instances a
  running step is never cut, but the ranking is redone at every step over started and queued
  prompts alike (chunk-level preemption: a started prompt that ranks lower gets no chunk this
  step and keeps its KV), so one step bounds how long an urgent prompt waits. vLLM's selector
  instead lets every started prompt continue first, so a long prompt's chunks hold the
  instance until it is done.
- **Prefill-ahead admission (parking).** With `park` > 1 a prompt may start while up to
  park x max_num_seqs requests run (its KV must fit): once prefilled it has its first token
  and waits, KV held, for one of the max_num_seqs decode places (earliest admitted first).
  Decode batches never exceed max_num_seqs. When the decode places are the bottleneck (long
  outputs), a colocated instance otherwise holds every new prompt in its queue until a decode
  ends, and the wait lands on TTFT; disaggregated policies already work this way (a prefilled
  request waits in its decode instance's migration queue), where the wait lands on the first
  inter-token gap, which a TPOT SLO averaged over a long output absorbs.
- **Decode places by banked slack.** When more requests hold KV than there are decode places,
  the places go to the decodes with the least banked TPOT slack (`places` "slack"; `banked`),
  not to the earliest admitted. First come, first served, a parked request waits until a
  whole output ends, a wait its first gap cannot absorb when its own output is short, while
  the requests that hold the places run well inside their SLO; by slack the places rotate
  and every request's mean gap grows a little. Reasoning shape (P219/D1467) at TTFT 0.5-6 s
  by length and TPOT 100 ms: 22 -> 24 req/s (vLLM 20).
- **A chunk waits for KV instead of preempting.** vLLM lets a prompt's next chunk free KV by
  recompute-preempting the most recently admitted running request; with long prompts that is
  often another half-prefilled prompt, whose work is thrown away and redone (Mooncake at loose
  TPOT: 400 preemptions, 1.7x the prompt tokens computed). Here a started prompt whose chunk
  does not fit skips the step and keeps its KV; decodes finishing free blocks. Only a step
  that would otherwise be empty lets the chunk preempt as vLLM does, so the instance always
  makes progress (`prefill_preempts` restores vLLM's rule).
- **TTFT rescue.** When the top-ranked prompt would miss its TTFT deadline at the step's
  TPOT-bounded budget but makes it with a larger one (the budget doubled up to the chunk),
  the step takes the smallest such budget, as long as its longer step breaks the banked TPOT
  slack of at most `rescue` (a tenth) of its decodes. One prompt saved for a few decodes'
  slack: TPOT is a mean, and a decode's later steps pay back one long step. BurstGPT at
  25 ms TPOT and 250 ms TTFT, colocated: 4.25 -> 4.81 req/s (vLLM's chunked prefill, which
  never protects TPOT, 4.62).
- **Shedding at the shared rate.** Moore-Hodgson (`shed`) runs the queue one prompt after
  another; on a MIXED instance each step also carries its decodes, so a prompt takes longer
  than alone by the step's stretch, step(budget beside the decodes) / step(budget alone). The
  prompts are timed at that rate (`shed_rate` "shared"), not alone: timed alone, the shedding
  keeps prompts it cannot finish, which then miss after taking the time of those behind them.
  Azure Conv at TTFT 0.5/2/6 s by length, TPOT 100 ms: 50 -> 56 req/s.
- **Budget (DynaServe Alg. 2).** When a step carries decodes, its prefill tokens are the
  largest budget whose predicted step time (online profile table, `dynaserve.local_batch`) stays
  within the tightest TPOT SLO among those decodes (times a headroom), capped at the chunk
  size; a step without decodes takes the full chunk. With a loose TPOT this is vLLM's
  2048-token chunked prefill; with a tight one the decodes keep their TPOT while prefill
  still advances every step. There is one profile table per TPOT value seen (usually one to
  three), each fed every measured step.
"""

from __future__ import annotations

from flowyard.core.kvcache import KVCacheManager
from flowyard.core.plan import BatchShape, StepOutput, StepPlan
from flowyard.core.request import RequestState, Status
from flowyard.costmodel.base import CostModel
from flowyard.policies.framework.contracts import Role
from flowyard.policies.framework.local_core import LocalCore
from flowyard.policies.dynaserve.local_batch import DynaServeSelector, LocalConfig, ProfileTable
from flowyard.policies.framework.order import QueueOrder, moore_hodgson
from flowyard.policies.framework.slack import TTFTPredictor, given_up

INF = float("inf")
PLACES = ("fcfs", "slack")
SHED_RATES = ("alone", "shared")


def banked(st: RequestState, now: float, default_tpot: float | None = None) -> float:
    """Seconds a decode may still wait and meet its TPOT SLO, a mean ((last - first) / (n - 1)):
    with n tokens out since its first at f, the next must come by f + tpot x n (INF without an
    SLO, or default_tpot standing in for it)."""
    tpot = st.req.slo.tpot if st.req.slo.tpot is not None else default_tpot
    if tpot is None or st.first_token_time is None:
        return INF
    return tpot * st.num_output - (now - st.first_token_time)


class FlowyardSelector(DynaServeSelector):
    """Chunked prefill in `order` with a per-step budget bounded by the decodes' TPOT SLO."""

    def __init__(self, cost: CostModel, *, chunk: int = 2048, order: str = "s-edf", tbt_budget: bool = True,
                 headroom: float = 0.9, min_prefill: int = 64, slack: bool = True, park: float = 1.0,
                 shed: bool = False, prefill_preempts: bool = True, rescue: float | None = None,
                 places: str = "fcfs", default_tpot: float = 0.1, shed_rate: str = "alone") -> None:
        local = LocalConfig(tbt_slo=1.0, headroom=headroom, chunk_cap=chunk, min_prefill=min_prefill,
                            max_prefill=chunk)
        super().__init__(cost, local)
        self.chunk, self.tbt_budget, self.slack, self.shed = chunk, tbt_budget, slack, shed
        self.prefill_preempts, self.rescue = prefill_preempts, rescue
        if park < 1:
            raise ValueError(f"park must be >= 1 (a multiple of max_num_seqs), got {park}")
        if places not in PLACES:
            raise ValueError(f"decode places must be one of {PLACES}, got {places!r}")
        if shed_rate not in SHED_RATES:
            raise ValueError(f"shed_rate must be one of {SHED_RATES}, got {shed_rate!r}")
        self.park, self.places, self.default_tpot, self.shed_rate = park, places, default_tpot, shed_rate
        self._ready: list[RequestState] = []  # this step's decodes (`shed_rate` "shared" prices them)
        self.order = QueueOrder(order)
        self.ttft_hat = TTFTPredictor(cost).request if self.order.needs_ttft else None
        self._tables: dict[float, ProfileTable] = {}

    def _table(self, tpot: float) -> ProfileTable:
        t = self._tables.get(tpot)
        if t is None:
            cfg = LocalConfig(tbt_slo=tpot, headroom=self.local.headroom, chunk_cap=self.chunk,
                              min_prefill=self.local.min_prefill, max_prefill=self.chunk)
            t = self._tables[tpot] = ProfileTable(self.profile.cost, cfg)
        return t

    def decode_order(self, decodes: list[RequestState], now: float) -> list[RequestState]:
        """Who takes the max_num_seqs decode places when more decodes hold KV (parked, `park`):
        the earliest admitted (fcfs), or the least banked TPOT slack first (`places` "slack"),
        so a parked request takes the place of one that ran ahead of its SLO and the wait is
        spread over all instead of landing on the parked requests' first gaps. A request
        without a TPOT SLO is ranked as if it had `default_tpot`, so it is not starved."""
        if self.places == "fcfs" or len(decodes) <= self.core.max_num_seqs:
            return decodes
        return sorted(decodes, key=lambda r: banked(r, now, self.default_tpot))

    def decode_cap(self, now: float, decodes: list[RequestState]) -> float:
        """The decodes that join this step: the first max_num_seqs in `decode_order`."""
        ready = decodes[:self.core.max_num_seqs]
        n = len(ready)
        tpots = [r.req.slo.tpot for r in ready if r.req.slo.tpot is not None]
        if not self.tbt_budget or not n or not tpots:
            self._budget = self.chunk
        else:
            ctx = sum(r.num_computed + 1 for r in ready) / n
            history = max((r.num_computed for r in self.core.running if r.in_prefill), default=0)
            budget = self._table(self._limit(ready, min(tpots), now)).budget(n, ctx, history)
            self._budget = min(self.chunk, max(self.local.min_prefill, budget))
            if self.rescue is not None and self._budget < self.chunk:
                self._budget = self._rescued(ready, ctx * n, now) or self._budget
        self.token_budget = n + self._budget
        self._ready = ready
        return n

    def _stretch(self) -> float:
        """How much longer prefill takes in this step's shape than alone: the decodes' share
        (`shed_rate` "shared"; 1 when timed alone)."""
        n = len(self._ready)
        if self.shed_rate == "alone" or not n:
            return 1.0
        ctx_sum = sum(r.num_computed + 1 for r in self._ready)
        cost, b = self.profile.cost, self._budget
        alone = float(cost.step_time(BatchShape.chunk(0, b)))
        return max(1.0, float(cost.step_time(BatchShape.chunk(0, b, n, ctx_sum))) / alone) if alone > 0 else 1.0

    def _rescued(self, ready: list, ctx_sum: float, now: float) -> int | None:
        """TTFT rescue (module docstring): the smallest doubling of the budget with which the
        top-ranked prompt makes its deadline, if this step's decodes can spare it; else None."""
        if self.order.static:
            return None
        cands = [r for r in self.core.running if r.in_prefill and r.status is Status.RUNNING]
        cands += self.waiting_states()
        if not cands:
            return None
        (late, due, *_), head = min(((self.order.key(st, now, self.ttft_hat), st) for st in cands),
                                    key=lambda e: e[0])
        u, h, n = self.want(head), head.num_computed, len(ready)

        def step(b: int) -> float:
            return float(self.profile.cost.step_time(BatchShape.chunk(h, min(u, b), n, ctx_sum)))

        b = self._budget
        if late or not u or now + -(-u // b) * step(b) <= due:
            return None
        while b < self.chunk:
            b = min(self.chunk, 2 * b)
            t = step(b)
            if now + -(-u // b) * t <= due:
                break
        else:
            return None  # not even full chunks save it
        spent = sum(1 for r in ready if banked(r, now) < t)
        return b if spent <= self.rescue * n else None

    def _limit(self, ready: list, tpot: float, now: float) -> float:
        """The TPOT value this step's budget answers for: the tightest SLO, or (`slack`) the
        largest rung of tpot x 2^k that every decode's banked slack covers. TPOT is a mean
        ((last - first) / (n - 1)): a decode with k tokens out since its first at f still
        meets it after a step ending at now + T iff T <= tpot x k - (now - f), so decodes that
        ran faster than their SLO have banked time a longer prefill step may spend (vLLM's
        long outputs amortise whole chunks; per-step TBT bounds would starve prefill)."""
        if not self.slack:
            return tpot
        spare = min((banked(r, now) / r.req.slo.tpot for r in ready if r.req.slo.tpot is not None), default=INF)
        rung = 1.0
        while rung < 64 and spare >= 2 * rung:
            rung *= 2
        return tpot * rung

    def select(self, plan: StepPlan, now: float) -> StepPlan:
        """Started and queued prompts ranked together in `order` (module docstring); a static
        order (fcfs, edf) keeps vLLM's rule (started prompts first)."""
        if self.order.static:
            return super().select(plan, now)
        core = self.core
        key = self.order.key
        queued = self.queued(now)
        started = [r for r in core.running if r.in_prefill and r.status is Status.RUNNING]
        # (rank key, started first on ties, their order, state, whether it is queued)
        queue = [(key(st, now, self.ttft_hat), 0, k, st, False) for k, st in enumerate(started)]
        queue += [(key(st, now, self.ttft_hat), 1, seq, st, True) for seq, st in queued]
        queue.sort(key=lambda q: (q[0], q[1], q[2]))
        if self.shed and self.order.needs_ttft:
            queue = self._shed(queue, now)
        budget = self.token_budget - plan.num_tokens
        taken: list[RequestState] = []
        admit = True  # False once a queued prompt found no KV: no later one overtakes it
        for _, _, _, st, is_queued in queue:
            if budget <= 0:
                break
            if not is_queued:  # started: its KV grows chunk by chunk (held while it waits)
                if st.status is Status.RUNNING:  # else preempted by an earlier grow this step
                    budget -= self.continue_prompt(st, budget, plan, now)
                continue
            if not admit or len(core.running) >= core.max_num_seqs * self.park:
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

    def _shed(self, queue: list[tuple], now: float) -> list[tuple]:
        """Overload: the prompts Moore-Hodgson gives up (`order.moore_hodgson`), run back to
        back in this order at this instance's rate (`shed_rate`), rank with the late ones, so
        the rest all make their TTFT."""
        jobs = [(q[0][1], self.ttft_hat(q[3]), i) for i, q in enumerate(queue) if q[0][0] == 0]
        if not jobs:
            return queue
        f = self._stretch()  # priced only when some prompt can still make its deadline
        late = moore_hodgson(((due, f * t, i) for due, t, i in jobs), now)
        if not late:
            return queue
        for i in late:
            queue[i] = (given_up(queue[i][0]), *queue[i][1:])
        queue.sort(key=lambda q: (q[0], q[1], q[2]))
        return queue

    def allows_run(self) -> bool:
        """No multi-step decode run while prompts wait or while the decode places rotate
        (more decodes than places, `places` "slack"): S-EDF's ranking, the KV admission rule
        and the places are redone at every step, so a run would not be the steps it stands for."""
        if self.num_waiting:
            return False
        if self.places == "fcfs":
            return True
        decodes = sum(1 for r in self.core.running if r.status is Status.RUNNING and not r.in_prefill)
        return decodes <= self.core.max_num_seqs

    def executed(self, plan, out: StepOutput) -> None:
        """Record the step in every profile table (they differ only in the SLO they answer for)."""
        if self._composed is not None and len(out.end_times):
            pf, ctx, n, start, model = self._composed
            for t in self._tables.values():
                t.record(pf, ctx, n, float(out.end_times[0]) - start, model)
        self._composed = None


def flowyard_scheduler(instance: int, role: Role, kv: KVCacheManager, cost: CostModel, *, chunk: int = 2048,
                       order: str = "s-edf", tbt_budget: bool = True, max_num_seqs: int = 256,
                       max_model_len: int | None = None, max_repeats: int = 512, slack: bool = True,
                       park: float = 1.0, shed: bool = False, prefill_preempts: bool = True,
                       rescue: float | None = None, places: str = "fcfs", default_tpot: float = 0.1,
                       shed_rate: str = "alone") -> LocalCore:
    if role is not Role.MIXED:
        raise ValueError(f"flowyard's instances are MIXED (stateless, Arrow), got {role}")
    sel = FlowyardSelector(cost, chunk=chunk, order=order, tbt_budget=tbt_budget, slack=slack, park=park, shed=shed,
                           prefill_preempts=prefill_preempts, rescue=rescue, places=places, default_tpot=default_tpot,
                           shed_rate=shed_rate)
    return LocalCore(instance, role, kv, sel, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                     max_repeats=max_repeats)
