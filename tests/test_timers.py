"""Timers in both executors: a local scheduler's wake-up time (a batching window) and the
global scheduler's periodic tick, the seams PLA-Serve's AWD windows and Arrow's monitor use."""

from __future__ import annotations

import asyncio
import time

import pytest

from conftest import LinearCost, make_requests
from flowyard.core.request import SLO
from flowyard.policies.framework.contracts import Role
from flowyard.policies.framework.continuous_batching import BatchConfig, BatchScheduler
from flowyard.policies.framework.policy import Policy
from flowyard.policies.baselines.routers import RoundRobin
from flowyard.sim.run import SimConfig, build_topology
from flowyard.sim.simulator import Simulator

WINDOW = 0.2


class WindowedScheduler(BatchScheduler):
    """Holds new requests until the oldest has waited WINDOW seconds or 4 are queued."""

    def schedule(self, now):
        if not self.running and 0 < self.num_waiting < 4:
            oldest = min(w.req.arrival for w in self.selector.waiting_states())
            if now < oldest + WINDOW - 1e-12:
                return None
        return super().schedule(now)

    def wake_at(self, now):
        if self.running or not self.num_waiting:
            return None
        return min(w.req.arrival for w in self.selector.waiting_states()) + WINDOW


class Ticking(RoundRobin):
    period = 0.5

    def __init__(self):
        super().__init__()
        self.ticks: list[float] = []

    def tick(self, view, now):
        self.ticks.append(now)
        assert list(view.instances()) == [0]


def policy(router=None) -> Policy:
    cfg = BatchConfig()

    def make(i, role, kv, batch):  # batch: cfg with the executor's limits applied
        return WindowedScheduler(i, role, kv, batch)

    return Policy("windowed", router or RoundRobin(), [Role.MIXED], {Role.MIXED: cfg}, {Role.MIXED: make})


def test_simulator_wakes_a_scheduler_whose_batching_window_closes():
    reqs = make_requests(n=3, rate=1000.0, prompt=(16, 32), out=(2, 3))  # within a millisecond
    sim = Simulator(reqs, policy(), LinearCost(), build_topology(SimConfig()))
    res = sim.run()
    firsts = sorted(s.first_token_time for s in res.states)
    assert firsts[0] >= WINDOW  # nobody started before the window closed
    assert firsts[0] == pytest.approx(WINDOW + LinearCost().step_time(
        __import__("flowyard.core.plan", fromlist=["x"]).BatchShape.of([(0, r.prompt_len) for r in reqs], [])))


def test_simulator_ticks_the_global_scheduler_while_requests_remain():
    reqs = make_requests(n=20, rate=5.0, prompt=(16, 32), out=(2, 3))
    router = Ticking()
    res = Simulator(reqs, policy(router), LinearCost(), build_topology(SimConfig())).run()
    end = max(s.finish_time for s in res.states)
    assert router.ticks == pytest.approx([0.5 * (k + 1) for k in range(len(router.ticks))])
    assert end - 0.5 <= router.ticks[-1] <= end + 0.5


def test_real_engine_sleeps_until_the_window_closes_instead_of_spinning(tmp_path):
    pytest.importorskip("transformers")
    from helpers_models import make_tiny_model
    from flowyard.engine.async_engine import AsyncLLMEngine
    from flowyard.engine.engine_config import EngineConfig
    from flowyard.engine.loader import load_checkpoint
    from flowyard.engine.model import CausalLM
    from flowyard.engine.sampling import SamplingParams
    from flowyard.runtime.cluster import LocalCluster

    d, _ = make_tiny_model(tmp_path, "llama")
    ckpt = load_checkpoint(d)
    model = CausalLM(ckpt.config)
    model.load_weights(ckpt.weights)
    cluster = LocalCluster(model, ckpt.tokenizer, policy(), EngineConfig(dtype="float32", kv_cache_tokens=1024))
    calls = {"n": 0}
    sched = cluster.engines[0].scheduler
    original = sched.schedule

    def counting(now):
        calls["n"] += 1
        return original(now)

    sched.schedule = counting
    client = AsyncLLMEngine(cluster)

    async def one() -> float:
        t0 = time.monotonic()
        async for out in client.generate("r", [5, 6, 7, 8], SamplingParams(max_tokens=2, temperature=0),
                                         SLO(ttft=5.0)):
            if out.new_token_ids:
                return time.monotonic() - t0
        raise AssertionError("no token")

    try:
        ttft = asyncio.run(one())
    finally:
        client.shutdown()
    assert WINDOW - 0.02 <= ttft < WINDOW + 0.5
    assert calls["n"] < 20  # woke at the window's end, not polled in a loop


