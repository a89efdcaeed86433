"""Closed-loop (concurrency-bounded) clients in the simulator: `flowyard/sim/arrivals.py`."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from conftest import FixedLink, LinearCost, make_requests
from flowyard.cli import main
from flowyard.core.metrics import summarize
from flowyard.core.request import Request, RequestState, Status
from flowyard.policies.registry import PolicyOptions, build_policy
from flowyard.sim.arrivals import ClosedLoop, OpenLoop
from flowyard.sim.cluster import Topology
from flowyard.sim.simulator import Simulator

TOPO = Topology(1, FixedLink(), FixedLink())
POLICIES = ["vllm", "least-load", "distserve", "flowprefill"]


def run(reqs, policy="vllm", n=2, capacity=20_000, concurrency=None, think_time=0.0):
    cost = LinearCost(capacity=capacity)
    pol = build_policy(policy, PolicyOptions(num_instances=n, predictor=cost))
    arrivals = None if concurrency is None else ClosedLoop(reqs, concurrency, think_time)
    return Simulator(reqs, pol, cost, TOPO, arrivals=arrivals).run()


def end_time(s: RequestState) -> float:
    """When the request left its client's hands: finished, or rejected on arrival."""
    return s.finish_time if s.status is Status.FINISHED else s.req.arrival


def max_in_flight(states) -> int:
    """Most requests between arrival and end at once; [arrival, end) so a request sent at the
    instant another ends does not overlap it."""
    events = sorted([(end_time(s), -1) for s in states] + [(s.req.arrival, +1) for s in states])
    level = peak = 0
    for _, delta in events:  # at equal times the -1 sorts first
        level += delta
        peak = max(peak, level)
    return peak


def sessions(n_sessions=12, turns=4, seed=0):
    """Multi-turn conversations whose ids interleave across sessions and run against turn order."""
    rng = np.random.default_rng(seed)
    reqs, rid = [], 0
    for k in range(turns - 1, -1, -1):
        for s in range(n_sessions):
            reqs.append(Request(rid, arrival=float(rid), prompt_len=int(rng.integers(50, 800)),
                                output_len=int(rng.integers(2, 60)), session=f"s{s}", turn=k))
            rid += 1
    return reqs


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("concurrency", [1, 3, 16])
def test_never_more_than_concurrency_in_flight_and_all_finish(policy, concurrency):
    reqs = make_requests(80, seed=4)
    res = run(reqs, policy, concurrency=concurrency, capacity=8_000)
    assert all(s.status is Status.FINISHED for s in res.states)  # and the simulator checked KV
    assert [s.id for s in res.states] == [r.id for r in reqs]
    assert max_in_flight(res.states) == concurrency
    for s in res.states:
        assert s.first_token_time >= s.req.arrival and s.num_output == s.req.output_len


@pytest.mark.parametrize("think", [0.0, 0.25])
def test_session_turns_in_order_each_after_the_previous_ends(think):
    reqs = sessions()
    res = run(reqs, "distserve", n=4, concurrency=5, think_time=think)
    assert all(s.status is Status.FINISHED for s in res.states)
    by_session: dict[str, list[RequestState]] = {}
    for s in res.states:
        by_session.setdefault(s.req.session, []).append(s)
    for turns in by_session.values():
        turns.sort(key=lambda s: s.req.arrival)
        assert [s.req.turn for s in turns] == [0, 1, 2, 3]
        for prev, nxt in zip(turns, turns[1:]):
            assert nxt.req.arrival == prev.finish_time + think
    assert max_in_flight(res.states) == 5
    # five clients start the first five sessions at time 0, in order of their lowest id
    first = sorted(s.req.session for s in res.states if s.req.arrival == 0.0)
    assert first == sorted(f"s{i}" for i in range(5))


def test_concurrency_one_serialises_everything():
    reqs = make_requests(40, seed=5)
    res = run(reqs, "least-load", n=3, concurrency=1, think_time=0.1)
    order = sorted(res.states, key=lambda s: s.req.arrival)
    assert [s.id for s in order] == [r.id for r in reqs]  # single-turn jobs in id order
    assert order[0].req.arrival == 0.0
    for prev, nxt in zip(order, order[1:]):
        assert nxt.req.arrival == prev.finish_time + 0.1
    assert max_in_flight(res.states) == 1


@pytest.mark.parametrize("policy", POLICIES)
def test_large_concurrency_equals_open_loop_with_everything_at_zero(policy):
    reqs = make_requests(60, seed=6)
    closed = run(reqs, policy, concurrency=1_000, capacity=8_000)
    at_zero = [dataclasses.replace(r, arrival=0.0) for r in reqs]
    opened = run(at_zero, policy, capacity=8_000)
    assert closed.events == opened.events and closed.steps == opened.steps
    for a, b in zip(closed.states, opened.states):
        assert a.req == b.req and a.status is b.status
        np.testing.assert_array_equal(a.all_token_times(), b.all_token_times())


