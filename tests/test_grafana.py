"""The shipped Grafana dashboard only queries metrics that /metrics really exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

from fastapi.testclient import TestClient

from helpers_models import tiny_model
from flowyard.engine.async_engine import AsyncLLMEngine
from flowyard.engine.engine_config import EngineConfig
from flowyard.engine.llm_engine import LLMEngine
from flowyard.server.app import build_app
from flowyard.server.metrics import LEGACY_VLLM

DASHBOARD = Path(__file__).parent.parent / "docs" / "grafana" / "flowyard.json"


def exported(tmp_path) -> set[str]:
    engine = AsyncLLMEngine(LLMEngine(*tiny_model(tmp_path), EngineConfig(kv_cache_tokens=1024)))
    try:
        with TestClient(build_app(engine)) as client:
            assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "ttft_slo": 5}).status_code == 200
            text = client.get("/metrics").text
    finally:
        engine.shutdown()
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


def test_every_dashboard_query_reads_an_exported_metric(tmp_path):
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs.append(dash["templating"]["list"][0]["query"])
    used = {m for e in exprs for m in re.findall(r"flowyard:[a-z0-9_]+", e)}
    assert len(dash["panels"]) >= 8 and len(used) >= 10
    missing = used - exported(tmp_path)
    assert not missing, f"the dashboard queries metrics /metrics does not export: {sorted(missing)}"
    assert all(p["datasource"]["uid"] == "${DS_PROMETHEUS}" for p in dash["panels"])


def test_dashboard_queries_are_well_formed(tmp_path):
    """Stricter than the prefix check: every series a query selects (any name before `{`, or
    label_values' first argument) is exported, rate() reads only counters and histogram series,
    histogram_quantile only `_bucket` series summed by `le`, and the panels import cleanly
    (unique ids and refIds, no overlapping tiles, the datasource an input)."""
    dash = json.loads(DASHBOARD.read_text())
    have = exported(tmp_path)
    assert [i["name"] for i in dash["__inputs"]] == ["DS_PROMETHEUS"] and dash["uid"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    tiles = set()
    for p in dash["panels"]:
        g = p["gridPos"]
        cells = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert g["x"] + g["w"] <= 24 and not cells & tiles, p["title"]
        tiles |= cells
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)) and p["targets"], p["title"]
        for t in p["targets"]:
            e = t["expr"]
            names = set(re.findall(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{", e))
            assert names and names <= have, (p["title"], sorted(names - have))
            for inner in re.findall(r"rate\(([a-zA-Z_:][a-zA-Z0-9_:]*)\{", e):
                assert inner.endswith(("_total", "_bucket", "_sum", "_count")), (p["title"], inner)
            for q in re.findall(r"histogram_quantile\(([^,]+),\s*sum by \(le\) \(rate\(([a-z_:]+)\{", e):
                assert 0 < float(q[0]) < 1 and q[1].endswith("_bucket"), (p["title"], q)
    var = dash["templating"]["list"][0]["query"]
    assert re.match(r"label_values\(([a-z_:]+), model_name\)", var).group(1) in have


# vLLM's own names (V1 engine, docs/design/metrics.md of vllm-project/vllm): what a vLLM
# dashboard or a vLLM-aware router reads, each with the same meaning and unit here.
VLLM_NAMES = {
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
    "vllm:request_prompt_tokens_bucket", "vllm:request_generation_tokens_bucket",
    "vllm:time_to_first_token_seconds_bucket", "vllm:time_per_output_token_seconds_bucket",
    "vllm:inter_token_latency_seconds_bucket", "vllm:request_time_per_output_token_seconds_bucket",
    "vllm:e2e_request_latency_seconds_bucket", "vllm:request_queue_time_seconds_bucket",
    "vllm:request_prefill_time_seconds_bucket", "vllm:request_decode_time_seconds_bucket",
    "vllm:request_inference_time_seconds_bucket", "vllm:request_max_num_generation_tokens_bucket",
}
FLOWYARD_ONLY = ("slo_attained", "slo_violated", "preemption_blocking_seconds", "num_preemptions",
                 "engine_cpu_threads")


def test_vllm_names_are_exported_beside_flowyards(tmp_path):
    have = exported(tmp_path)
    assert not VLLM_NAMES - have, sorted(VLLM_NAMES - have)
    # every vllm: series has its flowyard: twin (but vLLM V0's names), and the other way round
    # except flowyard's own
    legacy = {"vllm:" + n for n in LEGACY_VLLM}
    assert legacy <= have
    assert {n.replace("vllm:", "flowyard:") for n in have if n.startswith("vllm:") and n not in legacy} <= have
    own = {n for n in have if n.startswith("flowyard:") and not n.startswith(tuple("flowyard:" + f for f in FLOWYARD_ONLY))}
    assert {n.replace("flowyard:", "vllm:") for n in own} <= have


def test_the_dashboard_reads_a_flowyard_server_under_vllm_names_too(tmp_path):
    """The shipped dashboard with `flowyard:` replaced by `vllm:` (what a vLLM dashboard asks
    for) finds every panel's series except flowyard's own SLO and preemption panels."""
    dash = json.loads(DASHBOARD.read_text())
    have = exported(tmp_path)
    for p in dash["panels"]:
        for t in p["targets"]:
            e = t["expr"]
            if any(f in e for f in FLOWYARD_ONLY):
                continue
            names = set(re.findall(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{", e.replace("flowyard:", "vllm:")))
            assert names and names <= have, (p["title"], sorted(names - have))


# Every series vLLM's own example dashboard queries (vllm-project/vllm,
# examples/online_serving/prometheus_grafana/grafana.json at commit e88892c9, read for issue
# 29), less the two of V0's CPU swapping, which neither flowyard nor vLLM V1 has:
# vllm:num_requests_swapped and vllm:cpu_cache_usage_perc.
VLLM_DASHBOARD = {
    "vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:time_per_output_token_seconds_bucket", "vllm:time_per_output_token_seconds_sum",
    "vllm:time_per_output_token_seconds_count", "vllm:num_requests_running", "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count", "vllm:gpu_cache_usage_perc", "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket", "vllm:request_success_total", "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum", "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum",
}


def test_vllms_own_dashboard_finds_every_series_it_queries(tmp_path):
    have = exported(tmp_path)
    assert not VLLM_DASHBOARD - have, sorted(VLLM_DASHBOARD - have)


def test_phase_histograms_add_up(tmp_path):
    """queue + prefill + decode = e2e within the server's overhead; inference = prefill + decode."""
    engine = AsyncLLMEngine(LLMEngine(*tiny_model(tmp_path), EngineConfig(kv_cache_tokens=1024)))
    try:
        with TestClient(build_app(engine)) as client:
            for _ in range(3):
                assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5}).status_code == 200
            text = client.get("/metrics").text
    finally:
        engine.shutdown()

    def total(name: str) -> float:
        return float(re.search(rf"^vllm:{name}_sum{{[^}}]*}} (\S+)$", text, re.M).group(1))

    def count(name: str) -> float:
        return float(re.search(rf"^vllm:{name}_count{{[^}}]*}} (\S+)$", text, re.M).group(1))

    assert all(count(f"request_{k}_time_seconds") == 3 for k in ("queue", "prefill", "decode", "inference"))
    assert count("request_generation_tokens") == 3 and total("request_generation_tokens") == 15
    inference = total("request_inference_time_seconds")
    assert abs(inference - total("request_prefill_time_seconds") - total("request_decode_time_seconds")) < 1e-6
    assert total("request_queue_time_seconds") + inference <= total("e2e_request_latency_seconds") + 0.05
