"""Price one MoE layer's experts as `moe_gemm_measure.py` timed them, and write the table.

Two measured times per token count: the two grouped GEMMs alone, and the whole routed MLP of
`gpu_steps_measure.py` (router, top-k, sort, gathers, GEMMs, combine, each its own kernel).
The roofline (flowyard/costmodel/moe.py) is set beside each: its GEMM price (gate/up and down,
no router) and its whole-FFN price (with the router, element-wise traffic and launches). An
engine's fused MoE (gathers folded into the GEMM, one combine kernel) costs between the two
measured columns, so the GEMM ratio is the roofline's error on the part engines share, and the
whole-MLP ratio an upper bound on the rest.

    python benchmarks/moe_gemm_compare.py [--data benchmarks/results/moe_gemm_h100.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from flowyard.costmodel import get_model
from flowyard.costmodel.engines import DEFAULT_ENGINE_PROFILE
from flowyard.costmodel.fit import current_fit
from flowyard.costmodel.moe import ExpertFFN
from flowyard.experiments.report import md_table, source_revision

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "benchmarks" / "results" / "moe_gemm_h100.json"


def priced(data: dict) -> list[dict]:
    """Each point with the roofline's prices (ms) of its GEMMs and of its whole FFN."""
    gpu = "h100" if "H100" in data["meta"]["device"] else "h200"
    ffn = ExpertFFN.build(get_model(data["meta"]["model"]), current_fit().hardware(gpu, DEFAULT_ENGINE_PROFILE), 1, 2)
    ra, rw, rb = ffn.router
    out = []
    for p in data["points"]:
        T = p["tokens"]
        gu, dn = ffn.op_times(T)
        router = max(ra * T, rw + rb * T)
        whole = gu + dn + T * (ffn.gate_up_elem + ffn.down_elem) + ffn.gate_up_fixed + ffn.down_fixed
        out.append({**p, "gemms_pred_ms": 1e3 * (gu - router + dn), "moe_pred_ms": 1e3 * whole})
    return out


def report(data: dict) -> str:
    meta, rows = data["meta"], priced(data)
    lines = [f"# One MoE layer's experts on an {meta['device']}: measured and priced (report at "
             f"{source_revision() or 'unknown revision'})", "",
             f"Measured by `python benchmarks/moe_gemm_measure.py` at {meta['revision']} ({meta['model']}, "
             f"{meta['dtype']}, PyTorch {meta['torch']}, CUDA-graph replay, median of {meta['reps']}; uniform "
             f"routing); priced by `python benchmarks/moe_gemm_compare.py` with the `{DEFAULT_ENGINE_PROFILE}` "
             "profile of the `published` calibration. An engine's fused MoE costs between the two measured "
             "columns: the GEMMs are what every engine runs, the rest of the whole MLP here is gathers, sorts "
             "and a combine that fused kernels partly fold away.", ""]
    lines.append(md_table(
        ("tokens", "experts touched", "GEMMs ms", "priced ms", "measured / priced", "whole MLP ms",
         "priced ms", "measured / priced"),
        [(p["tokens"], p["distinct_experts"], f"{p['gemms_ms']:.3f}", f"{p['gemms_pred_ms']:.3f}",
          f"{p['gemms_ms'] / p['gemms_pred_ms']:.2f}", f"{p['moe_ms']:.3f}", f"{p['moe_pred_ms']:.3f}",
          f"{p['moe_ms'] / p['moe_pred_ms']:.2f}") for p in rows]))
    big = [p["gemms_ms"] / p["gemms_pred_ms"] for p in rows if p["tokens"] >= 8]
    lines += ["", f"From 8 tokens up the grouped GEMMs take {min(big):.2f}-{max(big):.2f}x the roofline's price."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "moe_gemm_h100.md")
    a = ap.parse_args(argv)
    a.out.write_text(report(json.loads(a.data.read_text())))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
