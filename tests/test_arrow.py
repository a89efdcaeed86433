"""Arrow: elastic pools (Fig. 5), SLO-aware dispatch (Alg. 1, 2), flips (Alg. 3, 4) and the
instance monitor, in the simulator and on the real LocalCluster."""

from __future__ import annotations

import numpy as np
import pytest

from hypothesis import given, settings, strategies as st

from conftest import FixedLink, LinearCost, make_requests
from flowyard.core.kvcache import KVCacheManager
from flowyard.core.plan import StepOutput
from flowyard.core.request import SLO, Request, RequestState, Status
from flowyard.policies.arrow.router import ArrowConfig, ArrowRouter
from flowyard.policies.arrow.pools import ElasticPools, Pool, QuadraticTTFT, chunked_prefill_time
from flowyard.policies.framework.contracts import InstanceSnapshot, Role
from flowyard.policies.framework.continuous_batching import BatchConfig, BatchScheduler
from flowyard.policies.framework.policy import Policy
from flowyard.policies.registry import PolicyOptions, build_policy
from flowyard.sim.cluster import Topology
from flowyard.sim.simulator import Simulator

TOPO = Topology(1, FixedLink(), FixedLink())


def snap(i: int, queue=(), decoding: int = 0, running_tokens: int = 0, interval: float = 0.0,
         migrating: int = 0) -> InstanceSnapshot:
    return InstanceSnapshot(
        instance=i, role=Role.MIXED, num_running=decoding, num_waiting=len(queue),
        waiting_tokens=sum(n for _, n in queue), running_tokens=running_tokens, kv_free_blocks=1000,
        kv_total_blocks=1000, block_size=16, num_migrating_in=migrating, prefill_queue=tuple(queue),
        num_decoding=decoding, token_interval=interval)


class View:
    """A ClusterView over hand-made snapshots."""

    def __init__(self, snaps: dict[int, InstanceSnapshot]) -> None:
        self.snaps = snaps

    def instances(self, role=None):
        return sorted(self.snaps)

    def snapshot(self, i):
        return self.snaps[i]


def router(pools: dict[int, Pool], **cfg) -> ArrowRouter:
    r = ArrowRouter(LinearCost(), ArrowConfig(**cfg))
    r.pools = ElasticPools(dict(pools))
    r._start = 0.0
    return r


def test_pool_transitions_follow_fig5():
    busy_p, busy_d, idle = snap(0, queue=[(0, 500)]), snap(0, decoding=3, running_tokens=900), snap(0)
    pools = ElasticPools.split([0, 1, 2, 3], 2)
    assert pools.of == {0: Pool.P, 1: Pool.P, 2: Pool.D, 3: Pool.D}
    assert pools.flip_to_decode(0, busy_p, 1.0) is Pool.P2D  # prefill work left: transitional
    assert pools.settle(0, busy_p, 2.0) is Pool.P2D
    assert pools.settle(0, idle, 3.0) is Pool.D  # drained: black edge
    assert pools.flip_to_decode(1, idle, 4.0) is Pool.D  # nothing to drain: straight to D
    assert pools.flip_to_prefill(2, busy_d, 5.0) is Pool.D2P
    assert pools.settle(2, busy_d, 6.0) is Pool.D2P
    assert pools.settle(2, snap(0, migrating=1), 6.5) is Pool.D2P  # a decode still arriving
    assert pools.settle(2, idle, 7.0) is Pool.P
    assert pools.flip_to_prefill(3, idle, 8.0) is Pool.P
    # flipped back from a transitional pool
    assert pools.flip_to_decode(3, busy_p, 9.0) is Pool.P2D
    assert pools.flip_to_prefill(3, busy_p, 10.0) is Pool.P
    assert pools.flip_to_prefill(1, busy_d, 11.0) is Pool.D2P
    assert pools.flip_to_decode(1, busy_d, 12.0) is Pool.D
    assert [(m[1], m[2], m[3]) for m in pools.moves][:3] == [(0, Pool.P, Pool.P2D), (0, Pool.P2D, Pool.D),
                                                              (1, Pool.P, Pool.D)]


def test_ttft_predictor_fits_chunked_prefill_times():
    cost = LinearCost(per_ctx=1e-6)
    q = QuadraticTTFT.fit(cost, 2048, 20_000)
    for n in (100, 1000, 5000, 15_000):
        assert q(n) == pytest.approx(chunked_prefill_time(cost, n, 2048), rel=0.1)
    s = snap(0, queue=[(0, 1000), (1000, 500)])
    assert q.queue_delay(s, 2048) == pytest.approx(q(1000) + q(1500) - q(1000))


