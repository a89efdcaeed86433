"""An engine profile's frontend latency: requests reach the scheduler that long after their
client sent them, so every TTFT includes it (flowyard/sim/simulator.py, costmodel/refit.py)."""

from __future__ import annotations

import pytest

from conftest import FixedLink, LinearCost, make_requests
from flowyard.costmodel.engines import get_engine_profile
from flowyard.costmodel.fit import current_fit, fitted_on
from flowyard.costmodel.published import published_points
from flowyard.costmodel.refit import lone_request_ttfts
from flowyard.policies.registry import PolicyOptions, build_policy
from flowyard.sim.arrivals import ClosedLoop
from flowyard.sim.cluster import Topology
from flowyard.sim.simulator import Simulator


class FrontendCost(LinearCost):
    def __init__(self, frontend: float) -> None:
        super().__init__()
        self.frontend = frontend

    def frontend_latency(self) -> float:
        return self.frontend


def _run(frontend: float, policy: str = "vllm", concurrency: int | None = None):
    reqs = make_requests(40, seed=3)
    cost = FrontendCost(frontend)
    pol = build_policy(policy, PolicyOptions(num_instances=2, predictor=cost))
    arrivals = None if concurrency is None else ClosedLoop(reqs, concurrency, 0.0)
    return Simulator(reqs, pol, cost, Topology(1, FixedLink(), FixedLink()), arrivals=arrivals).run()


@pytest.mark.parametrize("policy", ["vllm", "distserve", "arrow"])
def test_open_loop_ttft_is_the_engines_plus_the_frontend(policy):
    base, delayed = _run(0.0, policy), _run(0.25, policy)
    for a, b in zip(base.states, delayed.states):
        assert b.req.arrival == a.req.arrival  # arrival stays the client's send time
        ttft_a = a.first_token_time - a.req.arrival
        ttft_b = b.first_token_time - b.req.arrival
        assert ttft_b == pytest.approx(ttft_a + 0.25, abs=1e-9)


def test_closed_loop_clients_send_at_their_send_time_and_wait_the_frontend():
    res = _run(0.5, concurrency=4)
    for st in res.states:
        assert st.first_token_time - st.req.arrival >= 0.5
    first = sorted(st.req.arrival for st in res.states)[:4]
    assert first == [0.0] * 4  # the first four are sent at 0 and arrive at 0.5


def test_the_default_profile_has_a_frontend_fitted_on_lone_request_ttfts():
    lone = lone_request_ttfts(published_points())
    assert lone and all(p.metric == "ttft_p50" for p in lone)
    # one point per series, at its lowest load
    for p in lone:
        same = [q for q in published_points() if q.kind == "serving" and q.metric == "ttft_p50"
                and q.family == p.family and q.model == p.model and q.hardware == p.hardware
                and q.tp == p.tp]
        load = lambda q: q.workload.get("concurrency") or q.workload.get("rate")  # noqa: E731
        assert load(p) == min(load(q) for q in same)
    assert get_engine_profile().frontend_s > 0
    assert current_fit().fitted_on["frontend:vllm-v1"]
    assert set(lone) <= set(fitted_on("published"))  # reported as fit inputs, not checks
