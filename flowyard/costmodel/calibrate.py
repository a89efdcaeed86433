"""Fit the roofline's efficiency factors to Vidur's measured GPU operator and NCCL timings.

Reproduce the constants in `hardware.py` with `python -m flowyard.costmodel.calibrate`.

Vidur times each kernel of one layer separately (fp16, CUDA events, ms). The fit works per
kernel, so every factor keeps a physical meaning: eff_compute, eff_mem and gemm_fixed_s on
the four GEMM columns, then eff_elem and launch_s on the norm/activation/add/RoPE columns,
each minimising the mean |log(pred/meas)| over token counts 1..4096 and TP 1, 2, 4, 8 of
every profile of one GPU family (a numpy Nelder-Mead over log-parameters, so small and large
batches weigh alike). All-reduce latency and bus efficiency are fitted the same way on
intra-node NCCL rows. The check is on our operators, which fold norms, activation and
residual adds into their neighbouring GEMM: each is compared with the matching sum of Vidur
columns (`OP_COLUMNS`) in `op_errors` / `report`.
"""

from __future__ import annotations

import csv
import gzip
import io
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from flowyard.core.plan import BatchShape
from flowyard.costmodel.hardware import HARDWARE, HardwareSpec
from flowyard.costmodel.models import ModelSpec
from flowyard.costmodel.roofline import RooflineCostModel

SHARED_DIR = Path(__file__).resolve().parents[3] / "shared" / "profiles" / "vidur"
VENDORED_DIR = Path(__file__).resolve().parents[1] / "data" / "profiles"
OP_COLUMNS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("input_layernorm", "attn_pre_proj"),
    "o_proj": ("attn_post_proj", "add"),
    "gate_up_proj": ("post_attention_layernorm", "mlp_up_proj"),
    "down_proj": ("mlp_act", "mlp_down_proj", "add"),
}
FAMILY_HW = {"a100": "a100-80g", "h100": "h100"}  # Vidur's a100 is the 80 GB SXM part
GEMM_COLUMNS = {"qkv_proj": "attn_pre_proj", "o_proj": "attn_post_proj",
                "gate_up_proj": "mlp_up_proj", "down_proj": "mlp_down_proj"}
ELEM_COLUMNS = ("input_layernorm", "post_attention_layernorm", "mlp_act", "add", "attn_rope")
GEMM_KEYS = ("eff_compute", "eff_mem", "gemm_fixed_s")
ELEM_KEYS = ("eff_elem", "launch_s")


def profile_dir() -> Path:
    """The shared Vidur profiles when present (all six models), else the vendored subset."""
    return SHARED_DIR if SHARED_DIR.is_dir() else VENDORED_DIR


def read_profile(path: Path) -> list[dict[str, str]]:
    """Rows of a Vidur CSV, plain or gzipped."""
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    return list(csv.DictReader(io.StringIO(raw.decode())))


def find_profiles(pattern: str, directory: Path | None = None) -> list[Path]:
    """Profile files matching a glob stem (e.g. "h100_*_mlp"), plain or gzipped."""
    d = directory or profile_dir()
    return sorted(d.glob(pattern + ".csv")) + sorted(d.glob(pattern + ".csv.gz"))


def load_mlp_profiles(family: str, directory: Path | None = None, max_tokens: int = 4096
                      ) -> Iterator[tuple[str, ModelSpec, int, np.ndarray, dict[str, np.ndarray]]]:
    """Yield (file stem, model shape, tp, token counts, measured seconds) per TP degree; the
    measurements are keyed by Vidur column and by our composite op name."""
    for path in find_profiles(f"{family}_*_mlp", directory):
        rows = read_profile(path)
        r0 = rows[0]
        heads, hidden = int(r0["n_head"]), int(r0["n_embd"])
        spec = ModelSpec(path.name.split("_")[1], hidden=hidden, layers=1, heads=heads,
                         kv_heads=int(r0["n_kv_head"]), head_dim=hidden // heads,
                         intermediate=int(r0["n_expanded_embd"]), vocab=int(r0["vocab_size"]))
        for tp in sorted({int(r["num_tensor_parallel_workers"]) for r in rows}):
            sel = sorted(((int(r["num_tokens"]), r) for r in rows
                          if int(r["num_tensor_parallel_workers"]) == tp
                          and int(r["num_tokens"]) <= max_tokens), key=lambda x: x[0])
            tokens = np.array([t for t, _ in sel], dtype=float)
            cols = set(ELEM_COLUMNS) | set(GEMM_COLUMNS.values())
            meas = {c: np.array([float(r[f"time_stats.{c}.median"]) for _, r in sel]) * 1e-3
                    for c in cols}
            for op, parts in OP_COLUMNS.items():
                meas[op] = sum((meas[c] for c in parts), np.zeros_like(tokens))
            yield path.name.split("_mlp")[0], spec, tp, tokens, meas


