"""Fitting the 'published' calibration and its leave-one-source-out cross-validation.

`fit_points` fits what the published points can identify (fit.Fit: A100 attention terms, the
kernel-only term of Vidur's profiled kernel, each engine profile's host terms on its own
stacks' points) by Nelder-Mead in log space from the 'vidur' calibration's assumed values
(fit.PRIOR), staged: the kernel terms first, then each profile on its own points, then all
together. The loss is the mean |log(predicted/measured)| with every (source family, kind)
group weighted alike, so 39 Vidur rows do not outvote four vLLM runs; serving replays enter no
step term, save two: their lone-request TTFTs fit each profile's frontend latency
(fit_frontend), and the TPOTs of runs that send every request at once fit the all-reduce
latency of a profile whose steps include no tensor-parallel run (fit_ar_latency).
`cross_validate` refits without each source family in turn.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from flowyard.costmodel.calibrate import nelder_mead
from flowyard.costmodel.fit import (ENGINE_KEYS, HOST_KINDS, KERNEL_KEYS, KERNEL_ONLY, PRIOR, TP_KEYS, Fit,
                                    Row, fittable, predict, predict_fit)
from flowyard.costmodel.published import Point

PRIOR_KERNEL = {k: PRIOR[k] for k in KERNEL_KEYS}
RIDGE = 1e-3  # weight of the pull to PRIOR per log-unit squared (a factor e costs 0.1 % error)
# Physical limits: a kernel cannot beat the datasheet peak it is a fraction of.
CEILING = {"eff_attn": 1.0, "eff_attn_mem": 1.0}
FLOOR = 1e-7  # seconds for host terms; no fitted term is smaller than this in any unit


def group(point: Point) -> str:
    """The loss group a point is weighted in: its source family and kind."""
    return f"{point.family}/{point.group}"


def _loss(rows_pred: list[tuple[Point, float]]) -> float:
    by: dict[str, list[float]] = {}
    for p, pred in rows_pred:
        if p.is_range:
            val = math.log1p(abs(Row(p, pred).error))
        else:
            val = abs(math.log(max(pred, 1e-12) / p.measured))
        by.setdefault(group(p), []).append(val)
    return float(np.mean([np.mean(v) for v in by.values()]))




def fit_points(points: list[Point], iters: int = 1500, restarts: int = 1) -> Fit:
    """Fit the terms these points can identify (Nelder-Mead in log space from PRIOR, with a
    weak pull back to PRIOR so that a term the points say nothing about stays where the
    'vidur' calibration assumed it instead of wandering along a flat direction)."""
    pts = fittable(points)
    engines = {e: tuple(sorted({p.family for p in pts if p.engine == e and p.kind in HOST_KINDS}))
               for e in ENGINE_KEYS}
    keys: list[tuple[str, str]] = [("kernel", k) for k in KERNEL_KEYS]
    kfams = tuple(sorted({p.family for p in pts if p.kernel == "vidur-profile"}))
    if kfams:
        keys.append(("kernel_only", "attn_causal_extra"))
    for e, fams in engines.items():
        if fams:
            keys += [(e, k) for k in ENGINE_KEYS[e]]
            if any(p.tp > 1 for p in pts if p.engine == e and p.kind in ("step", "generation")):  # AR priced
                keys += [(e, k) for k in TP_KEYS]
    x = x0 = np.log([PRIOR[k] for _, k in keys])

    def build(xv: np.ndarray) -> Fit:
        vals = np.maximum(np.exp(xv), FLOOR)  # a term the data drive to 0 stops at FLOOR
        vals = [min(v, CEILING.get(k, v)) for (_, k), v in zip(keys, vals)]
        kernel = dict(PRIOR_KERNEL)
        kernel_only: dict[str, dict[str, float]] = {"vidur-profile": {"attn_causal_extra": 0.0}}
        eng: dict[str, dict[str, float]] = {e: {} for e in ENGINE_KEYS}
        for (where, k), v in zip(keys, vals):
            if where == "kernel":
                kernel[k] = float(v)
            elif where == "kernel_only":
                kernel_only[KERNEL_ONLY[k]][k] = float(v)
            else:
                eng[where][k] = float(v)
        on = {e: f for e, f in engines.items() if f}
        if kfams:
            on["kernel:vidur-profile"] = kfams
        return Fit(kernel, kernel_only, eng, on)

    def loss_on(sub: list[Point]):
        def loss(xv: np.ndarray) -> float:
            return (_loss(list(zip(sub, predict_fit(build(xv), sub))))
                    + RIDGE * float(np.mean((xv - x0) ** 2)))
        return loss

    def stage(idx: list[int], sub: list[Point], step: float, n: int) -> None:
        """Nelder-Mead over the coordinates `idx` of x, on the points `sub`."""
        nonlocal x
        if not idx or not sub or n <= 0:
            return
        base = x.copy()

        def f(y: np.ndarray) -> float:
            z = base.copy()
            z[idx] = y
            return loss_on(sub)(z)
        x = base.copy()
        x[idx] = nelder_mead(f, base[idx], step=step, iters=n)

    # Staged: the kernel terms first (engine terms at their prior), then each profile's host
    # terms on its own points, then all together from there; a simplex over all 13 terms
    # from the prior stalls in the flat directions.
    kern = [i for i, (w, _) in enumerate(keys) if w in ("kernel", "kernel_only")]
    stage(kern, pts, 1.0, iters // 2)
    for e in ENGINE_KEYS:
        stage([i for i, (w, _) in enumerate(keys) if w == e],
              [p for p in pts if p.engine == e and p.kind in HOST_KINDS], 1.0, iters // 4)
    for _ in range(restarts):
        stage(list(range(len(keys))), pts, 0.3, iters)
    return fit_frontend(fit_ar_latency(build(x), points), points)


def golden(f: Callable[[float], float], lo: float, hi: float, iters: int = 14) -> float:
    """The minimum of a unimodal `f` on [lo, hi] by golden-section search."""
    r = (math.sqrt(5) - 1) / 2
    a, b = lo + (1 - r) * (hi - lo), lo + r * (hi - lo)
    fa, fb = f(a), f(b)
    for _ in range(iters):
        if fa <= fb:
            hi, b, fb = b, a, fa
            a = lo + (1 - r) * (hi - lo)
            fa = f(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + r * (hi - lo)
            fb = f(b)
    return a if fa <= fb else b


AT_ONCE_RPS = 1e6  # a published "request rate inf" (every request sent at once), as the points store it


def burst_tpots(points: list[Point]) -> list[Point]:
    """The tensor-parallel P50 TPOTs of runs that send every request at once: after the
    prompts, nothing arrives to stall the decodes, so the TPOT is the decode step the run's
    batch takes, whose TP-dependent part is its all-reduces."""
    return [p for p in points if p.kind == "serving" and p.metric == "tpot_p50" and p.tp > 1
            and p.workload.get("concurrency") is None and float(p.workload.get("rate") or 0) >= AT_ONCE_RPS]


def fit_ar_latency(fit: Fit, points: list[Point]) -> Fit:
    """`fit` with the all-reduce latency of each profile whose own steps include no
    tensor-parallel run, fitted on its stacks' burst TPOTs (burst_tpots) instead, as the
    frontend latency is fitted on their lone-request TTFTs: a golden-section search over
    1-100 us in log space of the same loss. A profile whose steps fitted the term keeps it;
    one with neither keeps the GPU's calibrated NCCL latency."""
    engines = {e: dict(v) for e, v in fit.engines.items()}
    on = dict(fit.fitted_on)
    bursts = burst_tpots(points)
    for e in ENGINE_KEYS:
        pts = [p for p in bursts if p.engine == e]
        if "ar_latency_s" in engines.get(e, {}) or not on.get(e) or not pts:
            continue

        def loss(lx: float, e: str = e, pts: list[Point] = pts) -> float:
            trial = Fit(fit.kernel, fit.kernel_only, engines | {e: engines[e] | {"ar_latency_s": math.exp(lx)}}, on)
            return _loss(list(zip(pts, predict_fit(trial, pts))))
        engines[e]["ar_latency_s"] = math.exp(golden(loss, math.log(1e-6), math.log(1e-4)))
        on[f"ar:{e}"] = tuple(sorted({p.family for p in pts}))
    return Fit(fit.kernel, fit.kernel_only, engines, on)


