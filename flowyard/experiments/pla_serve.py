"""`flowyard reproduce pla-serve`: PLA-Serve's evaluation (§4: Fig. 6, Fig. 7, Table 2) in the
simulator on simulated H200 with Qwen2.5-14B, on multi-turn conversations built from the bundled
ShareGPT and Azure LLM conversation lengths (`workloads.multi_turn_sessions`), closed-loop
clients (`sim.arrivals.ClosedLoop`) and prefix caching.

- Fig. 6: prefill-stage RPS, mean and P90 TTFT against client concurrency, one and eight
  prefill instances; SGLang-like PD (`distserve`), graphs only, disaggregation only, full PLA.
- Fig. 7: TTFT-SLO (0.4 s) violation rate against concurrency for PD with a round-robin router,
  PD with the load-balancing router, vanilla data parallel and PLA, with real decode.
- Table 2: deadline-free ("distillation") end-to-end time of a fixed set of conversations on
  4P + 4D, PLA in token-max mode against the PD baseline.

The runs live here; the write-up in `pla_serve_report.py`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np

from flowyard.core.request import SLO, Status
from flowyard.experiments.common import Log, Stopwatch, Tally, stderr_log
from flowyard.policies.pla.selector import PLAConfig, is_short, length_model_of
from flowyard.policies.registry import build_policy
from flowyard.policies.baselines.routers import RoundRobinPD
from flowyard.sim.run import SimConfig, build_cost_model, build_simulator, load_workload, policy_options
from flowyard.sim.simulator import SimulationError, Simulator
from flowyard.workloads import Workload, multi_turn_sessions, with_slo

MODEL, HARDWARE = "qwen2.5-14b", "h200"
TTFT_SLO = 0.4  # s, Fig. 7
NO_SPLIT = 1 << 30  # a length boundary no prompt reaches: one queue, every prompt "short"
TURNS_MEAN, MAX_NEW_TOKENS, MAX_CONTEXT = 4.0, 64, 32768
DISTILL_OUTPUT = 1024  # Table 2: 1K decode tokens per reply
#: cluster name -> (prefill instances, decode instances); data parallel gets P + D instances
CLUSTERS = {"1P": (1, 1), "8P": (8, 8)}
#: label -> (registry policy, PLA knobs, global scheduler: "" the policy's own, "rr" round-robin
#: prefill dispatch, "affinity" PLA's session-affine dispatcher (same rule and tolerance as
#: `pla`: a later turn goes back to the instance holding its history unless that is clearly
#: worse) over DistServe's least-queued choice; both decode as DistServe)
Variant = tuple[str, "PLAConfig | None", str]
AFFINE = "affinity"
FIG6: dict[str, Variant] = {
    "SGLang-like PD (distserve)": ("distserve", None, ""),
    "PD + session affinity": ("distserve", None, AFFINE),
    "PLA, graphs only": ("pla", PLAConfig(boundary=NO_SPLIT), ""),
    "PLA, disaggregation only": ("pla", PLAConfig(graphs=False), ""),
    "PLA, full (pla)": ("pla", None, ""),
    "PLA, full spatial (pla-spatial)": ("pla-spatial", None, ""),
}
FIG7: dict[str, Variant] = {
    "PD + round-robin router": ("distserve", None, "rr"),
    "PD + load-balancing router (distserve)": ("distserve", None, ""),
    "PD + session affinity": ("distserve", None, AFFINE),
    "vanilla DP (vllm)": ("vllm", None, ""),
    "DP + least-load router": ("least-load", None, ""),
    "PLA (pla)": ("pla", None, ""),
    "PLA spatial (pla-spatial)": ("pla-spatial", None, ""),
}
DISTILL: dict[str, Variant] = {
    "SGLang-like PD (distserve)": ("distserve", None, ""),
    "PLA deadline-free (pla)": ("pla", PLAConfig(deadline_free=True), ""),
}
BASELINE, FULL_PLA = "SGLang-like PD (distserve)", "PLA, full (pla)"
AFFINE_PD = "PD + session affinity"


@dataclass(frozen=True)
class Settings:
    fig6_requests: dict[str, int]  # per cluster
    fig6_conc: tuple[int, ...]
    fig7_requests: dict[str, int]
    fig7_conc: dict[str, tuple[int, ...]]
    distill_requests: int  # per dataset
    distill_clients: int  # the distillation job's worker pool
    distill_output: int = DISTILL_OUTPUT
    distill_datasets: tuple[str, ...] = ("azure-conv", "sharegpt")
    quick: bool = False


FULL = Settings(fig6_requests={"1P": 1500, "8P": 3000}, fig6_conc=(1, 2, 4, 8, 16, 32, 64),
                fig7_requests={"1P": 1200, "8P": 3000},
                fig7_conc={"1P": (1, 4, 8, 16, 32, 64), "8P": (8, 32, 64, 128, 256)},
                distill_requests=2000, distill_clients=64)
QUICK = Settings(fig6_requests={"1P": 300, "8P": 600}, fig6_conc=(4, 32),
                 fig7_requests={"1P": 300, "8P": 600}, fig7_conc={"1P": (32,), "8P": (64,)},
                 distill_requests=150, distill_clients=16, distill_output=256, quick=True)


@dataclass(frozen=True)
class CLPoint:
    """One closed-loop run. Rates and latencies are over the steady window: from the start until
    the last conversation is handed to a client (after that clients run dry one by one)."""

    rps: float
    ttft_mean: float
    ttft_p90: float
    violation: float  # share of the window's requests with TTFT > TTFT_SLO
    short_mean: float  # TTFT of requests PLA's boundary calls short / long (same split for all)
    short_p90: float
    long_mean: float
    long_p90: float
    hit_rate: float  # prompt tokens found in a prefix cache
    makespan: float  # first send to last finish, whole run
    window: float
    graphed: float = math.nan  # PLA: share of short batches replayed as a captured graph
    depth: float = math.nan  # PLA: mean short-batch depth
    short_tokens: float = math.nan  # prompt tokens computed per short re-prefill (misses recompute history)
    prefill_busy: float = math.nan  # mean busy share of the prefill instances over the makespan
    decode_busy: float = math.nan
    wall_s: float = 0.0
    events: int = 0
    error: str = ""


@dataclass
class Results:
    settings: Settings
    seed: int
    boundary: float  # L_m of a fresh prefill, tokens
    workloads: dict[str, dict[str, float]] = field(default_factory=dict)  # name -> stats
    fig6: dict[str, dict[str, list[tuple[int, CLPoint]]]] = field(default_factory=dict)
    fig7: dict[str, dict[str, list[tuple[int, CLPoint]]]] = field(default_factory=dict)
    distill: dict[str, dict[str, CLPoint]] = field(default_factory=dict)
    wall_s: float = 0.0
    tally: Tally | None = None


def _reply_len(n: int | None, output: int | None, cap: int | None) -> int | None:
    """A reply's length: `output` when set, else `n` capped at `cap` (None: uncapped)."""
    if output is not None:
        return output
    if cap is None:
        return n
    if n is None:
        raise ValueError("output_cap needs requests whose output length the trace gives")
    return min(n, cap)


