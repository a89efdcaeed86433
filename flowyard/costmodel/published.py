"""Published GPU measurements the simulator is checked against (`flowyard validate`).

The points live in `flowyard/data/published_points.json`, one per line: a number someone else
measured on a GPU and where it comes from (a paper's table or text, a repository file at a
commit, or a public benchmark page). Nothing there was produced by flowyard. Each point names
its source `family` (the unit of leave-one-source-out cross-validation: all of Vidur's
profiles are one family) and the `engine` profile (costmodel.engines) of the stack that
measured it.

Kinds (what `flowyard.costmodel.fit.predict` compares against):
  step          whole step time (ms): prefills (history, new tokens) and decodes (count, context)
  attn_prefill  one layer's prefill attention kernel (ms), one sequence
  attn_decode   one layer's decode attention kernel (ms)
  cpu_overhead  per-step CPU time outside the GPU kernels (ms) for `decodes` sequences
  ridge         prefill tokens where a lone prefill turns compute-bound (a range [lo, hi])
  generation    end-to-end latency (ms) of a batch that prefills together and decodes in lockstep
  serving       a serving run replayed in the simulator (`metric`: ttft_p50, tpot_p50 in ms,
                tbt_p50 over every gap between tokens, throughput_rps); `workload.scheduler`
                names the policy the measured engine ran: "vllm" (chunked prefill beside
                decodes, the default), "round-robin" (the same behind a round-robin router) or
                "prefill-first" (vLLM V0 without chunked prefill, SGLang without mixed
                chunks); `trace` (with `rate` or `concurrency`), `shape` ([prompt, output]
                for every request) or `lengths` (the run's own [prompt, output] pairs, in
                order), the last two with Poisson arrivals at `rate`; `instances` and `chunk` (the
                token budget) when the run was not one instance with the policy's default;
                `scheduler_steps` (vLLM 0.6's --num-scheduler-steps) when the engine scheduled
                once per that many steps
A point with `hi` set is a range: the error is 0 inside it, else the distance to the nearest end.

Derived points keep their derivation as data and the loader computes it: `parts` (a sum of
profiled phases), `little` (a decode batch by Little's law, rps/replicas x tokens x TBT, at
context `ctx`) and `chunk` (a chunked-prefill step: the token budget less the decodes, at a
history).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from flowyard.costmodel.models import ModelSpec

DATA = Path(__file__).resolve().parents[1] / "data" / "published_points.json"
KINDS = ("step", "attn_prefill", "attn_decode", "cpu_overhead", "ridge", "generation", "serving")
METRICS = ("ttft_p50", "tpot_p50", "tbt_p50", "throughput_rps")
SCHEDULERS = ("vllm", "prefill-first", "round-robin")

# Models the sources measured that are not in our catalog (shapes from their config.json).
LLAMA2_7B = ModelSpec("llama-2-7b", hidden=4096, layers=32, heads=32, kv_heads=32, head_dim=128,
                      intermediate=11008, vocab=32000)
LLAMA2_70B = ModelSpec("llama-2-70b", hidden=8192, layers=80, heads=64, kv_heads=8, head_dim=128,
                       intermediate=28672, vocab=32000)
CODELLAMA_34B = ModelSpec("codellama-34b", hidden=8192, layers=48, heads=64, kv_heads=8,
                          head_dim=128, intermediate=22016, vocab=32000)
EXTRA_MODELS = {m.name: m for m in (LLAMA2_7B, LLAMA2_70B, CODELLAMA_34B)}


@dataclass(frozen=True)
class Point:
    """One published measurement and the batch (or run) it was taken on."""

    name: str
    kind: str
    model: str | ModelSpec
    hardware: str
    tp: int
    measured: float
    unit: str
    source: str                                  # paper + table/text, repo:path@commit, or URL
    prefills: tuple[tuple[int, int], ...] = ()   # (history, new tokens)
    decodes: tuple[tuple[int, int], ...] = ()    # (count, context length)
    hi: float | None = None                      # set: `measured` is the low end of a range
    note: str = ""
    from_figure: bool = False
    kernel: str = ""                             # a measured kernel with its own terms
    family: str = ""                             # source family: the cross-validation fold
    engine: str = ""                             # engine profile of the measuring stack
    metric: str = ""                             # serving points: what was measured
    workload: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def is_range(self) -> bool:
        return self.hi is not None

    @property
    def group(self) -> str:
        """The kind a report groups the point under: prefill, decode, mixed, serving, kernel,
        cpu (a generation run is decode steps after one small prefill)."""
        if self.kind == "serving":
            return "serving"
        if self.kind.startswith("attn_"):
            return "kernel"
        if self.kind == "cpu_overhead":
            return "cpu"
        if self.kind in ("ridge",):
            return "prefill"
        if self.kind == "generation":
            return "decode"
        if self.prefills and self.decodes:
            return "mixed"
        return "prefill" if self.prefills else "decode"


def _model(name: str) -> str | ModelSpec:
    return EXTRA_MODELS.get(name, name)


def _pairs(field: str, rows: Any) -> tuple[tuple[int, int], ...]:
    """`rows` as (int, int) pairs; an entry of another length is a bad field, not a silent tuple."""
    out = []
    for x in rows:
        if len(x) != 2:
            raise ValueError(f"{field}: each entry needs two numbers, got {x!r}")
        out.append((int(x[0]), int(x[1])))
    return tuple(out)


def point_from_dict(d: dict[str, Any]) -> Point:
    """A `Point` from one JSON entry, its derivations computed. Bad entries raise ValueError."""
    try:
        kind = d["kind"]
        if kind not in KINDS:
            raise ValueError(f"unknown kind {kind!r}")
        if kind == "serving" and d.get("metric") not in METRICS:
            raise ValueError(f"serving point needs a metric in {METRICS}")
        w = d.get("workload", {})
        if w.get("scheduler", "vllm") not in SCHEDULERS:
            raise ValueError(f"workload scheduler must be one of {SCHEDULERS}")
        if kind == "serving" and sum(k in w for k in ("trace", "shape", "lengths")) != 1:
            raise ValueError("a serving point's workload needs one of a trace, a shape or lengths")
        if "lengths" in w and not (w["lengths"] and all(len(r) == 2 and min(map(int, r)) >= 1
                                                        for r in w["lengths"])):
            raise ValueError("workload lengths must be [prompt tokens, output tokens] pairs, both >= 1")
        steps = w.get("scheduler_steps", 1)
        if not isinstance(steps, int) or steps < 1:
            raise ValueError("workload scheduler_steps must be a whole number >= 1")
        if "shape" in w and not (len(w["shape"]) == 2 and all(int(x) >= 1 for x in w["shape"])):
            raise ValueError("workload shape must be [prompt tokens, output tokens], both >= 1")
        measured = float(sum(d["parts"])) if "parts" in d else float(d["measured"])
        prefills = _pairs("prefills", d.get("prefills", ()))
        decodes = _pairs("decodes", d.get("decodes", ()))
        note = d.get("note", "")
        if "little" in d:
            li = d["little"]
            batch = max(1, round(li["rps"] / li.get("replicas", 1) * li["tokens"] * measured / 1e3))
            decodes = ((batch, int(li["ctx"])),)
            note = (f"batch {batch} = {li['rps']} rps / {li.get('replicas', 1)} x {li['tokens']} "
                    f"tokens x {measured} ms (Little's law)" + (f"; {note}" if note else ""))
        if "chunk" in d:
            ch = d["chunk"]
            prefills = ((int(ch["history"]), int(ch["budget"]) - sum(c for c, _ in decodes)),)
        return Point(d["name"], kind, _model(d["model"]), d["hardware"], int(d["tp"]), measured,
                     d["unit"], d["source"], prefills, decodes, d.get("hi"), note,
                     bool(d.get("from_figure", False)), d.get("kernel", ""), d["family"],
                     d["engine"], d.get("metric", ""), dict(d.get("workload", {})))
    except (KeyError, TypeError) as e:
        raise ValueError(f"published point {d.get('name', '?')!r}: missing or bad field {e}") from None


def load_points(path: str | Path = DATA) -> list[Point]:
    """Every point of a published-points JSON file, in file order."""
    doc = json.loads(Path(path).read_text())
    return [point_from_dict(d) for d in doc["points"]]


@lru_cache(maxsize=1)
def _bundled() -> tuple[Point, ...]:
    return tuple(load_points(DATA))


def published_points() -> list[Point]:
    """The bundled points, in file order."""
    return list(_bundled())


def families(points: list[Point] | None = None) -> list[str]:
    """Source families in first-seen order."""
    seen: dict[str, None] = {}
    for p in published_points() if points is None else points:
        seen.setdefault(p.family, None)
    return list(seen)
