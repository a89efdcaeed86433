"""`flowyard bench` against a tiny fake OpenAI-compatible streaming server with known delays.

The fake server (FastAPI + uvicorn on 127.0.0.1, background thread) counts prompt tokens as
whitespace words plus a fixed template overhead, waits `ttft + per_prompt_token * prompt`
before the first token and `itl` between chunks, can fail every k-th request with 500/429,
and records the most requests it had in flight. Measured numbers are checked against those
delays with a tolerance wide enough for a loaded CI machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import pytest

fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
from fastapi.responses import JSONResponse, StreamingResponse  # noqa: E402

from flowyard.bench.cli_bench import add_bench_parser  # noqa: E402
from flowyard.bench.client import BenchError  # noqa: E402
from flowyard.bench.loadgen import PromptBuilder, cap_lengths, request_body  # noqa: E402
from flowyard.bench.serve_bench import parse_goodput, prepare_workload, run_bench  # noqa: E402
from flowyard.core.request import Request  # noqa: E402
from flowyard.workloads import Workload  # noqa: E402

OVERHEAD = 7  # "chat template" tokens the fake server adds to every prompt
VLLM_KEYS = {"duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
             "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
             "input_lens", "output_lens", "ttfts", "itls", "errors"} | {
    f"{s}_{m}_ms" for s in ("mean", "median", "std", "p99") for m in ("ttft", "tpot", "itl", "e2el")}


@dataclass
class Fake:
    ttft: float = 0.05
    per_prompt_token: float = 0.0
    itl: float = 0.02
    tokens_per_chunk: int = 1
    fail_every: int = 0
    count: int = 0
    inflight: int = 0
    max_inflight: int = 0
    bodies: list = field(default_factory=list)
    headers: list = field(default_factory=list)


class Holder:
    """The current test's Fake; a handler keeps the one it started with, so a request
    abandoned by an earlier test (timeout) cannot touch the next test's counters."""

    fake = Fake()


