"""Pieces of `real_cluster.py`: workloads and SLOs scaled to the engine, one measured point on a
real server and in the simulator, the server's lifetime, and the report with its verdicts."""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path

from real_cluster_fixed import fixed_table, point_of
from real_cluster_observed import served_section
from real_cluster_points import added_note
from real_cluster_speed import speed_cell
from real_cluster_verdicts import _err, _pct, bracket, distance, kendall_tau, verdicts  # noqa: F401

from flowyard.bench.loadgen import cap_lengths
from flowyard.bench.serve_bench import run_bench
from flowyard.core.plan import BatchShape
from flowyard.costmodel.base import DriftedCostModel
from flowyard.costmodel.link import Link
from flowyard.costmodel.profiled import ProfiledCostModel
from flowyard.experiments.report import md_table, source_revision
from flowyard.policies.registry import PolicyOptions, build_policy
from flowyard.sim.cluster import Topology
from flowyard.sim.simulator import Simulator
from flowyard.workloads import Workload, clip, load_trace, scale_rate
from flowyard.workloads.transforms import slo_by_length, with_slo

POLICIES = ("vllm", "distserve", "flowprefill", "pla", "arrow", "dynaserve", "flowyard")
# name -> (trace whose arrivals and lengths it replays, prompt cap, output cap): long prompts
# (a 1.5 k-token prefill takes many decode steps' time on this CPU) beside short ones
WORKLOADS = {"code-long": ("azure-code", 1536, 48), "conv-mixed": ("azure-conv", 1024, 64),
             "burst": ("burstgpt", 1536, 64), "conv-short": ("azure-conv", 512, 64)}
INSTANCES, MAX_NUM_SEQS = 2, 64  # as `flowyard serve --instances 2` (its default --max-num-seqs)


@dataclass(frozen=True)
class ExperimentConfig:
    requests: int = 24
    evals: int = 4
    model: str | None = None


@dataclass(frozen=True)
class EngineSLOs:
    """SLOs scaled to the engine: TPOT a few decode steps, TTFT by prompt length a few times
    the prompt's own prefill, so a request misses only when scheduling delays it."""

    tpot: float
    spec: str  # --ttft-slo-by-length


def engine_slos(cost, factor: float = 4.0) -> EngineSLOs:
    step = float(cost.step_time(BatchShape(decode_seqs=8, decode_ctx=8 * 512)))
    ttft = {lo: max(1.0, factor * float(cost.step_time(BatchShape.chunk(0, hi))))
            for lo, hi in ((0, 512), (512, 1024), (1024, 1536))}
    return EngineSLOs(tpot=round(max(0.1, factor * step), 3),
                      spec=",".join(f"{lo}:{round(s, 2):g}" for lo, s in ttft.items()))


def run_slos(meta: dict, rows: list[dict], executor: str, cost) -> EngineSLOs:
    """The SLOs an earlier run of `executor` judged its requests by (meta.json), so that points
    added to it, or simulated again, are judged alike even when this revision's cost model
    prices the profile's prefills differently; from `cost` when the run recorded none. Runs
    before `slos_by` stored the last executor's SLOs; they count only when its rows are of one."""
    got = (meta.get("slos_by") or {}).get(executor)
    if got is None and {r["executor"] for r in rows} == {executor}:
        got = meta.get("slos")
    if not got:
        return engine_slos(cost, meta["slo_factor"])
    return EngineSLOs(tpot=float(got["tpot_s"]), spec=str(got["ttft_by_length"]))


@dataclass(frozen=True)
class RealWorkload:
    name: str
    workload: Workload  # trace arrivals, capped lengths, SLOs set
    base_rate: float  # req/s of `workload` as recorded
    guess: float  # a first goodput guess (req/s) from the engine's cost
    fixed_rate: float  # where per-request fidelity is measured


