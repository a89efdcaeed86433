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