def _app(holder: type[Holder]):
    app = fastapi.FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    async def handle(body: dict, chat: bool):
        fake = holder.fake
        fake.count += 1
        fake.bodies.append(body)
        if fake.fail_every and fake.count % fake.fail_every == 0:
            code = (500, 429)[(fake.count // fake.fail_every) % 2]
            return JSONResponse({"error": {"message": f"fake failure {code}", "code": code}}, code)
        text = body["messages"][0]["content"] if chat else body["prompt"]
        prompt = len(text.split()) + OVERHEAD
        n = int(body["max_tokens"])
        fake.inflight += 1
        fake.max_inflight = max(fake.max_inflight, fake.inflight)

        def sse(obj) -> str:
            return f"data: {json.dumps(obj)}\n\n"

        def choice(tok: str | None, fin=None):
            if chat:
                return {"index": 0, "delta": {} if tok is None else {"content": tok}, "finish_reason": fin}
            return {"index": 0, "text": tok or "", "finish_reason": fin}

        async def gen():
            try:
                if chat:  # role-only chunk right away: must not count as the first token
                    yield sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
                await asyncio.sleep(fake.ttft + fake.per_prompt_token * prompt)
                sent = 0
                while sent < n:
                    if sent:
                        await asyncio.sleep(fake.itl)
                    k = min(fake.tokens_per_chunk, n - sent)
                    yield sse({"choices": [choice(" tok" * k)]})
                    sent += k
                yield sse({"choices": [choice(None, "length")]})
                yield sse({"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": n}})
                yield "data: [DONE]\n\n"
            finally:
                fake.inflight -= 1

        return StreamingResponse(gen(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(req: fastapi.Request):
        holder.fake.headers.append({k: v for k, v in req.headers.items() if k.startswith("x-slo")})
        return await handle(await req.json(), True)

    @app.post("/v1/completions")
    async def completions(req: fastapi.Request):
        return await handle(await req.json(), False)

    return app


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    port = _free_port()
    srv = uvicorn.Server(uvicorn.Config(_app(Holder), host="127.0.0.1", port=port, log_level="error"))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    deadline = time.time() + 10
    while not srv.started and time.time() < deadline:
        time.sleep(0.02)
    assert srv.started, "fake server did not start"
    yield f"http://127.0.0.1:{port}"
    srv.should_exit = True
    th.join(5)


@pytest.fixture
def fake(server):
    Holder.fake = Fake()  # fresh delays and counters for each test
    return Holder.fake, server


def workload(prompts, outputs, arrival=0.0) -> Workload:
    reqs = [Request(id=i, arrival=arrival * i, prompt_len=p, output_len=o)
            for i, (p, o) in enumerate(zip(prompts, outputs))]
    return Workload("test", reqs)


def test_measured_ttft_itl_match_server_delays(fake):
    f, url = fake
    f.ttft, f.itl = 0.06, 0.025
    res = run_bench(url, workload([20, 50, 100, 30], [5] * 4), request_rate=float("inf"), seed=1)
    m = res.vllm_metrics()
    assert res.model == "fake-model" and m["completed"] == 4 and m["failed"] == 0
    assert m["input_lens"] == [20, 50, 100, 30]  # calibrated prompts hit the server's count
    assert m["output_lens"] == [5] * 4 and m["total_output_tokens"] == 20
    # client and server share one process (and GIL): allow HTTP overhead, and on a shared
    # 2-core machine under load ~100 ms of scheduling delay (seen: 157 ms for a 60 ms TTFT)
    assert all(0.06 <= t < 0.06 + 0.2 for t in m["ttfts"]), m["ttfts"]
    itls = np.concatenate(m["itls"])
    assert len(itls) == 16 and 0.02 <= itls.mean() < 0.025 + 0.03
    assert 20 <= m["mean_tpot_ms"] < 55 and 160 <= m["median_e2el_ms"] < 160 + 200, m
    assert m["mean_ttft_ms"] == pytest.approx(np.mean(m["ttfts"]) * 1e3)
    body = f.bodies[-1]  # lengths are forced the way vLLM/SGLang honour them
    assert body["max_tokens"] == body["min_tokens"] == 5 and body["ignore_eos"] is True
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}


def test_completions_endpoint_bundled_chunks(fake):
    f, url = fake
    f.ttft, f.itl, f.tokens_per_chunk = 0.03, 0.03, 2
    res = run_bench(url, workload([10, 10], [6, 6]), endpoint="completions",
                    request_rate=float("inf"), calibrate_prompts=False)
    m = res.vllm_metrics()
    assert "prompt" in f.bodies[-1] and m["output_lens"] == [6, 6]  # from usage, not chunk count
    assert res.summary.output_tokens == 12
    # 3 chunks 30 ms apart carry 6 tokens: TPOT = 60 ms / 5 tokens, as vLLM computes it;
    # each chunk's time goes to both its tokens, so ITL shows the bundling as zero gaps
    assert all(len(g) == 5 and sum(x == 0.0 for x in g) == 3 for g in m["itls"])
    assert m["mean_tpot_ms"] == pytest.approx(np.mean([sum(g) / 5 for g in m["itls"]]) * 1e3)
    assert 9 <= m["mean_tpot_ms"] < 12 + 20  # a late-read first chunk shortens the span
    assert m["input_lens"] == [10 + OVERHEAD] * 2  # uncalibrated: server's own count reported


def test_goodput_against_slos(fake):
    f, url = fake
    f.ttft, f.itl, f.per_prompt_token = 0.02, 0.01, 0.0005  # TTFT ~30 ms vs ~224 ms
    w = workload([12, 400] * 3, [3] * 6)
    res = run_bench(url, w, request_rate=float("inf"), goodput=["ttft:110", "tpot:1000"])
    m = res.vllm_metrics()
    assert res.good == [True, False] * 3 and res.summary.slo_attainment == pytest.approx(0.5)
    assert m["request_goodput"] == pytest.approx(3 / m["duration"])
    res = run_bench(url, w, request_rate=float("inf"), goodput={"e2el": 5})
    assert sum(res.good) == 0 and res.summary.slo_attainment == 0.0
    res = run_bench(url, w, request_rate=float("inf"))
    assert res.request_goodput is None and res.vllm_metrics()["request_goodput"] is None


def test_http_errors_are_counted_and_listed(fake):
    f, url = fake
    f.ttft, f.itl, f.fail_every = 0.01, 0.005, 3
    res = run_bench(url, workload([10] * 9, [2] * 9), request_rate=float("inf"),
                    calibrate_prompts=False, max_concurrency=1)
    m = res.vllm_metrics()
    assert m["failed"] == 3 and m["completed"] == 6 and res.summary.rejected == 3
    errs = [e for e in m["errors"] if e]
    assert len(m["errors"]) == 9 and len(errs) == 3
    assert any(e.startswith("HTTP 500") for e in errs) and any(e.startswith("HTTP 429") for e in errs)
    assert all("fake failure" in e for e in errs)
    assert [m["output_lens"][i] for i, e in enumerate(m["errors"]) if e] == [0, 0, 0]


def test_timeout_bounds_the_run(fake):
    f, url = fake
    f.ttft = 3.0
    t = time.perf_counter()
    res = run_bench(url, workload([5, 5], [2, 2]), request_rate=float("inf"), timeout=0.3,
                    calibrate_prompts=False)
    assert time.perf_counter() - t < 2.0
    assert res.summary.completed == 0 and res.summary.aborted == 2
    assert all("timeout" in e for _, e in res.errors())


def test_max_concurrency_is_honoured(fake):
    f, url = fake
    f.ttft, f.itl = 0.02, 0.01
    res = run_bench(url, workload([8] * 12, [3] * 12), request_rate=float("inf"),
                    max_concurrency=3, calibrate_prompts=False)
    assert res.summary.completed == 12
    assert f.max_inflight == 3 and res.vllm_metrics()["max_concurrent_requests"] <= 3


def test_connection_refused_is_one_clear_error(capsys):
    url = f"http://127.0.0.1:{_free_port()}"
    with pytest.raises(BenchError, match="not reachable.*connection refused"):
        run_bench(url, workload([5], [2]))
    assert _cli(["--base-url", url, "--trace", "sharegpt", "--num-prompts", "2", "--quiet"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("flowyard: error:") and "connection refused" in err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="flowyard")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *argv])
    return args.func(args)


def test_cli_end_to_end_writes_vllm_keys(fake, tmp_path, capsys):
    f, url = fake
    f.ttft, f.itl = 0.01, 0.005
    trace = tmp_path / "lens.csv"
    trace.write_text("num_prefill_tokens,num_decode_tokens\n" + "".join(
        f"{p},{o}\n" for p, o in [(40, 3), (90, 12), (25, 2), (300, 8), (60, 5)]))
    out = tmp_path / "r.json"
    code = _cli(["--base-url", url + "/v1", "--trace", str(trace), "--request-rate", "inf",
                 "--max-output-len", "4", "--max-input-len", "100", "--goodput", "ttft:2000",
                 "tpot:2000", "--json", str(out), "--quiet", "--endpoint", "completions"])
    assert code == 0
    text = capsys.readouterr().out
    assert "Serving Benchmark Result" in text and "Request goodput" in text
    data = json.loads(out.read_text())
    assert VLLM_KEYS <= set(data) and {"ttft", "slo_attainment", "throughput_rps"} <= set(data)
    assert data["completed"] == 5 and data["failed"] == 0 and data["request_goodput"] > 0
    assert data["output_lens"] == [3, 4, 2, 4, 4] and data["input_lens"] == [40, 90, 25, 100, 60]
    assert data["model_id"] == "fake-model" and data["backend"] == "openai"


@pytest.mark.parametrize("argv", [["--goodput", "foo:1"], ["--goodput", "ttft"],
                                  ["--request-rate", "0"], ["--endpoint", "grpc"],
                                  ["--max-concurrency", "0"], ["--burstiness", "-1"]])
def test_bad_flags_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        _cli(argv)
    assert e.value.code == 2


def test_unknown_trace_exits_2(capsys):
    assert _cli(["--trace", "nope", "--quiet"]) == 2
    assert "unknown trace" in capsys.readouterr().err


def test_parse_goodput_and_arrivals():
    assert parse_goodput("ttft:500 tpot:50") == {"ttft": 500.0, "tpot": 50.0}
    assert parse_goodput(["e2el:1e4"]) == {"e2el": 10000.0}
    for bad in ("ttft", "itl:5", "ttft:-1", "ttft:x"):
        with pytest.raises(ValueError):
            parse_goodput(bad)
    w = workload([5] * 200, [2] * 200, arrival=1.0)
    assert all(r.arrival == 0 for r in prepare_workload(w, request_rate=float("inf")).requests)
    p = prepare_workload(w, request_rate=10.0, seed=3)
    assert p.rate == pytest.approx(10.0, rel=0.25)
    g = np.diff(prepare_workload(w, request_rate=10.0, burstiness=0.25, seed=3).arrivals())
    assert g.std() / g.mean() > 1.4  # shape 0.25 → CV 2
    assert len(prepare_workload(w, num_prompts=7)) == 7


def test_prompts_and_caps():
    b = PromptBuilder(overhead=OVERHEAD, slope=1.0, seed=0)
    r = Request(id=0, arrival=0.0, prompt_len=57, output_len=4)
    assert len(b.prompt(r).split()) == 50 and b.prompt(r) == b.prompt(r)
    assert b.prompt(r) != b.prompt(Request(id=1, arrival=0.0, prompt_len=57, output_len=4))
    shared = [Request(id=i, arrival=0.0, prompt_len=40, output_len=1, block_hashes=(9, i + 1),
                      hash_block_size=16) for i in range(2)]
    a, c = (b.prompt(x).split() for x in shared)
    assert a[:16] == c[:16] and a[16:] != c[16:]  # same hash block → same words
    assert request_body("chat", "m", "hi", 3, ignore_eos=False) == {
        "model": "m", "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "hi"}]}
    w = cap_lengths(workload([10, 500], [900, 5]), max_input_len=100, max_output_len=50)
    assert [(r.prompt_len, r.target_output) for r in w.requests] == [(10, 50), (100, 5)]


def test_save_result_and_json_to_stdout(fake, tmp_path, capsys):
    """vLLM's --save-result/--result-dir/--result-filename, per-request lists included, and
    `--json -`: the JSON alone on standard output, the tables on stderr; a Mooncake trace
    (prefix hashes) replays too."""
    f, url = fake
    f.ttft, f.itl = 0.01, 0.005
    code = _cli(["--base-url", url, "--trace", "mooncake-conv", "--num-prompts", "3", "--request-rate", "inf",
                 "--max-output-len", "3", "--max-input-len", "64", "--endpoint", "completions",
                 "--save-result", "--result-dir", str(tmp_path), "--result-filename", "run.json", "--json", "-"])
    assert code == 0
    cap = capsys.readouterr()
    data = json.loads(cap.out)  # nothing else on stdout
    assert "Serving Benchmark Result" in cap.err and f"wrote {tmp_path / 'run.json'}" in cap.err
    saved = json.loads((tmp_path / "run.json").read_text())
    assert saved["completed"] == data["completed"] == 3
    for key in ("ttfts", "itls", "latencies", "input_lens", "output_lens", "generated_texts", "errors"):
        assert len(saved[key]) == 3, key
    assert all(t > 0 for t in saved["ttfts"]) and all(len(i) == n - 1 for i, n in zip(saved["itls"], saved["output_lens"]))
    argv = ["--base-url", url, "--trace", "mooncake-conv", "--num-prompts", "1", "--request-rate", "inf",
            "--max-output-len", "2", "--max-input-len", "32", "--endpoint", "completions", "--quiet", "--save-result"]
    code = _cli([*argv, "--result-dir", str(tmp_path / "new" / "dir"), "--result-filename", "r.json"])
    assert code == 0 and (tmp_path / "new" / "dir" / "r.json").is_file()  # created, as vLLM does
    sent = f.count
    code = _cli([*argv, "--result-dir", str(tmp_path / "run.json")])  # a file: fails before sending
    assert code == 2 and "cannot create --result-dir" in capsys.readouterr().err and f.count == sent
    code = _cli([*argv, "--result-dir", str(tmp_path), "--result-filename", "no/r.json"])
    assert code == 1 and "cannot write results" in capsys.readouterr().err


# The keys `vllm bench serve` writes for a generation backend (vllm/benchmarks/serve.py:
# main()'s setup keys, benchmark()'s result dict, process_one_metric for ttft/tpot/itl/e2el at
# its default percentile 99, and the client-queue statistics it adds under --max-concurrency).
VLLM_SETUP_KEYS = {"date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts",
                   "request_rate", "burstiness", "max_concurrency"}
VLLM_RESULT_KEYS = {"duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
                    "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
                    "input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times", "queue_times",
                    "generated_texts", "errors", "max_output_tokens_per_s", "max_concurrent_requests", "rtfx"}
VLLM_STAT_KEYS = {f"{s}_{m}_ms" for s in ("mean", "median", "std", "p99") for m in ("ttft", "tpot", "itl", "e2el")}
VLLM_QUEUE_KEYS = {f"{s}_{m}_ms" for s in ("mean", "median", "std", "p99")
                   for m in ("client_queue_time", "e2el_including_client_queue")}


def _mooncake_file(path, rows) -> str:
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": p, "output_length": o,
                                        "hash_ids": h}) + "\n" for t, p, o, h in rows))
    return str(path)