def test_deterministic():
    reqs = sessions(seed=3)
    a = run(reqs, "vllm", concurrency=4, think_time=0.05)
    b = run(reqs, "vllm", concurrency=4, think_time=0.05)
    for x, y in zip(a.states, b.states):
        assert x.req == y.req
        np.testing.assert_array_equal(x.all_token_times(), y.all_token_times())


def test_rejected_request_frees_its_client():
    reqs = [Request(0, 0.0, prompt_len=50_000, output_len=4, session="a", turn=0),
            Request(1, 0.0, prompt_len=10, output_len=4, session="a", turn=1),
            Request(2, 0.0, prompt_len=10, output_len=4)]
    res = run(reqs, n=1, capacity=10_000, concurrency=1, think_time=0.5)
    s0, s1, s2 = res.states
    assert s0.status is Status.REJECTED and s0.req.arrival == 0.0
    assert s1.req.arrival == 0.5 and s1.status is Status.FINISHED  # the conversation goes on
    assert s2.req.arrival == s1.finish_time + 0.5 and s2.status is Status.FINISHED


def test_throughput_is_over_the_closed_loop_span():
    reqs = [dataclasses.replace(r, arrival=1000.0 + r.arrival) for r in make_requests(30, seed=7)]
    res = run(reqs, concurrency=2)
    summary = summarize(res.states)
    span = max(s.finish_time for s in res.states)  # the first request is sent at 0
    assert summary.duration_s == pytest.approx(span)
    assert summary.throughput_rps == pytest.approx(30 / span)


def test_open_loop_releases_one_arrival_at_a_time_in_arrival_order():
    reqs = [Request(i, t, prompt_len=10, output_len=2) for i, t in enumerate([2.0, 0.0, 1.0, 0.0])]
    src = OpenLoop(reqs)
    states = [RequestState(r) for r in reqs]
    seen = list(src.initial(states))
    while True:
        nxt = src.on_arrival(seen[-1][1], seen[-1][0])
        assert len(nxt) <= 1 and not src.on_done(seen[-1][1], seen[-1][0])
        if not nxt:
            break
        seen.extend(nxt)
    assert [s.id for _, s in seen] == [1, 3, 2, 0]


@pytest.mark.parametrize("kwargs,match", [
    ({"concurrency": 0}, "concurrency"), ({"concurrency": 2.5}, "concurrency"),
    ({"concurrency": 2, "think_time": -1.0}, "think_time"),
    ({"concurrency": 2, "think_time": float("inf")}, "think_time"),
])
def test_bad_closed_loop_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ClosedLoop(make_requests(5), **kwargs)


def test_source_must_match_the_simulators_requests():
    reqs = make_requests(5)
    pol = build_policy("vllm", PolicyOptions(num_instances=1))
    with pytest.raises(ValueError, match="other requests"):
        Simulator(reqs[:4], pol, LinearCost(), TOPO, arrivals=ClosedLoop(reqs, 2)).run()
    with pytest.raises(ValueError, match="unique"):
        ClosedLoop(reqs + reqs[:1], 2)


SMALL = ["--trace", "azure-conv", "--num-requests", "60", "--instances", "2", "--quiet"]


def test_cli_concurrency(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["simulate", *SMALL, "--concurrency", "4", "--think-time", "0.5", "--json", str(out)]) == 0
    assert "closed loop: 4 clients, think time 0.5 s" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["config"]["concurrency"] == 4 and data["config"]["think_time"] == 0.5
    assert data["requests"] == data["completed"] == 60
    assert data["throughput_rps"] < 4 / 0.5  # each client idles 0.5 s per request


@pytest.mark.parametrize("argv,message", [
    (["simulate", "--concurrency", "0"], "--concurrency"),
    (["simulate", "--concurrency", "two"], "--concurrency"),
    (["simulate", "--concurrency", "2", "--think-time", "-1"], "--think-time"),
    (["simulate", "--think-time", "1"], "needs --concurrency"),
    (["simulate", "--concurrency", "2", "--rate-scale", "2"], "--rate-scale"),
    (["goodput", "--concurrency", "4"], "simulate --concurrency"),
])
def test_cli_bad_values_exit_2(capsys, argv, message):
    try:
        code = main([*argv, *SMALL])
    except SystemExit as e:  # argparse's own type checks
        code = e.code
    assert code == 2
    assert message in capsys.readouterr().err
