"""The local scheduler of the `flowyard` policy: one `LocalCore` per (MIXED) instance whose
chunked prefill selector (`framework.chunked.ChunkedSelector`) is composed of FlowPrefill's
S-EDF order, a TPOT-slack budget rule after DynaServe's Alg. 2 (`TPOTSlackBudget`), parking
admission (`Admission`), decode places by banked slack (`SlackPlaces`) and Moore-Hodgson
shedding (`MooreHodgsonShedding`); `flowyard_selector` assembles them.

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

from typing import Callable, Sequence

from flowyard.core.kvcache import KVCacheManager
from flowyard.core.plan import BatchShape, StepOutput, StepPlan
from flowyard.core.request import RequestState, Status
from flowyard.costmodel.base import CostModel
from flowyard.policies.dynaserve.local_batch import LocalConfig, MeasuredStep, ProfileTable
from flowyard.policies.framework.chunked import ChunkedSelector
from flowyard.policies.framework.contracts import Role
from flowyard.policies.framework.local_core import LocalCore
from flowyard.policies.framework.order import QueueOrder, moore_hodgson
from flowyard.policies.framework.parts import (Admission, CoreView, DecodePlaces, FirstAdmitted, Ranked, StepBudget,
                                               UrgentQuery, want)
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


class TPOTSlackBudget:
    """The step's prefill budget bounded by its decodes' TPOT SLO (module docstring: Budget,
    TTFT rescue): the decodes that take the max_num_seqs places plus Alg. 2's largest prefill
    budget within the TPOT value the step answers for (`limit`), capped at the chunk; a step
    without decodes (or `tbt_budget` off) takes the full chunk. One profile table per TPOT
    value, each fed every measured step."""

    def __init__(self, cost: CostModel, *, chunk: int = 2048, headroom: float = 0.9, min_prefill: int = 64,
                 tbt_budget: bool = True, slack: bool = True, rescue: float | None = None) -> None:
        LocalConfig(headroom=headroom, chunk_cap=chunk, min_prefill=min_prefill, max_prefill=chunk)  # validates
        self.cost, self.chunk, self.headroom, self.min_prefill = cost, chunk, headroom, min_prefill
        self.tbt_budget, self.slack, self.rescue = tbt_budget, slack, rescue
        self.tables: dict[float, ProfileTable] = {}
        self._measure = MeasuredStep(cost)

    def table(self, tpot: float) -> ProfileTable:
        t = self.tables.get(tpot)
        if t is None:
            cfg = LocalConfig(tbt_slo=tpot, headroom=self.headroom, chunk_cap=self.chunk,
                              min_prefill=self.min_prefill, max_prefill=self.chunk)
            t = self.tables[tpot] = ProfileTable(self.cost, cfg)
        return t

    def step(self, decodes: Sequence[RequestState], now: float, core: CoreView,
             urgent: UrgentQuery) -> StepBudget:
        """The decodes that join this step are the first max_num_seqs in place order."""
        ready = decodes[:core.max_num_seqs]
        n = len(ready)
        tpots = [r.req.slo.tpot for r in ready if r.req.slo.tpot is not None]
        if not self.tbt_budget or not n or not tpots:
            prefill = self.chunk
        else:
            ctx = sum(r.num_computed + 1 for r in ready) / n
            history = max((r.num_computed for r in core.running if r.in_prefill), default=0)
            budget = self.table(self.limit(ready, min(tpots), now)).budget(n, ctx, history)
            prefill = min(self.chunk, max(self.min_prefill, budget))
            if self.rescue is not None and prefill < self.chunk:
                prefill = self.rescued(ready, ctx * n, prefill, now, urgent, self.rescue) or prefill
        return StepBudget(ready, prefill, n + prefill, n)

    def rescued(self, ready: Sequence[RequestState], ctx_sum: float, b: int, now: float, urgent: UrgentQuery,
                share: float) -> int | None:
        """TTFT rescue (module docstring): the smallest doubling of the budget b with which the
        top-ranked prompt makes its deadline, if no more than `share` of this step's decodes
        lose banked slack by it; else None."""
        top = urgent(now)
        if top is None:
            return None
        head, due = top.state, top.deadline
        u, h, n = want(head), head.num_computed, len(ready)

        def step(b: int) -> float:
            return float(self.cost.step_time(BatchShape.chunk(h, min(u, b), n, ctx_sum)))

        if top.given_up or not u or now + -(-u // b) * step(b) <= due:
            return None
        while b < self.chunk:
            b = min(self.chunk, 2 * b)
            t = step(b)
            if now + -(-u // b) * t <= due:
                break
        else:
            return None  # not even full chunks save it
        spent = sum(1 for r in ready if banked(r, now) < t)
        return b if spent <= share * n else None

    def limit(self, ready: Sequence[RequestState], tpot: float, now: float) -> float:
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

    def planned(self, plan: StepPlan, budget: StepBudget, now: float) -> None:
        self._measure.planned(plan, now)

    def executed(self, plan: StepPlan, out: StepOutput) -> None:
        """Record the step in every profile table (they differ only in the SLO they answer for)."""
        m = self._measure.measured(out)
        if m is not None:
            for t in self.tables.values():
                t.record(*m)


class SlackPlaces:
    """Decode places by banked slack (module docstring): when more decodes hold KV than there
    are places, the least banked TPOT slack first, so a parked request takes the place of one
    that ran ahead of its SLO and the wait is spread over all instead of landing on the parked
    requests' first gaps. A request without a TPOT SLO is ranked as if it had `default_tpot`,
    so it is not starved."""

    def __init__(self, default_tpot: float = 0.1) -> None:
        self.default_tpot = default_tpot

    def order(self, decodes: list[RequestState], now: float, places: int) -> list[RequestState]:
        if len(decodes) <= places:
            return decodes
        return sorted(decodes, key=lambda r: banked(r, now, self.default_tpot))

    def allows_run(self, core: CoreView) -> bool:
        """No multi-step decode run while the places rotate (more decodes than places)."""
        decodes = sum(1 for r in core.running if r.status is Status.RUNNING and not r.in_prefill)
        return decodes <= core.max_num_seqs


class MooreHodgsonShedding:
    """Overload (module docstring: Shedding at the shared rate): the prompts Moore-Hodgson
    gives up (`order.moore_hodgson`), run back to back in rank order at this instance's rate,
    rank with the late ones, so the rest all make their TTFT. `shared`: each prompt is timed
    at the step's stretch beside its decodes, step(budget beside them) / step(budget alone)."""

    def __init__(self, ttft_hat: Callable[[RequestState], float], cost: CostModel, shared: bool = True) -> None:
        self.ttft_hat, self.cost, self.shared = ttft_hat, cost, shared

    def stretch(self, budget: StepBudget) -> float:
        """How much longer prefill takes in this step's shape than alone (1 when timed alone)."""
        n = len(budget.decodes)
        if not self.shared or not n:
            return 1.0
        ctx_sum = sum(r.num_computed + 1 for r in budget.decodes)
        b = budget.prefill
        alone = float(self.cost.step_time(BatchShape.chunk(0, b)))
        shared = float(self.cost.step_time(BatchShape.chunk(0, b, n, ctx_sum)))
        return max(1.0, shared / alone) if alone > 0 else 1.0

    def shed(self, queue: list[Ranked], now: float, budget: StepBudget) -> list[Ranked]:
        jobs = [(q.key[1], self.ttft_hat(q.state), i) for i, q in enumerate(queue) if q.key[0] == 0]
        if not jobs:
            return queue
        f = self.stretch(budget)  # priced only when some prompt can still make its deadline
        late = moore_hodgson(((due, f * t, i) for due, t, i in jobs), now)
        if not late:
            return queue
        for i in late:
            queue[i] = queue[i]._replace(key=given_up(queue[i].key))
        queue.sort(key=Ranked.sort_key)
        return queue


