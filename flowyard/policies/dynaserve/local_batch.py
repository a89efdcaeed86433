"""DynaServe's local scheduler (Alg. 2, §4.2): SLO-aware batch composition per instance.

A fixed chunk size bounds step latency only loosely: what a step costs depends on its whole
composition (prefill tokens, number of decodes, their mean context). So before every step the
scheduler takes all ready decodes first, looks up in an online profile table the largest prefill
token budget whose predicted step time stays within the TBT SLO for that many decodes at that
context, and then fills that budget with prefill chunks in arrival order, each request taking at
most `chunk_cap` tokens. After every step it records (prefill tokens, mean decode context,
decode count, measured time) in the table, so the prediction follows what the instance really
does; before any measurement (cold start) it is the predictor cost model's.

Everything else (queues, KV accounting, preemption, migrations, micro-request split handling)
is the core's (`local_core.LocalCore`): the selector is vLLM's chunked one composed with
Alg. 2's budget rule (`TBTBudget`), which returns each step's token budget, and the core's
`migration_patience_s` breaks migration deadlocks between the instances of a pair.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from flowyard.core.kvcache import KVCacheManager
from flowyard.core.plan import BatchShape, StepOutput, StepPlan
from flowyard.core.request import RequestState
from flowyard.costmodel.base import CostModel
from flowyard.policies.framework.contracts import Role
from flowyard.policies.framework.chunked import ChunkedSelector
from flowyard.policies.framework.local_core import LocalCore
from flowyard.policies.framework.parts import CoreView, StepBudget, UrgentQuery

# Prefill budgets the table answers with (tokens), and the bucket edges of its keys.
PREFILL_GRID: tuple[int, ...] = (0, 16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536,
                                 2048, 3072, 4096, 6144, 8192)


def _bucket(x: float) -> int:
    """Power-of-two bucket (0, 1, 2, 4, 8, ...): table keys for decode count and context."""
    return 0 if x < 1 else 1 << int(x).bit_length() - 1


@dataclass(frozen=True, slots=True)
class LocalConfig:
    """Alg. 2's knobs: the TBT SLO a step must stay within (with a safety factor), the per-
    request chunk cap, a prefill floor so prompts progress even when decodes alone exceed the
    SLO, the weight of a new measurement in the table's moving average, and how long a
    micro-request's second segment waits for KV here before it is recomputed instead."""

    tbt_slo: float = 0.1
    headroom: float = 0.9
    chunk_cap: int = 1024
    min_prefill: int = 16
    max_prefill: int = 8192
    alpha: float = 0.2
    migration_patience_s: float = 0.5  # then a migration that finds no KV here is recomputed
    # None: Alg. 2 (the profile table's SLO-aware budget before every step). An int: every step
    # takes this many prefill tokens whatever its decodes cost, the "naive" batching §4.2 argues
    # against (the ablation of Fig. 11)
    fixed_prefill: int | None = None

    def __post_init__(self) -> None:
        if not self.tbt_slo > 0 or not 0 < self.headroom <= 1 or self.chunk_cap < 1:
            raise ValueError("tbt_slo > 0, 0 < headroom <= 1 and chunk_cap >= 1 required")
        if self.fixed_prefill is not None and self.fixed_prefill < 1:
            raise ValueError("fixed_prefill must be positive (or None for Alg. 2's SLO-aware budget)")


# cost model -> grid -> (model_time memo, _grid_times memo), shared by every instance's table:
# the cost model's times are a pure function of the shape, so the tables of a thousand
# instances keep one copy instead of filling a thousand (most of a large run's memory)
_MEMOS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _memos(cost: CostModel, grid: tuple[int, ...]) -> tuple[dict, dict]:
    per = _MEMOS.get(cost)
    if per is None:
        per = _MEMOS[cost] = {}
    memo = per.get(grid)
    if memo is None:
        memo = per[grid] = ({}, {})
    return memo