def conversations(trace: str, n: int, seed: int, *, output: int | None = None, output_cap: int | None = None,
                  ttft: float | None = TTFT_SLO) -> Workload:
    """`n` requests of `trace` chained into sessions (mean 4 turns, follow-ups of at most 64 new
    tokens). `output_cap` caps each reply before the chaining (1: a prefill-stage benchmark whose
    histories hold only the earlier prompts); `output` sets every reply's length instead."""
    w = load_workload(SimConfig(trace=trace, model=MODEL, hardware=HARDWARE, num_requests=n, seed=seed))
    if output is not None or output_cap is not None:
        reqs = [dataclasses.replace(r, output_len=_reply_len(r.output_len, output, output_cap)) for r in w.requests]
        w = w.derive(reqs, normalize_order=False)
    w = multi_turn_sessions(w, turns_mean=TURNS_MEAN, seed=seed, max_new_tokens=MAX_NEW_TOKENS, think_time=0.0,
                            max_prompt_len=MAX_CONTEXT)
    if ttft is None:
        return w.derive([dataclasses.replace(r, slo=SLO()) for r in w.requests], normalize_order=False)
    return with_slo(w, ttft=ttft)


def workload_stats(w: Workload, lengths) -> dict[str, float]:
    new = np.array([r.prompt_len - r.history_len for r in w.requests])
    short = np.array([is_short(r, lengths) for r in w.requests])
    return {"requests": len(w.requests), "sessions": len({r.session for r in w.requests}),
            "prompt_mean": float(np.mean([r.prompt_len for r in w.requests])), "new_mean": float(new.mean()),
            "first_turn_new_mean": float(np.mean([r.prompt_len for r in w.requests if r.turn == 0])),
            "short_share": float(short.mean()), "long_token_share": float(new[~short].sum() / max(1, new.sum())),
            "output_mean": float(np.mean([r.output_len for r in w.requests]))}


