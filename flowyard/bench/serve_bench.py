"""`run_bench`: load-test an OpenAI-compatible server with a workload, like `vllm bench serve`.

The workload's arrival times are replayed against the wall clock (or re-timed as a Poisson /
Gamma process at `request_rate`, or sent all at once for rate inf), each request streams
through `client.stream_request`, and the measured timestamps become `RequestState`s so that
every metric comes from `flowyard.core.metrics` - the same code that scores simulator runs.
A simulated and a measured run of one trace are therefore comparable number for number.

Metric conventions follow vLLM (benchmarks/serve.py) so results can be read side by side:
TTFT, ITL and E2EL are measured from the moment a request is sent (after any
`max_concurrency` wait), `duration` spans the first dispatch to the last response, rates and
throughputs divide by it, latency statistics cover successful requests only, and a request
is "good" for `request_goodput` when it meets every `--goodput` SLO (TPOT vacuous for one
output token). When the server streams several tokens in one chunk, the chunk's time is
given to each of its tokens (count from `usage.completion_tokens`), so TPOT and token totals
match vLLM's and ITL shows the bundling as zero gaps.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from flowyard.bench.client import (BenchError, RequestOutput, auth_headers, list_models,
                                   make_client, stream_request)
from flowyard.bench.loadgen import PromptBuilder, calibrate, endpoint_url, request_body
from flowyard.bench.vllm_result import clean_nan, vllm_result
from flowyard.core.metrics import EPS, Summary, e2e, meets_slo, summarize
from flowyard.core.request import SLO, Request, RequestState, Status
from flowyard.workloads import Workload, clip, retime
from flowyard.workloads.transforms import slo_by_length

GOODPUT_METRICS = ("ttft", "tpot", "e2el")
ENDPOINTS = ("chat", "completions")
Progress = Callable[[int, int], None]


def parse_goodput(spec: str | Sequence[str] | Mapping[str, float] | None) -> dict[str, float]:
    """'ttft:500 tpot:50' or ['ttft:500', ...] or {name: ms} → {name: milliseconds}.

    Same syntax and names as vLLM's --goodput; ValueError names the bad item."""
    if spec is None:
        return {}
    items: list[tuple[str, float | str]]
    if isinstance(spec, Mapping):
        items = [(str(k), v) for k, v in spec.items()]
    else:
        parts = spec.replace(",", " ").split() if isinstance(spec, str) else list(spec)
        items = []
        for p in parts:
            name, sep, text = str(p).partition(":")
            if not sep:
                raise ValueError(f"bad goodput SLO {p!r}: expected NAME:MS, e.g. ttft:500")
            items.append((name, text))
    out: dict[str, float] = {}
    for name, val in items:
        key = name.strip().lower()
        if key not in GOODPUT_METRICS:
            raise ValueError(f"bad goodput metric {name!r}: expected one of {', '.join(GOODPUT_METRICS)}")
        try:
            ms = float(val)
        except (TypeError, ValueError):
            raise ValueError(f"bad goodput SLO {name}:{val}: not a number of milliseconds") from None
        if not (ms > 0 and math.isfinite(ms)):
            raise ValueError(f"bad goodput SLO {name}:{val}: must be a positive number of ms")
        out[key] = ms
    return out


def prepare_workload(w: Workload, *, num_prompts: int | None = None,
                     request_rate: float | None = None, burstiness: float = 1.0,
                     seed: int = 0) -> Workload:
    """First `num_prompts` requests, then arrivals: the trace's own (request_rate None), all
    at 0 (inf), or a Gamma process of shape `burstiness` (1 = Poisson) at request_rate.
    Burstiness alone re-times at the trace's own mean rate. vLLM's burstiness is the Gamma
    shape k; `retime` takes the coefficient of variation, cv = 1/sqrt(k)."""
    if num_prompts is not None and num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"burstiness must be a positive number, got {burstiness!r}")
    if request_rate is not None and not request_rate > 0:
        raise ValueError(f"request rate must be > 0 (inf = all at once), got {request_rate!r}")
    if num_prompts is not None:
        w = clip(w, max_requests=num_prompts)
    if not w.requests:
        raise ValueError(f"workload {w.name!r} has no requests to send")
    if request_rate is None and burstiness == 1.0:
        return w
    if request_rate is not None and math.isinf(request_rate):
        return w.derive([replace(r, arrival=0.0) for r in w.requests], normalize_order=False)
    rate = request_rate if request_rate is not None else (w.rate or 1.0)
    process = "poisson" if burstiness == 1.0 else "gamma"
    return retime(w, process, rate, seed, cv=1.0 / math.sqrt(burstiness))


