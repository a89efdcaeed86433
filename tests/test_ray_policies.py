"""Every registry policy on Ray actors (one process per instance) gives exactly the greedy
tokens of one engine, with its own mechanisms at work: hand-offs between actor processes,
decode routing, micro-request splits, preemption, session turns (issue 13)."""

from __future__ import annotations

import pytest

from helpers_models import load_model, make_tiny_model
from flowyard.cluster.core import DecisionLog
from flowyard.cluster.timeline import Timeline
from flowyard.core.request import SLO, RequestState
from flowyard.costmodel import make_cost_model
from flowyard.engine.engine_config import EngineConfig
from flowyard.engine.llm_engine import LLMEngine, new_request
from flowyard.engine.sampling import SamplingParams
from flowyard.policies.registry import POLICY_NAMES, PolicyOptions, build_policy

ray = pytest.importorskip("ray")
LENS = [60, 9, 90, 25, 41, 70]
PROMPTS = [[(7 * i + j) % 200 + 3 for j in range(n)] for i, n in enumerate(LENS)]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
CONFIG = EngineConfig(dtype="float32", kv_cache_tokens=2048, max_num_batched_tokens=32, block_size=8)
# what each policy must have done on the way (besides routing every request)
EXPECTED = {"distserve": {"handoff"}, "distserve-cp2k": {"handoff"}, "distserve-cp8k": {"handoff"},
            "flowprefill": {"handoff"}, "pla": {"handoff"}, "pla-spatial": {"handoff"}}