def make_workload(name: str, n: int, slos: EngineSLOs, cost=None) -> RealWorkload:
    trace, max_in, max_out = WORKLOADS[name]
    w = cap_lengths(clip(load_trace(trace), max_requests=n), max_in, max_out)
    w = slo_by_length(with_slo(w, tpot=slos.tpot), slos.spec)
    span = max(r.arrival for r in w.requests) - min(r.arrival for r in w.requests)
    base = (len(w.requests) - 1) / span if span > 0 else 1.0
    guess = 0.5
    if cost is not None:  # two instances time-sharing the cores: capacity ~ 1 / work per request
        reqs = w.requests
        work = sum(float(cost.step_time(BatchShape.chunk(0, r.prompt_len))) for r in reqs) / len(reqs)
        out = sum(r.target_output for r in reqs) / len(reqs)
        work += out * float(cost.step_time(BatchShape(decode_seqs=8, decode_ctx=8 * 512))) / 8
        guess = 0.7 / work
    return RealWorkload(name, w, base, guess, fixed_rate=round(0.6 * guess, 3))


def _at(w: RealWorkload, rate: float) -> Workload:
    return scale_rate(w.workload, rate / w.base_rate)


def sim_point(w: RealWorkload, rate: float, policy: str, cost, shared_device: bool, predictor=None,
              timeline=None) -> dict:
    """`sim_states`' numbers."""
    return point_of(sim_states(w, rate, policy, cost, shared_device, predictor, timeline))


def sim_states(w: RealWorkload, rate: float, policy: str, cost, shared_device: bool, predictor=None,
               timeline=None) -> list:
    """The simulator's run of the workload at `rate`, its requests' states, emulating the served
    engine: its profile, `flowyard serve`'s policy options, and for in-process instances one
    shared device. `cost` clocks the steps; the policy predicts with `predictor` (default: the
    same model); a `Timeline` given records the run's steps."""
    link = Link(1e12) if shared_device else Link(1e9, 2e-3)  # an in-process copy; Ray's object store
    opts = PolicyOptions(num_instances=INSTANCES, max_num_seqs=MAX_NUM_SEQS, predictor=predictor or cost,
                         shared_device=shared_device)
    reqs = [replace(r, max_tokens=None) for r in _at(w, rate).requests]
    res = Simulator(reqs, build_policy(policy, opts), cost, Topology(1, link, link),
                    shared_device=shared_device, timeline=timeline).run()
    return res.states


def fixed_workload(name: str, n: int, rate: float, slos: EngineSLOs, cost) -> RealWorkload:
    """The per-request fidelity point's workload: the trace's first n requests at `rate` (the
    fixed rate of the search's workload, whatever n is)."""
    return replace(make_workload(name, n, slos, cost), fixed_rate=rate)


def served_clock(profile: Path, fit: dict | None, plain, speed: float = 1.0,
                 drift: tuple[float, float] | list[float] | None = None):
    """What clocks the simulator's steps: the profile with the executor's fitted serving terms
    (`--fit-serving`), or the plain profile `plain` without a fit; with the machine `speed`
    times slower than the profile (real_cluster_speed), all of it scaled by that. With a
    `drift` (prompt-bearing steps' speed, decodes' speed) measured instead, everything runs at
    the decodes' speed and prompt-bearing steps at theirs."""
    from real_cluster_speed import at_speed

    if drift is not None:
        prompt, decode = drift
        return DriftedCostModel(served_clock(profile, fit, plain, decode), prompt / decode, 1.0)
    fit = at_speed(fit, speed)
    return ProfiledCostModel({**json.loads(profile.read_text()), "serving": fit}) if fit else plain


def real_states(url: str, w: RealWorkload, rate: float, slos: EngineSLOs, calibrate: bool = True) -> list:
    """One `flowyard bench` run at `rate`, its requests' states: every request carries its SLO as
    headers (calibrate: fit prompt words to the server's token counts first, so prompts have the
    trace's lengths)."""
    return run_bench(url, _at(w, rate), goodput=f"tpot:{slos.tpot * 1e3:g}", ttft_slo_by_length=slos.spec,
                     send_slo=True, timeout=180.0, seed=0, calibrate_prompts=calibrate).states