def flowyard_selector(cost: CostModel, *, chunk: int = 2048, order: str = "s-edf", tbt_budget: bool = True,
                      headroom: float = 0.9, min_prefill: int = 64, slack: bool = True, park: float = 1.0,
                      shed: bool = False, prefill_preempts: bool = True, rescue: float | None = None,
                      places: str = "fcfs", default_tpot: float = 0.1, shed_rate: str = "alone") -> ChunkedSelector:
    """flowyard's prefill selector: chunked prefill in `order` (started and queued prompts
    ranked together under a slack order), the TPOT-slack budget, parking admission with chunks
    that wait for KV (unless `prefill_preempts`), decode places by `places`, and Moore-Hodgson
    shedding (`shed`, under S-EDF) timed at `shed_rate`."""
    if places not in PLACES:
        raise ValueError(f"decode places must be one of {PLACES}, got {places!r}")
    if shed_rate not in SHED_RATES:
        raise ValueError(f"shed_rate must be one of {SHED_RATES}, got {shed_rate!r}")
    queue_order = QueueOrder(order)
    ttft_hat = TTFTPredictor(cost).request if queue_order.needs_ttft else None
    budget = TPOTSlackBudget(cost, chunk=chunk, headroom=headroom, min_prefill=min_prefill, tbt_budget=tbt_budget,
                             slack=slack, rescue=rescue)
    admission = Admission(park=park, chunk_preempts=prefill_preempts, runs_while_queued=False)
    decode_places: DecodePlaces = SlackPlaces(default_tpot) if places == "slack" else FirstAdmitted()
    shedding = MooreHodgsonShedding(ttft_hat, cost, shed_rate == "shared") \
        if shed and ttft_hat is not None else None
    return ChunkedSelector(budget, order=queue_order, ttft_hat=ttft_hat, chunk_cap=chunk, admission=admission,
                           places=decode_places, shedding=shedding, together=True)


def flowyard_scheduler(instance: int, role: Role, kv: KVCacheManager, cost: CostModel, *, chunk: int = 2048,
                       order: str = "s-edf", tbt_budget: bool = True, max_num_seqs: int = 256,
                       max_model_len: int | None = None, max_repeats: int = 512, slack: bool = True,
                       park: float = 1.0, shed: bool = False, prefill_preempts: bool = True,
                       rescue: float | None = None, places: str = "fcfs", default_tpot: float = 0.1,
                       shed_rate: str = "alone") -> LocalCore:
    if role is not Role.MIXED:
        raise ValueError(f"flowyard's instances are MIXED (stateless, Arrow), got {role}")
    sel = flowyard_selector(cost, chunk=chunk, order=order, tbt_budget=tbt_budget, slack=slack, park=park, shed=shed,
                            prefill_preempts=prefill_preempts, rescue=rescue, places=places,
                            default_tpot=default_tpot, shed_rate=shed_rate)
    return LocalCore(instance, role, kv, sel, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                     max_repeats=max_repeats)