def predict_ops(spec: ModelSpec, hw: HardwareSpec, tp: int, tokens: np.ndarray
                ) -> dict[str, np.ndarray]:
    """Per-layer seconds of the four linear composites for prefill batches of `tokens` rows."""
    cm = RooflineCostModel(spec, hw, tp, dtype_bytes=2)
    ops = cm.layer_op_times(BatchShape(prefill_tokens=tokens))
    return {op: np.asarray(ops[op], dtype=float) for op in OP_COLUMNS}


def op_errors(family: str, hw: HardwareSpec | None = None, directory: Path | None = None
              ) -> dict[str, np.ndarray]:
    """Relative errors |pred - meas| / meas per op over every profile row of the family."""
    hw = hw or HARDWARE[FAMILY_HW[family]]
    errs: dict[str, list[np.ndarray]] = {op: [] for op in OP_COLUMNS}
    for _, spec, tp, tokens, meas in load_mlp_profiles(family, directory):
        pred = predict_ops(spec, hw, tp, tokens)
        for op in OP_COLUMNS:
            errs[op].append(np.abs(pred[op] - meas[op]) / meas[op])
    return {op: np.concatenate(v) for op, v in errs.items()}


def nelder_mead(f: Callable[[np.ndarray], float], x0: np.ndarray, step: float = 0.3,
                iters: int = 400) -> np.ndarray:
    """Minimal Nelder-Mead (numpy only: no scipy dependency for a one-off fit)."""
    pts = [x0] + [x0 + step * np.eye(len(x0))[i] for i in range(len(x0))]
    vals = [f(p) for p in pts]
    for _ in range(iters):
        order = np.argsort(vals)
        pts, vals = [pts[i] for i in order], [vals[i] for i in order]
        centroid = np.mean(pts[:-1], axis=0)
        refl = centroid + (centroid - pts[-1])
        fr = f(refl)
        if fr < vals[0]:
            exp = centroid + 2 * (centroid - pts[-1])
            fe = f(exp)
            pts[-1], vals[-1] = (exp, fe) if fe < fr else (refl, fr)
        elif fr < vals[-2]:
            pts[-1], vals[-1] = refl, fr
        else:
            con = centroid + 0.5 * (pts[-1] - centroid)
            fc = f(con)
            if fc < vals[-1]:
                pts[-1], vals[-1] = con, fc
            else:
                pts = [pts[0] + 0.5 * (p - pts[0]) for p in pts]
                vals = [f(p) for p in pts]
    return pts[int(np.argmin(vals))]


def kernel_times(hw: HardwareSpec, spec: ModelSpec, tp: int, tokens: np.ndarray
                 ) -> dict[str, np.ndarray]:
    """Seconds of each Vidur kernel column under the roofline's per-kernel terms."""
    cm = RooflineCostModel(spec, hw, tp, dtype_bytes=2)
    p, b = hw.params, cm.dtype_bytes
    flops, bw = hw.peak_flops * p.eff_compute, hw.mem_bw * p.eff_mem
    elem = hw.mem_bw * p.eff_elem
    out = {}
    for op, (k, n) in cm.gemms.items():
        out[GEMM_COLUMNS[op]] = np.maximum(2 * tokens * k * n / flops,
                                           (k * n + tokens * (k + n)) * b / bw) + p.gemm_fixed_s
        for name, per_row in cm.elementwise[op]:
            out[name] = tokens * per_row / elem + p.launch_s
    out["attn_rope"] = tokens * dict(cm.elementwise["attn"])["attn_rope"] / elem + p.launch_s
    return out


