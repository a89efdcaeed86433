"""What an HTTP client sees when a Ray actor dies under load, per policy (issue 29), measured.

For each policy: the OpenAI server (the app `flowyard serve` runs) over a 2-instance Ray
cluster of the embedded SmolLM2; 12 chat streams in flight; instance 1's actor killed after
`--kill-after` seconds; then 6 new requests at once; /health watched until the replacement
rejoins; 6 requests after the rejoin; then instance 0 killed while idle, the time until /health
shows it, and 4 requests sent at that moment. Every outcome is counted by what the client got:
a completed answer, a 503 with Retry-After, an error event in a stream (its type), or anything
else (a 500, a hang: the bad cases).

    .venv/bin/python benchmarks/faults.py --policies flowyard,arrow,distserve,dynaserve \\
        --out docs/results/faults.md
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx

CHAT = {"messages": [{"role": "user", "content": "Write a short story about a lighthouse keeper."}],
        "max_tokens": 48, "temperature": 0, "ignore_eos": True}


def serve(app):
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(app, log_level="error", lifespan="off"))
    th = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    while not srv.started:
        time.sleep(0.01)
    return srv, th, f"http://127.0.0.1:{sock.getsockname()[1]}"


async def stream(c: httpx.AsyncClient, url: str) -> str:
    """One streaming chat request's outcome, as the client sees it."""
    try:
        async with c.stream("POST", url + "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
            if r.status_code != 200:
                await r.aread()
                return f"HTTP {r.status_code}" + (" + Retry-After" if "retry-after" in r.headers else "")
            last = None
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    last = json.loads(line[6:])
                    if "error" in last:
                        return f"200 then error event ({last['error']['type']})"
            return "completed" if last and last["choices"] and last["choices"][0]["finish_reason"] else "ended early"
    except (httpx.HTTPError, asyncio.TimeoutError) as e:
        return f"client error {type(e).__name__}"


async def plain(c: httpx.AsyncClient, url: str) -> str:
    r = await c.post(url + "/v1/chat/completions", json=CHAT)
    if r.status_code == 200:
        return "completed"
    return f"HTTP {r.status_code}" + (" + Retry-After" if "retry-after" in r.headers else "")


def states(url: str) -> tuple[int, list[str]]:
    r = httpx.get(url + "/health", timeout=10)
    return r.status_code, [i["state"] for i in r.json().get("instances", [])]


async def wait_health(url: str, pred, timeout: float) -> float | None:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if pred(*states(url)):
            return time.monotonic() - start
        await asyncio.sleep(0.1)
    return None


async def scenario(url: str, cluster, kill_after: float) -> dict:
    import ray

    out: dict = {}
    async with httpx.AsyncClient(timeout=120) as c:
        tasks = [asyncio.create_task(stream(c, url)) for _ in range(12)]
        await asyncio.sleep(kill_after)
        ray.kill(cluster.actors[1], no_restart=True)
        t_kill = time.monotonic()
        new = await asyncio.gather(*[plain(c, url) for _ in range(6)])
        out["in_flight"] = collections.Counter(await asyncio.gather(*tasks))
        out["new_at_kill"] = collections.Counter(new)
        out["rejoin_s"] = await wait_health(url, lambda s, st: st and all(x == "serving" for x in st), 120)
        out["rejoin_s"] = None if out["rejoin_s"] is None else round(time.monotonic() - t_kill, 1)
        out["after_rejoin"] = collections.Counter(await asyncio.gather(*[plain(c, url) for _ in range(6)]))
        await asyncio.sleep(1.0)
        ray.kill(cluster.actors[0], no_restart=True)
        noticed = await wait_health(url, lambda s, st: "restarting" in st, 30)
        out["idle_noticed_s"] = None if noticed is None else round(noticed, 2)
        out["idle_health"] = states(url)[0]
        out["at_idle_death"] = collections.Counter(await asyncio.gather(*[plain(c, url) for _ in range(4)]))
        await wait_health(url, lambda s, st: st and all(x == "serving" for x in st), 120)
    return out


def run_policy(name: str, kill_after: float) -> dict:
    from flowyard.costmodel import make_cost_model
    from flowyard.engine.async_engine import AsyncLLMEngine
    from flowyard.engine.engine_config import EngineConfig
    from flowyard.policies.registry import PolicyOptions, build_policy
    from flowyard.runtime.ray_cluster import RayCluster
    from flowyard.server.app import build_app

    policy = build_policy(name, PolicyOptions(num_instances=2, predictor=make_cost_model("smollm2-135m", "cpu")))
    cluster = RayCluster(None, policy, EngineConfig(kv_cache_memory_mb=64, threads=1))
    engine = AsyncLLMEngine(cluster)
    srv, th, url = serve(build_app(engine))
    try:
        return asyncio.run(scenario(url, cluster, kill_after))
    finally:
        srv.should_exit = True
        th.join(10)
        engine.shutdown()
        cluster.shutdown()


def fmt(c) -> str:
    return ", ".join(f"{k}: {v}" for k, v in sorted(c.items())) if isinstance(c, collections.Counter) else str(c)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", default="flowyard,arrow,distserve,dynaserve")
    ap.add_argument("--kill-after", type=float, default=3.0)
    ap.add_argument("--out", default="docs/results/faults.md")
    args = ap.parse_args()
    import ray

    ray.init(include_dashboard=False, log_to_driver=False)
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                           text=True).stdout.strip()
    rows = []
    for name in args.policies.split(","):
        r = run_policy(name, args.kill_after)
        print(name, {k: fmt(v) for k, v in r.items()}, flush=True)
        rows.append((name, r))
    cols = [("in_flight", "12 streams in flight when instance 1 dies"), ("new_at_kill", "6 new requests at the kill"),
            ("rejoin_s", "replacement rejoined after (s)"), ("after_rejoin", "6 requests after the rejoin"),
            ("idle_noticed_s", "idle death shown by /health after (s)"),
            ("at_idle_death", "4 requests right after the idle death")]
    lines = [f"# Faults on Ray, as a client sees them (measured at {rev}{', uncommitted changes' if dirty else ''})",
             "", f"`python benchmarks/faults.py --policies {args.policies} --kill-after {args.kill_after:g}`: "
             "2 Ray actor instances of the embedded SmolLM2 on this CPU machine, chat requests of 48 tokens.", "",
             "| policy | " + " | ".join(c[1] for c in cols) + " |", "|---|" + "---|" * len(cols)]
    for name, r in rows:
        lines.append(f"| {name} | " + " | ".join(fmt(r[k]) for k, _ in cols) + " |")
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
