"""Per-instance work accounting of the simulator (MFU and HBM-use reports) and the
length-sample workloads that DynaServe's evaluation is built from."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from flowyard.costmodel import make_cost_model
from flowyard.costmodel.models import get_model
from flowyard.policies.dynaserve.lengths import make_length_predictor
from flowyard.core.request import Request
from flowyard.policies.registry import PolicyOptions, build_policy
from flowyard.sim.run import SimConfig, build_topology
from flowyard.sim.simulator import Simulator
from flowyard.workloads import fixed_shape, load_trace, mix, reasoning_like, resample

COST = make_cost_model("qwen2.5-14b", "a100-80g", tp=1)
TOPO = build_topology(SimConfig(model="qwen2.5-14b", hardware="a100-80g", instances=2))


@settings(max_examples=8, deadline=None)
@given(policy=st.sampled_from(["vllm", "distserve", "dynaserve"]), seed=st.integers(0, 1000),
       rate=st.floats(0.5, 8.0))
def test_work_adds_up_to_the_requests(policy, seed, rate):
    w = resample(load_trace("burstgpt"), 40, rate=rate, seed=seed)
    opts = PolicyOptions(num_instances=2, num_prefill=1, predictor=COST)
    res = Simulator(w.requests, build_policy(policy, opts), COST, TOPO, prefix_caching=False).run()
    work = res.instance_work
    assert sum(x.prefill_tokens for x in work) == pytest.approx(sum(r.prompt_len for r in w.requests))
    # every output token after the first comes from one decode step (the first from the prefill)
    assert sum(x.decode_tokens for x in work) == pytest.approx(sum(r.target_output - 1 for r in w.requests))
    makespan = res.sim_time
    for x in work:
        assert 0.0 <= x.kv_usage(makespan) <= 1.0
    assert sum(x.kv_block_s for x in work) > 0


def test_model_flops_is_two_per_weight_per_token():
    m = get_model("qwen2.5-14b")
    assert m.flops(1) == 2 * m.layers * m.layer_params
    assert m.flops(0, attn_pairs=10) == 40 * m.layers * m.q_dim


def test_fixed_length_predictor_ignores_the_truth():
    p = make_length_predictor("fixed", prior_mean=1467, margin=0)
    r = Request(id=0, arrival=0.0, prompt_len=219, output_len=1300)
    assert p.predict(r) == 1467
    with pytest.raises(ValueError, match="fixed"):
        make_length_predictor("fixed", prior_mean=0)


def test_synthetic_workloads_have_the_asked_shape():
    w = fixed_shape(219, 1467, 400, rate=2.0, output_std=50, seed=1)
    assert {r.prompt_len for r in w} == {219}
    assert abs(w.output_lens().mean() - 1467) < 10 and 35 < w.output_lens().std() < 65
    r = reasoning_like(2000, rate=1.0)
    assert abs(r.prompt_lens().mean() - 219) < 20 and abs(r.output_lens().mean() - 1467) < 80
    m = mix([load_trace("burstgpt"), load_trace("azure-code")], 600, rate=3.0)
    tasks = [q.task for q in m]
    assert 0.4 < tasks.count("burstgpt") / len(tasks) < 0.6
    assert np.all(np.diff(m.arrivals()) >= 0) and abs(m.rate - 3.0) < 0.6
    with pytest.raises(ValueError, match="rate"):
        fixed_shape(10, 10, 5, rate=0)
    with pytest.raises(ValueError, match="at least one"):
        resample(load_trace("burstgpt"), 0, rate=1)


def test_on_step_sees_every_step_of_runs_committed_in_pieces():
    """A decode run read mid-way by a snapshot is committed in pieces; the tracing callback
    gets each piece (bug: it missed them and undercounted decode steps)."""
    w = resample(load_trace("burstgpt"), 60, rate=6.0, seed=3)
    seen: list[int] = []
    decode_tokens = []
    pol = build_policy("least-load", PolicyOptions(num_instances=2, predictor=COST))
    sim = Simulator(w.requests, pol, COST, TOPO,
                    on_step=lambda i, plan, k: (seen.append(k), decode_tokens.append(len(plan.decodes) * k)))
    res = sim.run()
    assert sum(seen) == res.steps
    assert sum(decode_tokens) == sum(r.target_output - 1 for r in w.requests)


@pytest.mark.parametrize("policy", ["distserve", "round-robin"])
def test_a_shared_device_runs_one_step_at_a_time(policy):
    """`shared_device`: instances time-share one device, as LocalCluster's engines share one
    thread: their busy times never overlap, so they add up to at most the makespan."""
    w = resample(load_trace("azure-code"), 80, rate=6.0, seed=2)
    opts = PolicyOptions(num_instances=2, num_prefill=1)
    apart = Simulator(w.requests, build_policy(policy, opts), COST, TOPO).run()
    shared = Simulator(w.requests, build_policy(policy, opts), COST, TOPO, shared_device=True).run()
    assert sum(apart.instance_busy_s) > apart.sim_time  # the two instances overlap
    assert sum(shared.instance_busy_s) <= shared.sim_time + 1e-9
    assert shared.sim_time > apart.sim_time
    assert all(s.num_output == s.req.target_output for s in shared.states)