def real_point(url: str, w: RealWorkload, rate: float, slos: EngineSLOs, calibrate: bool = True) -> dict:
    """`real_states`' numbers."""
    return point_of(real_states(url, w, rate, slos, calibrate))


class Server:
    """`flowyard serve --instances 2 --policy P` for the duration of a `with` block. One server
    takes every rate of a search, and each point sends the same prompts (the load generator's
    words depend on the request only): with the prefix cache on, every point after the first
    found its prompts cached (a smoke run measured TTFT P50 1.5 s against 18 s uncached), so
    the cache is off, as in the simulator, which these workloads give no shared prefix."""

    def __init__(self, policy: str, executor: str, profile: Path, model: str | None, log: Path) -> None:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.cmd = [sys.executable, "-m", "flowyard.cli", "serve", "--port", str(self.port), "--instances",
                    str(INSTANCES), "--policy", policy, "--profile", str(profile), "--max-num-seqs",
                    str(MAX_NUM_SEQS), "--no-prefix-caching"] + (["--ray"] if executor == "ray" else []) + (["--model", model] if model else [])
        self.log = log
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> str:
        self.proc = subprocess.Popen(self.cmd, stdout=self.log.open("w"), stderr=subprocess.STDOUT,
                                     env=dict(os.environ, RAY_DEDUP_LOGS="0"))
        url, deadline = f"http://127.0.0.1:{self.port}", time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"flowyard serve exited: see {self.log}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return url
            except OSError:
                time.sleep(1)
        raise RuntimeError(f"flowyard serve did not come up in 600 s: see {self.log}")

    def __exit__(self, *exc) -> None:
        assert self.proc is not None
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def timeline_states(srv: "Server", timeline: Path, w: "RealWorkload", rate: float, slos: EngineSLOs) -> list:
    """`real_states` at `rate` on a fresh server `srv` that writes its timeline to `timeline`,
    once that file exists (the server writes it as it shuts down)."""
    srv.cmd += ["--timeline", str(timeline)]
    with srv as url:
        states = real_states(url, w, rate, slos)
    for _ in range(60):
        if timeline.exists():
            break
        time.sleep(1)
    return states


def timeline_point(srv: "Server", timeline: Path, w: "RealWorkload", rate: float, slos: EngineSLOs) -> dict:
    """`timeline_states`' numbers."""
    return point_of(timeline_states(srv, timeline, w, rate, slos))


def _rows_revisions(rows: list[dict], rev: str) -> str:
    """Which revision measured which rows (a resumed run spans several)."""
    by: dict[str, list[str]] = {}
    for r in rows:
        cell, cells = f"`{r['policy']}` ({r['executor']})", by.setdefault(r.get("revision") or "unrecorded", [])
        if cell not in cells:  # once, not once per workload
            cells.append(cell)
    return "Rows measured at: " + "; ".join(f"{k}: {', '.join(v)}" for k, v in by.items()) + "."


def _profile_cell(r: dict) -> str:
    if "profile_age_min" not in r:
        return "—"
    age = f"{r['profile_age_min']:.0f} min old"
    own = r.get("profile") != f"profile-{r['executor']}.json"  # not the run's one profile: made for this row
    return f"{age}, {r['step_price_vs_slo_profile']:.2f}×" if own else age


def _span(lo: float, hi: float) -> str:
    return f"{lo:.3f} – {'∞' if not math.isfinite(hi) else f'{hi:.3f}'}"


def _curve(curve: list | None) -> str:
    return ", ".join(f"{r:.2f}: {a:.0%}" for r, a in sorted(curve or []))


