"""`flowyard reproduce flowyard`: the composed policy against every design and baseline (issue 16).

Cluster: Qwen2.5-32B on 8 simulated H800, four instances at TP2; the PD policies split 2P2D.
(Arrow's own setting, Llama-3.1-8B on eight TP1 instances, needs ~4× the requests per run to
leave the burst-absorbing regime, which does not fit 20 minutes on 2 cores.) Eight workloads, each under three SLO settings:

- **tight TPOT**: the workload's TTFT SLO and TPOT 25 ms (decodes cannot share a step with a
  long prefill chunk);
- **loose TPOT**: the workload's TTFT SLO and TPOT 200 ms (colocation's home ground);
- **TTFT by length**: TTFT 0.5 s for prompts under 1,024 tokens, 2 s up to 4,096, 6 s above;
  TPOT 100 ms (FlowPrefill's heterogeneous SLOs on any trace).

Metric: goodput, the highest request rate with SLO attainment (TTFT and TPOT both met) of at
least 90 % (`threshold_search` around a grid, rates by Arrow's method: timestamps × 1/scale).
Ablations pin or remove one part of `flowyard` at a time on a few rows. The write-up is in
`flowyard_suite_report.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from flowyard.core.metrics import summarize
from flowyard.costmodel.base import CostModel
from flowyard.experiments.common import Log, Stopwatch, Tally, Threshold, stderr_log, threshold_search
from flowyard.policies.flowyard.router import FlowyardConfig
from flowyard.sim.run import SimConfig, build_cost_model, build_simulator, load_workload, policy_options
from flowyard.sim.simulator import SimulationError
from flowyard.sweep import current, digest
from flowyard.workloads import (Workload, clip, load_trace, mix, multi_turn_sessions, reasoning_like,
                                slo_by_length, with_slo)

MODEL, HARDWARE, TP, INSTANCES, TARGET = "qwen2.5-32b", "h800", 2, 4, 0.9
FLOWYARD = "flowyard"
#: every other policy of the registry that is not an ablation of another (arrow-minload,
#: arrow-rr, dynaserve-oracle, distserve-cp8k, pla-spatial and round-robin are left out to
#: keep the full run within 20 minutes on 2 cores)
OTHERS: tuple[str, ...] = ("vllm", "least-load", "distserve", "distserve-cp2k", "flowprefill", "pla", "pla-mix",
                           "arrow", "dynaserve")


@dataclass(frozen=True)
class SLOSetting:
    key: str
    label: str
    tpot: float
    by_length: str | None = None  # TTFT SLO by prompt length; None: the workload's own TTFT


SLO_SETTINGS: dict[str, SLOSetting] = {
    "tight": SLOSetting("tight", "tight TPOT (25 ms)", 0.025),
    "loose": SLOSetting("loose", "loose TPOT (200 ms)", 0.2),
    "bylen": SLOSetting("bylen", "TTFT by length (0.5/2/6 s)", 0.1, "0:0.5,1024:2,4096:6"),
}


@dataclass(frozen=True)
class WorkloadSpec:
    key: str
    label: str
    ttft: float  # the workload's TTFT SLO (s) under the tight and loose settings
    grid: tuple[float, ...]  # request rates (req/s) the search starts from
    why: str = ""
    prefix_caching: bool = False
    max_n: int | None = None  # requests a run may hold, instead of the settings' max_n (synthetic workloads)


WORKLOADS: dict[str, WorkloadSpec] = {w.key: w for w in (
    WorkloadSpec("azure-code", "Azure Code", 3.0, (2, 8), "the trace's first requests, its bursts kept"),
    WorkloadSpec("azure-conv", "Azure Conv", 2.0, (8, 32), "the trace's first requests"),
    WorkloadSpec("burstgpt", "BurstGPT", 0.25, (2, 8), "all 399 public rows (its TTFT SLO is 250 ms)"),
    WorkloadSpec("mooncake-conv", "Mooncake conv", 30.0, (0.5, 2), "the trace's first requests (long prompts)"),
    WorkloadSpec("sharegpt-sessions", "ShareGPT sessions", 2.0, (2, 8),
                 "ShareGPT lengths chained into sessions (mean 4 turns, follow-ups ≤ 64 new tokens, 5 s think "
                 "time), prefix caching on", prefix_caching=True),
    WorkloadSpec("arxiv", "arXiv", 3.0, (4, 16), "arXiv summarisation lengths, Poisson arrivals (long prompts)"),
    WorkloadSpec("reasoning", "Reasoning (long output)", 3.0, (4, 16),
                 "DynaServe's Mini Reasoning shape (P219/D1467, gamma), Poisson arrivals; up to 4,000 requests a run "
                 "(700, the trace rows' cap, fit in the cluster's 1,024 sequence slots at any rate)", max_n=4000),
    WorkloadSpec("hybrid", "Hybrid code+conv+Mooncake", 3.0, (1, 4),
                 "a uniform mix of Azure Code, Azure Conv and Mooncake conv lengths, Poisson arrivals"),
)}

#: label -> FlowyardConfig changes: each pins or removes one part
ABLATIONS: dict[str, dict] = {
    "pinned colocated": {"mode": "colocated"},
    "pinned disaggregated (Arrow pools)": {"mode": "disaggregated"},
    "fixed half/half split instead of priced pools": {"elastic": False},
    "prefill pool shrinks under a backlog": {"shrink_backlog": None},
    "Arrow's SLO-aware flips and monitor on": {"pools": "slo"},
    "FCFS instead of S-EDF": {"order": "fcfs"},
    "S-EDF without Moore-Hodgson shedding": {"shed": False},
    "shedding times prompts alone, not beside the decodes": {"shed_rate": "alone"},
    "a prompt's chunk preempts for KV (vLLM)": {"prefill_preempts": True},
    "dispatch by the whole queue, not the work S-EDF ranks ahead": {"delay_ahead": False},
    "fixed chunk instead of TBT budgets": {"tbt_budget": False},
    "per-step TBT budgets (no banked TPOT slack)": {"slack": False},
    "no TTFT rescue": {"rescue": None},
    "no session affinity": {"affinity": None},
    "no prefill-ahead admission (parking)": {"park": 1.0},
    "decode places first come, first served (not by banked TPOT slack)": {"places": "fcfs"},
}


@dataclass(frozen=True)
class Settings:
    duration: float  # seconds of arrivals per run: a run holds rate x duration requests ...
    min_n: int  # ... but at least this many
    max_n: int  # ... and at most this many (the first of the workload's window)
    workloads: tuple[str, ...]
    slos: tuple[str, ...]
    others: tuple[str, ...]
    ablation_rows: tuple[tuple[str, str], ...]  # (workload, slo) rows with ablations
    tol: float
    extend: int = 3
    quick: bool = False


FULL = Settings(duration=60.0, min_n=200, max_n=700, workloads=tuple(WORKLOADS), slos=tuple(SLO_SETTINGS), others=OTHERS,
                ablation_rows=(("hybrid", "tight"), ("hybrid", "loose"), ("hybrid", "bylen"), ("azure-code", "tight"),
                               ("burstgpt", "tight"), ("sharegpt-sessions", "loose"), ("mooncake-conv", "tight"),
                               ("mooncake-conv", "loose"), ("reasoning", "loose"), ("reasoning", "bylen"),
                               ("azure-conv", "bylen")),
                tol=0.05)
QUICK = Settings(duration=8.0, min_n=60, max_n=150, workloads=("azure-code", "hybrid"), slos=("tight", "bylen"),
                 others=("vllm", "distserve", "arrow"), ablation_rows=(("hybrid", "bylen"),), tol=0.3, extend=2,
                 quick=True)


def base_workload(key: str, n: int, seed: int) -> Workload:
    """The unscaled workload `key` of n requests, without SLOs."""
    if key in ("azure-code", "azure-conv", "burstgpt", "mooncake-conv"):
        return clip(load_workload(SimConfig(trace=key, seed=seed)), max_requests=n)
    if key == "sharegpt-sessions":
        w = load_trace("sharegpt", rate=1.0, seed=seed, num_requests=n)
        return multi_turn_sessions(w, turns_mean=4, max_new_tokens=64, think_time=5.0, seed=seed)
    if key == "arxiv":
        return load_trace("arxiv", rate=1.0, seed=seed, num_requests=n)
    if key == "reasoning":
        return reasoning_like(n, rate=1.0, seed=seed)
    if key == "hybrid":
        src = [load_workload(SimConfig(trace=t, seed=seed)) for t in ("azure-code", "azure-conv", "mooncake-conv")]
        return mix(src, n, rate=1.0, seed=seed, name="hybrid")
    raise ValueError(f"unknown workload {key!r}")


def with_setting(w: Workload, spec: WorkloadSpec, slo: SLOSetting) -> Workload:
    if slo.by_length is not None:
        return with_slo(slo_by_length(w, slo.by_length), tpot=slo.tpot)
    return with_slo(w, ttft=spec.ttft, tpot=slo.tpot)


@dataclass(frozen=True, slots=True)
class FPoint:
    attainment: float
    throughput_rps: float
    ttft_p90: float
    tpot_p90: float
    switches: int  # flowyard: regime switches
    disaggregated_s: float  # flowyard: seconds spent in the disaggregated regime
    wall_s: float
    error: str = ""


@dataclass
class Search:
    goodput: Threshold
    points: dict[float, FPoint]


@dataclass
class Row:
    workload: str
    slo: str
    requests: int
    base_rate: float
    searches: dict[str, Search]  # policy -> search
    ablations: dict[str, Search] = field(default_factory=dict)


@dataclass
class Results:
    settings: Settings
    seed: int
    rows: list[Row]
    wall_s: float = 0.0
    tally: Tally | None = None


def run_fpoint(cfg: SimConfig, w: Workload, cost: CostModel, knobs: dict | None) -> "FPoint":
    """One simulation of the suite (module level: a parallel sweep runs it in a worker)."""
    from flowyard.policies.registry import build_policy

    extra = {} if knobs is None else {"flowyard": FlowyardConfig(**knobs)}
    policy_obj = build_policy(cfg.policy, policy_options(cfg, cost, **extra))
    sim = build_simulator(cfg, w, cost_model=cost, policy=policy_obj)
    try:
        res = sim.run()
    except SimulationError as e:
        nan = math.nan
        return FPoint(nan, nan, nan, nan, 0, 0.0, 0.0, error=f"{type(e).__name__}: {e}")
    s = summarize(res.states, policy=cfg.policy, wall_s=res.wall_s)
    router = getattr(policy_obj.global_scheduler, "dispatcher", None)
    switches, dis = _regime_time(router, s.duration_s, min(st.req.arrival for st in res.states))
    return FPoint(s.slo_attainment, s.throughput_rps, s.ttft["p90"], s.tpot["p90"], switches, float(dis), res.wall_s)


class Row_:
    """One (workload, SLO) row: its cluster, workload and memoised points."""

    def __init__(self, spec: WorkloadSpec, w: Workload, cost: CostModel, seed: int, tally: Tally,
                 log: Log | None, name: str, s: Settings) -> None:
        self.spec, self.w, self.cost, self.seed, self.tally, self.log, self.name = spec, w, cost, seed, tally, log, name
        self.settings = s
        self._windows: dict[int, Workload] = {}
        t = w.arrivals()
        self.base_rate = (len(t) - 1) / (t[-1] - t[0]) if len(t) > 1 and t[-1] > t[0] else 1.0
        self._cache: dict[tuple, FPoint] = {}

    def point(self, policy: str, rate: float, knobs: dict | None = None, label: str | None = None) -> FPoint:
        key = (policy, round(rate, 9), tuple(sorted((knobs or {}).items())))
        if key in self._cache:
            return self._cache[key]
        if math.isnan(rate):
            current().blocked()  # asked at a stand-in of a pending search
        cfg = SimConfig(trace=self.spec.key, model=MODEL, hardware=HARDWARE, tp=TP, instances=INSTANCES, policy=policy,
                        rate_scale=rate / self.base_rate, seed=self.seed, prefix_caching=self.spec.prefix_caching)
        w = self.window(rate)
        p = current().value(("flowyard_point", cfg.as_dict(), repr(knobs), digest(w), repr(self.cost)),
                            run_fpoint, cfg, w, self.cost, knobs)
        self.tally.record(f"{self.name}, {label or policy}, {rate:.3f} req/s", p.wall_s, p.error)
        if self.log is not None:
            self.log(f"  {self.name:>34} {label or policy:>36}  rate {rate:8.3f}  attainment {p.attainment:6.1%}"
                     f"  ({p.wall_s:.2f} s)")
        self._cache[key] = p
        return p

    def n_of(self, rate: float) -> int:
        """Requests in a run at `rate`: rate x duration, clamped, so an overloaded run is long
        enough for its queues to show (a short burst is absorbed by 8 instances)."""
        s = self.settings
        return int(min(max_requests(self.spec, s), len(self.w.requests), max(s.min_n, round(rate * s.duration))))

    def window(self, rate: float) -> Workload:
        n = self.n_of(rate)
        if n not in self._windows:
            self._windows[n] = clip(self.w, max_requests=n)
        return self._windows[n]

    def search(self, policy: str, s: Settings, knobs: dict | None = None, label: str | None = None) -> Search:
        def run() -> Search:
            t = threshold_search(lambda r: self.point(policy, r, knobs, label).attainment, self.spec.grid, TARGET,
                                 find="max", tol=s.tol, extend=s.extend)
            return Search(t, {x: self.point(policy, x, knobs, label) for x, _ in t.curve})

        return current().attempt(run, Search(Threshold(math.nan), {}))  # a stand-in while runs are pending


def max_requests(spec: WorkloadSpec, s: Settings) -> int:
    """Most requests a run of this workload holds: its own cap, if it has one, outside quick runs."""
    return spec.max_n if spec.max_n is not None and not s.quick else s.max_n


def _regime_time(router, duration: float, start: float) -> tuple[int, float]:
    """flowyard's regime switches and the seconds it spent disaggregated (0, 0 for others)."""
    switches = getattr(router, "switches", None)
    if switches is None:
        return 0, 0.0
    regime = "disaggregated" if router.cfg.mode == "disaggregated" else "colocated"
    t0, dis = start, 0.0
    for t, to in switches:
        if regime == "disaggregated":
            dis += t - t0
        regime, t0 = to, t
    if regime == "disaggregated":
        dis += max(0.0, start + duration - t0)
    return len(switches), dis


