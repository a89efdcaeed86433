"""FlowPrefill in the simulator: S-EDF order, SLO-aware batching, operator-level preemption."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flowyard.core.kvcache import KVCacheManager
from flowyard.core.plan import StepOutput
from flowyard.core.request import SLO, Request, RequestState, Status
from flowyard.costmodel import make_cost_model
from flowyard.costmodel.base import LAYER_OPS
from flowyard.policies.framework.contracts import Role
from flowyard.policies.flowprefill.scheduler import FlowPrefillConfig, FlowPrefillScheduler
from flowyard.policies.registry import PolicyOptions, build_policy
from flowyard.policies.framework.slack import priority_key
from flowyard.sim.run import SimConfig, build_topology
from flowyard.sim.simulator import Simulator

COST = make_cost_model("llama-3-8b", "a800")


def req(i: int, arrival: float, prompt: int, ttft: float | None, out: int = 4) -> Request:
    return Request(id=i, arrival=arrival, prompt_len=prompt, output_len=out,
                   slo=SLO(ttft=ttft) if ttft else SLO())


def run(requests, fp: FlowPrefillConfig | None = None, policy: str = "flowprefill"):
    opts = PolicyOptions(num_instances=2, predictor=COST, flowprefill=fp)
    sim = Simulator(requests, build_policy(policy, opts), COST, build_topology(SimConfig(hardware="a800")))
    res = sim.run()
    return {s.id: s for s in res.states}, res, sim


# -- priorities -------------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0.01, 100), st.floats(0.01, 20), st.floats(0, 10)), min_size=2, max_size=12),
       st.floats(0, 50))
def test_s_edf_key_orders_like_sgn_slack_over_deadline(entries, now):
    """The sort key orders exactly as the paper's priority sgn(slack)/deadline (descending)."""
    reqs = [(req(i, a, 100, slo), hat) for i, (a, slo, hat) in enumerate(entries)]
    by_key = sorted(reqs, key=lambda x: priority_key("s-edf", x[0], now, x[1]))

    def prio(x):
        r, hat = x
        d = r.arrival + r.slo.ttft
        slack = d - now - hat
        return (1 if slack >= 0 else -1) / d

    prios = [prio(x) for x in by_key]
    assert all(a >= b - 1e-12 for a, b in zip(prios, prios[1:]))


def test_no_slo_ranks_after_feasible_before_late():
    now = 10.0
    feasible = req(0, 9.0, 10, 5.0)
    none = req(1, 0.0, 10, None)
    late = req(2, 0.0, 10, 1.0)
    keys = {r.id: priority_key("s-edf", r, now, 0.1) for r in (feasible, none, late)}
    assert keys[0] < keys[1] < keys[2]
    # D-EDF: late only once the deadline itself has passed; EDF: never
    almost = req(3, 9.5, 10, 1.0)  # deadline 10.5, predicted 1 s: S-EDF late, D-EDF not
    assert priority_key("s-edf", almost, now, 1.0)[0] == 1
    assert priority_key("d-edf", almost, now, 1.0)[0] == 0
    assert priority_key("edf", late, now, 1.0)[0] == 0


# -- preemption -------------------------------------------------------------------------------
def test_short_tight_request_preempts_long_loose_one_at_an_operator_boundary():
    long_r = req(0, 0.0, 16000, 30.0)
    t_long = COST.prefill_time(16000)
    short = req(1, t_long / 3, 300, 0.25)
    states, res, _ = run([long_r, short])
    s, l = states[1], states[0]
    assert s.first_token_time - short.arrival <= 0.25  # met its TTFT
    assert s.first_token_time < l.first_token_time
    assert len(res.preemption_blocking) == 1
    op_max = max(float(v) for v in COST.layer_op_times(
        __import__("flowyard.core.plan", fromlist=["BatchShape"]).BatchShape.of([(0, 16000)], [])).values())
    assert 0 <= res.preemption_blocking[0] <= op_max + 1e-9
    # no recomputation: the long prompt finishes one short prefill (plus a boundary) later
    t_short = COST.prefill_time(300)
    assert l.first_token_time == pytest.approx(t_long + t_short, rel=0.02)


