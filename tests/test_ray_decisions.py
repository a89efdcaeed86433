"""What a Ray cluster tells its decision log and when a moved request's KV is freed: the
source keeps it until the destination has imported it (the Transport contract), and a request
an actor refuses is logged as a refusal, as the simulator and `LocalCluster` log it."""

from __future__ import annotations

import pytest

from helpers_ray import ray_session_with_actors
from flowyard.cluster.core import DecisionLog
from flowyard.engine.engine_config import EngineConfig
from flowyard.engine.sampling import SamplingParams
from flowyard.policies.registry import PolicyOptions, build_policy

ray = pytest.importorskip("ray")
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
CONFIG = EngineConfig(dtype="float32", kv_cache_tokens=512, block_size=8)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    yield from ray_session_with_actors(tmp_path_factory, "raydec")


def cluster(model, name: str, **kw):
    from flowyard.runtime.ray_cluster import RayCluster

    d, actors = model
    log = DecisionLog()
    return RayCluster(d, build_policy(name, PolicyOptions(num_instances=2)), CONFIG, decisions=log,
                      actors=actors, **kw), log


def give_back(model, c) -> None:
    used = c.detach()
    model[1][:len(used)] = used


def finish(c) -> dict[str, tuple]:
    ends = {}
    for _ in range(10_000):
        if not c.has_unfinished():
            break
        ends.update({o.request_id: (o.finish_reason, o.error) for o in c.step() if o.finished})
    return ends


def test_the_source_keeps_a_moved_requests_kv_until_the_destination_imports_it(model):
    c, log = cluster(model, "distserve")
    try:
        c.add_request("r0", [(3 * j) % 200 + 3 for j in range(40)], GREEDY)
        while not c.migrations:  # the prefill instance hands r0 off; its destination has not stepped yet
            c.step()
        src, dst = c.fresh_snapshots()
        assert src.kv_free_blocks < src.kv_total_blocks  # not freed when it left
        assert finish(c)["r0"][0] == "length"
        assert all(s.kv_free_blocks == s.kv_total_blocks for s in c.fresh_snapshots())  # freed once imported
        assert ("handoff", 0, 0, 1, "") in log.without_time()
    finally:
        give_back(model, c)


@pytest.mark.parametrize("lockstep", [False, True])
def test_a_request_an_actor_refuses_is_logged_as_a_refusal(model, lockstep):
    c, log = cluster(model, "round-robin", lockstep=lockstep)
    try:
        limit = c.max_model_len
        c.max_model_len = limit + 100  # a driver that lets through what no instance can hold
        too_long = [(5 * j) % 200 + 3 for j in range(limit)]
        if lockstep:  # refused at once, as LocalCluster refuses it
            with pytest.raises(ValueError, match="does not fit"):
                c.add_request("big", too_long, GREEDY)
        else:  # the actor's refusal comes back with its next step
            c.add_request("big", too_long, GREEDY)
            reason, error = finish(c)["big"]
            assert reason == "rejected" and "does not fit" in error
        rejects = [d for d in log.decisions if d.kind == "reject"]
        assert [(d.request, d.dst) for d in rejects] == [(0, 0)] and "does not fit" in rejects[0].detail
        c.add_request("ok", too_long[:20], GREEDY)  # the cluster goes on serving
        assert finish(c)["ok"][0] == "length"
    finally:
        give_back(model, c)

