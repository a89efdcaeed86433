"""The measurement behind `flowyard reproduce dynaserve`: one simulation of a two-instance
cluster at a Poisson rate, reduced to DynaServe's metrics (§6.1, Table 1).

- TBT: every gap between consecutive output tokens of every request. P50/P99 over all gaps;
  token attainment = share of gaps within the 100 ms SLO (Fig. 11's reading of attainment).
- Goodput: output tokens per second of the requests whose own P99 TBT meets the SLO ("useful
  output tokens generated per second under a latency SLO", §2.2).
- Serving capacity: the highest rate whose P99 TBT meets the SLO while the cluster keeps up,
  i.e. the median scheduling delay stays within 2 s: Sarathi-Serve's definition, which the
  paper follows. A request's scheduling delay is its TTFT minus its prompt's prefill time
  alone on one instance, plus its longest output stall beyond the TBT SLO: a disaggregated
  request that waits seconds for a decode slot after its first token is queued too, though
  that one gap is under 1 % of a long output's gaps and so never reaches the P99 TBT.
- Saturation (Table 1's operating point): the highest rate whose median delay stays within
  2 s, whatever the TBT.
- MFU: model FLOPs of the tokens each instance computed (`ModelSpec.flops`) over its peak
  FLOPs (TP GPUs) times the makespan; HBM use: mean share of its KV cache in use.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from flowyard.core.metrics import tbt, ttft
from flowyard.costmodel.hardware import get_hardware
from flowyard.costmodel.models import get_model
from flowyard.experiments.common import Tally
from flowyard.policies.dynaserve.split import DynaServeConfig
from flowyard.policies.registry import build_policy
from flowyard.sim.run import SimConfig, build_cost_model, build_simulator, policy_options
from flowyard.sim.simulator import SimulationError, Simulator
from flowyard.workloads import Workload

HARDWARE, TBT_SLO, MAX_DELAY = "a100-80g", 0.1, 2.0

#: system label -> (policy, colocation chunk size or None)
COLOC, DISAGG, DYNA = "PD Coloc.", "PD Disagg.", "DynaServe"


@dataclass(frozen=True, slots=True)
class DSPoint:
    """One run's numbers; NaN everywhere (and `error`) when the run did not finish."""

    rate: float
    rps: float
    out_tps: float
    goodput_tps: float
    tbt_p50: float
    tbt_p99: float
    token_attainment: float
    request_attainment: float
    delay_p50: float  # median scheduling delay (s)
    mfu: tuple[float, ...]
    hbm: tuple[float, ...]
    kv_exposed_ms: float  # mean KV transfer time not hidden behind compute, per hand-off
    split_share: float  # requests run on two instances
    wall_s: float
    events: int
    error: str = ""
    tbt_cdf: tuple[float, ...] = ()  # TBT (s) at percentiles 0, 1, ..., 100 of all gaps (when asked for)

    @property
    def sustainable(self) -> bool:
        return self.tbt_p99 <= TBT_SLO + 1e-9 and self.delay_p50 <= MAX_DELAY

    @property
    def saturation_score(self) -> float:
        """>= 1 exactly when the cluster keeps up (a search target for the saturation rate)."""
        return 0.0 if math.isnan(self.delay_p50) else MAX_DELAY / max(self.delay_p50, 1e-9)

    @property
    def capacity_score(self) -> float:
        """>= 1 exactly when the point meets the serving-capacity conditions (a search target)."""
        if math.isnan(self.tbt_p99):
            return 0.0
        return min(TBT_SLO / max(self.tbt_p99, 1e-9), MAX_DELAY / max(self.delay_p50, 1e-9))


def _nan_point(rate: float, error: str) -> DSPoint:
    n = math.nan
    return DSPoint(rate, n, n, n, n, n, n, n, n, (), (), n, n, 0.0, 0, error)