def test_alg1_picks_p_before_d2p_and_flips_d_to_p_when_the_slo_would_be_missed():
    pools = {0: Pool.P, 1: Pool.D2P, 2: Pool.D, 3: Pool.D}
    r = router(pools)
    req = Request(id=0, arrival=0.0, prompt_len=1000, output_len=10, slo=SLO(ttft=1.0, tpot=0.1))
    light = {0: snap(0, queue=[(0, 2000)]), 1: snap(1, decoding=1, running_tokens=200),
             2: snap(2, decoding=5, running_tokens=3000),
             3: snap(3, decoding=2, running_tokens=500)}
    assert r.route(req, View(light), 0.0) == 0  # P meets the SLO: not the idler D→P
    heavy = light | {0: snap(0, queue=[(0, 6000)] * 2), 1: snap(1, queue=[(0, 6000)] * 2, decoding=1)}
    assert r.route(req, View(heavy), 0.0) == 3  # least running tokens among D
    assert r.pools.of[3] is Pool.D2P and r.pools.of[2] is Pool.D
    assert r.route(req, View(heavy), 0.0) == 3  # the new D→P instance meets the SLO now
    full = heavy | {3: snap(3, queue=[(0, 6000)] * 2, decoding=2, running_tokens=500)}
    # only one decode instance left: Alg. 3 refuses, the request goes to t1
    assert r.route(req, View(full), 0.0) == 0
    # overload rule: decode load high (token interval over TPOT) -> no flip
    r2 = router(pools)
    hot = heavy | {2: snap(2, decoding=5, running_tokens=3000, interval=0.3)}
    assert r2.route(req, View(hot), 0.0) == 0 and r2.pools.of == pools


def test_alg2_keeps_decode_on_a_prefill_instance_that_became_decode():
    r = router({0: Pool.P, 1: Pool.P, 2: Pool.D, 3: Pool.D})
    view = View({0: snap(0, queue=[(0, 800)]), 1: snap(1), 2: snap(2, decoding=3, running_tokens=900),
                 3: snap(3, decoding=1, running_tokens=100)})
    st = RequestState(Request(id=7, arrival=0.0, prompt_len=100, output_len=10, slo=SLO(tpot=0.1)), num_computed=100, num_output=1)
    assert r.route_decode(st, 1, view, 0.0) == 3  # fewest running tokens in D
    r.pools.flip_to_decode(0, view.snapshot(0), 0.0)
    assert r.pools.of[0] is Pool.P2D
    assert r.route_decode(st, 0, view, 0.0) == 0  # stays: no KV to move
    # D instances over the TPOT threshold: Alg. 4 flips the P instance with least prefill delay
    slow = View(view.snaps | {2: snap(2, decoding=3, interval=0.5), 3: snap(3, decoding=1, interval=0.5)})
    r2 = router({0: Pool.P, 1: Pool.P, 2: Pool.D, 3: Pool.D})
    assert r2.route_decode(st, 1, slow, 0.0) == 1 and r2.pools.of[1] is Pool.D


def test_monitor_flips_prefill_to_decode_when_token_interval_stays_over_tpot():
    r = router({0: Pool.P, 1: Pool.P, 2: Pool.D, 3: Pool.D}, monitor_periods=2)
    view = View({0: snap(0, queue=[(0, 50)]), 1: snap(1, queue=[(0, 10)]), 2: snap(2, decoding=4, interval=0.2),
                 3: snap(3, decoding=4, interval=0.2)})
    r.tick(view, 0.5)
    assert not r.pools.moves  # one period over the threshold is tolerated (Insight 4)
    r.tick(view, 1.0)
    assert r.pools.moves[-1][1:] == (1, Pool.P, Pool.P2D)


def test_token_interval_is_the_recent_decode_step_time():
    sched = BatchScheduler(0, Role.MIXED, KVCacheManager(100, 16), BatchConfig(max_repeats=1))
    st = RequestState(Request(id=0, arrival=0.0, prompt_len=20, output_len=50))
    sched.add_request(st, 0.0)
    now = 0.0
    for k in range(30):
        plan = sched.schedule(now)
        now += 0.05 if plan.prefills else 0.02
        sched.update_from_output(plan, StepOutput(end_times=np.array([now])))
    assert sched.snapshot().token_interval == pytest.approx(0.02, rel=1e-6)
    assert sched.snapshot().num_decoding == 1 and sched.snapshot().prefill_queue == ()


def simulate(name_or_policy, reqs, n=4, capacity=20_000):
    cost = LinearCost(capacity=capacity)
    pol = (build_policy(name_or_policy, PolicyOptions(num_instances=n, predictor=cost))
           if isinstance(name_or_policy, str) else name_or_policy)
    return Simulator(reqs, pol, cost, TOPO).run(), pol


def test_burst_of_long_prompts_flips_a_decode_instance_to_prefill_and_back_in_the_simulator():
    burst = [Request(id=i, arrival=0.01 * i, prompt_len=4000, output_len=4, slo=SLO(ttft=1.0, tpot=0.05))
             for i in range(12)]
    # then many short prompts with long outputs: decode batches slow past the TPOT threshold
    tail = [Request(id=12 + i, arrival=4.0 + 0.02 * i, prompt_len=64, output_len=300, slo=SLO(ttft=1.0, tpot=0.05))
            for i in range(120)]
    cost = LinearCost()
    pol = Policy("arrow", ArrowRouter(cost, ArrowConfig(num_prefill=1)), [Role.MIXED] * 3,
                 {Role.MIXED: BatchConfig()})
    res, _ = simulate(pol, burst + tail, n=3)
    moves = pol.global_scheduler.pools.moves
    assert [(i, a, b) for _, i, a, b in moves] == [(1, Pool.D, Pool.P), (1, Pool.P, Pool.D)]
    assert moves[0][0] < 1.0 < 4.0 < moves[1][0]  # to prefill in the burst, back when decodes slow
    assert all(s.num_output == s.req.output_len for s in res.states)