@dataclass
class BenchResult:
    """One benchmark run: the flowyard `Summary` (what `format_table` prints), the per-request
    states and raw outputs, and vLLM's result keys (`vllm_metrics`)."""

    summary: Summary
    states: list[RequestState]
    outputs: list[RequestOutput]
    duration: float
    model: str
    good: list[bool]
    goodput: dict[str, float] = field(default_factory=dict)
    config: dict = field(default_factory=dict)
    queue_times: list[float] = field(default_factory=list)  # due -> sent (--max-concurrency waits)

    @property
    def failed(self) -> int:
        return sum(1 for o in self.outputs if o.error)

    @property
    def request_goodput(self) -> float | None:
        """Requests/s that met every --goodput SLO (vLLM's key); None without SLOs."""
        if not self.goodput:
            return None
        return sum(self.good) / self.duration if self.duration > 0 else 0.0

    def errors(self) -> list[tuple[int, str]]:
        """(request index, error) of every failed request."""
        return [(i, o.error) for i, o in enumerate(self.outputs) if o.error]

    def vllm_metrics(self) -> dict:
        """`vllm bench serve` result keys (see `vllm_result`); latencies in ms, per-request
        lists in seconds."""
        return vllm_result(self.summary, self.states, self.outputs, duration=self.duration,
                           request_goodput=self.request_goodput, queue_times=self.queue_times,
                           max_concurrency=self.config.get("max_concurrency"),
                           request_rate=self.config.get("request_rate"))

    def to_json(self) -> dict:
        """Flowyard's `--json` keys (Summary.to_dict) + vLLM's keys + the run's config."""
        return {**self.summary.to_dict(), **self.vllm_metrics(), **clean_nan(self.config)}