def lone_request_ttfts(points: list[Point]) -> list[Point]:
    """Per series of serving runs (source family, stack, model, GPU, TP, dataset, open or closed
    loop), the P50 TTFT point at the lowest load: the run where a request's TTFT is closest to
    its engine's prefill plus the frontend, with the least queueing for the scheduler model to
    get wrong."""
    lowest: dict[tuple, tuple[float, Point]] = {}
    for p in points:
        if p.kind != "serving" or p.metric != "ttft_p50":
            continue
        w = p.workload
        closed = w.get("concurrency") is not None
        load = float(w["concurrency"] if closed else w.get("rate") or math.inf)
        key = (p.family, p.engine, str(p.model), p.hardware, p.tp, str(w.get("trace")), closed)
        if key not in lowest or load < lowest[key][0]:
            lowest[key] = (load, p)
    return [p for _, p in lowest.values()]


def fit_frontend(fit: Fit, points: list[Point]) -> Fit:
    """`fit` with each engine profile's frontend latency: the constant that, added to the
    simulated TTFT of its stacks' lone-request serving runs (lone_request_ttfts), best matches
    the published TTFT (least squares in relative error, not below 0). A profile with no such
    run keeps 0. Fitted after the step terms, which never see serving runs, on the simulator's
    replays of those runs with the fitted step terms."""
    engines = {e: {**v, "frontend_s": 0.0} for e, v in fit.engines.items()}
    on = dict(fit.fitted_on)
    lone = lone_request_ttfts(points)
    for e in ENGINE_KEYS:
        pts = [p for p in lone if p.engine == e]
        if not pts:
            continue
        pred = np.array(predict_fit(Fit(fit.kernel, fit.kernel_only, engines, on), pts))
        m = np.array([p.measured for p in pts])
        gap_ms = float(np.sum((m - pred) / m ** 2) / np.sum(1.0 / m ** 2))
        engines[e]["frontend_s"] = max(0.0, gap_ms) / 1e3
        on[f"frontend:{e}"] = tuple(sorted({p.family for p in pts}))
    return Fit(fit.kernel, fit.kernel_only, engines, on)





