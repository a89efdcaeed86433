"""FlowPrefill Fig. 17 (§6.5): the mixture-of-experts model Qwen3-30B-A3B with 2-way tensor
parallelism, FlowPrefill against DistServe-CP2K and DistServe-CP8K on the QwenTrace stand-in.

The same measurement as Fig. 9 (goodput over a rate grid, min SLO scale at the rate where the
primary baseline just meets the SLOs), on the catalog's `qwen3-30b-a3b`, whose roofline prices
attention as for a dense model and the FFN by its routed experts (`costmodel.moe`). Table 2
gives no SLOs for this model, so the run takes the row of the Table 2 model whose prefill
capacity (on its own TP) lies closest to Qwen3-30B-A3B's, and says which.

The write-up is in `flowprefill_moe_report.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flowyard.costmodel import get_model
from flowyard.experiments.common import Log, Scenario, Tally
from flowyard.experiments.flowprefill import (FALLBACK_SLO_RATE, HARDWARE, MODELS, PRIMARY, SYSTEMS, ModelResult,
                                              Settings, goodput, min_slo, prefill_capacity)
from flowyard.sim.run import SimConfig, build_cost_model
from flowyard.workloads.multitask import qwentrace_like

#: (catalog name, TP, label) of Fig. 17
MOE_MODEL: tuple[str, int, str] = ("qwen3-30b-a3b", 2, "Qwen3-30B-A3B TP2")
#: the systems Fig. 17 compares (§6.5), and the closer reading of the CP baseline (see SYSTEMS)
MOE_SYSTEMS: tuple[str, ...] = ("FlowPrefill", "DistServe-CP2K", "DistServe-CP8K", "CP2K, EDF per chunk")
#: the paper's baselines in Fig. 17, over which its "up to" claims range
PAPER_BASELINES: tuple[str, ...] = ("DistServe-CP2K", "DistServe-CP8K")


@dataclass(frozen=True)
class MoESettings:
    """Fig. 17's run; the `full` one takes the study's request count, grids and tolerance."""

    systems: tuple[str, ...]
    n_requests: int | None = None  # None: the study's Settings
    rate_fracs: tuple[float, ...] | None = None
    slo_grid: tuple[float, ...] | None = None
    tol: float | None = None


#: Settings.moe -> Fig. 17's settings. Quick: the primary baseline only, a short workload and
#: coarse grids, so it adds a few seconds to `reproduce flowprefill --quick`.
MOE_SETTINGS: dict[str, MoESettings] = {
    "full": MoESettings(MOE_SYSTEMS),
    "quick": MoESettings(("FlowPrefill", "DistServe-CP2K"), n_requests=150, rate_fracs=(0.25, 1.0, 4.0),
                         slo_grid=(0.25, 1.0, 4.0), tol=0.15),
}


@dataclass
class MoEResult:
    """Fig. 17's run: the end-to-end result and how its SLOs were chosen."""

    result: ModelResult
    systems: tuple[str, ...]
    n_requests: int
    slo_model: str  # the Table 2 row (catalog name) the workload's SLOs come from
    capacities: dict[str, float]  # Table 2 model (or the MoE model) -> prefill capacity C (req/s)
    total_params: int
    active_params: int


def _capacity(model: str, tp: int, n: int, seed: int, slo_model: str) -> float:
    """Prefill capacity C of `model` on TP `tp` over the stand-in's prompts (no simulation)."""
    cost = build_cost_model(SimConfig(model=model, hardware=HARDWARE, tp=tp))
    w = qwentrace_like(n, rate=1.0, model=slo_model, seed=seed)
    return 1.0 / (sum(cost.prefill_time(r.prompt_len) for r in w.requests) / len(w.requests))


def slo_row(n: int, seed: int) -> tuple[str, dict[str, float]]:
    """The Table 2 model whose prefill capacity is closest (in ratio) to the MoE model's, and
    every capacity compared. A lone prefill is priced by the cost model, so this is cheap."""
    model, tp, _ = MOE_MODEL
    caps = {m: _capacity(m, t, n, seed, m) for m, t, _ in MODELS}
    caps[model] = _capacity(model, tp, n, seed, MODELS[0][0])
    best = min((m for m, _, _ in MODELS), key=lambda m: abs(math.log(caps[m] / caps[model])))
    return best, caps


def run_moe(s: Settings, seed: int, tally: Tally, log: Log | None) -> MoEResult:
    """Fig. 17: goodput and min SLO scale of each system of `MOE_SETTINGS[s.moe]` on
    Qwen3-30B-A3B TP2."""
    if s.moe not in MOE_SETTINGS:
        raise ValueError(f"unknown Fig. 17 settings {s.moe!r}; known: {', '.join(MOE_SETTINGS)}, off")
    ms_ = MOE_SETTINGS[s.moe]
    n = ms_.n_requests or s.n_requests
    fracs, slos, tol = ms_.rate_fracs or s.rate_fracs, ms_.slo_grid or s.slo_grid, ms_.tol or s.tol
    say = log or (lambda _m: None)
    model, tp, label = MOE_MODEL
    row, caps = slo_row(n, seed)
    cfg = SimConfig(model=model, hardware=HARDWARE, tp=tp, instances=2, prefill_instances=1, seed=seed)
    cost = build_cost_model(cfg)
    w = qwentrace_like(n, rate=1.0, model=row, seed=seed)
    sc = Scenario(model, cfg, w, cost, tally=tally, log=log)
    cap = prefill_capacity(sc)
    grid = [f * cap for f in fracs]
    say(f"[fig 17] {label}: prefill capacity C = {cap:.2f} req/s, Table 2 SLOs of {row}")
    systems = {name: SYSTEMS[name] for name in ms_.systems}
    gp = {name: goodput(sc, pol, grid, tol, fp, name) for name, (pol, fp) in systems.items()}
    rate = gp[PRIMARY].value if gp[PRIMARY].value > 0 else FALLBACK_SLO_RATE * cap
    say(f"[fig 17] {label}: SLO sweep at {rate:.2f} req/s")
    ms = {name: min_slo(sc, pol, rate, slos, tol, fp, name) for name, (pol, fp) in systems.items()}
    spec = get_model(model)
    return MoEResult(ModelResult(model, label, cap, rate, gp, ms), ms_.systems, n, row, caps, spec.num_params,
                     spec.active_params)
