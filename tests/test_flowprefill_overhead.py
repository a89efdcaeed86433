"""The fast FlowPrefill round (numpy columns for Q_w, bulk-priced batching probes) takes exactly
the decisions of the straightforward one: every key computed, Q_w sorted, one freshly built
probe per candidate. Not a timing test (benchmarks/flowprefill_overhead.py times it): this is
what lets the optimisation claim it changed nothing."""

from __future__ import annotations

from unittest import mock

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from flowyard.core.kvcache import KVCacheManager
from flowyard.core.plan import BatchShape, PrefillSlice, StepOutput, StepPlan
from flowyard.core.prefix_cache import PrefixCachingKVManager
from flowyard.core.request import SLO, Request, RequestState
from flowyard.costmodel import make_cost_model
from flowyard.costmodel.base import with_error
from flowyard.policies.framework import slack
from flowyard.policies.framework.contracts import Role
from flowyard.policies.framework.local_core import LocalCore
from flowyard.policies.flowprefill.scheduler import FlowPrefillConfig, FlowPrefillScheduler, FlowPrefillSelector, Task
from flowyard.policies.framework.slack import TTFTPredictor, extended

COST = make_cost_model("llama-3-8b", "a800")


class ScalarOnly:
    """A cost model that cannot take array-valued shapes: the fast path must fall back."""

    def __init__(self, base) -> None:
        self.base, self.num_layers = base, base.num_layers

    def step_time(self, shape: BatchShape) -> float:
        return float(self.base.step_time(shape))

    def prefill_time(self, prompt_len: int, history: int = 0) -> float:
        return self.base.prefill_time(prompt_len, history)


PREDICTORS = {"roofline": COST, "scaled": with_error(COST, 1.37), "scalar-only": ScalarOnly(COST)}