class Runner:
    def __init__(self, tally: Tally, log: Log | None) -> None:
        self.cost = build_cost_model(SimConfig(model=MODEL, hardware=HARDWARE))
        self.lengths = length_model_of(self.cost)
        self.tally, self.log = tally, log

    def point(self, w: Workload, v: Variant, prefill: int, decode: int, conc: int, what: str) -> CLPoint:
        name, pla, router = v
        cfg = SimConfig(model=MODEL, hardware=HARDWARE, instances=prefill + decode, prefill_instances=prefill,
                        policy=name, prefix_caching=True, concurrency=conc)
        pol = build_policy(name, policy_options(cfg, self.cost, pla=pla))
        if router == "rr":
            pol.global_scheduler = RoundRobinPD()  # prefill dispatch in turn; decode as distserve
        elif router == AFFINE:  # `pla`'s global scheduler: least-queued + session affinity, DistServe decode
            pol.global_scheduler = build_policy("pla", policy_options(cfg, self.cost)).global_scheduler
        computed: dict[int, int] = {}  # request id -> prompt tokens prefilled (cache hits excluded)

        def trace(_instance, plan, _steps) -> None:
            for s in plan.prefills:
                computed[s.state.id] = computed.get(s.state.id, 0) + s.n

        sim = build_simulator(cfg, w, cost_model=self.cost, policy=pol, on_step=trace)
        try:
            res = sim.run()
        except SimulationError as e:
            self.tally.failures.append(f"{what}, c={conc}: {type(e).__name__}: {e}")
            nan = math.nan
            return CLPoint(nan, nan, nan, nan, nan, nan, nan, nan, nan, nan, nan, error=str(e))
        p = self._measure(res, sim, computed, prefill)
        self.tally.record(what, res.wall_s, None, res.events)  # a failed run is a failure, not a run
        if self.log is not None:
            self.log(f"  {what:<58} c={conc:<4} rps {p.rps:7.2f}  TTFT mean {1e3 * p.ttft_mean:7.1f} ms  "
                     f"p90 {1e3 * p.ttft_p90:7.1f} ms  viol {p.violation:5.1%}  ({res.wall_s:.1f} s)")
        return p

    def _measure(self, res, sim: Simulator, computed: dict[int, int], prefill: int) -> CLPoint:
        states = res.states
        send = np.array([s.req.arrival for s in states])
        t0 = float(send.min())
        starts = [s.req.arrival for s in states if s.req.turn == 0]
        t_end = max(starts) if starts else 0.0
        fin = np.array([s.finish_time if s.status is Status.FINISHED else math.nan for s in states], float)
        makespan = float(np.nanmax(fin) - t0)
        if t_end <= t0:  # every conversation started at once: the whole run is the window
            t_end = float(np.nanmax(fin))
        window = t_end - t0
        ttft = np.array([s.first_token_time - s.req.arrival if s.first_token_time is not None else math.nan
                         for s in states])
        sel = (send <= t_end) & np.isfinite(ttft)
        short = np.array([is_short(s.req, self.lengths) for s in states])
        re_short = [computed.get(s.id, 0) for s, k in zip(states, short) if k and s.req.history_len > 0]
        kv = [i.sched.kv for i in sim.instances]
        queries = sum(getattr(k, "queries", 0) for k in kv)
        parts = [getattr(i.sched, "selector", i.sched) for i in sim.instances]  # PLA: the AWD selector
        stats = [p.stats for p in parts if hasattr(p, "stats") and hasattr(p, "awd")]
        batches = sum(s.short_batches for s in stats)
        busy = res.instance_busy_s  # PD: prefill instances first; colocated: all count as "prefill"

        def mean(x):
            return float(np.mean(x)) if len(x) else math.nan

        def p90(x):
            return float(np.percentile(x, 90)) if len(x) else math.nan

        return CLPoint(
            rps=float(np.sum(fin <= t_end)) / window if window > 0 else math.nan,
            ttft_mean=mean(ttft[sel]), ttft_p90=p90(ttft[sel]), violation=mean(ttft[sel] > TTFT_SLO),
            short_mean=mean(ttft[sel & short]), short_p90=p90(ttft[sel & short]),
            long_mean=mean(ttft[sel & ~short]), long_p90=p90(ttft[sel & ~short]),
            hit_rate=sum(getattr(k, "hits", 0) for k in kv) / queries if queries else math.nan,
            makespan=makespan, window=window,
            graphed=sum(s.graphed for s in stats) / batches if batches else math.nan,
            depth=sum(s.short_requests for s in stats) / batches if batches else math.nan,
            short_tokens=mean(re_short), prefill_busy=mean(busy[:prefill]) / makespan,
            decode_busy=mean(busy[prefill:]) / makespan, wall_s=res.wall_s, events=res.events)