def run(engine, prompts, sessions=None):
    """Send every prompt (with its session), then step to the end; tokens per prompt."""
    got: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        kw = {"session": sessions[i]} if sessions else {}
        engine.add_request(f"r{i}", p, GREEDY, SLO(ttft=5.0, tpot=1.0), **kw)
        got[f"r{i}"] = []
    for _ in range(20_000):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            assert o.error is None, o.error
            got[o.request_id] += o.new_token_ids
    return [got[f"r{i}"] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    pytest.importorskip("transformers")
    d, _ = make_tiny_model(tmp_path_factory.mktemp("raypol"), "llama")
    reference = LLMEngine(*load_model(d), EngineConfig(dtype="float32", kv_cache_tokens=4096))
    return str(d), [o.new_token_ids for o in reference.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def ray_session():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_policy_on_ray_gives_one_engines_tokens(name, tiny, ray_session):
    from flowyard.runtime.ray_cluster import RayCluster

    d, ref = tiny
    timeline = Timeline()
    log = timeline.log
    opts = PolicyOptions(num_instances=2, chunk_size=32, max_num_seqs=8,
                         predictor=make_cost_model("smollm2-135m", "cpu"))
    policy = build_policy(name, opts)
    cluster = RayCluster(d, policy, CONFIG, timeline=timeline)
    try:
        assert run(cluster, PROMPTS) == ref
        if name == "dynaserve":  # the driver's length predictor learnt from the actors' requests
            lengths, n = policy.global_scheduler.splitter.lengths, len(PROMPTS)
            w, prior = lengths.prior_weight, lengths.prior_mean
            assert lengths.estimate(None) == pytest.approx((w * prior + n * GREEDY.max_tokens) / (w + n))
        kinds = log.kinds()
        print(name, sorted(kinds), cluster.migrations)
        assert "route" in kinds and EXPECTED.get(name, set()) <= kinds
        # the timeline has what the actors ran and moved, on the driver's clock
        assert {"route", "request"} <= timeline.kinds() and timeline.kinds() & {"prefill", "mixed"}
        assert ("kv" in timeline.kinds()) == (cluster.migrations > 0)
        assert len(timeline.spans) == len(PROMPTS)
        snaps = cluster.fresh_snapshots()
        assert all(s.kv_free_blocks == s.kv_total_blocks for s in snaps)  # no KV leaked
        assert all(s.num_running == s.num_waiting == 0 for s in snaps)
    finally:
        cluster.shutdown()


def test_flowprefill_preempts_a_running_prefill_inside_an_actor(ray_session):
    """An arrival reaches a prefill in flight in another process: the short, tight request
    is dispatched while the long prefill runs, preempts it at an operator boundary, gets its
    first token first, and the long one still produces exactly its unpreempted tokens."""
    import time

    from flowyard.engine.embedded import embedded_model_path
    from flowyard.policies.flowprefill.scheduler import FlowPrefillConfig
    from flowyard.runtime.ray_cluster import RayCluster

    model, tok = load_model(embedded_model_path())
    long_prompt = tok.encode("Summarise the history of computing. " * 110)[:900]
    short_prompt = tok.encode("What is the capital of France?")
    reference = LLMEngine(model, tok, EngineConfig(dtype="float32", kv_cache_tokens=4096))
    ref_long, ref_short = (o.new_token_ids for o in reference.generate([long_prompt, short_prompt], GREEDY))
    policy = build_policy("flowprefill", PolicyOptions(
        num_instances=2, predictor=make_cost_model("smollm2-135m", "cpu"),
        flowprefill=FlowPrefillConfig(granularity="operator")))
    cluster = RayCluster(None, policy, EngineConfig(dtype="float32", kv_cache_tokens=4096, threads=1))
    try:
        cluster.add_request("long", long_prompt, GREEDY, SLO(ttft=60.0))
        got: dict[str, list[int]] = {"long": [], "short": []}
        first: list[str] = []
        start = time.monotonic()
        while time.monotonic() - start < 0.3:  # the long prefill is running in the actor
            assert not cluster.step()
        cluster.add_request("short", short_prompt, GREEDY, SLO(ttft=3.0))
        while cluster.has_unfinished():
            for o in cluster.step():
                if o.new_token_ids and o.request_id not in first:
                    first.append(o.request_id)
                got[o.request_id] += o.new_token_ids
        assert first == ["short", "long"]
        assert got == {"long": ref_long, "short": ref_short}
        assert cluster.preemption_stats.count == 1
    finally:
        cluster.shutdown()


@pytest.mark.parametrize("name,kill_after", [("distserve", 18), ("arrow", 18), ("dynaserve", 18), ("distserve", 1)])
def test_an_actor_killed_mid_run_loses_no_request_silently(name, kill_after, tiny, ray_session):
    """Instance 1 dies while requests run: each ends with one engine's tokens or with an
    error that says what happened, the driver keeps serving, the replacement rejoins, and
    no KV block stays held anywhere after the drain (kill_after 1: right after the first
    hand-off, which can make a release overtake its take; see the next test)."""
    import time

    from flowyard.runtime.ray_cluster import RayCluster

    d, ref = tiny
    opts = PolicyOptions(num_instances=2, chunk_size=32, max_num_seqs=8,
                         predictor=make_cost_model("smollm2-135m", "cpu"))
    log = DecisionLog()
    cluster = RayCluster(d, build_policy(name, opts), CONFIG, decisions=log)
    long = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    ref_long = {f"r{i}": None for i in range(len(PROMPTS))}
    try:
        got: dict[str, list[int]] = {}
        ends: dict[str, tuple[str, str | None]] = {}
        for i, p in enumerate(PROMPTS):
            cluster.add_request(f"r{i}", p, long)
            got[f"r{i}"] = []
        while sum(map(len, got.values())) < kill_after:
            for o in cluster.step():
                got[o.request_id] += o.new_token_ids
        ray.kill(cluster.actors[1], no_restart=True)
        while cluster.has_unfinished():
            for o in cluster.step():
                got[o.request_id] += o.new_token_ids
                if o.finished:
                    ends[o.request_id] = (o.finish_reason, o.error)
        assert set(ends) == set(got)  # every request ended, one way or the other
        reference = LLMEngine(*load_model(d), EngineConfig(dtype="float32", kv_cache_tokens=4096))
        for rid, (reason, error) in ends.items():
            if reason == "length":
                if ref_long[rid] is None:
                    ref_long[rid] = reference.generate([PROMPTS[int(rid[1:])]], long)[0].new_token_ids
                assert got[rid] == ref_long[rid]
            else:
                assert reason == "error" and "instance" in error and ("died" in error or "down" in error
                                                                      or "lost" in error), error
        assert any(r == "error" for r, _ in ends.values())  # the kill did cost something
        # down; on a busy machine its replacement may have loaded and rejoined meanwhile
        assert cluster.failures == 1 and ("down", -1, 1, 1, "actor died") in log.without_time()
        ray.get(cluster.actors[1].info.remote())  # the replacement loads (slowly, on a busy machine) ...
        for _ in range(400):  # ... and rejoins once the driver sees it loaded
            cluster.step()
            if not cluster.health_detail:
                break
            time.sleep(0.05)
        assert not cluster.health_detail
        snaps = cluster.fresh_snapshots()
        assert len(snaps) == 2 and all(s.kv_free_blocks == s.kv_total_blocks for s in snaps)
        assert run(cluster, PROMPTS[:2]) == ref[:2]  # and it serves again
    finally:
        cluster.shutdown()



def test_a_release_that_overtakes_its_take_frees_the_kv(tiny, ray_session):
    """The driver releases a moved request's KV at once when its destination dies; that
    command reaches the source's inbox while the `take` waits for the worker, and the take's
    drain applies it first. The take must then free the KV, not keep it for a release that
    has already come (a clean-clone CI run found the leak)."""
    import asyncio

    from flowyard.runtime.ray_actor import EngineActor

    d, _ = tiny
    policy = build_policy("distserve", PolicyOptions(num_instances=2, chunk_size=32, max_num_seqs=8))
    actor = EngineActor(d, CONFIG, 0, policy, 0.0)
    seq = iter(range(1000))
    asyncio.run(actor.add_request(next(seq), "r0", RequestState(new_request(0, 0.0, PROMPTS[0], GREEDY, None, 4096)), GREEDY))
    handed = []
    while not handed:  # a prefill instance hands the request off once its prompt is done
        handed = [s for r in asyncio.run(actor.step(next(seq))).results for s in r.handoffs]
    actor.inbox.append(("release", 0))  # arrived while the take waited for the worker
    assert actor._take(0, {}, True, 16) is not None
    snap = asyncio.run(actor.snapshot(next(seq)))
    assert snap.kv_free_blocks == snap.kv_total_blocks and not actor.held


def test_an_arrival_behind_a_kv_release_reaches_a_running_prefill(tiny):
    """On a prefill instance the driver releases each moved request's KV while the next prefill
    runs; an arrival queued behind that release must still reach the scheduler at the next
    operator boundary (it waited for the step's end, and FlowPrefill almost never preempted)."""
    import asyncio

    from flowyard.runtime.ray_actor import EngineActor

    d, _ = tiny
    policy = build_policy("flowprefill", PolicyOptions(num_instances=2, max_num_seqs=8,
                                                       predictor=make_cost_model("smollm2-135m", "cpu")))
    actor = EngineActor(d, CONFIG, 0, policy, 0.0)
    state = RequestState(new_request(7, 0.0, PROMPTS[1], GREEDY, None, 4096))
    actor.inbox.append(("release", 99))  # a request that left earlier
    asyncio.run(actor.add_request(0, "r7", state, GREEDY))
    actor._at_boundary()
    assert not actor.inbox and actor.engine.tracked("r7") is not None
    actor.inbox.append(("abort", "r7"))  # an abort keeps its place: nothing after it jumps ahead
    asyncio.run(actor.add_request(1, "r8", RequestState(new_request(8, 0.0, PROMPTS[2], GREEDY, None, 4096)), GREEDY))
    actor._at_boundary()
    assert [c[0] for c in actor.inbox] == ["abort", "add"]