def write_report(rows: list[dict], meta: dict, path: Path) -> Path:
    from real_cluster_fit import serving_note  # it builds on this module

    rev = source_revision()
    lines = [("" if rev and "uncommitted" not in rev else "**Made from uncommitted code.**\n\n")
             + "# Policies on a real cluster, and the simulator's prediction of it", "",
             _rows_revisions(rows, rev),
             f"Report written at revision {rev or 'unknown'}; machine {platform.platform()} ({meta['machine']}, {os.cpu_count()} cores); "
             f"{meta['requests_per_point']} requests per point"
             + (f" ({meta['fixed_requests']} at the fixed rate)" if meta.get("fixed_requests", meta["requests_per_point"])
                != meta["requests_per_point"] else "") + "; wall "
             + (f"{meta['wall_s'] / 60:.1f} min." if meta.get("wall_s") else "not recorded (a resumed run)."),
             f"Command: `{meta['command']}`. SLOs from the engine's profile: TPOT {meta['slos']['tpot_s'] * 1e3:.0f} ms, "
             f"TTFT by prompt length `{meta['slos']['ttft_by_length']}` (s). Workloads: "
             + "; ".join(f"`{k}` = {t} arrivals, prompts ≤ {i}, outputs ≤ {o}" for k, (t, i, o) in WORKLOADS.items())
             + "".join(f" Then: `{c}`." for c in meta.get("added_commands", [])), *serving_note(meta), "",
             "## Verdicts", "", *verdicts(rows, len(POLICIES)), "", "## Goodput (req/s at ≥ 90 % SLO attainment)", ""]
    sim_tol = max((r.get("sim_tol", 0.15) for r in rows), default=0.15)  # rows before sim_tol: 15 %
    resim = f" (searched again at {meta['sim_revision']}, `--resim`)" if meta.get("sim_revision") else ""
    lines += ["The real goodput is located between the highest rate that met the SLOs and the lowest rate "
              "above it that did not (∞: no rate above failed); the simulated one by its own search, to within "
              f"{sim_tol:.0%}{resim}. "
              "\"Sim outside\" is how far the simulated goodput lies outside the real bracket: a lower bound on "
              "its error, 0 when it is inside. \"Profile\" is the age of the profile that row's simulation "
              "used when its real runs began, and, where it was made for that row (`--reprofile`), what its "
              "steps cost relative to the profile the SLOs came from (above 1: the machine was slower then). "
              "\"Machine\" is the machine's speed right before each of the row's real points, relative to "
              "that profile (reference steps timed in the bench process while the server idled: "
              "benchmarks/real_cluster_speed.py); the row's simulated search is clocked at their median and its "
              "fixed-rate point at its own. Where the checks also timed each kind of step (\"p\" prompt-bearing "
              "steps, \"d\" decodes: their medians over the row), the simulator's clock runs each kind at its "
              "own speed.", ""]
    lines.append(md_table(["executor", "workload", "policy", "real (bracket)", "simulated", "sim outside", "profile",
                           "machine"],
                          [[r["executor"], r["workload"], f"`{r['policy']}`", _span(*bracket(r)),
                            f"{r['sim_goodput']:.3f}", _pct(distance(r["sim_goodput"], *bracket(r))),
                            _profile_cell(r), speed_cell(r)]
                           for r in rows]))
    lines += ["", "## Attainment curves", "",
              "Every rate each search tried (req/s: share of requests within both SLOs). With few requests a point "
              "moves in steps of one request, and near 90 % the curve is often flat over a wide range of rates: "
              "there a goodput bracket says little, and the two curves say more.", ""]
    lines.append(md_table(["executor", "workload", "policy", "real", "simulated"],
                          [[r["executor"], r["workload"], f"`{r['policy']}`", _curve(r["real_curve"]),
                            _curve(r["sim_curve"])] for r in rows]))
    lines += added_note(rows)
    lines += ["", "## Per-request fidelity at a fixed rate", ""]
    if meta.get("fixed_revision"):  # --refix measured every row's point again, after the searches
        k = meta.get("fixed_repeats") or 1
        lines += [f"Every row's point measured again with {meta['fixed_requests']} requests (`--refix`)"
                  + (f", served {k} times," if k > 1 else "") + f" at {meta['fixed_revision']}, "
                  f"{meta.get('fixed_at', 'time not recorded')}.", ""]
    lines += fixed_table(rows)
    lines += served_section(rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path
