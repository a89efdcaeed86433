"""Our prediction for every published point under a set of fitted terms (`Fit`).

The GEMM, elementwise and all-reduce factors stay as `calibrate` fitted them on Vidur's
operator profiles. What the published points fit (`Fit`, fitted by costmodel.refit) is what
those profiles cannot say: the A100 attention terms (eff_attn, attn_tile, eff_attn_mem,
attn_fixed_s), the extra causal cost of the one kernel Vidur profiled (KERNEL_TERMS, its rows
only) and, per engine profile (costmodel.engines), the host-side terms -- each profile only on
the points its own stacks measured. Serving runs are replayed in the simulator
(costmodel.replay) and only check, save one term: each profile's frontend latency, fitted on
its stacks' lone-request TTFTs (refit.fit_frontend), since no step measures it, and a
profile's all-reduce latency where its steps include no tensor-parallel run, on its stacks'
burst TPOTs (refit.fit_ar_latency). A point whose engine profile a fit
has no points of is priced with the default profile (else the prior).

Reproduce flowyard/data/calibration.json (the 'published' calibration) with

    python -m flowyard.costmodel.fit --write
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache

import numpy as np

from flowyard.core.plan import BatchShape
from flowyard.costmodel.engines import DEFAULT_ENGINE_PROFILE, HOST_TERMS, calibration_data
from flowyard.costmodel.hardware import (A100_PARAMS, H100_PARAMS, HardwareSpec, calibrated,
                                         get_hardware)
from flowyard.costmodel.published import Point, published_points
from flowyard.costmodel.roofline import RooflineCostModel

KERNEL_KEYS = ("eff_attn", "attn_tile", "eff_attn_mem", "attn_fixed_s")
KERNEL_ONLY = {"attn_causal_extra": "vidur-profile"}  # term -> the measured kernel it belongs to
# seq_overhead_layer_s stays 0: Vidur's per-sequence CPU time is the same for Llama-2-70B
# (80 layers) as for Llama-2-7B (32) at TP4, so a per-layer term (which CodeLlama-34B's rows
# alone suggest) is not what the data say.
ENGINE_KEYS = {"eager-2023": ("step_overhead_s", "seq_overhead_s"),
               "vllm-v0": ("step_overhead_s", "seq_overhead_s"),
               "vllm-v1": ("step_overhead_s", "seq_overhead_s")}
# Fitted for a profile only when its own points include tensor-parallel runs (else the GPU's
# calibrated NCCL latency stays): an engine that replays CUDA graphs and has its own one-shot
# all-reduce for small tensors (vLLM's custom all-reduce) pays a fraction of the NCCL latency
# Vidur's eager profiles measured, and a decode step at TP 8 makes 2 per layer.
TP_KEYS = ("ar_latency_s",)
# Where every fit starts: the 'vidur' calibration's assumed values (no published point in
# them); log-space needs a positive start for the terms 'vidur' sets to 0.
PRIOR = {"eff_attn": A100_PARAMS.eff_attn, "attn_tile": A100_PARAMS.attn_tile,
         "eff_attn_mem": A100_PARAMS.eff_attn_mem, "attn_fixed_s": 1e-6,
         "attn_causal_extra": 0.1, "step_overhead_s": A100_PARAMS.step_overhead_s,
         "seq_overhead_s": A100_PARAMS.seq_overhead_s, "seq_overhead_layer_s": 1e-7,
         "ar_latency_s": H100_PARAMS.ar_latency_s}


@dataclass(frozen=True)
class Fit:
    """A fitted set of terms: A100 attention (kernel), kernel-only terms and host terms per
    engine profile; `fitted_on` says which source families each profile's terms rest on."""

    kernel: dict[str, float]
    kernel_only: dict[str, dict[str, float]]
    engines: dict[str, dict[str, float]]
    fitted_on: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def engine_terms(self, engine: str) -> dict[str, float]:
        """The host terms a point of `engine` is priced with: its own profile's when this fit
        has points of it, else the default profile's (else the prior)."""
        for name in (engine, DEFAULT_ENGINE_PROFILE):
            if self.fitted_on.get(name):
                return {k: 0.0 for k in HOST_TERMS} | self.engines[name]
        return {k: (PRIOR[k] if k in ENGINE_KEYS[DEFAULT_ENGINE_PROFILE] else 0.0) for k in HOST_TERMS}

    def hardware(self, name: str, engine: str, kernel: str = "") -> HardwareSpec:
        """The catalog GPU `name` with this fit's terms, as `calibrated` builds it."""
        hw = get_hardware(name)
        if hw.params is A100_PARAMS:
            params = replace(A100_PARAMS, **self.kernel)
        elif hw.params is H100_PARAMS:
            params = replace(H100_PARAMS, attn_fixed_s=self.kernel["attn_fixed_s"])
        else:
            return hw
        params = replace(params, **self.engine_terms(engine), **self.kernel_only.get(kernel, {}))
        return replace(hw, params=params)

    def to_json(self) -> dict:
        return {"kernel": self.kernel, "kernel_only": self.kernel_only,
                "engines": {e: {**{k: 0.0 for k in HOST_TERMS}, **v,
                                "fitted_on": list(self.fitted_on.get(e, ())),
                                "frontend_fitted_on": list(self.fitted_on.get(f"frontend:{e}", ())),
                                "ar_fitted_on": list(self.fitted_on.get(f"ar:{e}", ()))}
                            for e, v in self.engines.items()}}


