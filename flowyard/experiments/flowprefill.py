"""`flowyard reproduce flowprefill`: FlowPrefill's evaluation (§6, Figs. 9-12 and 15-17) in the
simulator on simulated A800-80GB, on the QwenTrace stand-in (`workloads.multitask`).

Metric: TTFT SLO attainment (share of requests whose TTFT meets their task's Table 2 SLO);
FlowPrefill only changes prefill, so decode SLOs are not set. Goodput = the highest request
rate with attainment >= 90 %; min SLO scale = the smallest factor on Table 2's SLOs with
attainment >= 90 % at a fixed rate. Both by `threshold_search` around a plotted grid.

The runs live here; the write-up (tables, figures, the paper's numbers) in
`flowprefill_report.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from flowyard.experiments.common import (
    Log,
    Scenario,
    Stopwatch,
    Tally,
    Threshold,
    stderr_log,
    threshold_search,
)
from flowyard.experiments.flowprefill_coloc import FULL_COLOC, QUICK_COLOC, ColocSettings, Colocation, run_colocation
from flowyard.policies.flowprefill.scheduler import FlowPrefillConfig
from flowyard.sim.run import SimConfig, build_cost_model
from flowyard.sweep import current
from flowyard.workloads import Workload
from flowyard.workloads.multitask import qwentrace_like

if TYPE_CHECKING:
    from flowyard.experiments.flowprefill_moe import MoEResult

HARDWARE = "a800"
#: (catalog name, TP, label) as in §6.1: one, two and four-way tensor parallelism
MODELS: tuple[tuple[str, int, str], ...] = (
    ("llama-3-8b", 1, "Llama3-8B TP1"),
    ("qwen2.5-14b", 2, "Qwen2.5-14B TP2"),
    ("llama-3-70b", 4, "Llama3-70B TP4"),
)


def chunk_edf(chunk: int) -> FlowPrefillConfig:
    """Chunked prefill whose EDF re-ranks everything, partial prompts included, at every chunk
    boundary: FlowPrefill's pool with preemption only between steps ("chunk"), plain EDF, a
    token budget of one chunk. The registry's `distserve-cp*` follow vLLM's scheduler instead:
    a started prompt keeps its turn until its last chunk, EDF orders only the waiting queue."""
    return FlowPrefillConfig(priority="edf", granularity="chunk", chunk_size=chunk, batch_token_budget=chunk + 1)


#: label -> (registry policy, FlowPrefill knobs); all on 2 instances (1P1D; vLLM: 2 colocated)
SYSTEMS: dict[str, tuple[str, FlowPrefillConfig | None]] = {
    "FlowPrefill": ("flowprefill", None),
    "DistServe": ("distserve", None),
    "DistServe-CP2K": ("distserve-cp2k", None),
    "DistServe-CP8K": ("distserve-cp8k", None),
    "CP2K, EDF per chunk": ("flowprefill", chunk_edf(2048)),
    "CP8K, EDF per chunk": ("flowprefill", chunk_edf(8192)),
    "vLLM-CP2K (colocated)": ("vllm", None),
}
PRIORITY_VARIANTS = {"S-EDF": "s-edf", "EDF": "edf", "D-EDF": "d-edf"}
BUDGETS: dict[str, int | None] = {"no limit": None, "2K": 2048, "4K": 4096, "8K": 8192, "no batching": 0}
CHUNKS: dict[str, int | None] = {"no chunking": None, "2K": 2048, "4K": 4096, "8K": 8192, "16K": 16384}
GRANULARITIES = ("operator", "layer")
PRIMARY = "DistServe-CP2K"  # the paper's primary baseline (§6.1)
FALLBACK_SLO_RATE = 0.2  # x C, when the primary baseline never meets the target
SENSITIVITY_SYSTEMS = ("FlowPrefill", "DistServe-CP2K", "DistServe-CP8K", "CP2K, EDF per chunk",
                       "CP8K, EDF per chunk")
TARGET = 0.9


@dataclass(frozen=True)
class Settings:
    n_requests: int
    models: tuple[str, ...]  # catalog names of the end-to-end study
    rate_fracs: tuple[float, ...]  # rate grid as fractions of one instance's prefill capacity
    slo_grid: tuple[float, ...]  # SLO scales
    blocking_rate_frac: float  # rate of the blocking runs (Fig. 12)
    ablation_slo_rate_frac: float  # fixed rate of Fig. 10's SLO sweep
    slo_sensitivity: tuple[float, ...]  # more fixed rates (x C) for Fig. 9b's ratios, first model
    budget_rate_fracs: tuple[float, ...]  # Fig. 11
    blocking_models: tuple[str, ...]
    ablations: bool = True
    tol: float = 0.03
    moe: str = "full"  # Fig. 17's settings in flowprefill_moe.MOE_SETTINGS, or "off"
    coloc: ColocSettings | None = None  # Fig. 16 (PD colocation); None skips it


FULL = Settings(
    n_requests=2000, models=tuple(m for m, _, _ in MODELS),
    rate_fracs=(0.1, 0.2, 0.35, 0.5, 0.65, 0.8, 1.0, 1.25, 1.5),
    slo_grid=(0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0),
    blocking_rate_frac=0.5, ablation_slo_rate_frac=0.9, slo_sensitivity=(0.35, 0.5),
    budget_rate_fracs=(0.4, 0.7, 1.0, 1.3, 1.6, 2.0),
    blocking_models=tuple(m for m, _, _ in MODELS), coloc=FULL_COLOC,
)
QUICK = Settings(
    n_requests=300, models=("llama-3-8b",),
    rate_fracs=(0.2, 0.5, 1.0, 1.5), slo_grid=(0.5, 1.0, 2.0, 4.0),
    blocking_rate_frac=0.5, ablation_slo_rate_frac=0.9, slo_sensitivity=(), budget_rate_fracs=(0.5, 1.0, 2.0),
    blocking_models=("llama-3-8b",), tol=0.1, moe="quick",
    coloc=QUICK_COLOC,
)


@dataclass
class ModelResult:
    model: str
    label: str
    capacity: float  # req/s one instance prefills back to back, one request at a time
    slo_rate: float
    goodput: dict[str, Threshold]
    min_slo: dict[str, Threshold]
    fp_tasks: dict[str, float] = field(default_factory=dict)  # FlowPrefill's attainment per task at its goodput


@dataclass
class Results:
    settings: Settings
    seed: int
    e2e: list[ModelResult]
    sensitivity: dict[float, dict[str, Threshold]] = field(default_factory=dict)  # rate (x C) -> min SLO
    priority: dict[str, tuple[Threshold, Threshold]] | None = None  # (goodput, min SLO scale)
    priority_rate: float = 0.0
    budget: dict[str, list[tuple[float, float, float]]] | None = None  # (rate, attainment, req/s)
    blocking: dict[str, dict[str, dict[str, float]]] | None = None  # model -> granularity -> stats
    blocking_attainment: dict[str, dict[str, float]] | None = None
    chunk: dict[str, Threshold] | None = None
    colocation: Colocation | None = None  # Fig. 16
    base_capacity: float = 0.0
    arrival_cv: float = 0.0  # coefficient of variation of the inter-arrival gaps
    task_mix: dict[str, tuple[float, float]] = field(default_factory=dict)  # task -> (request, prompt-token share)
    wall_s: float = 0.0
    tally: Tally | None = None
    moe: "MoEResult | None" = None  # Fig. 17 (flowprefill_moe)


def scenario(model: str, tp: int, s: Settings, seed: int, tally: Tally, log: Log | None) -> Scenario:
    cfg = SimConfig(model=model, hardware=HARDWARE, tp=tp, instances=2, prefill_instances=1, seed=seed)
    cost = build_cost_model(cfg)
    w = qwentrace_like(s.n_requests, rate=1.0, model=model, seed=seed)
    return Scenario(model, cfg, w, cost, tally=tally, log=log)


def task_mix(w: Workload) -> dict[str, tuple[float, float]]:
    """Per task tag: its share of the requests and of the prompt tokens (what the notes explain
    FlowPrefill's per-task attainment with)."""
    n, toks = len(w.requests), sum(r.prompt_len for r in w.requests)
    out: dict[str, tuple[float, float]] = {}
    for t in sorted({r.task or "-" for r in w.requests}):
        rs = [r for r in w.requests if (r.task or "-") == t]
        out[t] = (len(rs) / max(1, n), sum(r.prompt_len for r in rs) / max(1, toks))
    return out


def prefill_capacity(sc: Scenario) -> float:
    """Requests/s one instance sustains prefilling this workload's prompts one at a time."""
    return 1.0 / float(np.mean([sc.cost.prefill_time(r.prompt_len) for r in sc.workload.requests]))


def goodput(sc: Scenario, policy: str, grid: list[float], tol: float,
            fp: FlowPrefillConfig | None = None, label: str | None = None) -> Threshold:
    return current().attempt(lambda: threshold_search(
        lambda r: sc.point(policy, r, flowprefill=fp, label=label).attainment, grid, TARGET, find="max", tol=tol),
        Threshold(math.nan))  # a stand-in while runs are pending (parallel sweeps)


def min_slo(sc: Scenario, policy: str, rate: float, grid: tuple[float, ...], tol: float,
            fp: FlowPrefillConfig | None = None, label: str | None = None) -> Threshold:
    return current().attempt(lambda: threshold_search(
        lambda k: sc.point(policy, rate, slo_scale=k, flowprefill=fp, label=label).attainment,
        grid, TARGET, find="min", tol=tol), Threshold(math.nan))


def run_experiments(s: Settings, seed: int, log: Log | None = stderr_log) -> Results:
    clock, tally = Stopwatch(), Tally()
    say = log or (lambda _m: None)
    scen: dict[str, Scenario] = {}
    for model, tp, _ in MODELS:
        if model in s.models or model in s.blocking_models:
            scen[model] = scenario(model, tp, s, seed, tally, log)
    res = Results(s, seed, [])
    for model, _, label in MODELS:  # Fig. 9
        if model not in s.models:
            continue
        sc = scen[model]
        cap = prefill_capacity(sc)
        grid = [f * cap for f in s.rate_fracs]
        say(f"[fig 9] {label}: prefill capacity C = {cap:.2f} req/s")
        gp = {name: goodput(sc, pol, grid, s.tol, fp, name) for name, (pol, fp) in SYSTEMS.items()}
        # SLO sweep at the rate where the paper's primary baseline just meets Table 2's SLOs
        rate = gp[PRIMARY].value if gp[PRIMARY].value > 0 else FALLBACK_SLO_RATE * cap
        say(f"[fig 9] {label}: SLO sweep at {rate:.2f} req/s")
        ms = {name: min_slo(sc, pol, rate, s.slo_grid, s.tol, fp, name) for name, (pol, fp) in SYSTEMS.items()}
        tasks = sc.point("flowprefill", gp["FlowPrefill"].value).by_task if gp["FlowPrefill"].value > 0 else {}
        res.e2e.append(ModelResult(model, label, cap, rate, gp, ms, tasks))
        if model == s.models[0]:
            for f in s.slo_sensitivity:
                res.sensitivity[f] = {n: min_slo(sc, SYSTEMS[n][0], f * cap, s.slo_grid, s.tol, SYSTEMS[n][1], n)
                                      for n in SENSITIVITY_SYSTEMS}
    from flowyard.experiments.flowprefill_moe import run_moe  # Fig. 17; it imports this module

    if s.moe != "off":
        res.moe = run_moe(s, seed, tally, log)
    base = scen[MODELS[0][0]] if MODELS[0][0] in scen else next(iter(scen.values()))
    cap = prefill_capacity(base)
    res.base_capacity = cap
    gaps = np.diff(base.workload.arrivals())
    res.arrival_cv = float(gaps.std() / gaps.mean()) if len(gaps) > 1 and gaps.mean() > 0 else 0.0
    res.task_mix = task_mix(base.workload)
    grid = [f * cap for f in s.rate_fracs]
    if s.ablations:  # Figs. 10, 11, 15 on Llama3-8B
        res.priority_rate = s.ablation_slo_rate_frac * cap
        say(f"[fig 10] priorities, SLO sweep at {res.priority_rate:.2f} req/s")
        res.priority = {}
        for name, kind in PRIORITY_VARIANTS.items():
            fp = FlowPrefillConfig(priority=kind)
            res.priority[name] = (goodput(base, "flowprefill", grid, s.tol, fp, name),
                                  min_slo(base, "flowprefill", res.priority_rate, s.slo_grid, s.tol, fp, name))
        say("[fig 11] batch token budgets")
        res.budget = {}
        for name, g in BUDGETS.items():
            fp = FlowPrefillConfig(batch_token_budget=g)
            pts = [(f * cap, base.point("flowprefill", f * cap, flowprefill=fp, label=f"budget {name}"))
                   for f in s.budget_rate_fracs]
            res.budget[name] = [(r, p.attainment, p.throughput_rps) for r, p in pts]
        say("[fig 15] FlowPrefill with chunked prefill")
        res.chunk = {name: goodput(base, "flowprefill", grid, s.tol, FlowPrefillConfig(chunk_size=c),
                                   f"chunk {name}") for name, c in CHUNKS.items()}
    res.blocking, res.blocking_attainment = {}, {}  # Fig. 12
    for model in s.blocking_models:
        sc = scen[model]
        rate = s.blocking_rate_frac * prefill_capacity(sc)
        say(f"[fig 12] {model}: preemption blocking at {rate:.2f} req/s")
        res.blocking[model], res.blocking_attainment[model] = {}, {}
        for gran in GRANULARITIES:
            p = sc.point("flowprefill", rate, flowprefill=FlowPrefillConfig(granularity=gran), label=gran)
            st = p.blocking_stats()
            st["below_4.5ms"] = float(np.mean(np.asarray(p.blocking) < 4.5e-3)) if p.blocking else float("nan")
            res.blocking[model][gran] = st
            res.blocking_attainment[model][gran] = p.attainment
    if s.coloc is not None:
        say("[fig 16] PD colocation: FlowPrefill's S-EDF vs vLLM chunked prefill")
        res.colocation = run_colocation(s.coloc, s.n_requests, seed, tally, log)
    res.wall_s, res.tally = clock.elapsed, tally
    return res

