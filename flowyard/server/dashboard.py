"""The live cluster page: `GET /dashboard`, fed by `GET /dashboard/state`.

The page polls the state twice a second and draws, with no script from outside the server:
each instance's role and pool, queue, running tokens and KV use; the cluster's decisions as
they happen (routes, splits, hand-offs, decode routes, migrations, flips, preemptions,
rejections); and each finished request's TTFT and TPOT against its SLOs over time.
"""

from __future__ import annotations

import time
from importlib import resources
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse

NOTABLE = ("flip", "preempt", "split", "handoff", "decode", "migrate", "reject")


def cluster_state(client: Any, recent: Any, since: int = 0, since_kv: int | None = None) -> dict:
    """A JSON-able picture of the cluster behind an engine client, and the decisions after the
    first `since` (the page passes back the `total` it last saw)."""
    engine = getattr(client, "engine", client)
    for _ in range(3):  # the engine thread may change a queue while we read it: read again
        try:
            snaps = engine.snapshots() if hasattr(engine, "snapshots") else [engine.scheduler.snapshot()]
            break
        except RuntimeError:
            time.sleep(0.001)
    else:
        snaps = []
    core = getattr(engine, "core", None)
    pools: dict[int, str] = {}
    events, total = [], 0
    if core is not None:
        for _, inst, _, to in list(core.gs.pool_moves()):
            pools[inst] = to
        if core.log is not None:
            total = core.log.total
            events = [{"t": d.t, "kind": d.kind, "request": d.request, "src": d.src, "dst": d.dst,
                       "detail": d.detail} for d in core.log.since(since)[-200:]]
    kv_seen = since_kv if since_kv is not None else 0
    transfers = list(getattr(engine, "transfers", ()))
    kv_total = getattr(engine, "transfers_total", 0)
    kv = [{"t": t, "request": r, "src": s, "dst": d, "seconds": sec}
          for t, r, s, d, sec in transfers[max(0, len(transfers) - (kv_total - kv_seen)):]] if kv_seen < kv_total else []
    now = engine.now() if hasattr(engine, "now") else 0.0
    wall = time.time()
    latency = [{"ago": wall - t, "ttft": ttft, "tpot": tpot, "ttft_slo": ts, "tpot_slo": ps, "met": met}
               for t, ttft, tpot, ts, ps, met in list(recent)[-300:]]
    judged = [p["met"] for p in latency if p["met"] is not None]
    policy = getattr(engine, "policy", None)
    return {
        "policy": getattr(policy, "name", "single engine"),
        "now": now,
        "instances": [{"id": s.instance, "role": s.role.value, "pool": pools.get(s.instance, s.role.value),
                       "waiting": s.num_waiting, "running": s.num_running, "decoding": s.num_decoding,
                       "waiting_tokens": s.waiting_tokens, "running_tokens": s.running_tokens,
                       "migrating_in": s.num_migrating_in, "kv_usage": round(s.kv_usage, 4),
                       "token_interval": s.token_interval} for s in snaps],
        "events": events,
        "total": total,
        "transfers": kv[-200:],
        "transfers_total": kv_total,
        "latency": latency,
        "attainment": sum(judged) / len(judged) if judged else None,
    }


def dashboard_router() -> APIRouter:
    router = APIRouter()
    page = resources.files("flowyard.server").joinpath("dashboard.html").read_text()

    @router.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(page)

    @router.get("/dashboard/state")
    async def state(request: Request, since: int = Query(0, ge=0), since_kv: int = Query(0, ge=0)) -> dict:
        s = request.app.state.flowyard
        return cluster_state(s.engine, s.metrics.recent, since, since_kv)

    return router