def test_layer_granularity_blocks_longer_than_operator_granularity():
    blocking = {}
    for gran in ("operator", "layer"):
        reqs = [req(2 * i, 3.0 * i, 16000, 60.0) for i in range(8)]
        reqs += [req(2 * i + 1, 3.0 * i + 0.37 + 0.11 * i, 200, 0.25) for i in range(8)]
        reqs.sort(key=lambda r: r.arrival)
        reqs = [Request(**{**{f: getattr(r, f) for f in ("arrival", "prompt_len", "output_len", "slo")}, "id": i})
                for i, r in enumerate(reqs)]
        _, res, _ = run(reqs, FlowPrefillConfig(granularity=gran))
        assert len(res.preemption_blocking) == 8
        blocking[gran] = sum(res.preemption_blocking) / 8
    assert blocking["layer"] > 2 * blocking["operator"]


def test_chunk_granularity_never_preempts_a_running_step():
    reqs = [req(0, 0.0, 16000, 30.0), req(1, 0.3, 300, 0.25)]
    states, res, _ = run(reqs, FlowPrefillConfig(granularity="chunk", chunk_size=2048))
    assert res.preemption_blocking == []
    assert states[1].first_token_time < states[0].first_token_time  # EDF between chunks


# -- SLO-aware batching (Alg. 1) --------------------------------------------------------------
def make_sched(budget: int | None = 4096, priority: str = "s-edf") -> FlowPrefillScheduler:
    cfg = FlowPrefillConfig(batch_token_budget=budget, priority=priority)
    return FlowPrefillScheduler(0, Role.PREFILL, KVCacheManager(10_000, 16), cfg, COST)


def test_batching_respects_token_budget_and_head_deadline():
    s = make_sched(budget=4096)
    for i, n in enumerate([1000, 1000, 1000, 1500]):
        s.add_request(RequestState(req(i, 0.0, n, 10.0)), 0.0)
    plan = s.schedule(0.0)
    assert plan.num_tokens < 4096 and plan.num_tokens == 3000
    # a head with almost no time left is not batched with anything
    s2 = make_sched(budget=None)
    t_one = COST.prefill_time(1000)
    s2.add_request(RequestState(req(0, 0.0, 1000, t_one * 1.05)), 0.0)
    s2.add_request(RequestState(req(1, 0.0, 1000, 10.0)), 0.0)
    assert len(s2.schedule(0.0).prefills) == 1
    # budget 0: no batching at all
    s3 = make_sched(budget=0)
    for i in range(3):
        s3.add_request(RequestState(req(i, 0.0, 100, 10.0)), 0.0)
    assert len(s3.schedule(0.0).prefills) == 1


def test_suspend_resume_keeps_progress_and_abort_inside_a_task_defers_the_free():
    import numpy as np

    s = make_sched()
    a, c = RequestState(req(0, 0.0, 3000, 30.0)), RequestState(req(2, 0.0, 500, 30.0))
    b = RequestState(req(1, 0.1, 100, 0.2))
    s.add_request(a, 0.0)
    s.add_request(c, 0.0)
    plan = s.schedule(0.0)
    assert len(plan.prefills) == 2
    s.add_request(b, 0.1)
    assert s.preempt_check(0.1)
    s.suspend(plan, 37, 0.11)
    plan_b = s.schedule(0.11)
    assert plan_b.prefills[0].state is b
    assert s.abort(0).status is Status.ABORTED  # a is inside the parked task
    assert s.kv.num_held(0) > 0  # its KV stays: the task's forward pass still writes it
    s.update_from_output(plan_b, StepOutput(end_times=np.array([0.15])))
    resumed = s.schedule(0.15)
    assert resumed is plan and resumed.ops_done == 37
    s.update_from_output(plan, StepOutput(end_times=np.array([0.5])))
    assert s.kv.num_held(0) == 0
    s.release(1)
    s.release(2)
    assert not s.has_work() and s.kv.leaked() == {}


