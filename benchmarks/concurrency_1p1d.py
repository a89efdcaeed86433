"""500 concurrent streams on a 1P1D Ray cluster, none lost (issue 29), as a client sees them.

Starts a real `flowyard serve --ray --policy distserve --instances 2` (one prefill and one
decode actor of the embedded SmolLM2) as a subprocess, then opens `--streams` streaming chat
requests at once (short outputs, a shared system prompt so the prefix cache is exercised).
Every request ends in one of three ways, counted:

- completed: a finish reason and `data: [DONE]`;
- failed with a clear error: an OpenAI error body (a non-200 answer, or an error event in the
  stream), or a 503 still refused after `--max-retries` retries;
- lost: anything else: no answer within `--timeout` seconds (a hang), a broken connection, a
  stream that ends without a finish reason or [DONE].

More streams than the bounded queue (`--max-waiting`, 256 by default) get 503 + Retry-After;
the client does what a well-behaved one does: waits what Retry-After says (plus up to 50%
jitter, so the refused ones do not all come back at the same instant) and retries. A retried
request is not lost; retries are counted. Afterwards the server must be idle (no request left
running or waiting), healthy, and answer one more request.

    .venv/bin/python benchmarks/concurrency_1p1d.py --out docs/results/concurrency_1p1d.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

SYSTEM = ("You are a concise assistant for a lighthouse museum. Answer in one short sentence, "
          "plainly, without lists, and never repeat the question back to the visitor.")


@dataclass
class Outcome:
    kind: str  # completed | failed | lost
    detail: str
    retries: int = 0
    e2e_s: float | None = None  # first send -> end of the stream, retries included
    ttft_s: float | None = None  # first send -> first content token
    refusals: list[str] = field(default_factory=list)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def body(i: int) -> dict:
    return {"messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": f"Visitor {i} asks: what did keeper number {i % 37} do?"}],
            "max_tokens": 8 + i % 9, "temperature": 0, "ignore_eos": True, "stream": True}


async def attempt(c: httpx.AsyncClient, url: str, i: int, t0: float) -> tuple[str, str, float | None, float | None]:
    """One try: (kind, detail, retry_after or None, ttft or None); kind is completed, failed,
    lost or retry."""
    async with c.stream("POST", url + "/v1/chat/completions", json=body(i)) as r:
        if r.status_code != 200:
            raw = await r.aread()
            try:
                err = json.loads(raw)["error"]
            except (ValueError, KeyError, TypeError):
                return "lost", f"HTTP {r.status_code} without an OpenAI error body", None, None
            if r.status_code == 503 and "retry-after" in r.headers:
                return "retry", f"503 {err.get('code')}", float(r.headers["retry-after"]), None
            return "failed", f"HTTP {r.status_code} {err.get('code')}", None, None
        finish, done, ttft = None, False, None
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return "failed", f"200 then error event {chunk['error'].get('code')}", None, ttft
            ch = chunk["choices"][0] if chunk.get("choices") else {}
            if ttft is None and (ch.get("delta") or {}).get("content"):
                ttft = time.monotonic() - t0
            finish = ch.get("finish_reason") or finish
        if finish and done:
            return "completed", finish, None, ttft
        return "lost", f"stream ended (finish {finish}, [DONE] {done})", None, ttft


async def one(c: httpx.AsyncClient, url: str, i: int, timeout: float, max_retries: int) -> Outcome:
    t0 = time.monotonic()
    out = Outcome("lost", "")
    try:
        async with asyncio.timeout(timeout):
            while True:
                kind, detail, retry_after, ttft = await attempt(c, url, i, t0)
                if kind != "retry":
                    out.kind, out.detail, out.ttft_s = kind, detail, ttft
                    break
                out.refusals.append(detail)
                if out.retries >= max_retries:
                    out.kind, out.detail = "failed", f"{detail}, still refused after {max_retries} retries"
                    break
                out.retries += 1
                await asyncio.sleep(retry_after * (1 + 0.5 * random.random()))
    except TimeoutError:
        out.kind, out.detail = "lost", f"no end within {timeout:g} s"
    except httpx.HTTPError as e:
        out.kind, out.detail = "lost", f"transport error {type(e).__name__}"
    out.e2e_s = time.monotonic() - t0
    return out


def start_server(port: int, args: argparse.Namespace, log: Path) -> tuple[subprocess.Popen, list[str]]:
    cmd = [str(Path(sys.executable).with_name("flowyard")), "serve", "--ray", "--policy", "distserve",
           "--instances", "2", "--port", str(port), "--max-waiting", str(args.max_waiting),
           "--max-num-seqs", str(args.max_num_seqs)] + (["--threads", str(args.threads)] if args.threads else [])
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    return proc, cmd


def wait_ready(url: str, proc: subprocess.Popen, log: Path, limit: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < limit:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"the server was not healthy within {limit:g} s:\n{log.read_text()[-3000:]}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)  # the server's own session: it and its Ray processes
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def metric(text: str, name: str) -> float | None:
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return None if m is None else float(m.group(1))


def pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else (xs[0] if xs else float("nan"))


async def run(url: str, args: argparse.Namespace) -> tuple[list[Outcome], float]:
    limits = httpx.Limits(max_connections=args.streams + 10, max_keepalive_connections=args.streams + 10)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=limits) as c:
        t0 = time.monotonic()
        outs = await asyncio.gather(*(one(c, url, i, args.timeout, args.max_retries) for i in range(args.streams)))
        return list(outs), time.monotonic() - t0


def after(url: str, limit: float = 60) -> dict:
    """The server once the clients are done: idle (nothing running or waiting), healthy, and
    still serving; plus its counters."""
    start, health = time.monotonic(), {}
    while time.monotonic() - start < limit:
        r = httpx.get(url + "/health", timeout=10)
        health = r.json()
        if r.status_code == 200 and health.get("num_running") == 0 and health.get("num_waiting") == 0:
            break
        time.sleep(0.5)
    one_more = httpx.post(url + "/v1/chat/completions", timeout=120,
                          json={**body(0), "stream": False}).status_code
    text = httpx.get(url + "/metrics", timeout=10).text
    return {"health": health, "idle_after_s": round(time.monotonic() - start, 1), "one_more": one_more,
            "queries": metric(text, "vllm:prefix_cache_queries_total"), "hits": metric(text, "vllm:prefix_cache_hits_total"),
            "success": {m.group(1): float(m.group(2)) for m in re.finditer(
                r'^vllm:request_success_total{[^}]*finished_reason="([^"]+)"[^}]*} (\S+)$', text, re.M)}}


def report(args, cmd, outs, wall, ready_s, post, out_path: Path) -> str:
    from flowyard.experiments.provenance import machine
    from flowyard.experiments.report import md_table, source_revision

    kinds = {k: [o for o in outs if o.kind == k] for k in ("completed", "failed", "lost")}
    done = kinds["completed"]
    e2e = [o.e2e_s for o in done if o.e2e_s is not None]
    ttft = [o.ttft_s for o in done if o.ttft_s is not None]
    retried = [o for o in outs if o.retries]
    refusals: dict[str, int] = {}
    for o in outs:
        for r in o.refusals:
            refusals[r] = refusals.get(r, 0) + 1
    details = {}
    for o in kinds["failed"] + kinds["lost"]:
        details[f"{o.kind}: {o.detail}"] = details.get(f"{o.kind}: {o.detail}", 0) + 1
    m = machine()
    h = post["health"]
    lines = [
        f"# {args.streams} concurrent streams on a 1P1D Ray cluster (issue 29)", "",
        f"Measured at revision {source_revision() or 'unknown'} on {m['cpu']} ({m['cpus']} CPUs, {m['system']}, "
        f"Python {m['python']}), shared with other work.", "",
        f"Command: `python benchmarks/concurrency_1p1d.py {' '.join(shlex.quote(a) for a in sys.argv[1:])}`; "
        f"the server it started: `{' '.join(['flowyard'] + cmd[1:])}` "
        f"(healthy {ready_s:.0f} s after launch).", "",
        f"{args.streams} streaming chat requests sent at once (a shared {len(SYSTEM.split())}-word system prompt, "
        f"8-16 output tokens each, greedy), each bounded at {args.timeout:g} s; a 503 with Retry-After is retried "
        f"after Retry-After x (1 to 1.5), at most {args.max_retries} times.", "",
        md_table(["outcome", "requests"], [
            ["completed", len(done)], ["failed with a clear error", len(kinds["failed"])],
            ["**lost** (hung, broken, or no clear end)", f"**{len(kinds['lost'])}**"],
            ["retried after a 503 + Retry-After (then completed or not)", len(retried)],
            ["503 answers in all (retries they caused)", sum(refusals.values())],
        ]), "",
        "| wall time (s) | e2e p50 (s) | e2e p99 (s) | TTFT p50 (s) | TTFT p99 (s) | max retries of one request |",
        "|---|---|---|---|---|---|",
        f"| {wall:.1f} | {pct(e2e, 50):.1f} | {pct(e2e, 99):.1f} | {pct(ttft, 50):.1f} | {pct(ttft, 99):.1f} "
        f"| {max((o.retries for o in outs), default=0)} |", "",
        "e2e and TTFT are of the completed requests, from their first send (waits for retries included).", "",
        f"Refusals by code: {', '.join(f'{k}: {v}' for k, v in sorted(refusals.items())) or 'none'}. "
        f"Failures and losses: {', '.join(f'{k} ({v})' for k, v in sorted(details.items())) or 'none'}.", "",
        f"After the run: /health {'idle' if h.get('num_running') == 0 and h.get('num_waiting') == 0 else 'NOT idle'} "
        f"(running {h.get('num_running')}, waiting {h.get('num_waiting')}, healthy {h.get('healthy')}) "
        f"{post['idle_after_s']} s after the last client finished; one more request: HTTP {post['one_more']}. "
        f"`/metrics`: `vllm:request_success_total` {post['success']}, `vllm:prefix_cache_queries_total` "
        f"{post['queries']:g}, `vllm:prefix_cache_hits_total` {post['hits']:g} (prompt tokens, the prefill "
        "instance's cache).", "",
    ]
    text = "\n".join(lines)
    out_path.write_text(text)
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=500)
    ap.add_argument("--timeout", type=float, default=600.0, help="per-request bound (s), retries included")
    ap.add_argument("--max-retries", type=int, default=1000)
    ap.add_argument("--max-waiting", type=int, default=256, help="the server's queue bound")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per actor (0: the server's default)")
    ap.add_argument("--load-timeout", type=float, default=300.0)
    ap.add_argument("--out", default="docs/results/concurrency_1p1d.md")
    args = ap.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = Path(tempfile.mkdtemp(prefix="flowyard-1p1d-")) / "server.log"
    proc, cmd = start_server(port, args, log)
    try:
        ready_s = wait_ready(url, proc, log, args.load_timeout)
        print(f"server healthy after {ready_s:.0f} s; sending {args.streams} streams", flush=True)
        outs, wall = asyncio.run(run(url, args))
        post = after(url)
    finally:
        stop(proc)
    text = report(args, cmd, outs, wall, ready_s, post, Path(args.out))
    print(text)
    print("server log:", log)
    lost = sum(o.kind == "lost" for o in outs)
    return 1 if lost else 0


if __name__ == "__main__":
    raise SystemExit(main())
