"""`flowyard reproduce arrow`: Arrow's evaluation (§7, Table 1, Figs. 7-9) in the simulator:
Llama-3.1-8B on 8 simulated H800, the four Table 1 workloads with their SLOs, rates set by
Arrow's method (trace timestamps × 1/scale).

Systems (8 GPUs each): Arrow (`arrow`, 8 stateless TP1 instances, starting 4P4D), vLLM
colocated as the paper ran it (`vllm`, one TP8 instance) and as users deploy an 8B model on 8
GPUs (`vllm`, 8 data-parallel TP1 instances behind vLLM's DP balancer), vLLM-disaggregated (`distserve` 1P1D at TP4) and
DistServe (`distserve` 4P4D at TP1). Metric: SLO attainment (TTFT and TPOT both met); the
goodput is the highest rate with attainment >= 90 % (`threshold_search` around a plotted grid).
Also: P90 TTFT and TPOT per rate, the Fig. 8 ablation (arrow vs arrow-minload vs arrow-rr) and
Fig. 9's scalability (4/8/16 instances). The write-up is in `arrow_report.py`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from flowyard.core.metrics import meets_slo, summarize, tpot, ttft
from flowyard.costmodel.base import CostModel
from flowyard.experiments.common import (
    Log,
    Scenario,
    Stopwatch,
    Tally,
    Threshold,
    stderr_log,
    threshold_search,
)
from flowyard.policies.arrow.pools import PREFILL_SIDE, Pool
from flowyard.sim.run import SimConfig, build_cost_model, build_simulator, load_workload
from flowyard.sim.simulator import SimulationError
from flowyard.sweep import current, digest
from flowyard.workloads import Workload, clip

MODEL, HARDWARE, TARGET = "llama-3.1-8b", "h800", 0.9
#: label -> (policy, instances, TP, prefill instances) on 8 GPUs (§7.1)
SYSTEMS: dict[str, tuple[str, int, int, int | None]] = {
    "Arrow": ("arrow", 8, 1, None),
    "vLLM (TP8)": ("vllm", 1, 8, None),
    "vLLM DP8 (8× TP1)": ("vllm", 8, 1, None),
    "vLLM-disagg. 1P1D (TP4)": ("distserve", 2, 4, 1),
    "DistServe 4P4D": ("distserve", 8, 1, 4),
}
ARROW, VLLM, DISAGG = "Arrow", "vLLM (TP8)", "vLLM-disagg. 1P1D (TP4)"
VLLM_DP = "vLLM DP8 (8× TP1)"
#: Fig. 8: label -> policy, all on 8 TP1 instances (the static ones split 4P4D)
ABLATION: dict[str, str] = {"SLO-aware (arrow)": "arrow", "Minimal load": "arrow-minload",
                            "Round robin": "arrow-rr"}
SCALE_POLICIES: dict[str, str] = {"SLO-aware (arrow)": "arrow", "Minimal load": "arrow-minload"}


@dataclass(frozen=True)
class WorkloadSpec:
    trace: str
    label: str
    start: float  # trace window, seconds of trace time (before rate scaling)
    duration: float | None  # None: to the end
    grid: tuple[float, ...]  # request rates (req/s) of the plotted curve
    why: str = ""


@dataclass(frozen=True)
class Settings:
    workloads: tuple[WorkloadSpec, ...]
    ablation: tuple[str, ...]  # traces of Fig. 8
    scale_trace: str  # trace of Fig. 9
    scale_counts: tuple[int, ...]  # instances (= GPUs) of Fig. 9
    tol: float
    quick: bool = False
    extend: int = 3  # doublings of the grid's top when every point passes


FULL = Settings(
    workloads=(
        WorkloadSpec("azure-code", "Azure Code", 0, None, (4, 8, 16, 32, 64),
                     "the whole hour, as the paper replays it (§7.1: a 1-hour trace): bursts of hundreds of "
                     "requests a minute after idle minutes"),
        WorkloadSpec("azure-conv", "Azure Conversation", 0, None, (15, 30, 60, 120, 240),
                     "the whole hour, as the paper replays it (§7.1): steady arrivals with long outputs, so "
                     "each run is decode-heavy and the slowest of the four to simulate"),
        WorkloadSpec("burstgpt", "BurstGPT", 0, None, (10, 25, 50, 100, 200, 400),
                     "all of it: only the first 400 rows of BurstGPT are public here (399 kept; one failed "
                     "row dropped), 11.5 h of overnight traffic at 0.0096 req/s, in place of the paper's "
                     "1-hour clip of 6,009 requests"),
        WorkloadSpec("mooncake-conv", "Mooncake", 0, 600, (1.5, 3, 6, 12),
                     "the first 10 min (1,750 requests), the paper's own clip (Table 1: 1,756)"),
    ),
    ablation=("azure-code", "azure-conv"), scale_trace="azure-code", scale_counts=(4, 8, 16), tol=0.04)
QUICK = Settings(
    workloads=(
        WorkloadSpec("azure-code", "Azure Code", 0, 300, (8, 32), "the first 5 min (quick mode)"),
        WorkloadSpec("azure-conv", "Azure Conversation", 0, 90, (25, 100), "the first 1.5 min (quick mode)"),
        WorkloadSpec("burstgpt", "BurstGPT", 0, None, (25, 100), "all 399 public rows"),
        WorkloadSpec("mooncake-conv", "Mooncake", 0, 90, (2, 6), "the first 1.5 min (quick mode)"),
    ),
    ablation=("azure-code",), scale_trace="azure-code", scale_counts=(4, 8), tol=0.35, quick=True, extend=1)


@dataclass(frozen=True, slots=True)
class APoint:
    """One simulation's numbers."""

    attainment: float  # TTFT and TPOT SLOs both met
    ttft_ok: float  # share meeting the TTFT SLO
    tpot_ok: float  # share meeting the TPOT SLO (single-token outputs meet it)
    ttft_p90: float
    tpot_p90: float
    throughput_rps: float
    flips: int  # Arrow: instance flips (transitional pools settling not counted)
    max_prefill: int  # Arrow: most instances on the prefill side (P + D→P) at once
    wall_s: float
    events: int
    error: str = ""


