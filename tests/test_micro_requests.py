"""Micro-requests (DynaServe's seam): a request split at any token s runs tokens 1..s on one
instance and the rest on another, in the simulator and on real engines with identical tokens."""

from __future__ import annotations

import pytest

from conftest import LinearCost, make_requests
from flowyard.policies.framework.contracts import Role
from flowyard.policies.framework.continuous_batching import BatchConfig
from flowyard.policies.framework.policy import Policy
from flowyard.policies.baselines.routers import RoundRobin
from flowyard.sim.run import SimConfig, build_topology
from flowyard.sim.simulator import Simulator


class SplitAt(RoundRobin):
    """Everything starts on instance 0 and moves to 1 after `where(req)` tokens."""

    def __init__(self, where):
        super().__init__()
        self.where = where

    def route(self, req, view, now):
        return 0

    def split_point(self, req, dst, view, now):
        return (self.where(req), 1)


def policy(where, chunk=2048) -> Policy:
    cfg = BatchConfig(max_num_batched_tokens=chunk)
    return Policy("split", SplitAt(where), [Role.MIXED, Role.MIXED], {Role.MIXED: cfg})


@pytest.mark.parametrize("where", [
    lambda r: max(1, r.prompt_len // 2),          # part of the prompt on B
    lambda r: r.prompt_len,                        # a plain PD split
    lambda r: r.prompt_len + r.output_len // 2,    # A decodes some tokens first
])
def test_simulated_micro_requests_finish_on_the_second_instance(where):
    reqs = make_requests(n=60, rate=30.0, prompt=(16, 600), out=(4, 40))
    sim = Simulator(reqs, policy(where), LinearCost(), build_topology(SimConfig()))
    res = sim.run()  # conservation and KV checks inside
    for s in res.states:
        assert s.num_output == s.req.output_len
        if where(s.req) < s.req.prompt_len + s.req.output_len - 1:
            assert s.instance == 1 and s.prefill_instance == 0


def test_split_inside_the_output_keeps_the_first_tokens_on_a():
    reqs = make_requests(n=1, prompt=(100, 101), out=(10, 11))
    seen = []
    sim = Simulator(reqs, policy(lambda r: r.prompt_len + 4), LinearCost(), build_topology(SimConfig()),
                    on_step=lambda i, plan, steps: seen.append((i, len(plan.decodes), steps)))
    sim.run()
    on_a = sum(steps for i, d, steps in seen if i == 0 and d)
    assert on_a == 4  # decode steps for tokens 2..5 ran on A (token 1 came from the prefill)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    pytest.importorskip("transformers")
    from helpers_models import tiny_model

    return tiny_model(tmp_path_factory.mktemp("micro"), "qwen2")


@pytest.mark.parametrize("offset", [-20, 0, 5])  # inside the prompt, at its end, inside the output
def test_real_micro_request_tokens_equal_the_unsplit_request(tiny, offset):
    from flowyard.engine.engine_config import EngineConfig
    from flowyard.engine.llm_engine import LLMEngine
    from flowyard.engine.sampling import SamplingParams
    from flowyard.runtime.cluster import LocalCluster

    model, tok = tiny
    prompt = [(7 * j) % 150 + 3 for j in range(60)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    ref = LLMEngine(model, tok, EngineConfig(dtype="float32", kv_cache_tokens=1024)).generate([prompt], params)[0].new_token_ids
    c = LocalCluster(model, tok, policy(lambda r: r.prompt_len + offset, chunk=32), EngineConfig(dtype="float32", kv_cache_tokens=1024))
    c.add_request("r", prompt, params)
    got = []
    while c.has_unfinished():
        for o in c.step():
            got += o.new_token_ids
    assert got == ref
    assert c.migrations == 1
    assert c.engines[1].tracked("r") is None and not any(e.kv.leaked() for e in c.engines)
