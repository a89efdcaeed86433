"""One scheduler, three executors: the guard of tests/test_two_executors.py with a third leg,
a `RayCluster` in lockstep (one actor process per instance, stepped one at a time by the
driver on the same virtual clock, every step priced by the same cost model). For every
registry policy the simulator's, `LocalCluster`'s and the Ray cluster's decision logs agree
event by event, preemptions and refusals included, and the two real clusters produce the
same tokens."""

from __future__ import annotations

import pytest

from helpers_ray import ray_session_with_actors
from test_two_executors import GUARD_BLOCK, GUARD_KV, GUARD_SHOWS, guard_jobs, guard_options
from flowyard.policies.registry import POLICY_NAMES

try:
    import ray
except ImportError:  # the guard's Ray leg needs the `ray` extra
    ray = None

pytestmark = pytest.mark.skipif(ray is None, reason="ray is not installed (pip install 'flowyard[ray]')")


@pytest.fixture(scope="module")
def ray_model(tmp_path_factory):
    yield from ray_session_with_actors(tmp_path_factory, "guard3")


@pytest.mark.parametrize("name", list(POLICY_NAMES))
def test_simulator_local_and_ray_clusters_decide_the_same_event_by_event(name, ray_model):
    from guard_driver import load_dir, profile_cost, run_cluster, run_ray_cluster, simulate

    model_dir, actors = ray_model
    cost = profile_cost(capacity=GUARD_KV)
    jobs = guard_jobs()
    opts = guard_options(name, cost)
    sim = simulate(name, jobs, cost, opts, GUARD_BLOCK)
    local, local_tokens = run_cluster(name, jobs, cost, opts, *load_dir(model_dir), GUARD_BLOCK, GUARD_KV)
    real, tokens = run_ray_cluster(name, jobs, cost, opts, model_dir, GUARD_BLOCK, GUARD_KV, actors)
    assert local.without_time() == sim.without_time()
    assert real.without_time() == sim.without_time()
    assert [d.t for d in real.decisions] == pytest.approx([d.t for d in sim.decisions], abs=1e-9)
    assert GUARD_SHOWS.get(name, set()) <= real.kinds()  # the policy's own mechanisms were at work
    assert tokens == local_tokens
    assert all(len(tokens[f"r{i}"]) == j.max_tokens for i, j in enumerate(jobs))


def patience_jobs():
    """Two instances with little KV, micro-requests migrating both ways between them: some
    second segments find no KV on their destination and are recomputed there once DynaServe's
    migration patience runs out (its deadlock breaker)."""
    import random

    from guard_driver import Job
    from flowyard.core.request import SLO

    rng = random.Random(2)
    jobs, t = [], 0.0
    for i in range(10):
        t += rng.choice([0.0005, 0.002, 0.004])
        n = rng.choice([40, 70, 110, 150])
        jobs.append(Job(round(t, 6), [(5 * i + j) % 200 + 3 for j in range(n)], rng.choice([12, 20, 30]),
                        SLO(ttft=0.3, tpot=0.05)))
    return jobs


def test_dynaserves_waited_too_long_path_decides_the_same_on_three_executors(ray_model):
    """A migration admitted without its KV (num_computed 0, recomputed at the destination)
    must be decided alike by the simulator, `LocalCluster` and Ray, and the real engines must
    import no KV for it yet produce the same tokens (issue 28: the path was in no guard)."""
    import dataclasses

    from guard_driver import load_dir, profile_cost, run_cluster, run_ray_cluster, simulate
    from flowyard.policies.dynaserve.split import DynaServeConfig

    model_dir, actors = ray_model
    kv = 320
    cost = profile_cost(capacity=kv)
    jobs = patience_jobs()
    opts = dataclasses.replace(guard_options("dynaserve", cost),
                               dynaserve=DynaServeConfig(migration_patience_s=0.005))
    ran: list = []
    sim = simulate("dynaserve", jobs, cost, opts, GUARD_BLOCK, ran=ran)
    assert sum(i.sched.recomputed for i in ran[0].instances) > 0  # the path is taken
    local, local_tokens = run_cluster("dynaserve", jobs, cost, opts, *load_dir(model_dir), GUARD_BLOCK, kv)
    real, tokens = run_ray_cluster("dynaserve", jobs, cost, opts, model_dir, GUARD_BLOCK, kv, actors)
    assert local.without_time() == sim.without_time()
    assert real.without_time() == sim.without_time()
    assert tokens == local_tokens
    assert all(len(tokens[f"r{i}"]) == j.max_tokens for i, j in enumerate(jobs))
