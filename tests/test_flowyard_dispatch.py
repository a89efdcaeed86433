"""`flowyard`'s colocated dispatch from indexes (`flowyard.dispatch`) picks what the scan of
every snapshot picks: a run on enough instances to use the indexes decides every request the
same way with them and without them."""

from unittest import mock

import flowyard.policies.flowyard.dispatch as fd
from flowyard.sim.run import SimConfig, build_cost_model, load_workload, simulate


def _outcomes(cfg: SimConfig, w, cost) -> tuple:
    summary, res = simulate(cfg, w, cost_model=cost)
    d = summary.to_dict()
    d.pop("wall_s", None)
    return d, [(s.id, s.instance, s.first_token_time, s.finish_time, s.num_output, s.preemptions)
               for s in res.states]


def test_indexed_dispatch_decides_as_the_scan() -> None:
    n = fd.INDEX_MIN + 8
    cfg = SimConfig(trace="azure-code", instances=n, policy="flowyard", rate_scale=n / 8, duration=40.0)
    w, cost = load_workload(cfg), build_cost_model(cfg)
    calls = []
    real = fd.indexed_pick

    def counted(*a, **k):
        pick = real(*a, **k)
        calls.append(pick is not None)
        return pick

    with mock.patch("flowyard.policies.flowyard.router.indexed_pick", counted):
        indexed = _outcomes(cfg, w, cost)
    assert sum(calls) > 0.5 * len(calls) > 0  # the indexes answered most arrivals
    with mock.patch.object(fd, "INDEX_MIN", 10**9):
        scanned = _outcomes(cfg, w, cost)
    assert indexed == scanned