def to_state(req: Request, out: RequestOutput, t0: float, slo: SLO | None) -> RequestState:
    """A measured request as a `RequestState` on the benchmark clock (t0 = first dispatch).

    arrival = send time; prompt_len = the server's usage.prompt_tokens when reported (the
    trace's otherwise); one token time per streamed chunk, repeated over the chunk's tokens
    when usage.completion_tokens says chunks carried several."""
    n = len(out.token_times)
    m = out.completion_tokens if out.ok and out.completion_tokens and out.completion_tokens > n else n
    prompt = out.prompt_tokens if out.prompt_tokens else req.prompt_len
    r = replace(req, arrival=out.start - t0, prompt_len=prompt, output_len=max(m, 1) if n else
                req.target_output, max_tokens=None, history_len=min(req.history_len, prompt),
                slo=req.slo if slo is None else slo)
    st = RequestState(req=r)
    if out.ok:
        rel = np.asarray(out.token_times, dtype=float) - t0
        counts = np.full(n, m // n) + (np.arange(n) < m % n)
        st.record_tokens(np.repeat(rel, counts))
        st.status, st.finish_time = Status.FINISHED, float(rel[-1])
    else:
        st.status = Status.REJECTED if out.kind == "http" else Status.ABORTED
        st.reject_reason = out.error
    return st


def request_slo(own: SLO, default: SLO | None) -> SLO:
    """A request's SLO: its own (e.g. TTFT by prompt length), else the run's `--goodput` one."""
    if default is None:
        return own
    return SLO(ttft=own.ttft if own.ttft is not None else default.ttft,
               tpot=own.tpot if own.tpot is not None else default.tpot)


def slo_headers(slo: SLO) -> dict[str, str]:
    """The SLO as flowyard's request headers (milliseconds), as a user's client sends it so
    that SLO-aware schedulers act on the very SLOs the run is judged on."""
    out = {}
    if slo.ttft is not None:
        out["x-slo-ttft-ms"] = f"{slo.ttft * 1e3:g}"
    if slo.tpot is not None:
        out["x-slo-tpot-ms"] = f"{slo.tpot * 1e3:g}"
    return out


async def arun_bench(base_url: str, workload: Workload, *, endpoint: str = "chat",
                     model: str | None = None, api_key: str | None = None,
                     max_concurrency: int | None = None, request_rate: float | None = None,
                     burstiness: float = 1.0, goodput: str | Sequence[str] | Mapping[str, float] | None = None,
                     timeout: float = 300.0, num_prompts: int | None = None, seed: int = 0,
                     ignore_eos: bool = True, calibrate_prompts: bool = True,
                     progress: Progress | None = None, ttft_slo_by_length: str | None = None,
                     send_slo: bool = False) -> BenchResult:
    """`run_bench` for callers that already run an event loop (same options)."""
    if endpoint not in ENDPOINTS:
        raise ValueError(f"unknown endpoint {endpoint!r}; expected one of {', '.join(ENDPOINTS)}")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    if not (timeout > 0 and math.isfinite(timeout)):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    slos = parse_goodput(goodput)
    w = prepare_workload(workload, num_prompts=num_prompts, request_rate=request_rate,
                         burstiness=burstiness, seed=seed)
    if ttft_slo_by_length:
        w = slo_by_length(w, ttft_slo_by_length)
    slo = SLO(ttft=slos["ttft"] / 1e3 if "ttft" in slos else None,
              tpot=slos["tpot"] / 1e3 if "tpot" in slos else None) if slos else None
    req_slos = [request_slo(r.slo, slo) for r in w.requests]
    if send_slo and not any(x.ttft or x.tpot for x in req_slos):
        raise ValueError("--send-slo needs SLOs to send: --goodput ttft:MS tpot:MS and/or --ttft-slo-by-length")
    headers = auth_headers(api_key) or None
    per_request = [{**(headers or {}), **slo_headers(x)} if send_slo else headers for x in req_slos]
    wall0 = time.perf_counter()
    if progress is not None:  # the total is known now; the model listing and prompt calibration come first
        progress(0, len(w.requests))
    async with make_client(max_concurrency) as client:
        models = await list_models(client, base_url, headers=headers, timeout=min(timeout, 30.0))
        if model is None:
            if not models:
                raise BenchError(f"server at {base_url} lists no models; pass --model")
            model = models[0]
        builder = (await calibrate(client, base_url, endpoint, model, headers=headers,
                                   timeout=timeout, seed=seed, ignore_eos=ignore_eos)
                   if calibrate_prompts else PromptBuilder(seed=seed))
        url = endpoint_url(base_url, endpoint)
        bodies = [request_body(endpoint, model, builder.prompt(r), r.target_output,
                               ignore_eos=ignore_eos) for r in w.requests]
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        done, due = 0, [0.0] * len(bodies)

        async def one(i: int, body: dict) -> RequestOutput:
            nonlocal done
            due[i] = time.perf_counter()
            if sem is None:
                out = await stream_request(client, url, body, headers=per_request[i], timeout=timeout)
            else:
                async with sem:
                    out = await stream_request(client, url, body, headers=per_request[i], timeout=timeout)
            done += 1
            if progress is not None:
                progress(done, len(bodies))
            return out

        tasks: list[asyncio.Task] = []
        t0 = time.perf_counter()
        for i, (r, body) in enumerate(zip(w.requests, bodies)):
            delay = t0 + r.arrival - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i, body)))
        outputs = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - t0
    states = [to_state(r, o, t0, x) for r, o, x in zip(w.requests, outputs, req_slos)]
    summary = summarize(states, duration=duration,
                        wall_s=time.perf_counter() - wall0)
    lim = slos.get("e2el", math.inf) / 1e3
    good = [meets_slo(st) and (e2e(st) or 0.0) <= lim + EPS for st in states]
    if "e2el" in slos:  # the Summary's attainment knows TTFT/TPOT only; add E2EL (vLLM's goodput)
        summary.slo_attainment = sum(good) / len(states)
        summary.token_goodput = sum(st.num_output for st, g in zip(states, good) if g) / duration
    backend = "openai-chat" if endpoint == "chat" else "openai"
    config = {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "endpoint_type": backend,
              "backend": backend, "label": None, "tokenizer_id": None, "endpoint": endpoint,
              "base_url": base_url, "url": url, "model_id": model, "trace": w.name, "num_prompts": len(w),
              "request_rate": "trace" if request_rate is None else
              ("inf" if math.isinf(request_rate) else request_rate),
              "burstiness": burstiness, "max_concurrency": max_concurrency, "goodput": slos,
              "timeout_s": timeout, "seed": seed,
              "prompt_calibration": {"overhead_tokens": builder.overhead,
                                     "tokens_per_word": builder.slope}}
    queued = [max(o.start - d, 0.0) if o.start else 0.0 for o, d in zip(outputs, due)]
    return BenchResult(summary, states, outputs, duration, model, good, slos, config, queued)


def run_bench(base_url: str, workload: Workload, **options: Any) -> BenchResult:
    """Load-test the OpenAI-compatible server at `base_url` with `workload` (options: those of
    `arun_bench`).

    endpoint: "chat" or "completions"; model: default first of GET /v1/models; request_rate:
    None keeps the workload's arrivals, inf sends all at once, else Poisson/Gamma(burstiness);
    goodput: vLLM-style SLOs in ms ("ttft:500 tpot:50 e2el:10000"); timeout: per-request
    deadline in s, so the call returns by itself; calibrate_prompts: fit prompt lengths to the
    server's token counts first. Raises BenchError when the server is unreachable or its first
    test request fails, ValueError for bad options."""
    return asyncio.run(arun_bench(base_url, workload, **options))


__all__ = ["BenchResult", "ENDPOINTS", "GOODPUT_METRICS", "arun_bench", "parse_goodput",
           "prepare_workload", "run_bench", "to_state"]