class ProfileTable:
    """Measured/predicted step-time ratios by (decode count, context, prefill) bucket.

    The prediction for a shape is the cost model's time times the ratio of its cell (the
    global ratio while the cell has no measurement; 1 before any). Storing ratios rather than
    raw times lets one measurement inform every shape of its cell. Ratios are used rounded to
    1 % steps, so a budget depends only on the table's contents, never on when it was
    looked up (the budget cache stays exact). Only steps with prefill tokens are recorded:
    the lookup always prices a step with prefill, and decode-only steps are the ones a
    simulator may fold into multi-step runs."""

    QUANTUM = 0.01

    def __init__(self, cost: CostModel, cfg: LocalConfig) -> None:
        self.cost, self.cfg = cost, cfg
        self.ratio: dict[tuple[int, int, int], float] = {}  # EWMA of measured / cost model
        self._used: dict[tuple[int, int, int], float] = {}  # the same, rounded
        self.global_ratio = 1.0
        self._global_used = 1.0
        self.samples = 0
        self._budget: dict[tuple[int, int, int], int] = {}
        self._grid = [g for g in PREFILL_GRID[1:] if g <= cfg.max_prefill]  # budgets tried, in order
        self._grid_buckets = [_bucket(g) for g in self._grid]
        self._model_times, self._grid_cache = _memos(cost, tuple(self._grid))

    def _grid_times(self, ctx: float, n: int, history: int) -> list[float]:
        """model_time of every grid budget at this (bucketed) composition, computed once."""
        key = (ctx, n, history)
        times = self._grid_cache.get(key)
        if times is None:
            if len(self._grid_cache) > 1 << 14:
                self._grid_cache.clear()
            g = np.array(self._grid, dtype=float)  # one vectorised call for the whole grid
            attn, kv = g * (history + (g + 1) / 2), history + g  # arrays: BatchShape evaluates element-wise
            shape = BatchShape(prefill_tokens=g, prefill_seqs=1, prefill_attn=attn,  # type: ignore[arg-type]
                               prefill_kv=kv, decode_seqs=n, decode_ctx=ctx * n)  # type: ignore[arg-type]
            times = self._grid_cache[key] = np.broadcast_to(self.cost.step_time(shape), g.shape).tolist()
        return times

    def _key(self, prefill: float, ctx: float, n: int) -> tuple[int, int, int]:
        return (_bucket(n), _bucket(ctx), _bucket(prefill))

    @staticmethod
    def shape(prefill: int, ctx: float, n: int, history: int = 0) -> BatchShape:
        return BatchShape(prefill_tokens=prefill, prefill_seqs=1 if prefill else 0,
                          prefill_attn=prefill * (history + (prefill + 1) / 2), prefill_kv=history + prefill,
                          decode_seqs=n, decode_ctx=ctx * n)

    def model_time(self, prefill: int, ctx: float, n: int, history: int = 0) -> float:
        """The cost model's time (cold start) for this composition; `history` tokens of the
        prompt already computed (a later chunk attends to them all). Memoised: the budget
        search asks for the same bucketed shapes again every time the ratios move."""
        key = (prefill, ctx, n, history)
        t = self._model_times.get(key)
        if t is None:
            if len(self._model_times) > 1 << 16:
                self._model_times.clear()
            t = self._model_times[key] = float(self.cost.step_time(self.shape(prefill, ctx, n, history)))
        return t

    def predict(self, prefill: int, ctx: float, n: int, history: int = 0) -> float:
        r = self._used.get(self._key(prefill, ctx, n), self._global_used)
        return self.model_time(prefill, ctx, n, history) * r

    def _round(self, r: float) -> float:
        return float(np.exp(round(np.log(r) / self.QUANTUM) * self.QUANTUM))

    def record(self, prefill: int, ctx: float, n: int, seconds: float,
               predicted: float | None = None) -> None:
        """One executed step with prefill: its composition, measured time and (if known) the
        cost model's time for its exact shape (chunk histories included)."""
        if predicted is None:
            predicted = self.model_time(prefill, ctx, n)
        if prefill <= 0 or not predicted > 0 or not seconds > 0:
            return
        a, x = self.cfg.alpha, seconds / predicted
        key = self._key(prefill, ctx, n)
        old = self.ratio.get(key)
        self.ratio[key] = x if old is None else (1 - a) * old + a * x
        self.global_ratio = (1 - a) * self.global_ratio + a * x if self.samples else x
        self.samples += 1
        used, glob = self._round(self.ratio[key]), self._round(self.global_ratio)
        if used != self._used.get(key) or glob != self._global_used:
            self._used[key], self._global_used = used, glob
            self._budget.clear()

    def budget(self, n: int, ctx: float, history: int = 0) -> int:
        """Largest prefill tokens (grid point, then bisection between grid points) whose
        predicted step with n decodes at mean context ctx (rounded up to 64 tokens), on a
        prompt with `history` tokens already computed (rounded up to 512), stays within the
        SLO. Without the history, later chunks of long prompts run over it."""
        key = (n, int(ctx) >> 6, int(history) >> 9)
        hit = self._budget.get(key)
        if hit is not None:
            return hit
        ctx = float((key[1] + 1) << 6)  # the top of its 64-token bucket: cached budgets are exact
        history = (key[2] + 1) << 9 if history > 0 else 0
        limit = self.cfg.tbt_slo * self.cfg.headroom
        ok = 0
        used, glob = self._used, self._global_used
        bn, bc = _bucket(n), _bucket(ctx)
        grid = self._grid
        for g, bg, t in zip(grid, self._grid_buckets, self._grid_times(ctx, n, history)):
            if t * used.get((bn, bc, bg), glob) > limit:  # predict(g, ctx, n, history), unrolled
                lo, hi = ok, g  # ok fits, g does not
                while hi - lo > 8:
                    mid = (lo + hi) // 2
                    lo, hi = (mid, hi) if self.predict(mid, ctx, n, history) <= limit else (lo, mid)
                ok = lo
                break
            ok = g
        if len(self._budget) > 4096:
            self._budget.clear()
        self._budget[key] = ok
        return ok


