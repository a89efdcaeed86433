"""Instances as Ray actors (one process each): DistServe PD with KV through the object store."""

from __future__ import annotations

import time

import pytest

from helpers_models import make_tiny_model
from flowyard.cluster.core import DecisionLog
from flowyard.engine.engine_config import EngineConfig
from flowyard.engine.llm_engine import LLMEngine
from flowyard.engine.loader import load_checkpoint
from flowyard.engine.model import CausalLM
from flowyard.engine.sampling import SamplingParams
from flowyard.policies.registry import PolicyOptions, build_policy

ray = pytest.importorskip("ray")
PROMPTS = [[(7 * i + j) % 200 + 3 for j in range(n)] for i, n in enumerate([40, 9, 70, 25])]
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def drive(engine):
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, GREEDY)
    got = {f"r{i}": [] for i in range(len(PROMPTS))}
    for _ in range(10_000):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            got[o.request_id] += o.new_token_ids
    return [got[f"r{i}"] for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny model directory (what actors load) and an in-process engine on it (the reference)."""
    pytest.importorskip("transformers")
    d, _ = make_tiny_model(tmp_path_factory.mktemp("ray"), "llama")
    ckpt = load_checkpoint(d)
    model = CausalLM(ckpt.config)
    model.load_weights(ckpt.weights)
    return str(d), lambda: LLMEngine(model, ckpt.tokenizer, EngineConfig(dtype="float32", kv_cache_tokens=4096))


@pytest.fixture(scope="module")
def ray_session():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_distserve_on_two_ray_actors_gives_the_same_tokens(tiny, ray_session):
    from flowyard.runtime.ray_cluster import RayCluster

    d, reference = tiny
    ref = drive(reference())
    cluster = RayCluster(d, build_policy("distserve", PolicyOptions(num_instances=2)),
                         EngineConfig(dtype="float32", kv_cache_tokens=2048))
    assert drive(cluster) == ref
    assert cluster.migrations == len(PROMPTS)
    snaps = cluster.fresh_snapshots()
    assert all(s.kv_free_blocks == s.kv_total_blocks for s in snaps)  # KV back to full
    cluster.shutdown()


def test_a_dead_instance_is_replaced_and_the_others_keep_serving(tiny, ray_session):
    from flowyard.runtime.ray_cluster import RayCluster

    d, _ = tiny
    log = DecisionLog()
    cluster = RayCluster(d, build_policy("round-robin", PolicyOptions(num_instances=2)),
                         EngineConfig(dtype="float32", kv_cache_tokens=2048), decisions=log)
    long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        cluster.add_request(f"r{i}", p, long)  # r0, r2 on instance 0; r1, r3 on 1
    started: set[str] = set()
    while len(started) < len(PROMPTS):  # every request has its first token (and KV) somewhere
        started |= {o.request_id for o in cluster.step() if o.new_token_ids}
    ray.kill(cluster.actors[1], no_restart=True)
    ends = {}
    for _ in range(10_000):
        if not cluster.has_unfinished():
            break
        for o in cluster.step():
            if o.finished:
                ends[o.request_id] = (o.finish_reason, o.error)
    assert ends["r0"][0] == ends["r2"][0] == "length"  # the survivor finished its own
    assert ends["r1"][0] == ends["r3"][0] == "error" and "died" in ends["r1"][1]
    # down, then (on a busy machine the replacement may have loaded meanwhile) up again
    assert cluster.failures == 1 and ("down", -1, 1, 1, "actor died") in log.without_time()
    assert cluster.health_detail in ("", "instance 1 is down (restarting)")
    ray.get(cluster.actors[1].info.remote())  # the replacement loads ...
    for _ in range(600):  # ... and rejoins once the driver sees it loaded
        cluster.step()
        if cluster.health_detail == "":
            break
        time.sleep(0.05)
    assert cluster.health_detail == ""
    assert log.without_time("down", "up") == [("down", -1, 1, 1, "actor died"),
                                              ("up", -1, 1, 1, "replacement loaded")]
    assert drive(cluster)[0]  # new work is served again, on both instances
    cluster.shutdown()


def test_prefix_cache_counters_reach_the_driver(tiny, ray_session):
    """The actors' prefix caches are counted where /metrics reads them (the driver's `kv`):
    requests sharing a prefix give queries and hits, as they do in one process."""
    from flowyard.runtime.ray_cluster import RayCluster

    d, _ = tiny
    cluster = RayCluster(d, build_policy("distserve", PolicyOptions(num_instances=2)),
                         EngineConfig(dtype="float32", kv_cache_tokens=2048))
    shared = [(5 * j) % 200 + 3 for j in range(64)]  # four full 16-token blocks
    short = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    for n in range(3):  # one after another: the later ones find the first one's blocks
        cluster.add_request(f"p{n}", shared + [n + 3, n + 4], short)
        while cluster.has_unfinished():
            cluster.step()
    kv = cluster.kv
    assert kv.queries >= 3 * len(shared)
    assert len(shared) <= kv.hits <= kv.queries and kv.hit_rate == kv.hits / kv.queries
    cluster.shutdown()


def test_requests_sent_during_a_step_stay_counted(tiny, ray_session):
    """The driver's view of an instance (what policies and the --max-waiting bound read) counts
    every request it sent there that has not finished, also a burst that reaches the actor
    while a step runs: the step's snapshot does not hold those, so the driver counts them in.
    (Found by benchmarks/concurrency_1p1d.py: the bounded queue let a burst through on Ray.)"""
    from flowyard.runtime.ray_cluster import RayCluster

    d, _ = tiny
    cluster = RayCluster(d, build_policy("round-robin", PolicyOptions(num_instances=1)),
                         EngineConfig(dtype="float32", kv_cache_tokens=2048, max_num_seqs=4))
    cluster.add_request("first", PROMPTS[2], GREEDY)
    cluster.step(timeout=0)  # its step is in flight now
    for i in range(12):
        cluster.add_request(f"burst{i}", PROMPTS[i % 4], GREEDY)
    unfinished, checked = 13, 0
    while cluster.has_unfinished():
        unfinished -= sum(o.finished for o in cluster.step())
        assert cluster.num_waiting + cluster.num_running == unfinished
        checked += 1
    assert unfinished == 0 and checked > 3
    cluster.shutdown()


def test_migrate_between_actors_at_any_token(tiny, ray_session):
    """Mid-prefill, at prefill end and mid-decode, KV in chunks through the object store."""
    from flowyard.runtime.ray_cluster import RayCluster

    d, reference = tiny
    prompt = PROMPTS[2]
    ref = reference().generate([prompt], GREEDY)[0]
    cluster = RayCluster(d, build_policy("round-robin", PolicyOptions(num_instances=2, chunk_size=16)),
                         EngineConfig(dtype="float32", kv_cache_tokens=2048, max_num_batched_tokens=16, block_size=4))
    for k, steps in enumerate([2, 5, 11]):  # mid-prefill (32 of 70), prefill end, mid-decode
        rid = f"m{k}"
        cluster.add_request(rid, prompt, GREEDY)
        src = cluster._where[rid]
        tokens = []
        for _ in range(steps):
            tokens += [t for o in cluster.step() for t in o.new_token_ids]
        assert cluster.migrate(rid, 1 - src)
        while cluster.has_unfinished():
            tokens += [t for o in cluster.step() for t in o.new_token_ids]
        assert tokens == ref.new_token_ids, k
    assert cluster.migrations == 3
    cluster.shutdown()