def _sweep(run: Runner, w: Workload, variants: dict[str, Variant], cluster: str, concs,
           tag: str) -> dict[str, list[tuple[int, CLPoint]]]:
    p, d = CLUSTERS[cluster]
    out: dict[str, list[tuple[int, CLPoint]]] = {}
    for label, v in variants.items():
        if (v[0] == "pla-spatial" or v[2] == AFFINE) and p < 2:
            continue  # two pools need two prefill instances; one prefill instance is every turn's home
        out[label] = [(c, run.point(w, v, p, d, c, f"[{tag}] {cluster} {label}")) for c in concs]
    return out


def run_experiments(s: Settings, seed: int, log: Log | None = stderr_log) -> Results:
    clock, tally = Stopwatch(), Tally()
    say = log or (lambda _m: None)
    run = Runner(tally, log)
    res = Results(s, seed, float(run.lengths.prefill_boundary()))
    for cluster in CLUSTERS:  # Fig. 6: ShareGPT, prefill stage (replies of one token)
        # no SLO: the paper sets none for Fig. 6 (its TTFT SLO of 0.4 s is Fig. 7's)
        w = conversations("sharegpt", s.fig6_requests[cluster], seed, output_cap=1, ttft=None)
        res.workloads[f"fig6 {cluster}"] = workload_stats(w, run.lengths)
        say(f"[fig 6] {cluster}: {len(w.requests)} requests")
        res.fig6[cluster] = _sweep(run, w, FIG6, cluster, s.fig6_conc, "fig 6")
    for cluster in CLUSTERS:  # Fig. 7: Azure conversations (the LMSys stand-in) with their replies
        w = conversations("azure-conv", s.fig7_requests[cluster], seed)
        res.workloads[f"fig7 {cluster}"] = workload_stats(w, run.lengths)
        say(f"[fig 7] {cluster}: {len(w.requests)} requests")
        res.fig7[cluster] = _sweep(run, w, FIG7, cluster, s.fig7_conc[cluster], "fig 7")
    for trace in s.distill_datasets:  # Table 2: deadline-free, 4P + 4D
        w = conversations(trace, s.distill_requests, seed, output=s.distill_output, ttft=None)
        res.workloads[f"table2 {trace}"] = workload_stats(w, run.lengths)
        say(f"[table 2] {trace}: {len(w.requests)} requests, {s.distill_clients} clients")
        res.distill[trace] = {label: run.point(w, v, 4, 4, s.distill_clients, f"[table 2] {trace} {label}")
                              for label, v in DISTILL.items()}
    res.wall_s, res.tally = clock.elapsed, tally
    return res