class Reference(FlowPrefillSelector):
    """FlowPrefill's round as first written: a plain dict for Q_w, a key per request per round,
    a full sort for batching and a fresh `BatchShape.of` per probe."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.waiting = {}

    def _best(self, now: float):
        best = None
        for st_ in self.waiting.values():
            k = self._request_key(st_, now)
            if best is None or k < best[0]:
                best = (k, st_)
        for task in self.preempted:
            k = self._task_key(task, now)
            if best is None or k < best[0]:
                best = (k, task)
        return best

    def _submit(self, head: RequestState, now: float) -> Task | None:
        plan = StepPlan(preempt_stride=self._stride)
        if not self._admit(head, self._slice(head), plan):
            return None
        budget = self.config.batch_token_budget
        deadline = head.req.arrival + head.req.slo.ttft if head.req.slo.ttft is not None else float("inf")
        remain, tokens = deadline - now, plan.num_tokens
        if budget != 0:
            for r in sorted(self.waiting.values(), key=lambda r: self._request_key(r, now)):
                if len(plan.prefills) >= self.config.max_num_seqs:
                    break
                n = self._slice(r)
                if budget is not None and tokens + n >= budget:
                    continue
                if not remain > self.predict.slices(plan.prefills + [PrefillSlice(r, r.num_computed, n)]):
                    continue
                if self._admit(r, n, plan):
                    tokens = plan.num_tokens
        self.stats.submits += 1
        self.stats.batched.append(len(plan.prefills))
        return Task(plan, head, self._ops, self.predict.step(plan))


def sig(plan: StepPlan | None):
    return None if plan is None else ([(s.state.id, s.start, s.n) for s in plan.prefills], plan.ops_done)


OPS = ("arrive", "arrive", "burst", "burst", "complete", "complete", "complete", "check", "abort", "release")


@st.composite
def scenarios(draw):
    cfg = FlowPrefillConfig(
        priority=draw(st.sampled_from(["s-edf", "edf", "d-edf"])),
        batch_token_budget=draw(st.sampled_from([None, 0, 600, 2048, 4096])),
        granularity=draw(st.sampled_from(["operator", "layer", "chunk"])),
        chunk_size=draw(st.sampled_from([None, None, 512, 2048])),
        max_num_seqs=draw(st.sampled_from([1, 3, 256])))
    ops = draw(st.lists(st.tuples(
        st.sampled_from(OPS), st.sampled_from([0.0, 0.0, 0.002, 0.02, 0.1, 0.4]),
        st.integers(1, 2300) | st.sampled_from([1, 16, 100, 299, 300, 301, 600, 1023, 1024, 2048]),
        st.sampled_from([None, 0.02, 0.1, 0.25, 0.5, 1.0, 6.0]), st.integers(0, 12), st.integers(0, 10**6)),
        min_size=1, max_size=120))
    return (cfg, ops, draw(st.sampled_from(sorted(PREDICTORS))), draw(st.booleans()),
            draw(st.sampled_from([(24, 4), (24, 1), (1, 0), (2, 1), (6, 2)])),
            draw(st.sampled_from([150, 400, 700])))


def drive(cfg, ops, predictor, prefix, thresholds, blocks=700):
    """Run one event sequence on both schedulers, comparing every decision. Request ids are
    not in arrival order (nothing requires it), so that tie-breaks on arrival and on id differ;
    hand-offs keep their KV until a "release", so that admissions also fail for want of KV."""
    kv = (lambda: PrefixCachingKVManager(blocks, 16)) if prefix else (lambda: KVCacheManager(blocks, 16))
    fast = FlowPrefillScheduler(0, Role.PREFILL, kv(), cfg, PREDICTORS[predictor])
    ref = LocalCore(0, Role.PREFILL, kv(), Reference(cfg, PREDICTORS[predictor]), max_num_seqs=cfg.max_num_seqs)
    now, ids, held = 0.0, [], []
    with mock.patch.object(slack, "VECTOR_MIN", thresholds[0]), \
            mock.patch.object(slack, "SCALAR_PROBES", thresholds[1]):
        for op, dt, prompt, slo, hashes, pick in ops:
            now += dt
            if op in ("arrive", "burst"):
                for k in range(1 if op == "arrive" else 1 + pick % 40):
                    n = prompt if k == 0 or (pick + k) % 3 == 0 else 1 + (pick * (k + 7)) % 3000
                    r = Request(id=len(ids) * 7919 % 100_003, arrival=now, prompt_len=n,
                                output_len=2, slo=SLO(ttft=slo) if slo else SLO(),
                                block_hashes=tuple(range(hashes)), hash_block_size=16)
                    ids.append(r.id)
                    assert fast.add_request(RequestState(r), now) == ref.add_request(RequestState(r), now)
            elif op == "abort" and ids:
                victim = ids[pick % len(ids)]
                a, b = fast.abort(victim), ref.abort(victim)
                assert (a and a.id) == (b and b.id)
                held = [i for i in held if i != victim]
            elif op == "complete" and fast.selector.executing is not None:
                out = StepOutput(end_times=np.array([now]))
                a = fast.update_from_output(fast.selector.executing.plan, out)
                b = ref.update_from_output(ref.selector.executing.plan, out)
                assert [s.id for s in a.handoffs] == [s.id for s in b.handoffs]
                held += [s.id for s in a.handoffs]
            elif op == "release":
                for i in held:
                    fast.release(i)
                    ref.release(i)
                held = []
            if fast.selector.executing is not None:  # an arrival (or a timer) while E runs
                pa, pb = fast.preempt_check(now), ref.preempt_check(now)
                assert pa == pb
                if pa:
                    done = pick % fast.selector.executing.total_ops
                    fast.suspend(fast.selector.executing.plan, done, now)
                    ref.suspend(ref.selector.executing.plan, done, now)
            if fast.selector.executing is None:
                assert sig(fast.schedule(now)) == sig(ref.schedule(now))
            assert sorted(s.id for s in fast.selector.waiting.values()) == sorted(ref.selector.waiting)
            assert fast.kv.num_free_blocks == ref.kv.num_free_blocks
    assert fast.selector.stats == ref.selector.stats
    return fast


@settings(max_examples=500, deadline=None)
@given(scenarios())
def test_fast_rounds_take_the_reference_decisions(scenario):
    """Random event sequences (arrivals, bursts, completions, preemptions, aborts, chunked
    prompts, prefix hits, KV pressure), both code paths forced through small thresholds."""
    drive(*scenario)


def test_a_long_queue_goes_through_the_vector_path_with_the_same_plans():
    """Deterministic: 300 queued, real thresholds, roofline: ranking and probes in bulk."""
    rnd = np.random.default_rng(3)
    ops = [("arrive", 0.0, int(rnd.integers(100, 6000)), [0.25, 0.5, 1.0, 6.0][i % 4], 0, i)
           for i in range(300)]
    ops += [(op, 0.01, 1, None, 0, i) for i in range(60) for op in ("complete", "release")]
    real = TTFTPredictor.probes
    with mock.patch.object(TTFTPredictor, "probes", autospec=True, side_effect=real) as probes:
        fast = drive(FlowPrefillConfig(), ops, "roofline", False, (24, 4), blocks=20_000)  # KV never binds
    assert fast.selector.stats.submits >= 60 and probes.call_count > 0 and fast.selector.predict.vectorised


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([0.0, 0.25, 0.5]),
                          st.sampled_from([None, 0.25, 0.5, 0.75, 1.0, 6.0]),
                          st.sampled_from([1, 100, 299, 300, 301, 600, 1023, 1024, 2048, 5000])),
                min_size=1, max_size=60),
       st.randoms(use_true_random=False), st.sampled_from(["s-edf", "edf", "d-edf"]),
       st.sampled_from([None, 600, 2048]), st.sampled_from([(24, 4), (24, 1), (1, 0), (3, 1)]),
       st.sampled_from(sorted(PREDICTORS)))
def test_same_plans_on_random_queues(rows, rnd, prio, budget, thresholds, predictor):
    """A queue drained by completions alone, built for ties (equal deadlines from different
    arrivals, SLO-less requests) and budget edges (slices one token under, at and over what is
    left), with ids in random order so that arrival and id tie-breaks disagree."""
    ids = rnd.sample(range(10 * len(rows)), len(rows))
    reqs = sorted((Request(id=i, arrival=a, prompt_len=p, output_len=1, slo=SLO(ttft=slo) if slo else SLO())
                   for i, (a, slo, p) in zip(ids, rows)), key=lambda r: r.arrival)
    cfg = FlowPrefillConfig(priority=prio, batch_token_budget=budget)
    fast = FlowPrefillScheduler(0, Role.PREFILL, KVCacheManager(2000, 16), cfg, PREDICTORS[predictor])
    ref = LocalCore(0, Role.PREFILL, KVCacheManager(2000, 16), Reference(cfg, PREDICTORS[predictor]),
                   max_num_seqs=cfg.max_num_seqs)
    for r in reqs:
        fast.add_request(RequestState(r), r.arrival)
        ref.add_request(RequestState(r), r.arrival)
    now = 0.5
    with mock.patch.object(slack, "VECTOR_MIN", thresholds[0]), \
            mock.patch.object(slack, "SCALAR_PROBES", thresholds[1]):
        while fast.selector.waiting:
            a, b = fast.schedule(now), ref.schedule(now)
            assert sig(a) == sig(b) and a is not None
            now += fast.selector.executing.predicted
            fast.update_from_output(a, StepOutput(end_times=np.array([now])))
            ref.update_from_output(b, StepOutput(end_times=np.array([now])))
    assert fast.selector.stats == ref.selector.stats and not ref.selector.waiting


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 30000), st.integers(1, 20000)), min_size=1, max_size=8),
       st.lists(st.tuples(st.integers(0, 30000), st.integers(1, 20000)), min_size=1, max_size=40),
       st.sampled_from(sorted(PREDICTORS)))
def test_probes_are_bit_identical_to_a_fresh_batch_shape(batch, cands, predictor):
    """Batching prices `batch + one candidate` from the batch's shape, and grows that shape
    admission by admission, instead of rebuilding `BatchShape.of` each time: same floats."""
    p = TTFTPredictor(PREDICTORS[predictor])
    plan = StepPlan(prefills=[PrefillSlice(None, h, n) for h, n in batch])  # type: ignore[arg-type]
    base = plan.shape()
    grown = StepPlan(prefills=plan.prefills[:1]).shape()
    for h, n in batch[1:]:
        grown = extended(grown, h, n)
    assert grown == base
    want = [p.slices(plan.prefills + [PrefillSlice(None, h, n)]) for h, n in cands]  # type: ignore[arg-type]
    assert [p.probe(base, h, n) for h, n in cands] == want
    got = p.probes(base, np.array([h for h, _ in cands]), np.array([n for _, n in cands]))
    if predictor == "scalar-only":
        assert got is None and not p.vectorised
    else:
        assert got.tolist() == want
