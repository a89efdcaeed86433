"""`flowprefill-colocated` (FlowPrefill's S-EDF on a colocated chunked core, Fig. 16) and the
per-objective attainment its experiment reports."""

from __future__ import annotations

import pytest

from flowyard.core.request import SLO, Request
from flowyard.costmodel import make_cost_model
from flowyard.experiments.common import objective_attainment
from flowyard.policies.framework.contracts import Role
from flowyard.policies.registry import POLICY_SPECS, PolicyOptions, build_policy
from flowyard.sim.run import SimConfig, build_topology
from flowyard.sim.simulator import Simulator

COST = make_cost_model("llama-3-8b", "a800")


def run(policy: str, reqs: list[Request]):
    pol = build_policy(policy, PolicyOptions(num_instances=1, predictor=COST, chunk_size=2048))
    return {s.id: s for s in Simulator(reqs, pol, COST, build_topology(SimConfig(hardware="a800"))).run().states}


def burst() -> list[Request]:
    """A prompt in progress, then a long loose prompt, then a short tight one (still able to make
    its deadline, or S-EDF would give up on it): both wait for the next free step, which FCFS gives
    to the long one and S-EDF to the short one."""
    return [Request(id=0, arrival=0.0, prompt_len=4096, output_len=8, slo=SLO(ttft=5.0)),
            Request(id=1, arrival=0.001, prompt_len=8000, output_len=8, slo=SLO(ttft=20.0)),
            Request(id=2, arrival=0.002, prompt_len=64, output_len=8, slo=SLO(ttft=0.6))]


def test_colocated_flowprefill_is_vllm_with_s_edf_order():
    pol = build_policy("flowprefill-colocated", PolicyOptions(num_instances=2, predictor=COST, chunk_size=1024))
    assert pol.roles == [Role.MIXED, Role.MIXED] and not POLICY_SPECS["flowprefill-colocated"].disaggregated
    cfg = pol.configs[Role.MIXED]
    assert cfg.order == "s-edf" and cfg.max_num_batched_tokens == 1024
    with pytest.raises(ValueError, match="predictor"):
        build_policy("flowprefill-colocated", PolicyOptions(num_instances=1))


def test_s_edf_serves_the_tight_short_prompt_before_the_loose_long_one():
    fcfs, sedf = run("vllm", burst()), run("flowprefill-colocated", burst())
    assert all(s.first_token_time is not None for s in list(fcfs.values()) + list(sedf.values()))
    assert sedf[2].first_token_time < sedf[1].first_token_time  # S-EDF: the short prompt first
    assert fcfs[2].first_token_time >= fcfs[1].first_token_time - 1e-9  # FCFS: behind the long one
    assert sedf[2].first_token_time - sedf[2].req.arrival <= 0.6 < fcfs[2].first_token_time - fcfs[2].req.arrival


def test_objective_attainment_judges_each_objective_alone():
    reqs = [Request(id=i, arrival=0.05 * i, prompt_len=1500, output_len=20, slo=SLO(ttft=0.12, tbt=0.03))
            for i in range(12)]
    states = list(run("vllm", reqs).values())
    att = objective_attainment(states)
    assert set(att) == {"ttft", "tbt"} and all(0.0 <= v <= 1.0 for v in att.values())
    ttft_ok = sum((s.first_token_time - s.req.arrival) <= 0.12 + 1e-9 for s in states) / len(states)
    assert att["ttft"] == pytest.approx(ttft_ok)
    # no request carries a TPOT objective: none is reported; no SLO at all: nothing to report
    assert objective_attainment([]) == {}