class Cluster:
    """Two instances of `model` at TP `tp` on simulated A100-80G: the paper's 14B/32B/72B
    deployments (§6.1: DP2 colocation, 1P1D disaggregation, a DynaServe pair, each instance
    a TP group of 1, 2 or 4 GPUs). Memoises points by (system, variant, workload key, rate)."""

    def __init__(self, model: str, tp: int, log: Callable[[str], None] | None = None,
                 tally: Tally | None = None) -> None:
        self.model, self.tp, self.log = model, tp, log
        self.tally = tally if tally is not None else Tally()
        self.cost = build_cost_model(SimConfig(model=model, hardware=HARDWARE, tp=tp))
        self.spec = get_model(model)
        self.peak = get_hardware(HARDWARE).peak_flops * tp
        self._cache: dict[tuple, DSPoint] = {}

    def _simulator(self, system: str, chunk: int | None, ds: DynaServeConfig | None, w: Workload) -> Simulator:
        cfg = SimConfig(model=self.model, hardware=HARDWARE, tp=self.tp, instances=2, prefill_instances=1,
                        chunk_size=chunk, policy={COLOC: "vllm", DISAGG: "distserve", DYNA: "dynaserve"}[system])
        policy = build_policy(cfg.policy, policy_options(cfg, self.cost, dynaserve=ds))
        return build_simulator(cfg, w, cost_model=self.cost, policy=policy)

    def point(self, system: str, key: str, rate: float, make: Callable[[float], Workload], *,
              chunk: int | None = None, ds: DynaServeConfig | None = None, cdf: bool = False) -> DSPoint:
        """`make(rate)` builds the workload (memoised by `key` and rate); `cdf` keeps the TBT
        distribution's percentiles (Fig. 11)."""
        ck = (system, chunk, ds, key, round(rate, 9), cdf)
        if ck in self._cache:
            return self._cache[ck]
        w = make(rate)
        sim = self._simulator(system, chunk, ds, w)
        try:
            res = sim.run()
        except SimulationError as e:
            p = _nan_point(rate, f"{type(e).__name__}: {e}")
        else:
            p = self._reduce(rate, res, sim, cdf)
        self.tally.record(f"{self.model} TP{self.tp}, {system}, {key} at {rate:.3f} req/s", p.wall_s, p.error, p.events)
        if self.log is not None:
            self.log(f"  {self.model:>12} TP{self.tp} {system + (f' c{chunk}' if chunk else ''):>16} {key:>22} "
                     f"rate {rate:7.3f}  P99 TBT {p.tbt_p99 * 1e3:6.1f} ms  goodput {p.goodput_tps:8.1f} tok/s "
                     f"({p.wall_s:.2f} s)")
        self._cache[ck] = p
        return p

    def _reduce(self, rate: float, res, sim: Simulator, cdf: bool = False) -> DSPoint:
        states = res.states
        makespan = max(res.sim_time, 1e-9)
        gaps_each = [tbt(s) for s in states]
        gaps = np.concatenate(gaps_each) if gaps_each else np.empty(0)
        ok = [len(g) == 0 or np.percentile(g, 99) <= TBT_SLO + 1e-9 for g in gaps_each]  # own P99 TBT
        good = sum(s.num_output for s, met in zip(states, ok) if met)
        firsts = [(ttft(s), s, g) for s, g in zip(states, gaps_each)]
        delay = [t - self.cost.prefill_time(s.req.prompt_len) + (max(0.0, float(g.max()) - TBT_SLO)
                                                                   if len(g) else 0.0)
                 for t, s, g in firsts if t is not None]
        mfu = tuple(self.spec.flops(w.prefill_tokens + w.decode_tokens, w.attn_pairs, w.decode_tokens)
                    / (self.peak * makespan) for w in res.instance_work)
        hbm = tuple(w.kv_usage(makespan) for w in res.instance_work)
        exposed = sim.kv_exposed
        pct = (lambda q: float(np.percentile(gaps, q))) if len(gaps) else (lambda q: math.nan)
        return DSPoint(
            rate=rate, rps=len(states) / makespan, out_tps=sum(s.num_output for s in states) / makespan,
            goodput_tps=good / makespan, tbt_p50=pct(50), tbt_p99=pct(99),
            token_attainment=float(np.mean(gaps <= TBT_SLO + 1e-9)) if len(gaps) else math.nan,
            request_attainment=float(np.mean(ok)), delay_p50=float(np.median(delay)) if delay else math.nan,
            mfu=mfu, hbm=hbm, kv_exposed_ms=float(np.mean(exposed)) * 1e3 if exposed else math.nan,
            split_share=float(np.mean([s.prefill_instance is not None and s.prefill_instance != s.instance
                                       for s in states])),
            wall_s=res.wall_s, events=res.events,
            tbt_cdf=tuple(np.percentile(gaps, np.arange(101)).tolist()) if cdf and len(gaps) else ())