def _pool_stats(policy) -> tuple[int, int]:
    gs = policy.global_scheduler
    pools = gs.pools if gs.capabilities.has_pools else None
    if pools is None:
        return 0, 0
    settles = {(Pool.P2D, Pool.D), (Pool.D2P, Pool.P)}
    of = dict(pools.home)
    most = sum(p in PREFILL_SIDE for p in of.values())
    flips = 0
    for _, i, frm, to in pools.moves:
        of[i] = to
        flips += (frm, to) not in settles
        most = max(most, sum(p in PREFILL_SIDE for p in of.values()))
    return flips, most


def run_apoint(cfg: SimConfig, workload: Workload, cost: CostModel) -> APoint:
    """One simulation as `flowyard.sim.run.simulate` assembles it (the cost model is also the
    predictor); a run that ends with requests stuck gives NaN numbers and the error."""
    sim = build_simulator(cfg, workload, cost_model=cost)
    policy = sim.policy
    try:
        res = sim.run()
    except SimulationError as e:
        nan = math.nan
        return APoint(nan, nan, nan, nan, nan, nan, 0, 0, 0.0, 0, error=f"{type(e).__name__}: {e}")
    s = summarize(res.states, policy=cfg.policy, wall_s=res.wall_s)
    ok_t = ok_p = 0
    for st in res.states:
        if meets_slo(st):
            ok_t, ok_p = ok_t + 1, ok_p + 1
            continue
        t, p, slo = ttft(st), tpot(st), st.req.slo  # an objective the request does not carry holds
        ok_t += t is not None and (slo.ttft is None or t <= slo.ttft + 1e-9)
        ok_p += t is not None and (p is None or slo.tpot is None or p <= slo.tpot + 1e-9)
    n = max(1, len(res.states))
    flips, most = _pool_stats(policy)
    return APoint(s.slo_attainment, ok_t / n, ok_p / n, s.ttft["p90"], s.tpot["p90"], s.throughput_rps,
                  flips, most, res.wall_s, res.events)


class ArrowScenario(Scenario):
    """`Scenario` whose points are `APoint`s (P90 TTFT/TPOT, per-SLO shares, Arrow's flips)."""

    def point(self, policy: str, rate: float, *, label: str | None = None, **_unused) -> APoint:  # type: ignore[override]
        key = (policy, round(rate, 9))
        if key not in self._cache:
            if math.isnan(rate):
                current().blocked()  # asked at a stand-in of a pending search
            cfg = self.cfg.replace(policy=policy, rate_scale=rate / self.base_rate)
            p = current().value(("run_apoint", cfg.as_dict(), digest(self.workload), repr(self.cost)),
                                run_apoint, cfg, self.workload, self.cost)
            self.tally.record(f"{self.name}, {label or policy}, {rate:.3f} req/s", p.wall_s, p.error, p.events)
            if self.log is not None:
                self.log(f"  {self.name:>22} {label or policy:>24}  rate {rate:8.3f}  attainment "
                         f"{p.attainment:6.1%}  ({p.wall_s:.2f} s)")
            self._cache[key] = p
        return self._cache[key]  # type: ignore[return-value]


@dataclass
class Search:
    """A goodput search and every point it evaluated (rate -> APoint)."""

    goodput: Threshold
    points: dict[float, APoint]


@dataclass
class WorkloadResult:
    spec: WorkloadSpec
    requests: int
    base_rate: float  # mean arrival rate of the unscaled window (req/s)
    systems: dict[str, Search]
    table_rate: float  # the rate of the P90 table: largest grid rate where Arrow meets the target
    ablation: dict[str, Search] = field(default_factory=dict)


@dataclass
class Results:
    settings: Settings
    seed: int
    workloads: list[WorkloadResult]
    scale: dict[int, dict[str, Search]] = field(default_factory=dict)  # instances -> label -> search
    scale_rate: float = 0.0
    wall_s: float = 0.0
    tally: Tally | None = None