def current_fit() -> Fit:
    """The fit stored in flowyard/data/calibration.json (the 'published' calibration)."""
    d = calibration_data()
    engines = {e: {k: float(v.get(k, 0.0)) for k in HOST_TERMS} | {k: float(v[k]) for k in TP_KEYS if k in v}
               for e, v in d["engines"].items()}
    on = {e: tuple(v.get("fitted_on", ())) for e, v in d["engines"].items()}
    on |= {f"{kind}:{e}": tuple(v[f"{kind}_fitted_on"]) for e, v in d["engines"].items()
           for kind in ("frontend", "ar") if v.get(f"{kind}_fitted_on")}
    return Fit(dict(d["kernel"]), {k: dict(v) for k, v in d["kernel_only"].items()}, engines, on)


@dataclass(frozen=True)
class Row:
    """One line of the fidelity table."""

    point: Point
    predicted: float

    @property
    def error(self) -> float:
        """Signed relative error; for a range, the distance outside it (0 inside)."""
        p, hi = self.point, self.point.hi
        if hi is not None:  # a range
            if p.measured <= self.predicted <= hi:
                return 0.0
            edge = p.measured if self.predicted < p.measured else hi
            return (self.predicted - edge) / edge
        return (self.predicted - p.measured) / p.measured


@lru_cache(maxsize=1024)
def shape_of(point: Point) -> BatchShape:
    decodes = [ctx for count, ctx in point.decodes for _ in range(count)]
    return BatchShape.of(list(point.prefills), decodes)


def ridge_tokens(cm: RooflineCostModel, limit: int = 8192) -> float:
    """Fewest prefill tokens whose compute side reaches the memory side (PLA-Serve §2.1)."""
    lo, hi = 1, limit
    if _compute_bound(cm, hi) is False:
        return float(limit)
    while lo < hi:  # the compute share grows with the tokens: bisect
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if _compute_bound(cm, mid) else (mid + 1, hi)
    return float(lo)


def _compute_bound(cm: RooflineCostModel, tokens: int) -> bool:
    comp, mem = cm.compute_memory_split(BatchShape.of([(0, tokens)], []))
    return bool(comp >= mem)  # scalar shape: numpy floats compare to numpy bools


def generation_ms(cm: RooflineCostModel, batch: int, input_len: int, output_len: int) -> float:
    """A batch that prefills together, then decodes output_len - 1 steps in lockstep (vLLM's
    benchmark_latency): one step per token, the decode contexts priced as one array."""
    prefill = cm.step_time(BatchShape.of([(0, input_len)] * batch, []))
    ctx = batch * (input_len + np.arange(1, output_len, dtype=float))
    decode = cm.step_time(BatchShape(decode_seqs=batch, decode_ctx=ctx))
    return 1e3 * float(prefill + np.sum(decode))


def predict(point: Point, hw: HardwareSpec, cm: RooflineCostModel | None = None) -> float:
    """Our number for `point` on `hw` (already calibrated), in the point's unit; `cm` may pass
    the cost model already built for that (model, hw, tp)."""
    cm = cm or RooflineCostModel(point.model, hw, point.tp)
    if point.kind == "serving":
        from flowyard.costmodel.replay import replay

        return replay(point, cm)
    if point.kind == "generation":
        w = point.workload
        return generation_ms(cm, int(w["batch"]), int(w["input_len"]), int(w["output_len"]))
    shape = shape_of(point)
    if point.kind == "step":
        return 1e3 * float(cm.step_time(shape))
    if point.kind == "attn_prefill":
        return 1e3 * float(cm.attention_kernel_times(shape)[0])
    if point.kind == "attn_decode":
        return 1e3 * float(cm.attention_kernel_times(shape)[1])
    if point.kind == "cpu_overhead":
        return 1e3 * float(cm.step_overhead(shape)["overhead"])
    if point.kind == "ridge":
        return ridge_tokens(cm)
    raise ValueError(f"unknown point kind {point.kind!r}")


