"""Per-request SLOs and priority on the API: `x-slo-*-ms` headers and body fields reach the
scheduler's `Request`, bad values get a 400, and priority orders the queue."""

from __future__ import annotations

import dataclasses

import httpx
import pytest

from helpers_models import tiny_model
from helpers_server import serving
from flowyard.cluster.core import DecisionLog
from flowyard.core.request import SLO
from flowyard.engine.async_engine import AsyncLLMEngine
from flowyard.engine.engine_config import EngineConfig
from flowyard.engine.sampling import SamplingParams
from flowyard.policies.registry import PolicyOptions, build_policy
from flowyard.runtime.cluster import LocalCluster
from flowyard.server.app import build_app


def cluster(tmp_path, order="fcfs", seqs=8):
    model, tok = tiny_model(tmp_path)
    policy = build_policy("vllm", PolicyOptions(num_instances=1, max_num_seqs=seqs))
    policy.configs = {r: dataclasses.replace(c, order=order) for r, c in policy.configs.items()}
    seen = []
    route = policy.global_scheduler.route
    policy.global_scheduler.route = lambda req, view, now: seen.append(req) or route(req, view, now)
    return LocalCluster(model, tok, policy, EngineConfig(kv_cache_tokens=2048), decisions=DecisionLog()), seen


def test_slo_headers_and_priority_reach_the_request(tmp_path):
    engine, seen = cluster(tmp_path)
    client = AsyncLLMEngine(engine)
    try:
        with serving(build_app(client)) as url:
            body = {"prompt": "hello", "max_tokens": 3, "temperature": 0}
            r = httpx.post(url + "/v1/completions", json={**body, "priority": 5, "tpot_slo": 0.2},
                           headers={"x-slo-ttft-ms": "750"}, timeout=60)
            assert r.status_code == 200, r.text
            req = seen[-1]
            assert (req.slo.ttft, req.slo.tpot, req.priority) == (0.75, 0.2, 5)
            bad = [({"x-slo-ttft-ms": "-3"}, body, "x-slo-ttft-ms"), ({"x-slo-tpot-ms": "fast"}, body, "x-slo-tpot-ms"),
                   ({"x-slo-ttft-ms": "nan"}, body, "x-slo-ttft-ms"),
                   ({"x-slo-ttft-ms": "100"}, {**body, "ttft_slo": 2}, "ttft"),
                   ({}, {**body, "priority": "high"}, "priority")]
            for headers, b, word in bad:
                r = httpx.post(url + "/v1/completions", json=b, headers=headers, timeout=60)
                assert r.status_code == 400 and word in r.text, (headers, r.text)
            assert len(seen) == 1  # nothing bad reached the scheduler
    finally:
        client.shutdown()


def test_priority_scheduling_runs_lower_values_first(tmp_path):
    engine, _ = cluster(tmp_path, order="priority", seqs=1)
    greedy = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    for rid, prio in (("a", 3), ("b", 1), ("c", 2), ("d", 1)):
        engine.add_request(rid, [5, 6, 7, 8], greedy, priority=prio)
    first: list[str] = []
    while engine.has_unfinished():
        first += [o.request_id for o in engine.step() if o.new_token_ids and o.request_id not in first]
    assert first == ["b", "d", "c", "a"]  # by priority, ties by arrival


def test_fcfs_ignores_priority(tmp_path):
    engine, _ = cluster(tmp_path, order="fcfs", seqs=1)
    greedy = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    for rid, prio in (("a", 3), ("b", 1)):
        engine.add_request(rid, [5, 6, 7, 8], greedy, priority=prio)
    first: list[str] = []
    while engine.has_unfinished():
        first += [o.request_id for o in engine.step() if o.new_token_ids and o.request_id not in first]
    assert first == ["a", "b"]


def test_serve_rejects_an_unknown_scheduling_policy(capsys):
    from flowyard.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--scheduling-policy", "lottery"])
    assert "invalid choice" in capsys.readouterr().err


def test_edf_orders_by_each_requests_own_ttft_slo(tmp_path):
    """An SLO-aware order reads the per-request SLO the API carried (Request.slo): under edf
    the request with the nearest arrival + ttft deadline runs first, whatever it was sent as."""
    engine, _ = cluster(tmp_path, order="edf", seqs=1)
    greedy = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    t = 1000.0
    for rid, ttft in (("slow", 9.0), ("urgent", 0.2), ("mid", 1.0)):
        engine.add_request(rid, [5, 6, 7, 8], greedy, slo=SLO(ttft=ttft), arrival=t)
    first: list[str] = []
    while engine.has_unfinished():
        first += [o.request_id for o in engine.step() if o.new_token_ids and o.request_id not in first]
    assert first == ["urgent", "mid", "slow"]
