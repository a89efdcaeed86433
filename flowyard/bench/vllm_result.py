"""The result JSON of `vllm bench serve`, computed from a measured run's `RequestState`s.

Key for key the dictionary vLLM's `benchmark()` returns for a generation backend
(vllm/benchmarks/serve.py): totals and rates, `{mean,median,std,pNN}_{ttft,tpot,itl,e2el}_ms`,
the per-request lists (`input_lens`, `output_lens`, `ttfts`, `itls`, `latencies`,
`start_times`, `queue_times`, `generated_texts`, `errors`), `max_output_tokens_per_s`,
`max_concurrent_requests`, `rtfx`, and under a concurrency cap the client-queue statistics.
Scripts written against vLLM's files can therefore read flowyard's. The setup keys vLLM adds
in `main()` (date, backend, label, model_id, ...) come from `arun_bench`'s config.

Conventions kept from vLLM: latency statistics in milliseconds over successful requests;
per-request lists in seconds with one entry per request sent, a failed request reading 0 /
[] / its error. Summary statistics come from `flowyard.core.metrics` (the simulator's code),
std and the client-queue percentiles from numpy like vLLM's. NaN (no successful request)
becomes null so the JSON stays strict.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from flowyard.bench.client import RequestOutput
from flowyard.core.metrics import Summary, e2e, tbt, tpot, ttft
from flowyard.core.request import RequestState, Status

METRIC_KEYS = ("ttft", "tpot", "itl", "e2el")
#: Per-request lists, one entry per request sent (vLLM writes them with --save-detailed).
PER_REQUEST_KEYS = ("input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times",
                    "queue_times", "generated_texts", "errors")


def vllm_result(summary: Summary, states: Sequence[RequestState], outputs: Sequence[RequestOutput], *,
                duration: float, request_goodput: float | None, queue_times: Sequence[float] = (),
                max_concurrency: int | None = None, request_rate: Any = None) -> dict:
    """vLLM's result keys for one run (request_rate as in the config: a number, "inf" or
    "trace"; only whether it is "inf" matters here, as in vLLM)."""
    s, dur = summary, duration
    ok = [st.status is Status.FINISHED for st in states]
    fin = [st for st, k in zip(states, ok) if k]
    values: dict[str, list[float | None] | np.ndarray] = {"tpot": [tpot(st) for st in fin], "itl": np.concatenate([tbt(st) for st in fin]) if fin else []}
    stats = {"ttft": s.ttft, "tpot": s.tpot, "itl": s.itl, "e2el": s.e2e}
    out: dict = {"duration": dur, "completed": s.completed, "failed": sum(1 for o in outputs if o.error),
                 "total_input_tokens": s.input_tokens, "total_output_tokens": s.output_tokens,
                 "request_throughput": s.completed / dur if dur > 0 else 0.0,
                 "request_goodput": request_goodput,
                 "output_throughput": s.output_tokens / dur if dur > 0 else 0.0,
                 "total_token_throughput": (s.input_tokens + s.output_tokens) / dur if dur > 0 else 0.0}
    values["ttft"], values["e2el"] = [ttft(st) for st in fin], [e2e(st) for st in fin]
    for m in METRIC_KEYS:
        v = np.asarray([x for x in values[m] if x is not None], dtype=float)
        out[f"mean_{m}_ms"] = stats[m]["mean"] * 1e3
        out[f"median_{m}_ms"] = stats[m]["p50"] * 1e3
        out[f"std_{m}_ms"] = float(np.std(v)) * 1e3 if len(v) else math.nan
        out[f"p90_{m}_ms"] = stats[m]["p90"] * 1e3
        out[f"p99_{m}_ms"] = stats[m]["p99"] * 1e3
    queued = list(queue_times) or [0.0] * len(states)
    out["input_lens"] = [st.req.prompt_len for st in states]
    out["output_lens"] = [st.num_output if k else 0 for st, k in zip(states, ok)]
    out["ttfts"] = [ttft(st) if k else 0.0 for st, k in zip(states, ok)]
    out["itls"] = [tbt(st).tolist() if k else [] for st, k in zip(states, ok)]
    out["latencies"] = [e2e(st) if k else 0.0 for st, k in zip(states, ok)]
    out["start_times"] = [st.req.arrival for st in states]
    out["queue_times"] = queued
    out["generated_texts"] = [o.text for o in outputs]
    out["errors"] = [o.error for o in outputs]
    out["max_output_tokens_per_s"] = peak_tokens_per_s(states)
    out["max_concurrent_requests"] = peak_concurrency(states)
    out["rtfx"] = 0.0  # vLLM's audio real-time factor; no audio here
    if max_concurrency is not None:  # vLLM reports the wait for a free slot under a cap
        q = [t for t, k in zip(queued, ok) if k]
        extra: dict[str, list[float]] = {"client_queue_time": q}
        if request_rate != "inf":
            extra["e2el_including_client_queue"] = [t + _finished_e2e(st) for t, st in zip(q, fin)]
        for m, xs in extra.items():
            out.update(_stats_ms(m, np.asarray(xs, dtype=float)))
    return clean_nan(out)


def _stats_ms(metric: str, v: np.ndarray) -> dict:
    if not len(v):
        return {f"{k}_{metric}_ms": math.nan for k in ("mean", "median", "std", "p90", "p99")}
    return {f"mean_{metric}_ms": float(np.mean(v)) * 1e3, f"median_{metric}_ms": float(np.median(v)) * 1e3,
            f"std_{metric}_ms": float(np.std(v)) * 1e3, f"p90_{metric}_ms": float(np.percentile(v, 90)) * 1e3,
            f"p99_{metric}_ms": float(np.percentile(v, 99)) * 1e3}


def peak_concurrency(states: Sequence[RequestState]) -> int:
    """Most successful requests in flight at once, over [send, last token) (vLLM's sweep)."""
    ev = sorted((t, d) for st in states if st.status is Status.FINISHED
                for t, d in ((st.req.arrival, 1), (st.finish_time, -1)))
    cur = peak = 0
    for _, d in ev:
        cur += d
        peak = max(peak, cur)
    return peak


def peak_tokens_per_s(states: Sequence[RequestState]) -> float:
    """Most output tokens in one whole second counted from the first send of a successful
    request (vLLM's one-second buckets)."""
    fin = [st for st in states if st.status is Status.FINISHED]
    if not fin:
        return 0.0
    t0 = min(st.req.arrival for st in fin)
    times = np.concatenate([st.all_token_times() for st in fin]) - t0
    times = times[times >= 0]
    return float(np.bincount(times.astype(np.int64)).max()) if len(times) else 0.0


def clean_nan(x: Any) -> Any:
    """NaN → None recursively, so the JSON stays strict (as Summary.to_dict does)."""
    if isinstance(x, dict):
        return {k: clean_nan(v) for k, v in x.items()}
    if isinstance(x, list):
        return [clean_nan(v) for v in x]
    if isinstance(x, float) and math.isnan(x):
        return None
    return x


__all__ = ["METRIC_KEYS", "PER_REQUEST_KEYS", "clean_nan", "peak_concurrency", "peak_tokens_per_s",
           "vllm_result"]


def _finished_e2e(st: RequestState) -> float:
    """e2e of a finished request: it emitted at least one token, so the latency exists."""
    v = e2e(st)
    assert v is not None, f"finished request {st.req.id} has no token times"
    return v