def test_save_result_has_every_vllm_key_from_a_mooncake_file(fake, tmp_path, capsys):
    """A Mooncake JSONL file by path (ms timestamps, hash_ids: shared prefix blocks give the same
    words) replays at its own timestamps, and --save-result carries vLLM's whole key set."""
    f, url = fake
    f.ttft, f.itl = 0.01, 0.005
    trace = _mooncake_file(tmp_path / "mc.jsonl", [(0, 40, 3, [1, 2, 3]), (150, 60, 4, [1, 2, 3, 4]),
                                                   (300, 20, 2, [9, 10])])
    code = _cli(["--base-url", url, "--trace", trace, "--endpoint", "completions", "--quiet", "--num-prompts", "3",
                 "--max-concurrency", "2", "--label", "mc", "--save-result", "--result-dir", str(tmp_path)])
    assert code == 0, capsys.readouterr().err
    saved_path, = tmp_path.glob("mc-inf*qps-concurrency2-fake-model-*.json")
    data = json.loads(saved_path.read_text())
    missing = (VLLM_SETUP_KEYS | VLLM_RESULT_KEYS | VLLM_STAT_KEYS | VLLM_QUEUE_KEYS) - set(data)
    assert not missing, sorted(missing)
    assert data["label"] == "mc" and data["endpoint_type"] == data["backend"] == "openai"
    assert data["completed"] == 3 and data["output_lens"] == [3, 4, 2] and data["rtfx"] == 0.0
    assert data["start_times"] == pytest.approx([0.0, 0.15, 0.3], abs=0.05)  # the trace's own clock
    assert all(len(data[k]) == 3 for k in ("ttfts", "itls", "latencies", "queue_times", "generated_texts"))
    assert data["latencies"] == pytest.approx([t + sum(g) for t, g in zip(data["ttfts"], data["itls"])], abs=1e-6)
    assert 1 <= data["max_output_tokens_per_s"] <= 9 and data["errors"] == ["", "", ""]
    p0, p1, p2 = (b["prompt"].split() for b in f.bodies[-3:])
    assert p1[:len(p0)] == p0 and p2[0] != p0[0]  # hash block 1 shared, block 9 not
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 5}\n')
    assert _cli(["--trace", str(bad), "--quiet"]) == 2
    assert "output_length" in capsys.readouterr().err


