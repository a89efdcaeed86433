"""Where the simulator's prediction of a real cluster goes wrong: step prices or scheduling.

For one policy and workload of `real_cluster.py`, at each of --rates: one `flowyard serve
--instances 2` run with `--timeline` (every step the engines ran, with its batch), and the
simulator's run of the same requests with the same profile and `shared_device`. The report
puts side by side

- SLO attainment and P50/P90 TTFT and TPOT, real and simulated;
- each real step's duration over the profile's price of its batch (median, P10, P90 by step
  kind): the cost model's error on the steps the server really ran;
- busy seconds (steps) and the seconds between steps while the server had work (the frontend,
  HTTP and the serving loop, which the simulator does not price);
- the same rate measured again (--repeats): the spread of the real measurement itself, which
  bounds how closely any prediction can be checked with this many requests.

Each step is priced with its prompt tokens and decode count, and a decode at the workload's
mean prompt plus half its mean output (stated in the report), so timelines from before steps
recorded their batch shapes are read the same way (`flowyard.costmodel.serving` uses the shapes).

    python benchmarks/real_cluster_steps.py --policy flowyard --workload conv-short \
        --rates 0.168,2.8,5.6 --repeats 2 --slo-factor 8 --out docs/results/real_cluster_steps.md
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from real_cluster import profile_engine
from real_cluster_fixed import mean_context
from real_cluster_lib import WORKLOADS, Server, engine_slos, make_workload, sim_point, timeline_point

from flowyard.cluster.timeline import Timeline
from flowyard.core.plan import BatchShape
from flowyard.costmodel.profiled import ProfiledCostModel
from flowyard.costmodel.serving import server_ttfts
from flowyard.experiments.provenance import machine
from flowyard.experiments.report import md_table, source_revision


def steps_of(trace: dict | list) -> list[tuple[str, float, int, int, float, dict | None]]:
    """(kind, seconds, prompt tokens, decodes, start, batch shape) of every step in a timeline's
    Chrome trace, a decode run recorded as one event (the simulator's) spread into its steps. The
    shape is the batch as the cost model prices it, where the timeline recorded it (None in
    timelines from before, and for decode runs)."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    out = []
    for e in events:
        if e.get("ph") != "X" or e.get("tid") != 0 or e.get("pid", 0) >= 1_000_000:
            continue
        a = e["args"]
        p, n, runs = int(a.get("prefill_tokens", 0)), int(a.get("decode_seqs", 0)), max(1, int(a.get("steps", 1)))
        kind, dur = "mixed" if p and n else ("prefill" if p else "decode"), e["dur"] / 1e6 / runs
        out += [(kind, dur, p, n, e["ts"] / 1e6 + j * dur, a.get("shape")) for j in range(runs)]
    return sorted(out, key=lambda s: s[4])


def real_steps(path: Path) -> list[tuple[str, float, int, int, float, dict | None]]:
    """`steps_of` a served timeline's file."""
    return steps_of(json.loads(path.read_text()))


def step_ratios(steps, cost, decode_ctx: float) -> dict[str, list[float]]:
    """kind -> each step's duration over the cost model's price of its batch: the recorded shape
    (a chunk with its history, each decode with its own context), else its prompt tokens as a
    fresh prompt and its decodes at `decode_ctx` (which misprices chunks that follow history)."""
    by: dict[str, list[float]] = {}
    for kind, dur, p, n, _, recorded in steps:
        shape = BatchShape(**recorded) if recorded else BatchShape.chunk(0, p, decode_seqs=n, decode_ctx=n * decode_ctx)
        by.setdefault(kind, []).append(dur / float(cost.step_time(shape)))
    return by


def gaps_while_busy(steps) -> float:
    """Seconds between consecutive steps shorter than 1 s (longer ones: the server was idle)."""
    ends = [(s[4], s[4] + s[1]) for s in steps]
    return sum(g for g in (b[0] - a[1] for a, b in zip(ends, ends[1:])) if 0 < g < 1.0)


def kv_moves(trace: dict) -> int:
    """KV transfers in a timeline's Chrome trace."""
    return sum(1 for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "kv")


def step_mix(steps) -> dict[str, tuple[int, float, float, float]]:
    """kind -> (steps, busy seconds, mean prompt tokens, mean decodes) of one run's steps."""
    by: dict[str, list] = {}
    for kind, dur, p, n, *_ in steps:
        by.setdefault(kind, []).append((dur, p, n))
    return {k: (len(v), sum(d for d, _, _ in v), statistics.mean(p for _, p, _ in v),
                statistics.mean(n for _, _, n in v)) for k, v in by.items()}


def sim_run(w, rate: float, policy: str, cost) -> tuple[dict, float, list, int]:
    """The simulator's point of the in-process cluster at `rate`: its numbers, busy seconds,
    steps (as `real_steps`) and KV transfers."""
    tl = Timeline()
    point = sim_point(w, rate, policy, cost, True, timeline=tl)
    trace = tl.to_chrome()
    return point, sum(end - start for _, start, end, _, _ in tl.steps), steps_of(trace), kv_moves(trace)


def _q(v: list[float], q: float) -> float:
    v = sorted(v)
    return v[min(len(v) - 1, int(q * len(v)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", default="flowyard")
    ap.add_argument("--workload", default="conv-short", choices=sorted(WORKLOADS))
    ap.add_argument("--rates", default="0.168,2.8,5.6", help="comma-separated req/s")
    ap.add_argument("--repeats", type=int, default=2, help="real runs per rate (the measurement's own spread)")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--slo-factor", type=float, default=8.0)
    ap.add_argument("--profile", default=None, help="a `flowyard profile` JSON (default: profile now)")
    ap.add_argument("--out", default="docs/results/real_cluster_steps.md")
    args = ap.parse_args()
    try:
        rates = [float(r) for r in args.rates.split(",")]
    except ValueError:
        sys.exit(f"real_cluster_steps: --rates must be numbers separated by commas, got {args.rates!r}")
    if not rates or min(rates) <= 0 or args.repeats < 1 or args.requests < 2:
        sys.exit("real_cluster_steps: rates must be positive, --repeats >= 1, --requests >= 2")
    work = Path(tempfile.mkdtemp(prefix="real-steps-"))
    prof = Path(args.profile) if args.profile else work / "profile.json"
    if not prof.exists():
        profile_engine(prof, None)
    cost = ProfiledCostModel(str(prof))
    slos = engine_slos(cost, args.slo_factor)
    w = make_workload(args.workload, args.requests, slos, cost)
    ctx = mean_context(w)
    started, rows, ratio_rows, mix_rows, shaped = time.time(), [], [], [], [0, 0]
    for rate in rates:
        s, sim_busy, simulated, sim_kv = sim_run(w, rate, args.policy, cost)
        sim_mix = step_mix(simulated)
        for k in range(args.repeats):
            tl = work / f"timeline-{rate}-{k}.json"
            rp = timeline_point(Server(args.policy, "local", prof, None, work / f"serve-{rate}-{k}.log"), tl, w,
                                rate, slos)
            trace = json.loads(tl.read_text())  # read once: steps, server TTFTs and KV moves
            steps, server = steps_of(trace), server_ttfts(trace)
            rows.append([f"{rate:g}", k + 1, f"{rp['attainment']:.2f} / {s['attainment']:.2f}",
                         f"{rp['ttft_p50'] * 1e3:.0f} / {s['ttft_p50'] * 1e3:.0f}",
                         f"{rp['ttft_p90'] * 1e3:.0f} / {s['ttft_p90'] * 1e3:.0f}",
                         f"{statistics.median(server) * 1e3:.0f}" if server else "—",
                         f"{rp['tpot_p50'] * 1e3:.0f} / {s['tpot_p50'] * 1e3:.0f}",
                         f"{rp['tpot_p90'] * 1e3:.0f} / {s['tpot_p90'] * 1e3:.0f}",
                         f"{sum(st[1] for st in steps):.1f} / {sim_busy:.1f}", f"{gaps_while_busy(steps):.2f}"])
            shaped[0], shaped[1] = shaped[0] + sum(1 for st in steps if st[5]), shaped[1] + len(steps)
            real_mix = step_mix(steps)
            for kind in sorted(set(real_mix) | set(sim_mix)):
                r_, s_ = real_mix.get(kind, (0, 0.0, 0.0, 0.0)), sim_mix.get(kind, (0, 0.0, 0.0, 0.0))
                mix_rows.append([f"{rate:g}", k + 1, kind, f"{r_[0]} / {s_[0]}", f"{r_[1]:.1f} / {s_[1]:.1f}",
                                 f"{r_[2]:.0f} / {s_[2]:.0f}", f"{r_[3]:.2f} / {s_[3]:.2f}"])
            mix_rows.append([f"{rate:g}", k + 1, "KV moves", f"{kv_moves(trace)} / {sim_kv}", "", "", ""])
            for kind, v in sorted(step_ratios(steps, cost, ctx).items()):
                ratio_rows.append([f"{rate:g}", k + 1, kind, len(v), f"{statistics.median(v):.2f}",
                                   f"{_q(v, 0.1):.2f}", f"{_q(v, 0.9):.2f}"])
            print(f"rate {rate:g} run {k + 1}: real attainment {rp['attainment']:.2f}, sim {s['attainment']:.2f}",
                  file=sys.stderr, flush=True)
    rev, host = source_revision(), machine()
    lines = [("" if rev and "uncommitted" not in rev else "**Made from uncommitted code.**\n\n")
             + f"# Real cluster against the simulator, step by step: `{args.policy}` on `{args.workload}`", "",
             f"Generated by `python benchmarks/real_cluster_steps.py {' '.join(sys.argv[1:])}` at revision {rev}; "
             f"machine {platform.platform()} ({host['arch']}, {host['cpu']}, 2 in-process instances); {args.requests} requests "
             f"per run; SLO factor {args.slo_factor:g}; wall {(time.time() - started) / 60:.1f} min.", "",
             "## Requests: real / simulated", "",
             "TTFT as the client sees it, and (server TTFT) from the request's arrival at the cluster to its "
             "first token in the server's timeline: the difference is HTTP, tokenization, streaming and the client.",
             "",
             md_table(["rate (req/s)", "run", "attainment", "TTFT P50 (ms)", "TTFT P90", "server TTFT P50",
                       "TPOT P50 (ms)", "TPOT P90",
                       "busy s", "real s between steps"], rows), "",
             "## Step prices: real step duration / profile's price of its batch", "",
             f"{shaped[0]} of the {shaped[1]} real steps are priced at the batch shape their timeline recorded (each "
             "chunk with its history, each decode at its own context); the others (decode runs, older timelines) "
             f"as fresh prompts with decodes at a context of {ctx:.0f} tokens (the workload's mean prompt plus half "
             "its mean output).",
             "", md_table(["rate (req/s)", "run", "kind", "steps", "median", "P10", "P90"], ratio_rows), "",
             "## Steps run: real / simulated", "",
             md_table(["rate (req/s)", "run", "kind", "steps", "busy s", "mean prompt tokens", "mean decodes"],
                      mix_rows)]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