def evaluate(calibration: str = "published", points: list[Point] | None = None,
             engine: str | None = None, serving: bool = True) -> list[Row]:
    """The fidelity table under one calibration, each point priced with its own engine
    profile (or `engine` for all). serving=False leaves out the simulator replays."""
    pts = published_points() if points is None else points
    return [Row(p, predict(p, calibrated(get_hardware(p.hardware), calibration, p.kernel,
                                         engine=engine or p.engine)))
            for p in pts if serving or p.kind != "serving"]


def evaluate_fit(fit: Fit, points: list[Point]) -> list[Row]:
    """The table under a `Fit` (a cross-validation fold, or a fit not yet written)."""
    return [Row(p, v) for p, v in zip(points, predict_fit(fit, points))]


def predict_fit(fit: Fit, points: list[Point]) -> list[float]:
    """predict() for every point under `fit`, building each (GPU, profile, kernel) spec and
    each (model, spec, TP) cost model once: the fit's loss calls this thousands of times."""
    hws: dict[tuple, HardwareSpec] = {}
    cms: dict[tuple, RooflineCostModel] = {}
    out = []
    for p in points:
        hk = (p.hardware, p.engine, p.kernel)
        if hk not in hws:
            hws[hk] = fit.hardware(*hk)
        mname = p.model if isinstance(p.model, str) else p.model.name
        ck = (mname, hk, p.tp)
        if ck not in cms:
            cms[ck] = RooflineCostModel(p.model, hws[hk], p.tp)
        out.append(predict(p, hws[hk], cms[ck]))
    return out


def summary(rows: list[Row]) -> dict[str, float]:
    """Median and max absolute relative error, and how many points pass 10 % and 25 %."""
    errs = np.abs([r.error for r in rows]) if rows else np.zeros(1)
    return {"points": len(rows), "median_abs_error": float(np.median(errs)),
            "max_abs_error": float(errs.max()), "within_10pct": int((errs <= 0.10).sum()),
            "within_25pct": int((errs <= 0.25).sum())}


HOST_KINDS = ("step", "generation", "cpu_overhead")  # kinds whose prediction has host terms


def fittable(points: list[Point]) -> list[Point]:
    """The points a fit may use: everything but the serving replays."""
    return [p for p in points if p.kind != "serving"]


def fitted_on(calibration: str) -> list[Point]:
    """The published points a calibration's terms were fitted on, so a report that predicts one
    of them labels it a fit input rather than a check: 'published' (`python -m
    flowyard.costmodel.fit --write`) is fitted on every point but the serving replays, and on
    the lone-request serving TTFTs (frontend latency), and on the burst TPOTs of a profile whose
    all-reduce latency they fitted; 'vidur' on Vidur's operator profiles only, none of which
    are points here."""
    if calibration != "published":
        return []
    from flowyard.costmodel.refit import burst_tpots, lone_request_ttfts

    pts = published_points()
    ar = {k[3:] for k, v in current_fit().fitted_on.items() if k.startswith("ar:") and v}
    return fittable(pts) + lone_request_ttfts(pts) + [p for p in burst_tpots(pts) if p.engine in ar]


def main(argv: list[str] | None = None) -> None:
    import argparse
    import json
    import subprocess

    from flowyard.costmodel.engines import CALIBRATION_FILE

    ap = argparse.ArgumentParser(description="fit the 'published' calibration on the published points")
    ap.add_argument("--write", action="store_true", help=f"write {CALIBRATION_FILE}")
    args = ap.parse_args(argv)
    from flowyard.costmodel.refit import fit_points

    pts = published_points()
    fit = fit_points(pts)
    rows = evaluate_fit(fit, fittable(pts))
    print("fitted:", json.dumps(fit.to_json(), indent=1))
    print("in-sample (no serving replays):", summary(rows))
    if args.write:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, cwd=CALIBRATION_FILE.parent).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True,
                               cwd=CALIBRATION_FILE.parent).stdout.strip()
        doc = {"note": "written by python -m flowyard.costmodel.fit --write at revision "
                       f"{rev}{' (uncommitted changes)' if dirty else ''} from "
                       f"{len(fittable(pts))} published points, frontend latencies on the lone-request "
                       "serving TTFTs",
               **fit.to_json()}
        CALIBRATION_FILE.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {CALIBRATION_FILE}")


if __name__ == "__main__":
    main()
