"""`flowyard` on instances that take turns on one device (`PolicyOptions.shared_device`): it
serves from the first instance whose KV cache holds the work and spills over only when that
cache is full, because on one device a second instance only adds steps."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from flowyard.core.request import Request
from flowyard.policies.flowyard.dispatch import KV_HEADROOM, consolidated
from flowyard.policies.flowyard.router import FlowyardConfig
from flowyard.policies.framework.contracts import InstanceSnapshot, Role
from flowyard.policies.registry import build_policy
from flowyard.sim.run import SimConfig, build_cost_model, build_topology, load_workload, policy_options
from flowyard.sim.simulator import Simulator


def _run(shared: bool, mode: str = "auto"):
    cfg = SimConfig(trace="azure-conv", instances=2, policy="flowyard", duration=20.0, rate_scale=0.5)
    w, cost = load_workload(cfg), build_cost_model(cfg)
    opts = policy_options(cfg, cost, shared_device=shared, flowyard=FlowyardConfig(mode=mode))
    res = Simulator(w.requests, build_policy("flowyard", opts), cost, build_topology(cfg), shared_device=True).run()
    return w, res


def test_on_a_shared_device_every_request_is_served_by_one_instance():
    w, res = _run(shared=True)
    assert len(res.completed) == len(w.requests) > 10
    assert {s.instance for s in res.states} == {0}
    _, spread = _run(shared=False)  # told nothing, it spreads the work over both
    assert {s.instance for s in spread.states} == {0, 1}


def test_a_pinned_regime_is_kept_on_a_shared_device():
    _, res = _run(shared=True, mode="disaggregated")
    assert {s.instance for s in res.states} == {0, 1}  # prefilled on one, decoded on the other


@dataclass
class _View:
    snaps: dict[int, InstanceSnapshot]

    def snapshot(self, i: int) -> InstanceSnapshot:
        return self.snaps[i]


def _snap(i: int, running_tokens: int, num_running: int = 1, waiting_tokens: int = 0) -> InstanceSnapshot:
    return InstanceSnapshot(i, Role.MIXED, num_running=num_running, num_waiting=0, waiting_tokens=waiting_tokens,
                            running_tokens=running_tokens, kv_free_blocks=0, kv_total_blocks=100, block_size=16)


@pytest.mark.parametrize("held, seqs, expect", [
    (0, 0, [0]),  # room: the first instance
    (int(KV_HEADROOM * 1600) - 100, 1, [0]),  # the prompt still fits its cache
    (int(KV_HEADROOM * 1600) - 99, 1, [1]),  # one token over: the next instance
    (0, 8, [1]),  # its batch is full
])
def test_consolidation_spills_over_on_kv_or_batch_only(held, seqs, expect):
    view = _View({0: _snap(0, held, seqs, waiting_tokens=10**6), 1: _snap(1, 0)})
    assert consolidated(Request(0, 0.0, prompt_len=100, output_len=8), view, [0, 1], max_seqs=8) == expect


def test_when_no_cache_holds_the_prompt_every_instance_is_a_candidate():
    view = _View({0: _snap(0, 1500), 1: _snap(1, 1500)})
    assert consolidated(Request(0, 0.0, prompt_len=100, output_len=8), view, [0, 1], max_seqs=8) == [0, 1]