def test_a_parked_task_whose_requests_all_abort_is_dropped():
    s = make_sched()
    a, b = RequestState(req(0, 0.0, 3000, 30.0)), RequestState(req(1, 0.1, 100, 0.2))
    s.add_request(a, 0.0)
    plan = s.schedule(0.0)
    s.add_request(b, 0.1)
    assert s.preempt_check(0.1)
    s.suspend(plan, 5, 0.11)
    s.abort(0)
    assert s.kv.num_held(0) == 0 and s.selector.preempted == []


# -- whole runs -------------------------------------------------------------------------------
@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 5), st.integers(1, 12000), st.sampled_from([0.25, 0.5, 4.0, None]),
                          st.integers(1, 8)), min_size=1, max_size=30),
       st.sampled_from(["s-edf", "edf", "d-edf"]), st.sampled_from(["operator", "layer"]),
       st.sampled_from([None, 0, 2048, 8192]), st.sampled_from([None, 2048]))
def test_every_request_finishes_and_kv_comes_back(rows, prio, gran, budget, chunk):
    rows = sorted(rows, key=lambda r: r[0])
    reqs = [req(i, a, p, slo, out) for i, (a, p, slo, out) in enumerate(rows)]
    cfg = FlowPrefillConfig(priority=prio, granularity=gran, batch_token_budget=budget, chunk_size=chunk)
    states, res, sim = run(reqs, cfg)  # the simulator checks conservation and KV leaks itself
    assert all(s.status is Status.FINISHED for s in states.values())
    assert all(s.num_output == s.req.output_len for s in states.values())
    sched = sim.instances[0].sched
    chunks = sum(math.ceil(r.prompt_len / chunk) - 1 for r in reqs) if chunk else 0
    # event-driven: a round per arrival and per completion (of a prompt or of a chunk) at most
    assert sched.selector.stats.rounds <= 2 * len(reqs) + chunks + sched.selector.stats.preemptions


def test_flowprefill_beats_fcfs_distserve_on_mixed_slos():
    import random

    rnd = random.Random(1)
    reqs, t = [], 0.0
    for i in range(300):
        t += rnd.expovariate(4.0)
        long_ = rnd.random() < 0.2
        reqs.append(req(i, t, rnd.randint(4000, 12000) if long_ else rnd.randint(100, 800),
                        4.0 if long_ else 0.25))

    def attain(policy):
        states, _, _ = run(reqs, policy=policy)
        return sum(s.first_token_time - s.req.arrival <= s.req.slo.ttft for s in states.values()) / len(reqs)

    fp, ds = attain("flowprefill"), attain("distserve")
    assert fp > ds + 0.1 and fp > 0.9


def test_op_boundaries_end_at_the_step_time():
    from flowyard.core.plan import BatchShape

    shape = BatchShape.of([(0, 3000), (0, 500)], [])
    b = COST.op_boundaries(shape)
    assert len(b) == COST.num_layers * len(LAYER_OPS) + 1
    assert all(x < y for x, y in zip(b, b[1:]))
    assert math.isclose(b[-1], float(COST.step_time(shape)), rel_tol=1e-6)


def test_flowprefill_needs_a_predictor():
    with pytest.raises(ValueError, match="predictor"):
        build_policy("flowprefill", PolicyOptions(num_instances=2))


def test_chunked_prompts_cannot_deadlock_a_full_kv_cache():
    """Regression: partial prompts back in Q_w used to hold KV that the next chunk of the most
    urgent one needed, and schedule() returned None forever."""
    import numpy as np

    kv = KVCacheManager(num_blocks=4, block_size=16)
    s = FlowPrefillScheduler(1, Role.PREFILL, kv, FlowPrefillConfig(priority="edf", chunk_size=16), COST)
    t, done = 0.0, 0
    for step in range(100):
        if step < 5:  # more urgent prompts keep arriving while the first ones are mid-way
            s.add_request(RequestState(req(step, t, 48, [10, 8, 6, 4, 2][step], out=2)), t)
        plan = s.schedule(t)
        if plan is None:
            for st in list(s._handed_off.values()):  # the decode side takes the hand-offs
                s.release(st.id)
                done += 1
            if not s.has_work():
                break
            plan = s.schedule(t)
            assert plan is not None, "deadlock"
        t += 0.01
        s.update_from_output(plan, StepOutput(end_times=np.array([t])))
    assert done == 5 and kv.leaked() == {}
