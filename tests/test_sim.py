"""Simulator and baseline-policy behaviour, through the public Simulator/Policy interfaces."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from conftest import FixedLink, LinearCost, make_requests
from flowyard.core.request import SLO, Request, Status
from flowyard.policies.framework.contracts import Role
from flowyard.policies.registry import POLICY_NAMES, PolicyOptions, UnknownPolicyError, build_policy
from flowyard.sim.cluster import Topology
from flowyard.sim.simulator import Simulator

TOPO = Topology(1, FixedLink(), FixedLink())


def simulate(name, reqs, n=4, capacity=20_000, max_repeats=None, on_step=None, **opts):
    cost = LinearCost(capacity=capacity)
    pol = build_policy(name, PolicyOptions(num_instances=n, predictor=cost, **opts))
    if max_repeats is not None:
        pol.configs = {r: dataclasses.replace(c, max_repeats=max_repeats) for r, c in pol.configs.items()}
    sim = Simulator(reqs, pol, cost, TOPO, on_step=on_step)
    return sim.run(), pol


def token_times(result):
    return [s.all_token_times() for s in result.states]


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_request_finishes_and_kv_returns(name):
    reqs = make_requests(200, seed=1)
    res, _ = simulate(name, reqs, capacity=8_000)
    assert len(res.completed) == 200
    for s in res.completed:
        assert s.num_output == s.req.output_len
        assert s.first_token_time >= s.req.arrival
        assert np.all(np.diff(s.all_token_times()) > 0)


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_decode_runs_equal_stepping_one_token_at_a_time(name):
    """The multi-step decode shortcut is exact: same token times as max_repeats=1."""
    reqs = make_requests(250, seed=2)
    fast, _ = simulate(name, reqs, capacity=6_000)
    slow, _ = simulate(name, reqs, capacity=6_000, max_repeats=1)
    assert fast.events < slow.events
    assert fast.steps == slow.steps
    for a, b in zip(token_times(fast), token_times(slow)):
        np.testing.assert_array_equal(a, b)
    assert [s.preemptions for s in fast.states] == [s.preemptions for s in slow.states]


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(2, 5), cap=st.integers(3_000, 30_000))
def test_deterministic_and_conserving(seed, n, cap):
    reqs = make_requests(60, seed=seed)
    a, _ = simulate("distserve-cp2k", reqs, n=n, capacity=cap)
    b, _ = simulate("distserve-cp2k", reqs, n=n, capacity=cap)
    for x, y in zip(token_times(a), token_times(b)):
        np.testing.assert_array_equal(x, y)
    assert all(s.status in (Status.FINISHED, Status.REJECTED) for s in a.states)


def test_distserve_never_decodes_on_prefill_instances():
    seen = []
    res, pol = simulate("distserve", make_requests(150, seed=3), on_step=lambda i, p, k: seen.append((i, p)))
    prefill_ids = {i for i, r in enumerate(pol.roles) if r is Role.PREFILL}
    assert prefill_ids == {0, 1}
    for i, plan in seen:
        if i in prefill_ids:
            assert not plan.decodes
    for s in res.completed:
        if s.num_output > 1:
            assert s.prefill_instance in prefill_ids and s.instance not in prefill_ids


@pytest.mark.parametrize("chunk", [256, 2048])
def test_vllm_respects_its_chunk_size(chunk):
    seen = []
    simulate("vllm", make_requests(100, seed=4), n=1, chunk_size=chunk, on_step=lambda i, p, k: seen.append(p))
    assert max(p.num_tokens for p in seen) <= chunk
    assert any(p.prefills and p.decodes for p in seen)  # mixed steps happen


def test_distserve_cp2k_chunks_prefill_in_edf_order():
    seen = []
    simulate("distserve-cp2k", make_requests(100, seed=5, prompt=(3000, 6000)), on_step=lambda i, p, k: seen.append(p))
    assert max(sum(s.n for s in p.prefills) for p in seen) <= 2048


def test_edf_serves_tight_deadline_first():
    reqs = [
        Request(0, 0.0, prompt_len=2048, output_len=2),  # keeps the prefill instance busy
        Request(1, 0.01, prompt_len=4000, output_len=2, slo=SLO(ttft=100.0)),
        Request(2, 0.01, prompt_len=4000, output_len=2, slo=SLO(ttft=10.0)),
        Request(3, 0.01, prompt_len=4000, output_len=2, slo=SLO(ttft=1.0)),
    ]
    res, _ = simulate("distserve-cp2k", reqs, n=2)
    firsts = [s.first_token_time for s in res.states]
    assert firsts[3] < firsts[2] < firsts[1]
    fcfs, _ = simulate("distserve", reqs, n=2)
    assert [s.first_token_time for s in fcfs.states][1] < [s.first_token_time for s in fcfs.states][3]


def test_round_robin_cycles_and_least_load_balances():
    reqs = [Request(i, 0.0, prompt_len=100, output_len=50) for i in range(12)]
    rr, _ = simulate("round-robin", reqs, n=4)
    assert [s.instance for s in rr.states] == [0, 1, 2, 3] * 3
    reqs = [Request(0, 0.0, prompt_len=100, output_len=1000), Request(1, 0.0, prompt_len=100, output_len=1000),
            Request(2, 0.5, prompt_len=100, output_len=5), Request(3, 0.6, prompt_len=100, output_len=5)]
    ll, _ = simulate("least-load", reqs, n=3)
    assert [s.instance for s in ll.states] == [0, 1, 2, 2]


def test_kv_pressure_preempts_and_recomputes():
    reqs = [Request(i, 0.0, prompt_len=500, output_len=400) for i in range(8)]
    res, _ = simulate("vllm", reqs, n=1, capacity=2_500)
    assert len(res.completed) == 8
    assert sum(s.preemptions for s in res.states) > 0


def test_prompt_larger_than_kv_is_rejected_with_a_reason():
    reqs = [Request(0, 0.0, prompt_len=50_000, output_len=4), Request(1, 0.1, prompt_len=10, output_len=4)]
    res, _ = simulate("vllm", reqs, n=1, capacity=10_000)
    assert res.states[0].status is Status.REJECTED and "does not fit" in res.states[0].reject_reason
    assert res.states[1].status is Status.FINISHED


def test_unknown_policy_lists_valid_names():
    with pytest.raises(UnknownPolicyError, match="distserve-cp2k"):
        build_policy("nope")


def test_distserve_needs_both_pools():
    with pytest.raises(ValueError, match="prefill"):
        build_policy("distserve", PolicyOptions(num_instances=1))


def test_stale_snapshots_count_in_what_was_sent_but_miss_what_finished():
    """Snapshots as old as a runtime's reports, read as asynchronous Ray reads them: a request
    sent since the snapshot is counted in (so a burst still spreads), but one that finished
    since is not seen to have left (so least-load keeps avoiding an instance that is idle)."""
    burst = [Request(i, 0.001 * i, prompt_len=100, output_len=50) for i in range(6)]
    pol = build_policy("least-load", PolicyOptions(num_instances=3))
    stale = Simulator(burst, pol, LinearCost(capacity=20_000), TOPO, snapshot_staleness=1.0).run()
    assert [s.instance for s in stale.states] == [0, 1, 2, 0, 1, 2]
    spaced = [Request(i, 0.3 * i, prompt_len=100, output_len=5) for i in range(12)]
    fresh, _ = simulate("least-load", spaced, n=3)
    assert [s.instance for s in fresh.states] == [0] * 12  # each finished before the next came
    pol = build_policy("least-load", PolicyOptions(num_instances=3))
    stale = Simulator(spaced, pol, LinearCost(capacity=20_000), TOPO, snapshot_staleness=1.0).run()
    assert len({s.instance for s in stale.states}) == 3
