"""`pla-mix`: PLA-Serve's short/long prefill pools on colocated instances that also decode."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import FixedLink, LinearCost
from flowyard.core.request import SLO, Request, Status
from flowyard.costmodel import make_cost_model
from flowyard.policies.framework.contracts import Role
from flowyard.policies.pla.selector import PLAConfig, is_short, length_model_of
from flowyard.policies.registry import PolicyOptions, build_policy
from flowyard.sim.cluster import Topology
from flowyard.sim.run import SimConfig, build_topology
from flowyard.sim.simulator import Simulator

COST = make_cost_model("qwen2.5-14b", "h200")
LENGTHS = length_model_of(COST)
TOPO = build_topology(SimConfig(hardware="h200"))


def mixed_load(n=300, seed=0):
    rng = np.random.default_rng(seed)
    t = np.sort(rng.uniform(0, 8, n))
    return [Request(id=i, arrival=float(t[i]), prompt_len=int(rng.choice([40, 150, 3000, 9000], p=[.5, .2, .2, .1])),
                    output_len=int(rng.integers(1, 300)), slo=SLO(ttft=0.4)) for i in range(n)]


def test_every_request_finishes_where_it_was_prefilled_with_tokens_conserved():
    reqs = mixed_load()
    pol = build_policy("pla-mix", PolicyOptions(num_instances=4, predictor=COST))
    assert pol.roles == [Role.MIXED] * 4
    prefill: dict[int, int] = {}
    where: dict[int, set[int]] = {}
    decoded_with_prefill = 0

    def on_step(i, plan, k):
        nonlocal decoded_with_prefill
        kinds = {is_short(s.state.req, LENGTHS) for s in plan.prefills}
        assert len(kinds) <= 1  # a step's prefills are all short or all long
        for s in plan.prefills:
            prefill[s.state.id] = prefill.get(s.state.id, 0) + s.n
            where.setdefault(s.state.id, set()).add(i)
        decoded_with_prefill += bool(plan.prefills and plan.decodes)
        assert all(d.instance == i for d in plan.decodes)

    res = Simulator(reqs, pol, COST, TOPO, on_step=on_step).run()  # checks conservation and KV
    for s in res.states:
        assert s.status is Status.FINISHED and s.num_output == s.req.output_len and s.preemptions == 0
        assert prefill[s.id] == s.req.prompt_len  # every prompt token computed exactly once
        assert where[s.id] == {s.instance}  # decoded where it was prefilled: no KV moved
        times = s.all_token_times()
        assert len(times) == s.req.output_len and times[0] >= s.req.arrival
        assert np.all(np.diff(times) > 0) and s.finish_time == times[-1]
    assert decoded_with_prefill > 0  # decodes ride along in prefill steps (mix mode)
    router = pol.global_scheduler
    assert router.pools.members("short") and router.pools.members("long")  # the pools span the colocated instances


def burst():
    """A 30,000-token prompt, then short prompts arriving during its chunked prefill."""
    long_ = Request(id=0, arrival=0.0, prompt_len=30_000, output_len=50, slo=SLO(ttft=5.0))
    shorts = [Request(id=i, arrival=0.02 * i, prompt_len=40, output_len=20, slo=SLO(ttft=0.2))
              for i in range(1, 21)]
    return [long_] + shorts


@pytest.mark.parametrize("n", [1, 2])  # one instance: temporal disaggregation; two: pools
def test_short_prompts_are_not_stuck_behind_a_long_one(n):
    def ttfts(name):
        pol = build_policy(name, PolicyOptions(num_instances=n, predictor=COST))
        res = Simulator(burst(), pol, COST, TOPO).run()
        assert all(s.status is Status.FINISHED for s in res.states)
        return res.states[0].first_token_time, [s.first_token_time - s.req.arrival for s in res.states[1:]]

    long_mix, short_mix = ttfts("pla-mix")
    _, short_vllm = ttfts("vllm")
    assert max(short_mix) <= 0.2 < long_mix  # every short prompt within its TTFT SLO
    assert max(short_vllm) > 5 * max(short_mix)  # FCFS chunked prefill: some wait for the long one


def test_decodes_are_preempted_and_recomputed_when_kv_runs_out():
    cost = LinearCost(capacity=3_000)
    rng = np.random.default_rng(1)
    reqs = [Request(id=i, arrival=0.01 * i, prompt_len=int(rng.integers(20, 600)), output_len=int(rng.integers(50, 400)))
            for i in range(40)]
    pol = build_policy("pla-mix", PolicyOptions(num_instances=2, predictor=cost, pla=PLAConfig(boundary=64)))
    sim = Simulator(reqs, pol, cost, Topology(1, FixedLink(), FixedLink()))
    res = sim.run()
    assert sum(i.sched.preempted for i in sim.instances) > 0
    for s in res.states:
        assert s.status is Status.FINISHED and s.num_output == s.req.output_len
        assert np.all(np.diff(s.all_token_times()) > 0)
