"""Price the GPU steps `gpu_steps_measure.py` timed with the simulator's cost model and report
the error by kind (prefill, decode, mixed, several prompts in one step).

Why: none of these H100 steps was used to fit the cost model (its kernel terms come from A100
points and its H100 terms from the hardware catalog; `flowyard/data/calibration.json` names
what each profile was fitted on), so this is a held-out check, and the mixed steps check the
premise PLA-Serve and DynaServe rest on: what a step that carries both prompt chunks and
decodes costs. CUDA-graph replay times are the GPU's alone, so they are compared with the
default profile (vllm-v1: CUDA graphs, host work overlapped); the eager times show how much a
Python-launched step adds.

    python benchmarks/gpu_steps_compare.py [--data benchmarks/results/gpu_steps_h200.json]
    # writes docs/results/gpu_steps_<gpu>.md
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from flowyard.core.plan import BatchShape
from flowyard.costmodel.engines import DEFAULT_ENGINE_PROFILE
from flowyard.costmodel.fit import current_fit
from flowyard.costmodel.roofline import RooflineCostModel
from flowyard.experiments.report import md_table, source_revision

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "benchmarks" / "results" / "gpu_steps_h100.json"
GPUS = ("H100", "H200", "A100", "H800")  # the device name's family -> the catalog's GPU


TP_NOTE = (" (one rank's shard, `--tp`: heads, KV heads, MLP width and vocabulary divided by the TP "
           "size; the measurement runs no collectives, so the prediction leaves out the cost model's "
           "all-reduce and all-gather terms)")


def gpu_of(meta: dict) -> str:
    """The catalog GPU a measurement ran on, from the device name CUDA reported."""
    for g in GPUS:
        if g in meta["device"]:
            return g.lower() if g != "A100" else "a100-80g"
    raise ValueError(f"no catalog GPU for device {meta['device']!r}")


def kind(p: dict) -> str:
    np_, nd = len(p["prefills"]), sum(b for b, _ in p["decodes"])
    if np_ and nd:
        return "mixed"
    if any(h for h, _ in p["prefills"]):
        return "prefill with history"
    if np_ > 1:
        return "prompts batched"
    return "prefill" if np_ else "decode"


def shape(p: dict) -> BatchShape:
    return BatchShape.of([tuple(x) for x in p["prefills"]], [c for b, c in p["decodes"] for _ in range(b)])


def label(p: dict) -> str:
    pre = p["prefills"]
    if len({tuple(x) for x in pre}) == 1 and len(pre) > 1:
        ps = f"{len(pre)} x {pre[0][1]}"
    else:
        ps = " + ".join(f"{n} after {h}" if h else str(n) for h, n in pre)
    ds = " + ".join(f"{b} x ctx {c}" for b, c in p["decodes"])
    return " ; ".join(x for x in (ps and f"prompt {ps}", ds and f"decode {ds}") if x)


def price(points: list[dict], model: str, gpu: str, engine: str, tp: int = 1) -> list[float]:
    """Predicted ms of each step; for one rank of a TP group, without the collectives (the
    measurement ran none)."""
    cm = RooflineCostModel(model, current_fit().hardware(gpu, engine), tp)
    return [1e3 * float(cm.step_time(s) - cm.collective_time(s)) for s in map(shape, points)]


def interference(points: list[dict], pred: list[float]) -> list[tuple]:
    """Mixed steps against the sum of their parts run alone, measured and predicted: below 1 a
    mixed step is cheaper than the two steps it replaces (the weights are read once)."""
    alone = {json.dumps([p["prefills"], p["decodes"]]): (p["graph_ms"], q) for p, q in zip(points, pred)}
    rows = []
    for p, q in zip(points, pred):
        if kind(p) != "mixed":
            continue
        a = alone.get(json.dumps([p["prefills"], []]))
        b = alone.get(json.dumps([[], p["decodes"]]))
        if a and b:
            rows.append((label(p), p["graph_ms"] / (a[0] + b[0]), q / (a[1] + b[1])))
    return rows


def errors(data: dict) -> tuple[list[float], list[float]]:
    """(predicted ms, relative error against the graph replay) for every measured step."""
    pred = priced(data)
    return pred, [q / p["graph_ms"] - 1 for p, q in zip(data["points"], pred)]


def priced(data: dict) -> list[float]:
    """`price` of a measurement file's steps, on the model, GPU and TP size it records."""
    meta = data["meta"]
    return price(data["points"], meta["model"], gpu_of(meta), DEFAULT_ENGINE_PROFILE, meta.get("tp", 1))


def varlen_rows(data: dict, varlen: dict) -> list[tuple]:
    """Steps of several fresh prompts timed again with their attention as one variable-length
    call (`gpu_steps_measure.py --varlen`, as vLLM's prefill runs it): the per-prompt time, the
    one-call time and the prediction's error against each."""
    pred = priced(varlen)
    per = {json.dumps([p["prefills"], p["decodes"]]): p["graph_ms"] for p in data["points"]}
    rows = []
    for p, q in zip(varlen["points"], pred):
        a = per.get(json.dumps([p["prefills"], p["decodes"]]))
        if a:
            rows.append((label(p), a, p["graph_ms"], q))
    return rows


