"""PLA-Serve on real engines: short prompts are not queued behind a long one, and the long
prompt's chunked prefill gives exactly its unchunked tokens."""

from __future__ import annotations

import pytest

from helpers_models import load_model, make_tiny_model
from flowyard.costmodel import make_cost_model
from flowyard.engine.embedded import embedded_model_path
from flowyard.engine.engine_config import EngineConfig
from flowyard.engine.llm_engine import LLMEngine
from flowyard.engine.sampling import SamplingParams
from flowyard.policies.pla.awd import AWDConfig
from flowyard.policies.pla.selector import PLAConfig
from flowyard.policies.registry import PolicyOptions, build_policy
from flowyard.runtime.cluster import LocalCluster

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PREDICTOR = make_cost_model("smollm2-135m", "cpu")


load = load_model


def cluster(model, tok, policy="pla", n=2, p=1):
    cfg = PLAConfig(boundary=64, long_chunk=128, awd=AWDConfig(w_max=0.0))
    pol = build_policy(policy, PolicyOptions(num_instances=n, num_prefill=p, predictor=PREDICTOR, pla=cfg))
    return LocalCluster(model, tok, pol, EngineConfig(dtype="float32", kv_cache_tokens=4096))


def alone(model, tok, prompt):
    e = LLMEngine(model, tok, EngineConfig(dtype="float32", kv_cache_tokens=4096))
    e.add_request("x", prompt, GREEDY)
    got = []
    while e.has_unfinished():
        for o in e.step():
            got += o.new_token_ids
    return got


def run_with_late_shorts(c, long_prompt, shorts):
    """The long prompt starts; after its first chunk the short ones arrive."""
    c.add_request("long", long_prompt, GREEDY)
    got: dict[str, list[int]] = {}
    first: dict[str, int] = {}
    steps = 0
    while c.has_unfinished():
        steps += 1
        for o in c.step():
            if o.new_token_ids and o.request_id not in first:
                first[o.request_id] = steps
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
        if steps == 1:
            for i, s in enumerate(shorts):
                c.add_request(f"s{i}", s, GREEDY)
    return got, first


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    pytest.importorskip("transformers")
    d, _ = make_tiny_model(tmp_path_factory.mktemp("pla"), "qwen2")
    return load(d)


def test_short_prompts_overtake_a_long_chunked_prefill_with_identical_tokens(tiny):
    model, tok = tiny
    long_prompt = [(5 * j) % 190 + 3 for j in range(240)]  # 2 chunks of 128
    shorts = [[7, 8, 9, 10 + i] for i in range(3)]
    c = cluster(model, tok)
    got, first = run_with_late_shorts(c, long_prompt, shorts)
    assert all(first[f"s{i}"] < first["long"] for i in range(3))
    assert got["long"] == alone(model, tok, long_prompt)
    assert all(got[f"s{i}"] == alone(model, tok, s) for i, s in enumerate(shorts))
    sched = c.engines[0].scheduler
    assert sched.selector.stats.short_batches == 1 and sched.selector.stats.short_requests == 3  # one AWD batch
    for e in c.engines:
        assert not e.kv.leaked() and not e.has_unfinished()


def test_spatial_pools_on_real_instances(tiny):
    model, tok = tiny
    c = cluster(model, tok, "pla-spatial", n=3, p=2)
    got, first = run_with_late_shorts(c, [(5 * j) % 190 + 3 for j in range(240)], [[7, 8, 9]])
    pools = c.policy.global_scheduler.pools
    assert pools.members("short") == [0] and pools.members("long") == [1]
    assert c.engines[0].scheduler.selector.stats.short_requests == 1
    assert c.engines[1].scheduler.selector.stats.long_chunks == 2


def test_mix_mode_decodes_on_the_prefill_instance_with_identical_tokens(tiny):
    model, tok = tiny
    long_prompt = [(5 * j) % 190 + 3 for j in range(240)]
    shorts = [[7, 8, 9, 10 + i] for i in range(3)]
    c = cluster(model, tok, "pla-mix", n=1)
    got, first = run_with_late_shorts(c, long_prompt, shorts)
    assert all(first[f"s{i}"] < first["long"] for i in range(3))
    assert got["long"] == alone(model, tok, long_prompt)
    assert all(got[f"s{i}"] == alone(model, tok, s) for i, s in enumerate(shorts))
    assert c.migrations == 0 and not c.engines[0].kv.leaked() and not c.engines[0].has_unfinished()


def test_embedded_model_short_prompt_is_not_queued_behind_a_long_one():
    model, tok = load(embedded_model_path())
    long_prompt = tok.encode("Tell me about the history of the printing press. " * 30)[:300]
    short = tok.encode("Hi!")
    c = cluster(model, tok)
    got, first = run_with_late_shorts(c, long_prompt, [short])
    assert first["s0"] < first["long"]
    assert got["long"] == alone(model, tok, long_prompt)