class MeasuredStep:
    """The step in flight, remembered when it is planned so that its measured time can be
    recorded in profile tables when it has run (DynaServe's online profiling): its prefill
    tokens, mean decode context, decode count, start and the cost model's time for it."""

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost
        self._step: tuple[int, float, int, float, float] | None = None

    def planned(self, plan: StepPlan, now: float) -> None:
        shape = plan.shape()
        dn = int(shape.decode_seqs)
        mean = float(shape.decode_ctx) / dn if dn else 0.0
        self._step = (int(shape.prefill_tokens), mean, dn, now, float(self.cost.step_time(shape)))

    def measured(self, out: StepOutput) -> tuple[int, float, int, float, float] | None:
        """(prefill, ctx, decodes, seconds, predicted) of the first executed step of the plan
        in flight, once (a decode run reports its steps in pieces); None if already taken."""
        step, self._step = self._step, None
        if step is None or not len(out.end_times):
            return None
        pf, ctx, n, start, model = step
        return pf, ctx, n, float(out.end_times[0]) - start, model


class TBTBudget:
    """DynaServe's budget rule (Alg. 2): the step's decodes plus the largest prefill budget
    whose predicted step time stays within the TBT SLO (profile table); every executed step is
    measured back into the table. `fixed_prefill` ablates it (Fig. 11).

    The TBT SLO is the tightest TPOT SLO of the requests running here (decodes and started
    prompts), else the last one seen, else `LocalConfig.tbt_slo`: the paper's experiments give
    every request one SLO, and a server's clients send theirs (a fixed 0.1 s on an engine whose
    16-token step takes longer held every prompt at the 16-token floor). One table per value."""

    def __init__(self, cost: CostModel, local: LocalConfig = LocalConfig()) -> None:
        self.local, self.cost = local, cost
        self.tables: dict[float, ProfileTable] = {local.tbt_slo: ProfileTable(cost, local)}
        self.tbt = local.tbt_slo  # the SLO in force: the last one the running requests gave
        self.budgets: list[int] = []  # prefill budget of each planned step (tests, reports)
        self._measure = MeasuredStep(cost)

    @property
    def profile(self) -> ProfileTable:
        """The table of the TBT SLO in force."""
        t = self.tables.get(self.tbt)
        if t is None:
            t = self.tables[self.tbt] = ProfileTable(self.cost, replace(self.local, tbt_slo=self.tbt))
        return t

    def step(self, decodes: Sequence[RequestState], now: float, core: CoreView,
             urgent: UrgentQuery) -> StepBudget:
        n = len(decodes)
        ctx = sum(r.num_computed + 1 for r in decodes) / n if n else 0.0
        history = max((r.num_computed for r in core.running if r.in_prefill), default=0)
        tpots = [r.req.slo.tpot for r in core.running if r.req.slo.tpot is not None]
        if tpots:
            self.tbt = min(tpots)
        if self.local.fixed_prefill is not None:  # SLO-aware batching off (Fig. 11's ablation)
            prefill = self.local.fixed_prefill
        else:
            prefill = max(self.local.min_prefill, self.profile.budget(n, ctx, history))
        return StepBudget(decodes, prefill, n + prefill, n + prefill)

    def planned(self, plan: StepPlan, budget: StepBudget, now: float) -> None:
        self.budgets.append(budget.prefill)
        self._measure.planned(plan, now)

    def executed(self, plan: StepPlan, out: StepOutput) -> None:
        m = self._measure.measured(out)
        if m is not None:
            for table in self.tables.values():
                table.record(*m)


def dynaserve_selector(cost: CostModel, local: LocalConfig = LocalConfig()) -> ChunkedSelector:
    """Alg. 2's selector: chunked prefill in arrival order, each request at most `chunk_cap`
    tokens a step, under the TBT budget rule."""
    return ChunkedSelector(TBTBudget(cost, local), chunk_cap=local.chunk_cap)


def dynaserve_scheduler(instance: int, role: Role, kv: KVCacheManager, cost: CostModel,
                        local: LocalConfig = LocalConfig(), *, max_num_seqs: int = 256,
                        max_model_len: int | None = None, max_repeats: int = 512) -> LocalCore:
    """DynaServe's local scheduler: the core with Alg. 2's selector and migration patience."""
    return LocalCore(instance, role, kv, dynaserve_selector(cost, local), max_num_seqs=max_num_seqs,
                     max_model_len=max_model_len, max_repeats=max_repeats,
                     migration_patience_s=local.migration_patience_s)
