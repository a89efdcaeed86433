"""PLA-Serve in mix mode: no decode pool; the instances that prefill also decode (§1, "Mix").

Every instance is MIXED. Its prefill side is `pla.PLAPrefillScheduler` unchanged: prompts are
classified short or long by their uncached tokens, short ones leave in AWD batches, long ones
in C_l chunks, and a step never holds both. What mix mode adds is the decode side: a request
whose prompt is done stays here and decodes, and every step carries all running decodes
(decode first, as vLLM: they already hold KV and a user waits for each of their tokens) plus
the prefill part PLA chooses, or no prefill while the AWD window is open. Under `pla-mix` the
router's short and long pools span all instances, so an instance of the short pool decodes
the short prompts it prefilled and one of the long pool the long ones; a long chunk never
delays a short prompt's first token on a short-pool instance.

A step with decodes runs eagerly (captured graphs hold prefill rows only). When a decode needs
a KV block and none is free, the most recently started decode is preempted: its KV is dropped
and it is recomputed later through the short or long queue (vLLM's recompute preemption).
With nothing queued, the decodes run as one multi-step plan (`StepPlan.max_repeats`) with its
KV reserved, which any arrival cuts short: the same tokens as stepping one at a time.
"""

from __future__ import annotations

from flowyard.core.kvcache import KVCacheManager, cdiv
from flowyard.core.plan import StepOutput, StepPlan
from flowyard.core.request import RequestState, Status
from flowyard.costmodel.base import CostModel
from flowyard.policies.base import InstanceSnapshot, Role, StepResult
from flowyard.policies.pla import PLAConfig, PLAPrefillScheduler, fill_is_short
from flowyard.policies.decode_run import reserve_run
from flowyard.policies.pla_boundary import LengthModel