def cross_validate(points: list[Point], iters: int = 1500, restarts: int = 1, workers: int = 1
                   ) -> tuple[list[Row], dict[str, Fit], list[Point]]:
    """Leave-one-source-out: for each family, fit on the others and predict it. Returns the
    rows of every point (in `points` order), each family's fold fit, and the points no fold
    can check (`checkable`): those resting on terms only their own family measures -- Vidur's
    CPU phases are the eager-2023 profile and its attention rows the one kernel it profiled;
    left out, nothing else defines them, and they are priced with the fold's fallbacks. A
    family with no fittable point leaves the fit unchanged: it reuses the all-points fit."""
    fams = list(dict.fromkeys(p.family for p in points))
    train = {f: [p for p in points if p.family != f] for f in fams}
    # a family takes part in a fit through its fittable points, its lone-request TTFTs (the
    # frontend term) or its burst TPOTs (the all-reduce term): any way, it needs its own fold
    used = {p.family for p in fittable(points) + lone_request_ttfts(points) + burst_tpots(points)}
    todo = [f for f in fams if f in used]
    jobs = todo + ["*all*"] if len(todo) < len(fams) else todo
    sets = [train[f] if f != "*all*" else points for f in jobs]
    if workers > 1:
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(workers) as ex:
            fits = list(ex.map(fit_points, sets, [iters] * len(jobs), [restarts] * len(jobs)))
    else:
        fits = [fit_points(t, iters, restarts) for t in sets]
    by_job = dict(zip(jobs, fits))
    folds = {f: by_job[f] if f in by_job else by_job["*all*"] for f in fams}  # "*all*" runs when any f is not a job
    unchecked = [p for p in points if not checkable(p, folds[p.family])]
    rows = [Row(p, predict(p, folds[p.family].hardware(p.hardware, p.engine, p.kernel)))
            for p in points]  # serving replays: cached per fold's factors
    return rows, folds, unchecked


def checkable(point: Point, fold: Fit) -> bool:
    """Whether `fold` can price `point` without terms only the point's own family measures:
    the host terms of its engine profile (for kinds that have them) and the terms of the one
    kernel it timed, and for a TTFT its stack's frontend latency; and a closed-loop run that
    fitted its benchmark client (`replay.client_chunk_s`) checks nothing about that client."""
    client = point.workload.get("client")
    if client and point.workload.get("concurrency") == client["concurrency"]:
        return False
    if point.metric == "ttft_p50" and not fold.fitted_on.get(f"frontend:{point.engine}"):
        return False  # no other family's lone-request TTFT fits its stack's frontend latency
    if point.kind in HOST_KINDS and not fold.fitted_on.get(point.engine):
        return False
    return not point.kernel or bool(fold.fitted_on.get(f"kernel:{point.kernel}"))