def run_experiments(s: Settings, seed: int, log: Log | None = stderr_log) -> Results:
    clock, tally = Stopwatch(), Tally()
    say = log or (lambda _m: None)
    cost = build_cost_model(SimConfig(model=MODEL, hardware=HARDWARE, tp=TP))
    res = Results(s, seed, [])
    for wk in s.workloads:
        spec = WORKLOADS[wk]
        base = base_workload(wk, max_requests(spec, s), seed)
        for sk in s.slos:
            slo = SLO_SETTINGS[sk]
            w = with_setting(base, spec, slo)
            row = Row_(spec, w, cost, seed, tally, log, f"{spec.label} / {sk}", s)
            say(f"[{spec.label} / {slo.label}] {len(w)} requests at {row.base_rate:.3g} req/s unscaled")
            searches = {p: row.search(p, s) for p in (FLOWYARD, *s.others)}
            r = Row(wk, sk, len(w), row.base_rate, searches)
            if (wk, sk) in s.ablation_rows:
                r.ablations = {label: row.search(FLOWYARD, s, knobs, label) for label, knobs in ABLATIONS.items()}
            res.rows.append(r)
    res.wall_s, res.tally = clock.elapsed, tally
    return res


# -- derived numbers (the report reads only these) ---------------------------------------------
def best_other(row: Row) -> tuple[str, float]:
    """The other policy with the highest goodput on the row (ties: the first listed)."""
    others = [(p, sr.goodput.value) for p, sr in row.searches.items() if p != FLOWYARD]
    return max(others, key=lambda x: x[1]) if others else ("", math.nan)


def ratio_to_best(row: Row) -> float:
    """flowyard's goodput over the best other policy's: NaN when either never met the target."""
    _, b = best_other(row)
    f = row.searches[FLOWYARD].goodput.value
    if not (b > 0 and math.isfinite(b) and f > 0 and math.isfinite(f)):
        return math.nan
    return f / b


def target_of(row: Row) -> float:
    """The issue's target on this row: 1.2× on the hybrid and the length-dependent-SLO rows,
    0.97× elsewhere."""
    return 1.2 if row.workload == "hybrid" or row.slo == "bylen" else 0.97


