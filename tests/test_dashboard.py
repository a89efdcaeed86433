"""The live cluster page, in a real headless browser (Debian's chromium driven by Playwright):
it shows each instance with its role, the decisions as they happen, and draws the requests'
latencies against their SLOs."""

from __future__ import annotations

import io
import shutil

import numpy as np
import pytest

from helpers_models import load_model, make_tiny_model
from helpers_server import serving
from flowyard.engine.engine_config import EngineConfig
from flowyard.policies.registry import PolicyOptions, build_policy

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A 1P1D cluster of the tiny model behind the OpenAI server, with a few requests served."""
    pytest.importorskip("transformers")
    import httpx

    from flowyard.cluster.core import DecisionLog
    from flowyard.engine.async_engine import AsyncLLMEngine
    from flowyard.runtime.cluster import LocalCluster
    from flowyard.server.app import build_app

    model, tok = load_model(make_tiny_model(tmp_path_factory.mktemp("dash"), "llama")[0])
    cluster = LocalCluster(model, tok, build_policy("distserve", PolicyOptions(num_instances=2)),
                           EngineConfig(kv_cache_tokens=2048), decisions=DecisionLog(limit=100))
    client = AsyncLLMEngine(cluster)
    with serving(build_app(client)) as url:
        for i in range(6):
            r = httpx.post(url + "/v1/completions", json={"prompt": "hello there " * (i + 1), "max_tokens": 8,
                                                          "temperature": 0, "ttft_slo": 5, "tpot_slo": 1}, timeout=60)
            assert r.status_code == 200, r.text
        yield url
    client.shutdown()


def test_state_has_instances_decisions_and_latencies(server):
    import httpx

    s = httpx.get(server + "/dashboard/state").json()
    assert s["policy"] == "distserve"
    assert [(i["id"], i["role"]) for i in s["instances"]] == [(0, "prefill"), (1, "decode")]
    kinds = [e["kind"] for e in s["events"]]
    assert kinds.count("route") == 6 and kinds.count("handoff") == 6
    assert [(k["src"], k["dst"]) for k in s["transfers"]] == [(0, 1)] * 6 and s["transfers_total"] == 6
    assert all(k["seconds"] >= 0 for k in s["transfers"])
    assert len(s["latency"]) == 6 and s["attainment"] == 1.0
    assert all(p["ttft"] > 0 and p["ttft_slo"] == 5 for p in s["latency"])
    again = httpx.get(server + "/dashboard/state", params={"since": s["total"], "since_kv": 6}).json()
    assert again["events"] == again["transfers"] == [] and again["total"] == s["total"]  # only what is new
    assert httpx.get(server + "/dashboard/state", params={"since": -1}).status_code == 400


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (scripts/test.sh installs it)")
def test_the_page_draws_the_cluster_in_a_real_browser(server):
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (scripts/test.sh)")
    from PIL import Image

    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--headless=new"])
        page = browser.new_page(viewport={"width": 1300, "height": 900})
        page.goto(server + "/dashboard")
        page.wait_for_selector("body[data-updated]", timeout=15_000)
        assert page.locator("#instances tbody tr").count() == 2
        assert "prefill" in page.locator("#instances").inner_text()
        assert "handoff 6" in page.locator("#counts").inner_text()
        assert "kv 6" in page.locator("#counts").inner_text()
        assert "100.0 %" in page.locator("#attainment").inner_text()
        png = page.locator("#latency").screenshot()
        browser.close()
    img = Image.open(io.BytesIO(png)).convert("RGB")
    pixels = np.asarray(img).reshape(-1, 3).tolist()
    # the points are drawn in saturated colours, the SLO lines in light ones: count points only
    ttft = sum(1 for r, g, b in pixels if b > 170 and r < 60 and g < 110)  # #1d4ed8
    tpot = sum(1 for r, g, b in pixels if r > 200 and 60 < g < 120 and b < 40)  # #ea580c
    slo = sum(1 for r, g, b in pixels if r < 170 and 180 < g < 215 and b > 240)  # #93c5fd
    assert ttft > 30 and tpot > 30 and slo > 30, (ttft, tpot, slo)
