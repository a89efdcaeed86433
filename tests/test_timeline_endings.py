"""Timelines keep every ending (issue 29): a client's abort, a rejection on arrival and a
failure the cluster decides all get a span with their status, and an instance's death and
rejoin are instant events in the Chrome trace (the Ray chaos test checks them on real actors)."""

from __future__ import annotations

import pytest

from helpers_models import tiny_model
from flowyard.cluster.timeline import Timeline
from flowyard.engine.engine_config import EngineConfig
from flowyard.engine.sampling import SamplingParams
from flowyard.policies.registry import PolicyOptions, build_policy
from flowyard.runtime.cluster import LocalCluster


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    pytest.importorskip("transformers")
    return tiny_model(tmp_path_factory.mktemp("endings"))


def test_aborted_and_rejected_requests_have_spans(model):
    timeline = Timeline()
    cluster = LocalCluster(*model, build_policy("round-robin", PolicyOptions(num_instances=2)),
                           EngineConfig(dtype="float32", kv_cache_tokens=1024), timeline=timeline)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    cluster.add_request("keep", [5, 6, 7, 8], params)
    cluster.add_request("leave", [9, 10, 11], params)
    for _ in range(3):
        cluster.step()
    assert cluster.abort("leave").finish_reason == "abort"
    gs = cluster.policy.global_scheduler
    dispatch, gs.dispatch = gs.dispatch, lambda req, view, now: (None, None)  # the policy refuses one
    with pytest.raises(ValueError, match="rejected"):
        cluster.add_request("refused", [3, 4, 5], params)
    gs.dispatch = dispatch
    while cluster.has_unfinished():
        cluster.step()
    statuses = sorted(s[-1] for s in timeline.spans)
    assert statuses == ["aborted", "finished", "rejected"], statuses
    spans = {e["args"]["status"]: e for e in timeline.to_chrome()["traceEvents"] if e.get("cat") == "request"
             and e["name"].startswith("request ")}
    assert spans["aborted"]["dur"] > 0  # it ran for a while before its client left


def test_instance_death_and_rejoin_are_events():
    t = Timeline()
    t.instance_event(1, "down", 2.0, "actor died")
    t.instance_event(1, "up", 6.5, "replacement loaded")
    assert {"down", "up"} <= t.kinds()
    marks = [e for e in t.to_chrome()["traceEvents"] if e.get("cat") == "instance"]
    assert [(m["name"], m["pid"], m["ts"]) for m in marks] == [("instance died", 1, 2e6),
                                                              ("instance rejoined", 1, 6.5e6)]
    names = {e["args"]["name"] for e in t.to_chrome()["traceEvents"] if e["name"] == "process_name"}
    assert "instance 1" in names