def report(data: dict, varlen: dict | None = None) -> str:
    meta, points = data["meta"], data["points"]
    pred, err = errors(data)
    rev = source_revision() or "unknown revision"
    gpu = gpu_of(meta)
    model, tp = meta["model"], meta.get("tp", 1)
    moe = ("Each MoE layer runs its experts as fused-MoE engines do (tokens sorted by expert, two "
           "grouped GEMMs, `torch._grouped_mm`); with random router weights the routing is close to "
           "uniform, the case the cost model's distinct-expert count assumes. ") if "a3b" in model else ""
    lines = [f"# Cost model vs whole steps measured on an {gpu.upper()}"
             + ("" if model == "llama-3-8b" else f": {model}") + (f", one rank of TP {tp}" if tp > 1 else "")
             + f" (report at {rev})", "",
             f"Measured by `python benchmarks/gpu_steps_measure.py` at {meta['revision']} on one "
             f"{meta['device']} (PyTorch {meta['torch']}, {meta['dtype']}, median of {meta['reps']} "
             f"runs per step); priced by `python benchmarks/gpu_steps_compare.py` with the "
             f"`{DEFAULT_ENGINE_PROFILE}` profile of the `published` calibration, model "
             f"{meta['model']}, GPU `{gpu}`, TP {tp}{TP_NOTE if tp > 1 else ''}. None of these steps was "
             "used to fit the cost model. "
             "Random bf16 weights; attention is PyTorch's fused SDPA (flash), one call per prompt "
             "and one batched call for the decodes (all at one context length). " + moe,
             "", "## Error by kind (CUDA-graph replay)", ""]
    kinds = sorted({kind(p) for p in points})
    rows = []
    for k in kinds + ["all"]:
        e = [abs(x) for p, x in zip(points, err) if k == "all" or kind(p) == k]
        rows.append((k, len(e), f"{100 * statistics.median(e):.1f} %", f"{100 * max(e):.1f} %"))
    lines += [md_table(("kind", "steps", "median abs error", "max abs error"), rows), ""]
    lines += ["## Every step", "",
              md_table(("step", "kind", "graph ms", "predicted ms", "error", "eager ms", "eager / graph"),
                       [(label(p), kind(p), f"{p['graph_ms']:.2f}", f"{q:.2f}", f"{100 * x:+.1f} %",
                         f"{p['eager_ms']:.2f}", f"{p['eager_ms'] / p['graph_ms']:.2f}")
                        for p, q, x in zip(points, pred, err)]), ""]
    inter = interference(points, pred)
    lines += ["## A mixed step against its parts run alone", "",
              "Mixed step time / (the prompt chunk alone + the decodes alone). Below 1 the mixed "
              "step saves the second pass over the weights; the cost model prices the mixed step "
              "as one step, so it should show the same saving.", "",
              md_table(("step", "measured", "predicted"),
                       [(s, f"{a:.2f}", f"{b:.2f}") for s, a, b in inter]), ""]
    if varlen:
        vr = varlen_rows(data, varlen)
        lines += ["## Several prompts' attention in one variable-length call", "",
                  "The same steps timed again with `--varlen` (at "
                  f"{varlen['meta']['revision']}): the prompts' attention is one variable-length "
                  "flash-attention call, as vLLM's prefill makes it, instead of one call per prompt "
                  "(the tables above).", "",
                  md_table(("step", "per-prompt calls ms", "one call ms", "predicted ms",
                            "error vs per-prompt", "error vs one call"),
                           [(s, f"{a:.2f}", f"{b:.2f}", f"{q:.2f}", f"{100 * (q / a - 1):+.1f} %",
                             f"{100 * (q / b - 1):+.1f} %") for s, a, b, q in vr]), ""]
    gaps = [p["eager_ms"] - p["graph_ms"] for p in points]
    lines += ["## What a Python-launched step adds", "",
              f"Eager minus graph time: median {statistics.median(gaps):.2f} ms, max {max(gaps):.2f} ms "
              "over these steps; it is largest for small steps, where launches outrun the GPU. "
              "This is PyTorch's launch cost alone, not a 2023 engine's scheduler and sampler "
              "(the `eager-2023` profile), so it is shown, not checked.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--out", type=Path, help="default: docs/results/gpu_steps_<gpu>.md")
    a = ap.parse_args(argv)
    data = json.loads(a.data.read_text())
    model = data["meta"]["model"]
    tp = data["meta"].get("tp", 1)
    suffix = ("" if model == "llama-3-8b" and tp == 1 else f"_{model}") + (f"_tp{tp}" if tp > 1 else "")
    out = a.out or ROOT / "docs" / "results" / f"gpu_steps_{gpu_of(data['meta'])}{suffix}.md"
    side = a.data.with_name(a.data.stem + "_varlen.json")
    out.write_text(report(data, json.loads(side.read_text()) if side.exists() else None))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
