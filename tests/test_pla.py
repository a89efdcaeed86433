"""PLA-Serve in the simulator: AWD short batching, exclusive short/long steps, pools."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flowyard.core.kvcache import KVCacheManager
from flowyard.core.plan import StepOutput
from flowyard.core.request import SLO, Request, RequestState, Status
from flowyard.costmodel import make_cost_model
from flowyard.policies.pla.awd import AWDConfig, AWDState
from flowyard.policies.framework.contracts import Role
from flowyard.policies.framework.local_core import LocalCore
from flowyard.policies.pla.selector import PLAConfig, length_model_of, pla_scheduler
from flowyard.policies.pla.router import ControllerConfig
from flowyard.policies.registry import PolicyOptions, build_policy
from flowyard.sim.run import SimConfig, build_topology
from flowyard.sim.simulator import Simulator

COST = make_cost_model("qwen2.5-14b", "h200")
LENGTHS = length_model_of(COST)
TOPO = build_topology(SimConfig(hardware="h200"))


def req(i, t, prompt, ttft=0.4, out=4, history=0):
    return Request(id=i, arrival=t, prompt_len=prompt, output_len=out, history_len=history,
                   slo=SLO(ttft=ttft) if ttft else SLO())


def sched(**kw) -> LocalCore:
    return pla_scheduler(0, Role.PREFILL, KVCacheManager(20_000, 16), PLAConfig(**kw), COST, LENGTHS)


# -- AWD (Alg. 1) -------------------------------------------------------------------------------
def test_awd_buckets_and_graph_shapes():
    c = AWDConfig()
    assert c.bucket(1) == 8 and c.bucket(9) == 16 and c.bucket(256) == 256 and c.bucket(257) is None
    assert c.graph(30, 5) == (32, 8)
    assert c.graph(300, 1) is None  # longer than every captured length
    assert c.graph(256, 64) is None  # over the memory budget: eager
    with pytest.raises(ValueError):
        AWDConfig(lengths=(16, 8))


def test_awd_adapts_window_and_depth():
    s = AWDState(AWDConfig(w_max=0.02))
    d0 = s.depth
    s.arrived(0.0)
    s.dispatched(0.004, d0, still_waiting=False)  # a full batch in 4 ms: W = 4 ms, D grows
    assert s.window == pytest.approx(0.004) and s.depth >= d0
    s.arrived(1.0)
    s.dispatched(1.01, 3, still_waiting=False)  # a short batch: D falls to its depth
    assert s.depth == 3


def test_short_requests_wait_for_the_window_then_leave_together():
    s = sched(awd=AWDConfig(w_max=0.01, w_min=0.01))
    for i in range(3):
        s.add_request(RequestState(req(i, 0.001 * i, 40, ttft=5.0)), 0.001 * i)
    assert s.schedule(0.002) is None  # the window is open and D is not reached
    wake = s.wake_at(0.002)
    assert wake == pytest.approx(0.01)
    plan = s.schedule(wake)
    assert len(plan.prefills) == 3 and plan.graph == (64, 4)
    assert plan.shape().prefill_tokens == 64 * 4 and plan.shape().graphed


def test_a_tight_deadline_cuts_the_window_short():
    s = sched(awd=AWDConfig(w_max=0.05, w_min=0.05, sigma=0.01))
    s.add_request(RequestState(req(0, 0.0, 40, ttft=0.03)), 0.0)
    assert s.schedule(0.0) is None
    wake = s.wake_at(0.0)  # when the slack reaches sigma, far before the 50 ms window
    est = s.selector.short_estimate()
    assert wake == pytest.approx(0.03 - est - 0.01)
    assert s.schedule(wake) is not None
    s2 = sched(awd=AWDConfig(w_max=0.05, w_min=0.05, sigma=0.05))
    s2.add_request(RequestState(req(0, 0.0, 40, ttft=0.03)), 0.0)
    assert s2.schedule(0.0) is not None  # slack already below sigma: at once


def test_steps_are_all_short_or_all_long_and_short_ones_are_not_queued_behind_long():
    s = sched(awd=AWDConfig(w_max=0.0))
    long_ = RequestState(req(0, 0.0, 20_000, ttft=30.0))
    s.add_request(long_, 0.0)
    plan = s.schedule(0.0)
    assert [p.state.id for p in plan.prefills] == [0] and plan.num_tokens == 2048  # a C_l chunk
    s.update_from_output(plan, StepOutput(end_times=np.array([0.1])))
    shorts = [RequestState(req(i, 0.1, 30, ttft=0.3)) for i in (1, 2)]
    for r in shorts:
        s.add_request(r, 0.1)
    plan = s.schedule(0.1)
    assert {p.state.id for p in plan.prefills} == {1, 2}  # before the long prompt's next chunk


def test_reprefill_on_cached_history_is_short_by_the_router():
    from flowyard.policies.pla.selector import is_short

    assert is_short(req(0, 0.0, 4000, history=3960), LENGTHS)
    assert not is_short(req(0, 0.0, 4000), LENGTHS)


# -- whole runs ---------------------------------------------------------------------------------
@settings(max_examples=20, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 3), st.integers(1, 9000), st.sampled_from([0.2, 0.5, None]),
                          st.integers(1, 6)), min_size=1, max_size=40),
       st.sampled_from(["pla", "pla-spatial", "pla-mix"]), st.booleans())
def test_every_request_finishes(rows, policy, deadline_free):
    rows = sorted(rows, key=lambda r: r[0])
    reqs = [req(i, a, p, slo, o) for i, (a, p, slo, o) in enumerate(rows)]
    opts = PolicyOptions(num_instances=4, predictor=COST, pla=PLAConfig(deadline_free=deadline_free))
    res = Simulator(reqs, build_policy(policy, opts), COST, TOPO).run()  # checks conservation and KV
    assert all(s.status is Status.FINISHED and s.num_output == s.req.output_len for s in res.states)


def test_controller_moves_an_instance_to_the_pressed_pool():
    rng = np.random.default_rng(0)
    reqs = [req(i, float(t), int(rng.integers(8, 60)), ttft=0.2)
            for i, t in enumerate(np.sort(rng.uniform(0, 20, 6000)))]
    cc = ControllerConfig(period=0.5, cooldown=1.0)
    pol = build_policy("pla-spatial", PolicyOptions(num_instances=6, num_prefill=4, predictor=COST,
                                                    pla_controller=cc))
    Simulator(reqs, pol, COST, TOPO).run()
    pools = pol.global_scheduler.pools
    assert pools.moves and pools.moves[0][3] == "short"  # all traffic is short: the long pool gives
    assert len(pools.members("long")) == cc.min_pool


def test_pla_keeps_up_with_distserve_on_multi_turn_reprefills():
    from flowyard.workloads import multi_turn_sessions, with_slo
    from flowyard.sim.run import load_workload

    cfg = SimConfig(trace="sharegpt", model="qwen2.5-14b", hardware="h200", instances=4, rate=6,
                    num_requests=600, prefix_caching=True)
    w = with_slo(multi_turn_sessions(load_workload(cfg), turns_mean=4, max_new_tokens=64, think_time=5),
                 ttft=0.4, tpot=0.2)

    def attain(name):
        pol = build_policy(name, PolicyOptions(num_instances=4, predictor=COST))
        res = Simulator(w.requests, pol, COST, TOPO, prefix_caching=True).run()
        return np.mean([s.first_token_time - s.req.arrival <= 0.4 for s in res.states])

    assert attain("pla") >= attain("distserve") - 0.02


def test_a_wake_up_at_the_head_of_line_bound_always_dispatches():
    """Regression: `ready` and `wake` computed the T_max bound differently, so rounding could
    leave a short request asking to be woken 'now' forever."""
    s = sched(awd=AWDConfig(w_min=0.1, w_max=0.1, t_max=0.05))
    hol = 5.433939890853173
    s.add_request(RequestState(req(0, hol, 40, ttft=None, out=1)), hol)
    t = s.wake_at(hol)
    assert t > hol and s.schedule(t) is not None


def test_a_turn_routed_away_from_its_history_is_long():
    s = sched()
    r = RequestState(req(0, 0.0, 4000, history=3960))  # its history is cached elsewhere
    s.add_request(r, 0.0)
    assert 0 not in s.selector.short and list(s.selector.long) == [r]


def test_a_short_prompt_that_cannot_get_kv_lets_the_long_prompt_holding_it_go_on():
    """Regression: with a tight short slack the long chunk was held back while the short prompt
    waited for KV that only the long prompt's end would free: nothing ever ran."""
    s = pla_scheduler(0, Role.PREFILL, KVCacheManager(300, 16), PLAConfig(boundary=1000),
                            COST, LENGTHS)
    long_ = RequestState(req(0, 0.0, 4000, ttft=30.0))  # reserves 250 of the 300 blocks
    s.add_request(long_, 0.0)
    plan = s.schedule(0.0)
    s.update_from_output(plan, StepOutput(end_times=np.array([0.1])))
    s.add_request(RequestState(req(1, 0.1, 900, ttft=0.05)), 0.1)  # short (< 1000), needs 57 blocks
    plan = s.schedule(0.1)
    assert plan is not None and [p.state.id for p in plan.prefills] == [0]