class PLAMixScheduler(PLAPrefillScheduler):
    policy_name = "PLA-Serve (mix)"

    def __init__(self, instance: int, role: Role, kv: KVCacheManager, config: PLAConfig,
                 predictor: CostModel, lengths: LengthModel, max_repeats: int = 512) -> None:
        if role is not Role.MIXED:
            raise ValueError("PLA-Serve's mix mode schedules colocated (MIXED) instances")
        super().__init__(instance, Role.PREFILL, kv, config, predictor, lengths)  # the prefill side
        self.role = role
        self.max_repeats = max(1, max_repeats)
        self.decoding: list[RequestState] = []  # prompt done, decoding here, in start order
        self.preempted = 0
        self._run: StepPlan | None = None  # a decode-only run whose later steps hold KV
        self._started = 0.0  # when the plan in flight (or its unapplied rest) started

    # -- scheduling --------------------------------------------------------------------------
    def schedule(self, now: float) -> StepPlan | None:
        plan = StepPlan()
        for st in list(self.decoding):
            if st.status is Status.RUNNING and self._grow(st, plan, now):
                plan.decodes.append(st)
        busy = self.stats.busy_s
        pre = self._choose(now)
        self.stats.busy_s = busy  # measured from the executed steps instead (decodes included)
        if pre is not None:
            plan.prefills = pre.prefills
            if pre.graph is not None and plan.decodes:
                self.stats.graphed -= 1  # decode rows do not fit a captured prefill shape
            else:
                plan.graph = pre.graph
        self._inflight = plan.prefills
        if plan.empty:
            return None
        self._started = now
        if not plan.prefills and not self.short and not self.long:
            plan.max_repeats = reserve_run(self.kv, plan.decodes, self.max_repeats, self.max_model_len)
            self._run = plan if plan.max_repeats > 1 else None
        return plan

    def _seq_room(self) -> int:
        return self.config.max_num_seqs - len(self.decoding)

    def _grow(self, st: RequestState, plan: StepPlan, now: float) -> bool:
        """KV for st's next token, preempting the most recently started decodes if needed."""
        while not self.kv.allocate(st.id, st.num_computed + 1):
            victim = self.decoding[-1]
            self._preempt(victim, plan, now)
            if victim is st:
                return False
        return True

    def _preempt(self, victim: RequestState, plan: StepPlan, now: float) -> None:
        self.decoding.remove(victim)
        if victim in plan.decodes:
            plan.decodes.remove(victim)
        self.kv.free(victim.id)
        victim.num_computed = 0
        victim.status = Status.PREEMPTED
        victim.preemptions += 1
        self.preempted += 1
        cached = self.kv.peek_prefix(victim)  # prompt + outputs so far are recomputed
        if fill_is_short(victim.seq_len - cached, cached, self.lengths, self.config.boundary):
            self.short[victim.id] = victim
            self.awd.arrived(now)
        else:
            self.long.append(victim)

    def shorten(self, plan: StepPlan, steps: int) -> None:
        for d in plan.decodes:
            self.kv.trim(d.id, d.num_computed + steps)
        plan.max_repeats = steps

    # -- results -----------------------------------------------------------------------------
    def _busy(self, out: StepOutput) -> None:
        if len(out.end_times):
            end = float(out.end_times[-1])
            self.stats.busy_s += end - self._started
            self._started = end

    def advance(self, plan: StepPlan, out: StepOutput) -> None:
        self._busy(out)
        for d in plan.decodes:
            d.num_computed += out.steps
            d.record_tokens(out.end_times)
        plan.max_repeats -= out.steps

    def update_from_output(self, plan: StepPlan, out: StepOutput) -> StepResult:
        self._run = None
        self._busy(out)
        ended: list[RequestState] = []
        for d in plan.decodes:
            d.num_computed += out.steps
            d.record_tokens(out.end_times)
            if out.sampled is not None:
                d.output_tokens.extend(out.sampled.get(d.id, ()))
            if out.steps < plan.max_repeats:
                self.kv.trim(d.id, d.num_computed)
            self.kv.register(d)
            if self._stops(d, out):
                ended.append(d)
        result = super().update_from_output(plan, out)  # the prefill slices, via _prefilled
        for d in ended:
            self.decoding.remove(d)
            self._finish(d, float(out.end_times[-1]), result)
        return result

    def _stops(self, st: RequestState, out: StepOutput) -> bool:
        return st.done or st.id in out.stopped or st.seq_len >= self.max_model_len

    def _finish(self, st: RequestState, t: float, result: StepResult) -> None:
        st.status = Status.FINISHED
        st.finish_time = t
        self.kv.free(st.id)
        result.finished.append(st)

    def _prefilled(self, st: RequestState, out: StepOutput, result: StepResult) -> None:
        """st's prompt is done and sampled a token: it finishes, or decodes here."""
        st.record_tokens(out.end_times[:1])
        if out.sampled is not None:
            st.output_tokens.extend(out.sampled.get(st.id, ()))
        if self._stops(st, out):
            self._finish(st, float(out.end_times[0]), result)
            return
        st.status = Status.RUNNING
        self.decoding.append(st)
        if st.num_output == 1:
            result.prefilled.append(st)

    def abort(self, req_id: int) -> RequestState | None:
        st = next((d for d in self.decoding if d.id == req_id), None)
        if st is None:
            return super().abort(req_id)
        self.decoding.remove(st)
        self.kv.free(req_id)
        st.status = Status.ABORTED
        return st

    # -- views -------------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self._inflight) + len(self.decoding)

    def has_work(self) -> bool:
        return bool(self.decoding) or super().has_work()

    def snapshot(self) -> InstanceSnapshot:
        s = super().snapshot()
        s.num_running += len(self.decoding)
        s.running_tokens += sum(d.seq_len for d in self.decoding)
        s.num_decoding = len(self.decoding)
        if self._run is not None:  # blocks held for steps after the one in flight count as free
            bs = self.kv.block_size
            s.kv_free_blocks += sum(self.kv.num_held(d.id) - cdiv(d.num_computed + 1, bs)
                                    for d in self._run.decodes)
        return s
