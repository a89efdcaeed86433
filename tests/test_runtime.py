"""In-process multi-instance runtime: baseline policies on real engines."""

from __future__ import annotations

import pytest

from helpers_models import tiny_model
from flowyard.cluster.core import DecisionLog
from flowyard.engine.engine_config import EngineConfig
from flowyard.engine.llm_engine import LLMEngine
from flowyard.engine.sampling import SamplingParams
from flowyard.policies.framework.contracts import Role
from flowyard.policies.registry import PolicyOptions, build_policy
from flowyard.runtime.cluster import LocalCluster

PROMPTS = [[(7 * i + j) % 200 + 3 for j in range(n)] for i, n in enumerate([40, 9, 70, 25, 5, 33])]
GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    pytest.importorskip("transformers")
    return tiny_model(tmp_path_factory.mktemp("rt"), "qwen2")


def run(cluster_or_engine, prompts=PROMPTS, params=GREEDY):
    for i, p in enumerate(prompts):
        cluster_or_engine.add_request(f"r{i}", p, params)
    got = {f"r{i}": [] for i in range(len(prompts))}
    done = set()
    while cluster_or_engine.has_unfinished():
        for o in cluster_or_engine.step():
            got[o.request_id] += o.new_token_ids
            if o.finished:
                done.add(o.request_id)
    assert done == set(got)
    return [got[f"r{i}"] for i in range(len(prompts))]


class Clock:
    """A virtual clock (tests never depend on the wall clock)."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def reference(tiny):
    model, tok = tiny
    return run(LLMEngine(model, tok, EngineConfig(dtype="float32", kv_cache_tokens=4096)))


@pytest.mark.parametrize("policy,n,p", [("distserve", 2, 1), ("distserve", 4, 2), ("distserve-cp2k", 2, 1),
                                        ("round-robin", 3, None), ("least-load", 2, None), ("vllm", 2, None)])
def test_policies_on_real_instances_give_the_same_tokens(tiny, policy, n, p):
    model, tok = tiny
    cluster = LocalCluster(model, tok, build_policy(policy, PolicyOptions(num_instances=n, num_prefill=p)),
                           EngineConfig(dtype="float32", kv_cache_tokens=2048))
    assert run(cluster) == reference(tiny)
    for e in cluster.engines:
        assert not e.kv.leaked() and not e.has_unfinished()
    if policy.startswith("distserve"):
        assert cluster.migrations == len(PROMPTS)
        prefill = [e for e in cluster.engines if e.scheduler.role is Role.PREFILL]
        assert all(e.num_running == 0 for e in prefill)


def test_round_robin_spreads_requests(tiny):
    model, tok = tiny
    cluster = LocalCluster(model, tok, build_policy("round-robin", PolicyOptions(num_instances=3)))
    for i, prompt in enumerate(PROMPTS):
        cluster.add_request(f"r{i}", prompt, GREEDY)
    assert [e.num_waiting for e in cluster.engines] == [2, 2, 2]


def test_decode_kv_pressure_waits_for_room_and_abort_mid_migration_frees_source(tiny):
    model, tok = tiny
    cluster = LocalCluster(model, tok, build_policy("distserve", PolicyOptions(num_instances=2)),
                           EngineConfig(dtype="float32", kv_cache_tokens=160, block_size=16))
    out = run(cluster, PROMPTS[:4], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    assert all(len(t) == 30 for t in out)
    long = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        cluster.add_request(f"y{i}", prompt, long)
    for _ in range(200):  # until a finished prefill is waiting for room on the decode instance
        if cluster._kv_home:
            break
        cluster.step()
    assert cluster._kv_home, "no migration had to wait"
    waiting = next(rid for rid, inst in cluster._where.items()
                   if cluster.engines[inst].tracked(rid).state.id in cluster._kv_home)
    assert cluster.abort(waiting).finish_reason == "abort"
    while cluster.has_unfinished():
        cluster.step()
    for e in cluster.engines:
        assert not e.kv.leaked() and not e.has_unfinished()


@pytest.mark.parametrize("where", ["mid-prefill", "prefill-end", "mid-decode"])
def test_migrate_at_any_token_keeps_the_tokens(tiny, where):
    model, tok = tiny
    prompt = PROMPTS[2]  # 70 tokens: five chunks of 16
    ref = run(LLMEngine(model, tok, EngineConfig(dtype="float32", kv_cache_tokens=4096)), [prompt])[0]
    cluster = LocalCluster(model, tok, build_policy("round-robin", PolicyOptions(num_instances=2, chunk_size=16)),
                           EngineConfig(dtype="float32", kv_cache_tokens=2048, max_num_batched_tokens=16))
    cluster.add_request("m", prompt, GREEDY)
    src = cluster._where["m"]
    st = cluster.engines[src].tracked("m").state
    reached = {"mid-prefill": lambda: 0 < st.num_computed < len(prompt),
               "prefill-end": lambda: st.num_output == 1,
               "mid-decode": lambda: st.num_output == 7}[where]
    tokens = []
    while not reached():
        for o in cluster.step():
            tokens += o.new_token_ids
    assert cluster.migrate("m", 1 - src)
    assert cluster._where["m"] == 1 - src and cluster.migrations == 1
    while cluster.has_unfinished():
        for o in cluster.step():
            tokens += o.new_token_ids
    assert tokens == ref
    for e in cluster.engines:
        assert not e.kv.leaked()


def test_global_scheduler_ticks_on_real_instances_on_the_simulators_grid(tiny):
    """`GlobalScheduler.tick` (pool controllers, monitors) runs on a LocalCluster on the
    simulator's grid (`flowyard.cluster.ticks`): every period from the first arrival, idle or
    not; a tick the loop slept through runs before the next arrival is routed, once (bug: it
    never ran there; then it stopped when idle, and Arrow ticked itself from dispatches)."""
    model, tok = tiny
    pol = build_policy("round-robin", PolicyOptions(num_instances=2))
    gs = pol.global_scheduler
    events: list[tuple[str, float]] = []
    gs.period = 0.5
    gs.tick = lambda view, now: events.append(("tick", now))
    clock = Clock()
    log = DecisionLog()
    cluster = LocalCluster(model, tok, pol, EngineConfig(dtype="float32", kv_cache_tokens=2048), clock=clock,
                           decisions=log)
    assert cluster.wake_delay() is None and cluster.poll() == []  # no grid before the first request
    clock.t = 1.0
    cluster.add_request("a", PROMPTS[0], GREEDY, arrival=1.0)
    assert cluster.wake_delay() == 0.0  # engine queued
    while cluster.has_unfinished():
        clock.t += 0.1
        cluster.step()
    steps_end = clock.t
    ticks = [t for _, t in events]
    cells = [int((t - 1.0 + 1e-9) // 0.5) for t in ticks]  # the grid point each tick is for
    assert ticks and cells[0] == 1 and cells == sorted(set(cells))  # one per grid point, from 1.5
    assert all(t - (1.0 + 0.5 * k) < 0.1 + 1e-9 for t, k in zip(ticks, cells))  # within a loop turn
    n = len(ticks)
    clock.t = steps_end + 0.7  # idle: the serving loop polls, and the grid goes on
    assert cluster.wake_delay() is not None
    cluster.poll()
    assert len(events) == n + 1
    before = events[-1][1]
    clock.t = before + 3.2  # slept through six grid points: one tick, then the request's route
    cluster.add_request("b", PROMPTS[1], GREEDY, arrival=clock.t)
    assert len(events) == n + 2 and events[-1] == ("tick", clock.t)
    assert cluster.core.ticks.next is not None and cluster.core.ticks.next > clock.t
    assert [d.kind for d in log.decisions][-1] == "route"


def test_the_global_scheduler_sees_the_real_request_with_its_session_history(tmp_path):
    """Under `serve` the policy routes the request itself, not a stand-in: a session's second
    turn carries its turn number and the history it shares with the first turn's prompt and
    reply, and PLA-Serve's session affinity sends it home."""
    from helpers_models import load_model, make_tiny_model
    from flowyard.cluster.core import DecisionLog
    from flowyard.costmodel import make_cost_model
    from flowyard.engine.engine_config import EngineConfig
    from flowyard.engine.sampling import SamplingParams
    from flowyard.policies.pla.selector import PLAConfig
    from flowyard.policies.registry import PolicyOptions, build_policy
    from flowyard.runtime.cluster import LocalCluster

    pytest.importorskip("transformers")
    model, tok = load_model(make_tiny_model(tmp_path, "llama")[0])
    seen = []
    policy = build_policy("pla", PolicyOptions(num_instances=3, num_prefill=2,
                                               predictor=make_cost_model("smollm2-135m", "cpu"),
                                               pla=PLAConfig(affinity_tolerance=10.0)))
    route = policy.global_scheduler.route
    policy.global_scheduler.route = lambda req, view, now: seen.append(req) or route(req, view, now)
    log = DecisionLog()
    cluster = LocalCluster(model, tok, policy, EngineConfig(dtype="float32", kv_cache_tokens=2048), decisions=log)
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    first = [(5 * j) % 200 + 3 for j in range(40)]
    cluster.add_request("t0", first, greedy, session="chat-1", task="chat")
    reply: list[int] = []
    while cluster.has_unfinished():
        reply += [t for o in cluster.step() for t in o.new_token_ids]
    cluster.add_request("t1", first + reply + [9, 10, 11], greedy, session="chat-1", task="chat")
    while cluster.has_unfinished():
        cluster.step()
    assert [r.id for r in seen] == [0, 1] and all(r.task == "chat" and r.session == "chat-1" for r in seen)
    assert (seen[0].turn, seen[0].history_len) == (0, 0)
    assert (seen[1].turn, seen[1].history_len) == (1, len(first) + len(reply))
    routes = [d.dst for d in log.decisions if d.kind == "route"]
    assert routes[0] == routes[1]  # home: where the first turn's history is cached