def _fit(family: str, keys: tuple[str, ...], columns: tuple[str, ...], x0: list[float],
         base: HardwareSpec, directory: Path | None) -> dict[str, float]:
    data = list(load_mlp_profiles(family, directory))

    def loss(x: np.ndarray) -> float:
        hw = base.with_params(**dict(zip(keys, np.exp(x))))
        err = []
        for _, spec, tp, tokens, meas in data:
            pred = kernel_times(hw, spec, tp, tokens)
            err += [np.abs(np.log(pred[c] / meas[c])) for c in columns]
        return float(np.mean(np.concatenate(err)))

    return dict(zip(keys, (float(v) for v in np.exp(nelder_mead(loss, np.log(x0))))))


def fit_compute(family: str, directory: Path | None = None) -> dict[str, float]:
    """Fit the GEMM factors on the four GEMM columns, then the elementwise factors on the
    norm/activation/add/RoPE columns, over every profile of one GPU family."""
    base = HARDWARE[FAMILY_HW[family]]
    gemm = _fit(family, GEMM_KEYS, tuple(GEMM_COLUMNS.values()), [0.7, 0.8, 8e-6], base,
                directory)
    elem = _fit(family, ELEM_KEYS, ELEM_COLUMNS, [0.5, 2e-6], base.with_params(**gemm),
                directory)
    return {**gemm, **elem}


def load_allreduce(family: str, directory: Path | None = None) -> tuple[np.ndarray, ...]:
    """Intra-node NCCL all-reduce rows: (workers, bytes, seconds). Vidur's collective profiler
    writes `size` already in bytes (its fp16 element count times two, collectives_wrapper.py);
    read as elements, every message was twice its size and the fitted bus bandwidth twice what
    NVLink can carry (H100 702 GB/s, A100 345 GB/s, against 450 and 300 per direction)."""
    (path,) = find_profiles(f"network_{family}_dgx_all_reduce", directory)[:1]
    rows = [r for r in read_profile(path) if r["num_workers"] == r["devices_per_node"]]
    n = np.array([int(r["num_workers"]) for r in rows], dtype=float)
    nbytes = np.array([int(r["size"]) for r in rows], dtype=float)
    secs = np.array([float(r["time_stats.all_reduce.median"]) for r in rows]) * 1e-3
    return n, nbytes, secs


def allreduce_time(hw: HardwareSpec, n: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    """Ring all-reduce: latency + 2(n-1)/n * bytes / (link bw * bus efficiency)."""
    p = hw.params
    return p.ar_latency_s + 2 * (n - 1) / n * nbytes / (hw.nvlink_bw * p.ar_eff)


def fit_allreduce(family: str, directory: Path | None = None) -> dict[str, float]:
    """Fit ar_latency_s and ar_eff of one family to its intra-node NCCL all-reduce rows."""
    base = HARDWARE[FAMILY_HW[family]]
    n, nb, t = load_allreduce(family, directory)

    def loss(x: np.ndarray) -> float:
        hw = base.with_params(ar_latency_s=float(np.exp(x[0])), ar_eff=float(np.exp(x[1])))
        return float(np.mean(np.abs(np.log(allreduce_time(hw, n, nb) / t))))

    x = nelder_mead(loss, np.log([20e-6, 0.8]))
    return {"ar_latency_s": float(np.exp(x[0])), "ar_eff": float(np.exp(x[1]))}


def report(family: str, hw: HardwareSpec | None = None) -> str:
    """Median and p90 relative error of each composite op and of the all-reduce."""
    hw = hw or HARDWARE[FAMILY_HW[family]]
    errs = op_errors(family, hw)
    n, nb, t = load_allreduce(family)
    ar = np.abs(allreduce_time(hw, n, nb) - t) / t
    lines = [f"{family}: median relative error per op over {len(errs['qkv_proj'])} rows"]
    lines += [f"  {op:<13} {np.median(e) * 100:5.1f} %  (p90 {np.percentile(e, 90) * 100:5.1f} %)"
              for op, e in errs.items()]
    lines.append(f"  {'allreduce':<13} {np.median(ar) * 100:5.1f} %  (p90 "
                 f"{np.percentile(ar, 90) * 100:5.1f} %)")
    return "\n".join(lines)


def main() -> None:
    for family in FAMILY_HW:
        fitted = {**fit_compute(family), **fit_allreduce(family)}
        print(f"{family}: " + ", ".join(f"{k}={v:.4g}" for k, v in fitted.items()))
        hw = HARDWARE[FAMILY_HW[family]]
        print(report(family, replace(hw, params=replace(hw.params, **fitted))))


if __name__ == "__main__":
    main()