def test_ray_actor_is_stepped_when_the_window_closes_not_polled(tmp_path):
    """Asynchronous Ray honours a scheduler's wake-up time as the simulator does: the actor
    whose window is open is stepped again when it closes (or at an event), not re-stepped in
    a loop by the driver while nothing can run."""
    ray = pytest.importorskip("ray")
    pytest.importorskip("transformers")
    import sys

    from ray import cloudpickle

    from helpers_models import make_tiny_model
    from flowyard.engine.engine_config import EngineConfig
    from flowyard.engine.sampling import SamplingParams
    from flowyard.runtime.ray_cluster import RayCluster

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actors unpickle the policy
    d, _ = make_tiny_model(tmp_path, "llama")
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        cluster = RayCluster(str(d), policy(), EngineConfig(dtype="float32", kv_cache_tokens=1024))
        steps = {"n": 0}
        call = cluster._call

        def counting(i, method, *args):
            steps["n"] += method == "step"
            return call(i, method, *args)

        cluster._call = counting
        cluster.add_request("r", [5, 6, 7, 8], SamplingParams(max_tokens=2, temperature=0), SLO(ttft=5.0))
        first, tokens = None, 0
        while cluster.has_unfinished():
            for o in cluster.step():
                tokens += len(o.new_token_ids)
                if o.new_token_ids and first is None:
                    first = cluster.now()
        assert tokens == 2 and first is not None and first >= WINDOW - 0.02
        assert steps["n"] < 12  # the window's first look, its end, two tokens: not a poll loop
        cluster.shutdown()
    finally:
        ray.shutdown()
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


class MoveEveryOther(RoundRobin):
    """A global scheduler that decides decodes after prefill (Arrow's seam): odd ids move."""

    routes_decode = True

    def route(self, req, view, now):
        return 0

    def route_decode(self, state, src, view, now):
        return 1 if state.id % 2 else src


def test_simulator_moves_decodes_a_stateless_policy_routes_elsewhere():
    cfg = BatchConfig()
    pol = Policy("arrow-like", MoveEveryOther(), [Role.MIXED, Role.MIXED], {Role.MIXED: cfg})
    reqs = make_requests(n=40, rate=50.0, prompt=(16, 200), out=(2, 30))
    res = Simulator(reqs, pol, LinearCost(), build_topology(SimConfig())).run()
    for s in res.states:
        assert s.num_output == s.req.output_len
        if s.req.output_len > 1:
            assert s.instance == (1 if s.id % 2 else 0)


def test_local_cluster_moves_decodes_with_identical_tokens(tmp_path):
    pytest.importorskip("transformers")
    from helpers_models import make_tiny_model
    from flowyard.engine.engine_config import EngineConfig
    from flowyard.engine.llm_engine import LLMEngine
    from flowyard.engine.loader import load_checkpoint
    from flowyard.engine.model import CausalLM
    from flowyard.engine.sampling import SamplingParams
    from flowyard.runtime.cluster import LocalCluster

    d, _ = make_tiny_model(tmp_path, "llama")
    ckpt = load_checkpoint(d)
    model = CausalLM(ckpt.config)
    model.load_weights(ckpt.weights)
    cfg = BatchConfig()
    pol = Policy("arrow-like", MoveEveryOther(), [Role.MIXED, Role.MIXED], {Role.MIXED: cfg})
    c = LocalCluster(model, ckpt.tokenizer, pol, EngineConfig(dtype="float32", kv_cache_tokens=1024))
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = [[3 + i, 5, 7, 9, 11 + i] for i in range(4)]
    ref = LLMEngine(model, ckpt.tokenizer, EngineConfig(dtype="float32", kv_cache_tokens=1024)).generate(prompts, params)
    for i, p in enumerate(prompts):
        c.add_request(f"r{i}", p, params)
    got: dict[str, list[int]] = {}
    while c.has_unfinished():
        for o in c.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert [got[f"r{i}"] for i in range(4)] == [r.new_token_ids for r in ref]
    assert c.migrations == 2
