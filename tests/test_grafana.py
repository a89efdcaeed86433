"""The shipped Grafana dashboard only queries metrics that /metrics really exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

from fastapi.testclient import TestClient

from helpers_models import tiny_model
from flowyard.engine.async_engine import AsyncLLMEngine
from flowyard.engine.llm_engine import EngineConfig, LLMEngine
from flowyard.server.app import build_app

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
