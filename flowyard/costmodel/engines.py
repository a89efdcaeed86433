"""Engine profiles: the fixed per-step and per-sequence CPU costs of a serving stack.

The GPU kernels of a step cost the same under any engine; what differs by an order of
magnitude is the host time around them. An eager engine that rebuilds its inputs and launches
every kernel from Python each step pays milliseconds per step and tens of microseconds per
sequence; an engine that replays CUDA graphs and prepares step n+1 while step n runs (vLLM's
V1 engine with async scheduling, SGLang's overlap scheduler) hides most of it. A profile names
one such stack and carries its host terms (RooflineParams.step_overhead_s, seq_overhead_s,
seq_overhead_layer_s, and frontend_s: the latency of the stack's HTTP frontend, which a client's
TTFT includes and a step does not; and, where its stacks' tensor-parallel runs say so,
ar_latency_s: CUDA-graph engines with their own one-shot all-reduce pay a fraction of the NCCL
latency an eager profile measures), each fitted by `python -m flowyard.costmodel.fit --write` on the
published points of its own source family (`fitted_on`) and stored in
flowyard/data/calibration.json with the fit's revision. A profile with no step-level points
of its own has none: it is not offered.

Profiles apply under the 'published' calibration (the fitted one); 'vidur' keeps its assumed
host terms whatever the profile.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

CALIBRATION_FILE = Path(__file__).resolve().parents[1] / "data" / "calibration.json"
DEFAULT_ENGINE_PROFILE = "vllm-v1"
# `flowyard reproduce --engine-profile` sets this for the experiments it runs (they build
# their own SimConfigs); an explicit profile always wins over it.
ENV_VAR = "FLOWYARD_ENGINE_PROFILE"
HOST_TERMS = ("step_overhead_s", "seq_overhead_s", "seq_overhead_layer_s", "frontend_s")

DESCRIPTIONS = {
    "eager-2023": "eager PyTorch step loop, synchronous scheduling: Sarathi-Serve / vLLM of 2023 "
                  "as Vidur profiled them",
    "vllm-v0": "vLLM 0.4-0.7 (V0 engine): CUDA graphs for decode, CPU scheduling and input "
               "preparation between steps",
    "vllm-v1": "vLLM >= 0.8 (V1 engine) and SGLang: CUDA graphs, persistent batch, CPU work "
               "overlapped with the GPU (async scheduling); the default",
}


@dataclass(frozen=True)
class EngineProfile:
    """One serving stack's host-side costs (seconds)."""

    name: str
    description: str
    step_overhead_s: float
    seq_overhead_s: float
    seq_overhead_layer_s: float
    fitted_on: tuple[str, ...]
    frontend_s: float = 0.0
    ar_latency_s: float | None = None  # set when its stacks' tensor-parallel runs fitted it

    def terms(self) -> dict[str, float]:
        """The RooflineParams fields this profile sets."""
        out = {k: getattr(self, k) for k in HOST_TERMS}
        if self.ar_latency_s is not None:
            out["ar_latency_s"] = self.ar_latency_s
        return out


@lru_cache(maxsize=1)
def calibration_data() -> dict:
    """flowyard/data/calibration.json: the fitted kernel terms and engine profiles."""
    return json.loads(CALIBRATION_FILE.read_text())


def engine_profiles() -> dict[str, EngineProfile]:
    """Every named profile, from the calibration file."""
    out = {}
    for name, d in calibration_data()["engines"].items():
        out[name] = EngineProfile(name, DESCRIPTIONS.get(name, ""), float(d["step_overhead_s"]),
                                  float(d["seq_overhead_s"]), float(d["seq_overhead_layer_s"]),
                                  tuple(d.get("fitted_on", ())), float(d.get("frontend_s", 0.0)),
                                  float(d["ar_latency_s"]) if "ar_latency_s" in d else None)
    return out


def engine_profile_names() -> tuple[str, ...]:
    return tuple(engine_profiles())


def get_engine_profile(name: str | EngineProfile | None = None) -> EngineProfile:
    """A profile by (case-insensitive) name; None gives $FLOWYARD_ENGINE_PROFILE or the
    default. Unknown names raise a
    ValueError that lists the valid ones."""
    if isinstance(name, EngineProfile):
        return name
    profiles = engine_profiles()
    key = (name or os.environ.get(ENV_VAR) or DEFAULT_ENGINE_PROFILE).strip().lower()
    if key not in profiles:
        raise ValueError(f"unknown engine profile {name!r}; choose one of {', '.join(profiles)}")
    return profiles[key]