def window(spec: WorkloadSpec, seed: int) -> Workload:
    w = load_workload(SimConfig(trace=spec.trace, model=MODEL, hardware=HARDWARE, seed=seed))
    return clip(w, spec.start, spec.duration) if spec.start or spec.duration is not None else w


def scenario(name: str, spec: WorkloadSpec, w: Workload, policy: str, instances: int, tp: int,
             prefill: int | None, seed: int, tally: Tally, log: Log | None) -> ArrowScenario:
    cfg = SimConfig(trace=spec.trace, model=MODEL, hardware=HARDWARE, tp=tp, instances=instances,
                    prefill_instances=prefill, policy=policy, seed=seed)
    return ArrowScenario(name, cfg, w, build_cost_model(cfg), tally=tally, log=log)


def search(sc: ArrowScenario, policy: str, grid: tuple[float, ...], s: Settings, label: str) -> Search:
    def run() -> Search:
        t = threshold_search(lambda r: sc.point(policy, r, label=label).attainment, grid, TARGET, find="max",
                             tol=s.tol, extend=s.extend)
        return Search(t, {x: sc.point(policy, x, label=label) for x, _ in t.curve})

    return current().attempt(run, Search(Threshold(math.nan), {}))  # a stand-in while runs are pending


def table_rate(s: Search, grid: tuple[float, ...]) -> float:
    ok = [x for x in grid if x in s.points and s.points[x].attainment >= TARGET - 1e-9]
    return max(ok) if ok else min(grid)


def run_experiments(s: Settings, seed: int, log: Log | None = stderr_log) -> Results:
    clock, tally = Stopwatch(), Tally()
    say = log or (lambda _m: None)
    res = Results(s, seed, [])
    arrow8: dict[str, ArrowScenario] = {}
    for spec in s.workloads:  # Fig. 7
        w = window(spec, seed)
        say(f"[fig 7] {spec.label}: {len(w)} requests")
        searches: dict[str, Search] = {}
        for label, (pol, n, tp, p) in SYSTEMS.items():
            sc = scenario(f"{spec.trace} {n}x TP{tp}", spec, w, pol, n, tp, p, seed, tally, log)
            if label == ARROW:
                arrow8[spec.trace] = sc
            searches[label] = search(sc, pol, spec.grid, s, label)
        base = arrow8[spec.trace].base_rate
        wr = WorkloadResult(spec, len(w), base, searches, table_rate(searches[ARROW], spec.grid))
        if spec.trace in s.ablation:  # Fig. 8
            say(f"[fig 8] {spec.label}: request scheduling strategies")
            wr.ablation = {label: searches[ARROW] if pol == "arrow" else
                           search(arrow8[spec.trace], pol, spec.grid, s, label) for label, pol in ABLATION.items()}
        res.workloads.append(wr)
    spec = next(x for x in s.workloads if x.trace == s.scale_trace)  # Fig. 9 (memoised at 8)
    w = arrow8[spec.trace].workload
    for n in s.scale_counts:
        say(f"[fig 9] {spec.label}: {n} instances")
        sc = arrow8[spec.trace] if n == 8 else scenario(f"{spec.trace} {n}x TP1", spec, w, "arrow", n, 1, None,
                                                         seed, tally, log)
        res.scale[n] = {label: search(sc, pol, spec.grid, s, label if n == 8 else f"{label} x{n}")
                        for label, pol in SCALE_POLICIES.items()}
    # Fig. 9's fixed rate: a grid rate, so every count's search has evaluated it
    res.scale_rate = next(r.table_rate for r in res.workloads if r.spec.trace == spec.trace)
    res.wall_s, res.tally = clock.elapsed, tally
    return res


def to_json(res: Results) -> dict:
    """Every curve as plain data (NaN as None): the report's `results.json`."""
    def search(s: Search) -> dict:
        g = s.goodput
        return {"goodput_rps": g.value if math.isfinite(g.value) else None, "capped": g.capped,
                "never_met": g.never_met, "points": {f"{x:g}": {k: None if isinstance(v, float) and math.isnan(v)
                                                                else v for k, v in asdict(p).items()}
                                                     for x, p in sorted(s.points.items())}}

    return {"seed": res.seed, "wall_s": res.wall_s, "model": MODEL, "hardware": HARDWARE,
            "systems": {k: list(v) for k, v in SYSTEMS.items()},
            "workloads": [{"trace": w.spec.trace, "window": [w.spec.start, w.spec.duration], "requests": w.requests,
                           "base_rate_rps": w.base_rate, "table_rate_rps": w.table_rate,
                           "systems": {n: search(s) for n, s in w.systems.items()},
                           "ablation": {n: search(s) for n, s in w.ablation.items()}} for w in res.workloads],
            "scalability": {"rate_rps": res.scale_rate,
                            "gpus": {str(k): {n: search(s) for n, s in d.items()} for k, d in res.scale.items()}}}

