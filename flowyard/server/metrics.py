"""Prometheus metrics of the HTTP server, named like vLLM's.

Every metric whose meaning vLLM defines is exported twice, as `flowyard:<suffix>` and as
`vllm:<suffix>` (same suffixes, meanings, units, label `model_name` and histogram buckets), so
a vLLM Grafana dashboard or a vLLM-aware router (which reads `vllm:num_requests_waiting`,
`vllm:kv_cache_usage_perc`) reads a flowyard server unchanged. flowyard-only metrics (SLO
counters, preemption blocking, engine threads) have the `flowyard:` prefix only. Every app gets its own `CollectorRegistry` (not the process-global one)
so several servers or test apps in one process never clash.

Latencies are measured here, at the server, from the moment the HTTP handler starts:
- time_to_first_token_seconds: arrival -> first output increment carrying tokens;
- time_per_output_token_seconds: per output increment, gap / tokens in it, observed once per
  token (vLLM's per-iteration meaning; equals inter-token latency for one-token steps);
- request_time_per_output_token_seconds: per request, (last - first) / (n - 1), the TPOT of
  DESIGN.md and of the SLO check;
- inter_token_latency_seconds: the same per-token gaps under vLLM V1's name;
- e2e_request_latency_seconds: arrival -> final output;
- request_{queue,prefill,decode,inference}_time_seconds: vLLM's request phases, timed by the
  engine on its clock (arrival -> first scheduled -> first token -> last token);
- request_prompt_tokens / request_generation_tokens: per-request token histograms;
  request_max_num_generation_tokens: the most tokens one sequence of a request generated
  (vLLM's, for n > 1; every request here has one sequence, so it equals generation tokens);
- prefix_cache_queries / prefix_cache_hits: prompt tokens looked up in / found in the prefix
  cache (counters, read from the engine at scrape time).
Gauges (running/waiting/KV usage) are read from `engine.stats()` at scrape time.
`vllm:gpu_cache_usage_perc` and `vllm:gpu_prefix_cache_hit_rate` are vLLM V0's names of
kv_cache_usage_perc and prefix_cache_hit_rate (`LEGACY_VLLM`), still read by vLLM's example
dashboard and older routers; they have no `flowyard:` twin.
SLO counters count requests that carry an SLO and finished normally (stop/length); attained
means every objective carried was met (TTFT, mean TPOT, and every client-visible gap for TBT).
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from flowyard.core.request import SLO
from flowyard.engine.protocol import EngineClient
from flowyard.engine.sampling import RequestOutput

log = logging.getLogger("flowyard.server")

PREFIX = "flowyard:"
VLLM = "vllm:"
PREFIXES = (PREFIX, VLLM)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
NORMAL_FINISH = ("stop", "length")
PHASE_BUCKETS = E2E_BUCKETS
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
PHASES = {"queue": "WAITING", "prefill": "PREFILL", "decode": "DECODE", "inference": "RUNNING"}
#: vLLM V0 names (deprecated in V1) exported as aliases: legacy name -> the suffix it mirrors.
LEGACY_VLLM = {"gpu_cache_usage_perc": "kv_cache_usage_perc", "gpu_prefix_cache_hit_rate": "prefix_cache_hit_rate"}


class Both:
    """One metric under both prefixes: every observation goes to the two children."""

    def __init__(self, children: list) -> None:
        self.children = children

    def observe(self, v: float) -> None:
        for c in self.children:
            c.observe(v)

    def inc(self, v: float = 1.0) -> None:
        for c in self.children:
            c.inc(v)

    def labels(self, *values: str) -> "Both":
        return Both([c.labels(*values) for c in self.children])


def both(kind, suffix: str, doc: str, labels: list[str], registry: CollectorRegistry, **kw) -> Both:
    return Both([kind(p + suffix, doc, labels, registry=registry, **kw) for p in PREFIXES])


class _EngineStatsCollector(Collector):
    """Gauges read from `engine.stats()` on every scrape, so they are never stale."""

    def __init__(self, engine: EngineClient, model_name: str) -> None:
        self.engine, self.model_name = engine, model_name

    def _families(self) -> list[GaugeMetricFamily | CounterMetricFamily]:
        lab = ["model_name"]
        out: list[GaugeMetricFamily | CounterMetricFamily] = []
        for p in PREFIXES:
            out += [
                GaugeMetricFamily(p + "num_requests_running", "Requests in model execution batches.", labels=lab),
                GaugeMetricFamily(p + "num_requests_waiting", "Requests waiting to be processed.", labels=lab),
                GaugeMetricFamily(p + "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels=lab),
                GaugeMetricFamily(p + "prefix_cache_hit_rate", "Prefix-cache hit rate (fraction).", labels=lab),
                CounterMetricFamily(p + "prefix_cache_queries", "Prefix-cache queries, in prompt tokens looked up.",
                                    labels=lab),
                CounterMetricFamily(p + "prefix_cache_hits", "Prefix-cache hits, in prompt tokens found.", labels=lab),
            ]
        out += [GaugeMetricFamily(VLLM + old, f"vLLM V0's name of {VLLM}{new}.", labels=lab)
                for old, new in LEGACY_VLLM.items()]
        return out

    def describe(self) -> Iterable[Metric]:
        return self._families()

    def collect(self) -> Iterable[Metric]:
        base = self._families()
        fams: list[Metric] = list(base)
        try:
            s = self.engine.stats()
        except Exception:  # a scrape must not fail because the engine is unwell
            log.exception("engine.stats() failed during /metrics scrape")
            return fams
        values = {"num_requests_running": s.num_running, "num_requests_waiting": s.num_waiting,
                  "kv_cache_usage_perc": s.kv_usage, "prefix_cache_hit_rate": s.prefix_cache_hit_rate,
                  "prefix_cache_queries": s.prefix_cache_queries, "prefix_cache_hits": s.prefix_cache_hits}
        for fam in base:
            suffix = fam.name.split(":", 1)[1]
            fam.add_metric([self.model_name], float(values[LEGACY_VLLM.get(suffix, suffix)]))
        p = s.preemption
        if p is not None:  # FlowPrefill: signal -> acknowledgement at an operator boundary
            hist = HistogramMetricFamily(
                PREFIX + "preemption_blocking_seconds",
                "Preemption blocking time: from the arrival that asked for it to the operator "
                "boundary where the running prefill stopped.", labels=["model_name"])
            hist.add_metric([self.model_name], p.cumulative(), p.total)
            count = CounterMetricFamily(PREFIX + "num_preemptions", "Prefill tasks suspended.",
                                        labels=["model_name"])
            count.add_metric([self.model_name], p.count)
            fams += [hist, count]
        if s.cpu_threads is not None:
            threads = GaugeMetricFamily(PREFIX + "engine_cpu_threads", "CPU threads the engine's steps run on "
                                        "(measured and chosen unless --threads pins it).", labels=["model_name"])
            threads.add_metric([self.model_name], float(s.cpu_threads))
            fams.append(threads)
        return fams


class ServerMetrics:
    """All collectors of one server, in one private registry."""

    def __init__(self, engine: EngineClient, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r, lab = self.registry, ["model_name"]
        self.ttft = both(Histogram, "time_to_first_token_seconds", "Time to first token in seconds.",
                         lab, r, buckets=TTFT_BUCKETS).labels(model_name)
        self.tpot = Both([both(Histogram, name, doc, lab, r, buckets=TPOT_BUCKETS).labels(model_name)
                          for name, doc in (("time_per_output_token_seconds", "Time per output token in seconds."),
                                            ("inter_token_latency_seconds", "Inter-token latency in seconds."))])
        self.req_tpot = both(Histogram, "request_time_per_output_token_seconds",
                             "Mean time per output token of each request, (last-first)/(n-1).",
                             lab, r, buckets=TPOT_BUCKETS).labels(model_name)
        self.e2e = both(Histogram, "e2e_request_latency_seconds", "End-to-end request latency in seconds.",
                        lab, r, buckets=E2E_BUCKETS).labels(model_name)
        self.phases = {k: both(Histogram, f"request_{k}_time_seconds", f"Seconds each request spent in its {v} phase.",
                               lab, r, buckets=PHASE_BUCKETS).labels(model_name) for k, v in PHASES.items()}
        self.req_prompt = both(Histogram, "request_prompt_tokens", "Number of prefill tokens processed per request.",
                               lab, r, buckets=TOKEN_BUCKETS).labels(model_name)
        self.req_generation = both(Histogram, "request_generation_tokens",
                                   "Number of generation tokens processed per request.",
                                   lab, r, buckets=TOKEN_BUCKETS).labels(model_name)
        self.req_max_generation = both(Histogram, "request_max_num_generation_tokens",
                                       "Most generation tokens of one sequence, per request.",
                                       lab, r, buckets=TOKEN_BUCKETS).labels(model_name)
        self.prompt_tokens = both(Counter, "prompt_tokens", "Number of prefill tokens processed.",
                                  lab, r).labels(model_name)
        self.generation_tokens = both(Counter, "generation_tokens", "Number of generation tokens processed.",
                                      lab, r).labels(model_name)
        self._success = both(Counter, "request_success", "Count of finished requests by finish reason.",
                             lab + ["finished_reason"], r)
        self.slo_attained = Counter(PREFIX + "slo_attained", "Finished requests that met every SLO they carry.",
                                    lab, registry=r).labels(model_name)
        self.slo_violated = Counter(PREFIX + "slo_violated", "Finished requests that missed an SLO they carry.",
                                    lab, registry=r).labels(model_name)
        self.model_name = model_name
        r.register(_EngineStatsCollector(engine, model_name))
        # the last finished requests, (unix time, ttft, tpot, ttft SLO, tpot SLO, met): /dashboard
        self.recent: collections.deque[tuple] = collections.deque(maxlen=1000)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def start(self, prompt_len: int, slo: SLO | None, arrival: float) -> "RequestMetrics":
        return RequestMetrics(self, prompt_len, slo, arrival)

    def success(self, reason: str) -> None:
        self._success.labels(self.model_name, reason).inc()


class RequestMetrics:
    """Timing of one request as its outputs pass through the server (perf_counter clock)."""

    def __init__(self, m: ServerMetrics, prompt_len: int, slo: SLO | None, arrival: float) -> None:
        self.m, self.prompt_len, self.slo, self.arrival = m, prompt_len, slo, arrival
        self.first: float | None = None
        self.last: float | None = None
        self.tokens = 0
        self.max_gap = 0.0
        self.done = False
        self.phases: dict[str, float] | None = None  # from the engine's final output

    def on_output(self, out: RequestOutput, now: float | None = None) -> None:
        if out.phases:
            self.phases = out.phases
        k = len(out.new_token_ids)
        if k == 0:
            return
        now = time.perf_counter() if now is None else now
        if self.first is None:
            self.first = now
            self.m.ttft.observe(now - self.arrival)
            self.m.prompt_tokens.inc(self.prompt_len)
        else:
            gap = now - self.last  # type: ignore[operator]
            self.max_gap = max(self.max_gap, gap)
            for _ in range(k):
                self.m.tpot.observe(gap / k)
        self.last = now
        self.tokens += k
        self.m.generation_tokens.inc(k)

    def finish(self, reason: str, now: float | None = None) -> None:
        """Record the end of the request once (later calls are ignored)."""
        if self.done:
            return
        self.done = True
        now = time.perf_counter() if now is None else now
        self.m.success(reason)
        if reason not in NORMAL_FINISH:
            return
        self.m.e2e.observe(now - self.arrival)
        self.m.req_prompt.observe(self.prompt_len)
        self.m.req_generation.observe(self.tokens)
        self.m.req_max_generation.observe(self.tokens)  # one sequence per request (n=1)
        for k, v in (self.phases or {}).items():
            if k in self.m.phases:
                self.m.phases[k].observe(v)
        tpot = None
        if self.tokens >= 2 and self.first is not None and self.last is not None:
            tpot = (self.last - self.first) / (self.tokens - 1)
            self.m.req_tpot.observe(tpot)
        ttft = None if self.first is None else self.first - self.arrival
        slo = self.slo or SLO()
        self.m.recent.append((time.time(), ttft, tpot, slo.ttft, slo.tpot, None if slo.empty else self._met(ttft, tpot)))
        if self.slo is None or self.slo.empty:
            return
        (self.m.slo_attained if self._met(ttft, tpot) else self.m.slo_violated).inc()

    def _met(self, ttft: float | None, tpot: float | None) -> bool:
        slo, ok = self.slo, True
        assert slo is not None
        if slo.ttft is not None:
            ok &= ttft is not None and ttft <= slo.ttft
        if slo.tpot is not None and tpot is not None:
            ok &= tpot <= slo.tpot
        if slo.tbt is not None:
            ok &= self.max_gap <= slo.tbt
        return ok