# A regression: a moved request waited forever for an idle destination, whose KV had been freed
# by a release (not a step), so no step end admitted it; the source, full with that request's KV,
# could not prefill the rest (found by the property test below in CI)
def test_arrow_with_a_kv_capacity_near_the_longest_request_finishes():
    reqs = make_requests(80, seed=328, rate=40.0, prompt=(16, 3000), out=(1, 120), slo=SLO(ttft=0.05, tpot=1.0))
    res, _ = simulate("arrow", reqs, n=3, capacity=4001)
    assert len(res.completed) == len(reqs)


@settings(max_examples=12, deadline=None, derandomize=True)
@given(seed=st.integers(0, 10_000), n=st.integers(2, 5), cap=st.integers(4_000, 30_000),
       ttft=st.sampled_from([0.05, 0.5, 5.0]), tpot=st.sampled_from([0.005, 0.05, 1.0]),
       name=st.sampled_from(["arrow", "arrow-minload", "arrow-rr"]))
def test_every_request_finishes_and_kv_returns(seed, n, cap, ttft, tpot, name):
    reqs = make_requests(80, seed=seed, rate=40.0, prompt=(16, 3000), out=(1, 120), slo=SLO(ttft=ttft, tpot=tpot))
    res, pol = simulate(name, reqs, n=n, capacity=cap)  # the simulator raises on stuck work or leaked KV
    assert len(res.completed) == len(reqs)
    assert all(s.num_output == s.req.output_len and s.status is Status.FINISHED for s in res.states)
    if name != "arrow":
        assert not pol.global_scheduler.pools.moves  # the ablations keep the static split


def test_arrow_beats_distserve_on_a_bursty_azure_code_slice():
    from flowyard.sim.run import SimConfig, load_workload
    from flowyard.sim.run import simulate as run
    from flowyard.workloads import clip

    base = SimConfig(trace="azure-code", model="llama-3.1-8b", hardware="h800", instances=4, rate_scale=2.0)
    w = clip(load_workload(base), start=840, duration=120)  # 931 requests, 411 of them in 10 s
    att = {p: run(base.replace(policy=p), w)[0].slo_attainment for p in ("distserve", "arrow", "arrow-minload")}
    assert att["arrow"] > att["distserve"] + 0.15
    assert att["arrow"] > att["arrow-minload"] + 0.15


def test_local_cluster_flips_and_moves_decodes_with_identical_tokens(tmp_path):
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
    # LinearCost predicts 0.06 s for the 200-token prompt in 64-token chunks and 0.014 s for the
    # 40-token one: behind the first, the second would miss its 0.065 s TTFT SLO, so Alg. 1 takes
    # decode instance 1. No decode batch meets a 0.1 ms TPOT threshold, so when the short
    # prefill ends Alg. 2 flips the idle instance 1 back to decode and keeps the request there;
    # the long one then moves its KV to instance 2.
    gs = ArrowRouter(LinearCost(), ArrowConfig(num_prefill=1, period=1e6, chunk_size=64))
    pol = Policy("arrow", gs, [Role.MIXED] * 3, {Role.MIXED: BatchConfig(max_num_batched_tokens=64)})
    now = [0.0]  # a virtual clock, 10 ms a step: the decisions must not depend on how busy the machine is
    c = LocalCluster(model, ckpt.tokenizer, pol, EngineConfig(dtype="float32", kv_cache_tokens=1024),
                     clock=lambda: now[0])
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = [[(7 * k) % 250 + 3 for k in range(200)], [(5 * k + 1) % 250 + 3 for k in range(40)]]
    ref = LLMEngine(model, ckpt.tokenizer, EngineConfig(dtype="float32", kv_cache_tokens=1024)).generate(prompts, params)
    for i, p in enumerate(prompts):
        c.add_request(f"r{i}", p, params, SLO(ttft=0.065, tpot=1e-4))
    assert [(i, a, b) for _, i, a, b in gs.pools.moves] == [(1, Pool.D, Pool.P)]
    got: dict[str, list[int]] = {}
    while c.has_unfinished():
        for o in c.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
        now[0] += 0.01
    assert [got[f"r{i}"] for i in range(2)] == [r.new_token_ids for r in ref]
    assert [(i, a, b) for _, i, a, b in gs.pools.moves] == [(1, Pool.D, Pool.P), (1, Pool.P, Pool.D)]
    assert c.migrations == 1  # only the long prompt's KV moved (to instance 2)
