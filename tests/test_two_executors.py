"""One scheduler, two executors: the same workload through the simulator and the real engine
must produce the same sequence of scheduling decisions (DESIGN.md's guard)."""

from __future__ import annotations

import dataclasses

import pytest

from conftest import FixedLink, LinearCost
from helpers_models import make_tiny_model, tiny_model
from flowyard.core.request import Request
from flowyard.engine.engine_config import EngineConfig
from flowyard.engine.llm_engine import LLMEngine
from flowyard.engine.loader import load_checkpoint
from flowyard.engine.model import CausalLM
from flowyard.engine.sampling import SamplingParams
from flowyard.policies.registry import POLICY_NAMES, PolicyOptions, build_policy
from flowyard.sim.cluster import Topology
from flowyard.sim.simulator import Simulator

PROMPTS = [40, 7, 90, 33, 5, 61, 18]
OUTPUTS = [12, 30, 4, 20, 9, 15, 25]
KV_TOKENS, BLOCK, CHUNK, SEQS = 160, 16, 48, 4  # small enough to force chunking and preemption


def decisions(plans):
    return [(sorted((s.state.id, s.start, s.n) for s in p.prefills), sorted(d.id for d in p.decodes))
            for p in plans]


def engine_plans(model_dir):
    pytest.importorskip("transformers")
    ckpt = load_checkpoint(model_dir)
    model = CausalLM(ckpt.config)
    model.load_weights(ckpt.weights)
    engine = LLMEngine(model, ckpt.tokenizer, EngineConfig(
        kv_cache_tokens=KV_TOKENS, block_size=BLOCK, max_num_batched_tokens=CHUNK, max_num_seqs=SEQS,
        enable_prefix_caching=False))
    plans = []
    schedule = engine.scheduler.schedule

    def recording(now):
        plan = schedule(now)
        if plan is not None:
            plans.append(dataclasses.replace(plan, prefills=list(plan.prefills), decodes=list(plan.decodes)))
        return plan

    engine.scheduler.schedule = recording
    for i, (p, o) in enumerate(zip(PROMPTS, OUTPUTS)):
        engine.add_request(f"r{i}", [(7 * i + j) % 200 + 3 for j in range(p)],
                           SamplingParams(max_tokens=o, temperature=0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    return plans, engine


def sim_plans():
    reqs = [Request(i, 0.0, prompt_len=p, output_len=o, max_tokens=o) for i, (p, o) in enumerate(zip(PROMPTS, OUTPUTS))]
    policy = build_policy("vllm", PolicyOptions(num_instances=1, chunk_size=CHUNK, max_num_seqs=SEQS))
    policy.configs = {r: dataclasses.replace(c, max_repeats=1) for r, c in policy.configs.items()}
    plans = []
    sim = Simulator(reqs, policy, LinearCost(capacity=KV_TOKENS), Topology(1, FixedLink(), FixedLink()),
                    block_size=BLOCK, on_step=lambda i, plan, k: plans.append(plan))
    result = sim.run()
    return plans, result


def test_simulator_and_engine_make_the_same_decisions(tmp_path):
    d, _ = make_tiny_model(tmp_path, "llama")
    real, engine = engine_plans(d)
    simulated, result = sim_plans()
    assert decisions(real) == decisions(simulated)
    assert any(p.prefills and p.decodes for p in real)  # mixed steps happened
    assert any(s.n < PROMPTS[s.state.id] for p in real for s in p.prefills)  # chunking happened
    assert sum(s.preemptions for s in result.states) > 0  # and so did recompute preemption
    assert not engine.kv.leaked()


# -- the guard widened: every policy, several instances, decisions compared event by event ------

GUARD_BLOCK, GUARD_KV = 8, 1024
# decisions each policy must have taken on the guard's workload (so the comparison covers them)
GUARD_SHOWS = {"distserve": {"handoff"}, "flowprefill": {"handoff", "preempt"}, "pla": {"handoff"},
               "pla-mix": {"flip"}, "arrow": {"decode", "flip"}, "dynaserve": {"split", "handoff"},
               "dynaserve-oracle": {"split", "handoff"}}


def guard_jobs():
    import random

    from guard_driver import Job
    from flowyard.core.request import SLO

    rng = random.Random(7)
    jobs, t = [], 0.0
    for i in range(14):
        t += rng.choice([0.0005, 0.002, 0.004, 0.01])
        n = rng.choice([6, 12, 30, 70, 110])
        jobs.append(Job(round(t, 6), [(5 * i + j) % 200 + 3 for j in range(n)], rng.choice([3, 6, 12, 20]),
                        SLO(ttft=rng.choice([0.02, 0.05, 0.3]), tpot=0.05)))
    return jobs


@pytest.fixture(scope="module")
def guard_model(tmp_path_factory):
    pytest.importorskip("transformers")
    return tiny_model(tmp_path_factory.mktemp("guard"))


def guard_options(name: str, cost) -> PolicyOptions:
    return PolicyOptions(num_instances=3 if name.startswith(("pla", "arrow")) else 2, chunk_size=32,
                         max_num_seqs=4, predictor=cost)


@pytest.mark.parametrize("name", list(POLICY_NAMES))
def test_simulator_and_cluster_decide_the_same_event_by_event(name, guard_model):
    from guard_driver import profile_cost, run_cluster, simulate

    model, tok = guard_model
    cost = profile_cost(capacity=GUARD_KV)
    jobs = guard_jobs()
    opts = guard_options(name, cost)
    sim = simulate(name, jobs, cost, opts, GUARD_BLOCK)
    real, tokens = run_cluster(name, jobs, cost, opts, model, tok, GUARD_BLOCK, GUARD_KV)
    assert real.without_time() == sim.without_time()
    assert [d.t for d in real.decisions] == pytest.approx([d.t for d in sim.decisions], abs=1e-9)
    assert len(sim.decisions) >= len(jobs)  # at least every route
    assert GUARD_SHOWS.get(name, set()) <= sim.kinds()  # the policy's own mechanisms were at work
    assert all(len(tokens[f"r{i}"]) == j.max_tokens for i, j in enumerate(jobs))


def test_flowyard_on_a_shared_device_decides_the_same_event_by_event(guard_model):
    """`flowyard serve` in one process builds flowyard with `shared_device` (its instances take
    turns on one device, so it consolidates); the simulator of that cluster builds it the same
    way, and the two must still agree decision by decision."""
    import dataclasses

    from guard_driver import profile_cost, run_cluster, simulate

    model, tok = guard_model
    cost = profile_cost(capacity=GUARD_KV)
    jobs = guard_jobs()
    opts = dataclasses.replace(guard_options("flowyard", cost), shared_device=True)
    sim = simulate("flowyard", jobs, cost, opts, GUARD_BLOCK)
    real, tokens = run_cluster("flowyard", jobs, cost, opts, model, tok, GUARD_BLOCK, GUARD_KV)
    assert real.without_time() == sim.without_time()
    assert [d.t for d in real.decisions] == pytest.approx([d.t for d in sim.decisions], abs=1e-9)
    routes = [d.dst for d in sim.decisions if d.kind == "route"]
    assert len(routes) == len(jobs)
    assert routes.count(0) > routes.count(1)  # it fills the first instance first
    assert all(len(tokens[f"r{i}"]) == j.max_tokens for i, j in enumerate(jobs))
