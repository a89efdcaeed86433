"""Closed-loop clients that read their streams on one processor (`flowyard/sim/client_cpu.py`):
a threaded Python benchmark caps what it measures once the server outruns it."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import FixedLink, LinearCost
from flowyard.core.metrics import summarize
from flowyard.core.request import Request, Status
from flowyard.policies.registry import PolicyOptions, build_policy
from flowyard.sim.arrivals import ClosedLoop
from flowyard.sim.client_cpu import SharedClient
from flowyard.sim.cluster import Topology
from flowyard.sim.run import SimConfig
from flowyard.sim.simulator import Simulator

TOPO = Topology(1, FixedLink(), FixedLink())


def requests(n=48, seed=0):
    rng = np.random.default_rng(seed)
    return [Request(i, arrival=0.0, prompt_len=int(rng.integers(20, 200)), output_len=int(rng.integers(20, 80)))
            for i in range(n)]


def run(reqs, arrivals):
    cost = LinearCost(capacity=20_000)
    pol = build_policy("vllm", PolicyOptions(num_instances=1, predictor=cost))
    return Simulator(reqs, pol, cost, TOPO, arrivals=arrivals).run()


def test_a_client_far_faster_than_the_server_observes_what_the_server_emits():
    """Not to the step: a request its client sends a nanosecond after a step began waits for
    that step, where a free client's request lands at the step boundary itself."""
    reqs = requests()
    free = summarize(run(reqs, ClosedLoop(reqs, 8)).states)
    fast = summarize(run(reqs, SharedClient(reqs, 8, chunk_s=1e-9)).states)
    assert fast.output_tokens_per_s == pytest.approx(free.output_tokens_per_s, rel=0.05)
    assert fast.tpot["p50"] == pytest.approx(free.tpot["p50"], rel=0.1)


@pytest.mark.parametrize("concurrency", [1, 4, 16])
def test_every_token_is_read_after_it_is_emitted_one_at_a_time(concurrency):
    reqs = requests()
    chunk = 2e-3
    res = run(reqs, SharedClient(reqs, concurrency, chunk_s=chunk))
    assert all(s.status is Status.FINISHED and s.num_output == s.req.output_len for s in res.states)
    reads = np.sort(np.concatenate([s.all_token_times() for s in res.states]))
    assert np.all(np.diff(reads) >= chunk - 1e-9)  # one processor: no two reads overlap
    assert reads[0] >= chunk


def test_a_saturated_client_caps_throughput_and_stretches_tpot_to_a_round_of_turns():
    reqs = requests(n=96)
    server = summarize(run(reqs, ClosedLoop(reqs, 16)).states)
    chunk = 4.0 / server.output_tokens_per_s  # the client reads four times slower than the server emits
    slow = summarize(run(reqs, SharedClient(reqs, 16, chunk_s=chunk)).states)
    assert slow.output_tokens_per_s <= 1 / chunk * 1.001
    assert slow.output_tokens_per_s < 0.5 * server.output_tokens_per_s
    assert slow.tpot["p50"] == pytest.approx(16 * chunk, rel=0.25)  # every thread takes a turn per token


def test_a_client_chunk_time_needs_closed_loop_clients_and_a_sane_value():
    with pytest.raises(ValueError, match="--client-token-ms needs --concurrency"):
        SimConfig(trace="sharegpt", client_chunk_s=1e-3)
    with pytest.raises(ValueError, match="--client-token-ms must be a finite number"):
        SimConfig(trace="sharegpt", concurrency=4, client_chunk_s=-1.0)
    with pytest.raises(ValueError, match="finite number"):
        SharedClient(requests(4), 2, chunk_s=float("nan"))


def test_simulate_takes_the_client_cost_from_the_command_line(capsys):
    from flowyard.cli import main

    args = ["simulate", "--trace", "sharegpt", "--num-requests", "40", "--concurrency", "8"]
    assert main(args) == 0
    free = capsys.readouterr().out
    assert main(args + ["--client-token-ms", "5"]) == 0
    slow = capsys.readouterr().out
    assert "client 5 ms per token" in slow and "client 0 ms per token" in free
    assert main(["simulate", "--trace", "sharegpt", "--num-requests", "4", "--client-token-ms", "1"]) == 2
    assert "--client-token-ms needs --concurrency" in capsys.readouterr().err


def test_a_published_closed_loop_series_fits_its_client_on_its_most_loaded_runs_throughput():
    """The client term comes from a run's published tokens/s (not a TTFT or TPOT), and that
    run's own points are not cross-validated."""
    from dataclasses import replace

    from flowyard.costmodel.hardware import calibrated, get_hardware
    from flowyard.costmodel.published import published_points
    from flowyard.costmodel.refit import checkable
    from flowyard.costmodel.fit import current_fit
    from flowyard.costmodel.replay import _config, client_chunk_s
    from flowyard.costmodel.roofline import RooflineCostModel
    from flowyard.sim.run import simulate

    series = [p for p in published_points() if p.workload.get("client")]
    assert series and all(p.workload.get("concurrency") for p in series)
    fold = current_fit()
    fit_run = [p for p in series if p.workload["concurrency"] == p.workload["client"]["concurrency"]]
    assert fit_run and not any(checkable(p, fold) for p in fit_run)
    assert any(checkable(p, fold) for p in series if p not in fit_run)

    p = series[0]
    target = 900.0  # tokens/s: below what this server serves 12 free clients
    small = replace(p, name="client fit (test)", workload={**p.workload, "concurrency": 12, "client": {
        "concurrency": 12, "num_requests": 60, "output_tok_s": target}})
    hw = calibrated(get_hardware(p.hardware))
    chunk = client_chunk_s(small, hw, p.tp)
    run = replace(small, workload={**small.workload, "num_requests": 60})
    got = simulate(_config(run, p.tp, client_chunk_s=chunk), cost_model=RooflineCostModel(p.model, hw, p.tp))[0]
    assert got.output_tokens_per_s == pytest.approx(target, rel=0.01)
    assert 0 < chunk < 1 / target
