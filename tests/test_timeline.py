"""Timelines (Chrome/Perfetto trace JSON) from both executors: the same kinds of event for the
same workload, and a file Perfetto can load."""

from __future__ import annotations

import json

import pytest

from test_two_executors import GUARD_BLOCK, GUARD_KV, guard_jobs, guard_model  # noqa: F401 (fixture)
from flowyard.cluster.timeline import Timeline
from flowyard.policies.registry import PolicyOptions


@pytest.mark.parametrize("name", ["distserve", "flowprefill", "dynaserve", "arrow"])
def test_both_executors_write_the_same_kinds_of_event(name, guard_model):  # noqa: F811
    from guard_driver import profile_cost, run_cluster, simulate

    model, tok = guard_model
    cost = profile_cost(capacity=GUARD_KV)
    opts = PolicyOptions(num_instances=3 if name == "arrow" else 2, chunk_size=32, max_num_seqs=4, predictor=cost)
    sim, real = Timeline(), Timeline()
    simulate(name, guard_jobs(), cost, opts, GUARD_BLOCK, timeline=sim)
    run_cluster(name, guard_jobs(), cost, opts, model, tok, GUARD_BLOCK, GUARD_KV, timeline=real)
    assert sim.kinds() == real.kinds()
    assert {"route", "request"} <= sim.kinds() and sim.kinds() & {"prefill", "mixed"}
    if name in ("distserve", "flowprefill", "dynaserve"):
        assert "kv" in sim.kinds() and "handoff" in sim.kinds()
    if name == "flowprefill":
        assert "preempt" in sim.kinds()
    assert len(sim.spans) == len(real.spans) == len(guard_jobs())


def test_chrome_trace_is_well_formed(tmp_path):
    from flowyard.cli import main

    out = tmp_path / "t.json"
    assert main(["simulate", "--trace", "azure-code", "--duration", "20", "--instances", "2",
                 "--policy", "distserve", "--timeline", str(out), "--quiet"]) == 0
    trace = json.loads(out.read_text())
    events = trace["traceEvents"]
    assert all({"ph", "pid", "name"} <= e.keys() for e in events)
    timed = [e for e in events if e["ph"] in ("X", "i")]
    assert timed and all(e["ts"] >= 0 and e.get("dur", 0) >= 0 for e in timed)
    cats = {e.get("cat") for e in timed}
    assert {"step", "decision", "kv", "request"} <= cats
    names = {e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert {"instance 0 (prefill)", "instance 1 (decode)", "requests"} <= names