def test_queue_times_measure_the_concurrency_wait(fake):
    """vLLM's queue_times: due -> sent. One slot and four requests due at once: each waits for
    the ones before it, and e2el including the wait adds it back."""
    f, url = fake
    f.ttft, f.itl = 0.04, 0.0
    res = run_bench(url, workload([8] * 4, [1] * 4), request_rate=float("inf"), max_concurrency=1,
                    calibrate_prompts=False)
    m = res.vllm_metrics()
    q = m["queue_times"]
    assert q[0] < 0.03 and all(b > a + 0.02 for a, b in zip(q, q[1:])), q
    assert m["mean_client_queue_time_ms"] == pytest.approx(np.mean(q) * 1e3)
    assert "mean_e2el_including_client_queue_ms" not in m  # vLLM skips it for rate inf
    free = run_bench(url, workload([8] * 2, [1] * 2), request_rate=float("inf"), calibrate_prompts=False)
    fm = free.vllm_metrics()
    assert all(t < 0.03 for t in fm["queue_times"]) and "mean_client_queue_time_ms" not in fm


@pytest.mark.parametrize("out_tty,err_tty,enabled,shown", [
    (True, True, True, True), (True, True, False, False), (False, True, True, False), (True, False, True, False)])
def test_bench_progress_only_on_a_terminal(monkeypatch, out_tty, err_tty, enabled, shown):
    import io

    from flowyard.bench.cli_bench import _progress

    class Tty(io.StringIO):
        def __init__(self, tty: bool) -> None:
            super().__init__()
            self.tty = tty

        def isatty(self) -> bool:
            return self.tty

    err = Tty(err_tty)
    monkeypatch.setattr("sys.stdout", Tty(out_tty))
    monkeypatch.setattr("sys.stderr", err)
    monkeypatch.setenv("TERM", "xterm-256color")
    with _progress(enabled) as bar:
        assert (bar is not None) == shown
        if bar is not None:
            bar(3, 10)
    assert ("requests" in err.getvalue()) == shown


