"""Serving metrics: per-request latencies, run summaries, goodput and serving-capacity search.

Definitions (DESIGN.md, "Workloads and metrics"), all in seconds:
  TTFT = first token - arrival; TPOT = (last - first) / (n - 1), undefined for n == 1;
  TBT  = every gap between consecutive output tokens (ITL is the same set, vLLM's name);
  E2E  = last token - arrival.
Percentiles use numpy's default (linear interpolation between order statistics), so they
match `np.percentile` on the same samples. Latency statistics cover completed requests only
(as `vllm bench serve` does); SLO attainment counts every request, rejected ones included.

SLO comparisons allow EPS (1 ns) of slack so that a latency exactly at its objective meets it
even after float rounding (e.g. 0.3 - 0.1 > 0.2 in binary floating point).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Iterable, Sequence

import numpy as np

from flowyard.core.request import RequestState, Status
from flowyard.core.exact_stats import percentiles
from flowyard.core.token_spans import TokenSpans, token_spans

EPS = 1e-9
PERCENTILES = {"p50": 50.0, "p90": 90.0, "p99": 99.0}


# ---------------------------------------------------------------- per request

def ttft(state: RequestState) -> float | None:
    """Time to first token, or None when no token was emitted."""
    if state.first_token_time is None:
        return None
    return state.first_token_time - state.req.arrival


def tpot(state: RequestState) -> float | None:
    """Mean time per output token after the first; None with fewer than two tokens."""
    t = state.all_token_times()
    if len(t) < 2:
        return None
    return float(t[-1] - t[0]) / (len(t) - 1)


def tbt(state: RequestState) -> np.ndarray:
    """Every gap between consecutive output tokens (empty with fewer than two tokens)."""
    return np.diff(state.all_token_times())


def e2e(state: RequestState) -> float | None:
    """Last token - arrival; None when no token was emitted."""
    t = state.all_token_times()
    if len(t) == 0:
        return None
    return float(t[-1]) - state.req.arrival


def meets_slo(state: RequestState) -> bool:
    """Whether the request finished and met every SLO it carries.

    Rejected, aborted and unfinished requests never meet it; neither does a finished request
    with no recorded token (nothing shows it was served). A finished request that carries no
    SLO counts as meeting it, so attainment of an SLO-free workload is its completion rate.
    TPOT and TBT objectives hold vacuously for a single-token output.
    """
    if state.status is not Status.FINISHED:
        return False
    t = state.all_token_times()
    if len(t) == 0:
        return False
    slo = state.req.slo
    if slo.ttft is not None and t[0] - state.req.arrival > slo.ttft + EPS:
        return False
    if len(t) >= 2:
        if slo.tpot is not None and (t[-1] - t[0]) / (len(t) - 1) > slo.tpot + EPS:
            return False
        if slo.tbt is not None and np.diff(t).max() > slo.tbt + EPS:
            return False
    return True


# ---------------------------------------------------------------- summary

def stats(values: np.ndarray, *, scratch: bool = False) -> dict[str, float]:
    """{mean, p50, p90, p99} of `values`; NaN everywhere when there are none.
    scratch=True lets numpy partition `values` in place (saves a copy of millions of gaps)."""
    if len(values) == 0:
        return {"mean": math.nan, **{k: math.nan for k in PERCENTILES}}
    mean = float(np.mean(values))
    pct = np.percentile(values, list(PERCENTILES.values()), overwrite_input=scratch)
    return {"mean": mean, **{k: float(v) for k, v in zip(PERCENTILES, pct)}}


def streamed_stats(spans: TokenSpans) -> dict[str, float]:
    """`stats` of every gap of `spans`, the same floats, without holding all the gaps at once
    (`exact_stats`: numpy's pairwise sum and percentile, replayed over batches of gaps)."""
    n = spans.n_gaps
    if spans.kept is not None:  # few enough to be kept: numpy on the array itself
        return stats(spans.kept, scratch=True)
    if n == 0:
        return stats(np.empty(0))
    pct = percentiles(spans.gap_batches, n, list(PERCENTILES.values()))
    return {"mean": float(np.float64(spans.gap_sum) / n), **{k: float(v) for k, v in zip(PERCENTILES, pct)}}


@dataclass(slots=True)
class Summary:
    """One run's results. Latency dicts hold seconds; NaN means no sample (None in JSON)."""

    policy: str = ""
    requests: int = 0
    completed: int = 0
    rejected: int = 0
    aborted: int = 0
    duration_s: float = 0.0
    input_tokens: int = 0
    output_tokens: int = 0
    ttft: dict[str, float] = field(default_factory=lambda: stats(np.empty(0)))
    tpot: dict[str, float] = field(default_factory=lambda: stats(np.empty(0)))
    e2e: dict[str, float] = field(default_factory=lambda: stats(np.empty(0)))
    tbt: dict[str, float] = field(default_factory=lambda: stats(np.empty(0)))
    itl: dict[str, float] = field(default_factory=lambda: stats(np.empty(0)))
    slo_attainment: float = 0.0
    throughput_rps: float = 0.0
    output_tokens_per_s: float = 0.0
    token_goodput: float = 0.0
    wall_s: float = 0.0

    def to_dict(self) -> dict:
        """JSON-ready dict (DESIGN.md `--json` keys); NaN becomes None so the JSON is strict."""
        return nan_to_none(asdict(self))


def nan_to_none(x):
    if isinstance(x, dict):
        return {k: nan_to_none(v) for k, v in x.items()}
    if isinstance(x, float) and math.isnan(x):
        return None
    return x


def summarize(states: Sequence[RequestState], *, duration: float | None = None,
              policy: str = "", wall_s: float = 0.0) -> Summary:
    """Summarise a run. Vectorised: concatenations of completed requests' token chunks (a
    batch of requests at a time, `token_spans`), then per-request first/last/max-gap by index
    arithmetic, so ~80k requests with millions of tokens take a fraction of a second (no
    per-token Python).

    duration defaults to last finish (finish_time, else last token) - first arrival; rates
    are 0 when it is not positive.
    """
    n_req = len(states)
    rejected = aborted = 0
    chunks: list[np.ndarray] = []
    nchunks: list[int] = []
    arrival: list[float] = []
    slo_ttft: list[float] = []
    slo_tpot: list[float] = []
    slo_tbt: list[float] = []
    prompt: list[int] = []
    finish: list[float] = []
    first_arrival = math.inf
    FIN, REJ, ABO, nan = Status.FINISHED, Status.REJECTED, Status.ABORTED, math.nan
    for s in states:
        req = s.req
        if req.arrival < first_arrival:
            first_arrival = req.arrival
        st = s.status
        if st is not FIN:
            if st is REJ:
                rejected += 1
            elif st is ABO:
                aborted += 1
            continue
        tt = s.token_times
        chunks.extend(tt)
        nchunks.append(len(tt))
        arrival.append(req.arrival)
        slo = req.slo
        v = slo.ttft
        slo_ttft.append(nan if v is None else v)
        v = slo.tpot
        slo_tpot.append(nan if v is None else v)
        v = slo.tbt
        slo_tbt.append(nan if v is None else v)
        prompt.append(req.prompt_len)
        v = s.finish_time
        finish.append(nan if v is None else v)

    out = Summary(policy=policy, requests=n_req, completed=len(arrival), rejected=rejected,
                  aborted=aborted, wall_s=wall_s, input_tokens=int(sum(prompt)))
    if not arrival:
        out.duration_s = duration if duration is not None else 0.0
        return out

    # per-request first/last token, count and largest gap, and the gaps' sum, a batch of
    # requests at a time (`token_spans`: the gaps are never all held at once)
    spans = token_spans(chunks, nchunks)
    del chunks
    first, last, n, max_gap = spans.first, spans.last, spans.n, spans.max_gap
    has, multi = n > 0, n >= 2
    arr = np.asarray(arrival)
    tpot_v = np.where(multi, (last - first) / np.maximum(n - 1, 1), np.nan)
    ttft_v = first - arr

    def ok(value: np.ndarray, limit: list[float], vacuous: np.ndarray) -> np.ndarray:
        lim = np.asarray(limit)
        return np.isnan(lim) | vacuous | (value <= lim + EPS)

    meets = has & ok(ttft_v, slo_ttft, ~has) & ok(tpot_v, slo_tpot, ~multi) \
        & ok(max_gap, slo_tbt, ~multi)

    fin = np.asarray(finish)
    fin = np.where(np.isnan(fin), last, fin)
    fin = fin[~np.isnan(fin)]
    if duration is None:
        duration = float(fin.max()) - first_arrival if len(fin) else 0.0
    out.duration_s = duration
    out.output_tokens = int(n.sum())
    out.ttft = stats(ttft_v[has])
    out.tpot = stats(tpot_v[multi])
    out.e2e = stats((last - arr)[has])
    out.tbt = streamed_stats(spans)
    out.itl = dict(out.tbt)
    out.slo_attainment = float(meets.sum()) / n_req
    if duration > 0:
        out.throughput_rps = len(arrival) / duration
        out.output_tokens_per_s = out.output_tokens / duration
        out.token_goodput = float(n[meets].sum()) / duration
    return out


def ttft_values(states: Iterable[RequestState]) -> np.ndarray:
    """TTFTs of completed requests that emitted a token (for CDF plots)."""
    return np.array([s.first_token_time - s.req.arrival for s in states
                     if s.status is Status.FINISHED and s.first_token_time is not None])