def test_an_idle_instance_admits_a_waiting_migration_once_a_release_makes_room(tiny):
    """Bug: a migration waiting for KV on an instance was admitted only when that instance
    ended a step; room made by a release (a request that left it) with nothing left to step
    left it waiting forever, and its source holding its KV (Arrow deadlocked so)."""
    model, tok = tiny
    long, short = [(3 * j) % 200 + 3 for j in range(100)], PROMPTS[0]  # 100 and 40 tokens
    cluster = LocalCluster(model, tok, build_policy("round-robin", PolicyOptions(num_instances=3)),
                           EngineConfig(dtype="float32", kv_cache_tokens=128, block_size=16))
    cluster.add_request("x", long, GREEDY)  # instance 0: 7 of its 8 blocks
    cluster.add_request("a", short, GREEDY)  # instance 1
    x, a = (cluster.engines[i].tracked(r).state for i, r in ((0, "x"), (1, "a")))
    while x.num_output < 2 or a.num_output < 2:
        cluster.step()
    assert cluster.migrate("a", 0) and cluster._kv_home  # no room on 0: it waits, KV on 1
    assert cluster.migrate("x", 2)  # room on 2 at once: 0's blocks are released
    for _ in range(200):
        if not cluster.has_unfinished():
            break
        cluster.step()
    assert not cluster.has_unfinished(), "the migration to instance 0 was never admitted"
    for e in cluster.engines:
        assert not e.kv.leaked()