def test_progress_knows_the_total_before_the_first_request(fake):
    """The bar shows 0/N from the start, not 0/? while models are listed and prompts calibrated."""
    _, url = fake
    calls = []
    run_bench(url, workload([8] * 3, [2] * 3), request_rate=float("inf"), calibrate_prompts=False,
              progress=lambda done, total: calls.append((done, total)))
    assert calls[0] == (0, 3) and calls[-1] == (3, 3)


def test_requests_carry_their_slos_when_asked(fake):
    """--send-slo: each request carries the SLO it is judged on (TTFT by prompt length, TPOT
    from --goodput) as flowyard's x-slo-* headers; without it, none."""
    f, url = fake
    w = workload([8, 300], [2, 2])
    res = run_bench(url, w, request_rate=float("inf"), calibrate_prompts=False, goodput="tpot:100",
                    ttft_slo_by_length="0:0.5,256:2", send_slo=True)
    assert sorted((h["x-slo-ttft-ms"], h["x-slo-tpot-ms"]) for h in f.headers) == [("2000", "100"), ("500", "100")]
    assert sorted(st.req.slo.ttft for st in res.states) == [0.5, 2.0]
    assert {st.req.slo.tpot for st in res.states} == {0.1}
    f.headers.clear()
    run_bench(url, w, request_rate=float("inf"), calibrate_prompts=False, goodput="tpot:100")
    assert f.headers == [{}, {}]
    with pytest.raises(ValueError, match="send-slo needs SLOs"):
        run_bench(url, w, request_rate=float("inf"), calibrate_prompts=False, send_slo=True)


def test_one_token_with_empty_text_sent_with_finish_reason_counts_as_generated():
    """max_tokens=1 may sample a special token: its text is empty and its chunk carries
    finish_reason, so it looks like framing; the server's usage says one token was generated,
    so the request succeeded (the benchmark's first probe failed on a fresh server before)."""
    import asyncio

    import httpx

    from flowyard.bench.client import stream_request

    def chunk(obj):
        return "data: " + json.dumps(obj) + "\n\n"

    def reply(usage_tokens):
        body = (chunk({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                    "finish_reason": None}]})
                + chunk({"choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": "length"}]})
                + chunk({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": usage_tokens}})
                + "data: [DONE]\n\n")
        return httpx.MockTransport(lambda request: httpx.Response(200, text=body))

    async def go(usage_tokens):
        async with httpx.AsyncClient(transport=reply(usage_tokens)) as client:
            return await stream_request(client, "http://x/v1/chat/completions", {})

    out = asyncio.run(go(1))
    assert not out.error and len(out.token_times) == 1 and out.completion_tokens == 1
    nothing = asyncio.run(go(0))  # the server says nothing was generated: still an error
    assert nothing.error == "stream ended without any generated token"
