"""`flowyard` command line: stable subcommand and flag names from DESIGN.md."""

from __future__ import annotations

import argparse
import os
import sys

# libgomp (torch's OpenMP) spins ~300,000 rounds (about 3 ms) for the next parallel region
# before sleeping. Alone on the cores that is what makes a decode step's ~150 small regions
# cheap, but next to a benchmark client or another job the spinning workers starve them: a
# single-stream step went from 24 to 98-233 ms under load (2-core VM). 30,000 rounds kept the
# quiet-machine step (24.4 ms) and matched the non-spinning 90-ms step under load. Set before
# torch is imported, since libgomp reads it once; an explicit GOMP_SPINCOUNT wins.
os.environ.setdefault("GOMP_SPINCOUNT", "30000")
from contextlib import contextmanager
from typing import Iterator, Protocol, Sequence

from flowyard.cliargs import UsageError, check_output_path, fraction, positive_float, positive_int
from flowyard.optional import MissingExtra

EXIT_USAGE = 2


def _add_workload_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload and cluster")
    g.add_argument("--trace", default="azure-conv", help="bundled trace name or a trace file path")
    g.add_argument("--model", default="llama-3-8b", help="catalog model name or a config.json path")
    g.add_argument("--hardware", default="h100", help="GPU type (a100-40g, h100, ...)")
    g.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel degree per instance")
    g.add_argument("--instances", type=positive_int, default=1, help="number of instances")
    g.add_argument("--prefill-instances", type=positive_int, default=None,
                   help="prefill instances of static PD splits (default: half)")
    g.add_argument("--rate-scale", type=positive_float, default=1.0,
                   help="multiply the request rate (timestamps x 1/scale)")
    g.add_argument("--duration", type=positive_float, default=None,
                   help="replay only the first DURATION seconds of the trace")
    g.add_argument("--num-requests", type=positive_int, default=None,
                   help="replay at most N requests (length-only traces: generate N)")
    g.add_argument("--rate", type=positive_float, default=None,
                   help="arrival rate (req/s) for length-only traces (sharegpt, arxiv)")
    g.add_argument("--mix", default=None, metavar="NAME[:SCALE],...",
                   help="superpose these traces (each at SCALE x its rate) on --trace (docs/scale.md)")
    g.add_argument("--tile", type=positive_int, default=1, metavar="N",
                   help="repeat the workload N times back to back: N x the requests (docs/scale.md)")
    g.add_argument("--ttft-slo", type=positive_float, default=None, help="TTFT SLO in seconds")
    g.add_argument("--tpot-slo", type=positive_float, default=None, help="TPOT SLO in seconds")
    g.add_argument("--ttft-slo-by-length", default=None, metavar="L1:S1,L2:S2",
                   help="TTFT SLO S_i for prompts of at least L_i tokens")
    g.add_argument("--chunk-size", type=positive_int, default=None,
                   help="override the policy's prefill chunk / token budget")
    g.add_argument("--max-num-seqs", type=positive_int, default=256)
    g.add_argument("--profile", default=None, metavar="PATH",
                   help="cost model from `flowyard profile` (emulates that engine) instead of the roofline")
    g.add_argument("--snapshot-staleness", type=float, default=0.0, metavar="S",
                   help="global policies see instance snapshots up to S seconds old (runtime reports)")
    g.add_argument("--enable-prefix-caching", action="store_true",
                   help="reuse KV of shared prefixes (Mooncake hash_ids, multi-turn history)")
    g.add_argument("--predictor-error", type=positive_float, default=1.0, metavar="F",
                   help="SLO-aware policies predict step times F times the truth (robustness)")
    g.add_argument("--concurrency", type=positive_int, default=None, metavar="N",
                   help="closed loop: N clients, each sending its next request (a session's next "
                        "turn) when its previous one ends; trace arrival times are ignored")
    g.add_argument("--think-time", type=float, default=0.0, metavar="S",
                   help="closed loop: a client waits S s after each response (needs --concurrency)")
    g.add_argument("--client-token-ms", type=float, default=0.0, metavar="MS",
                   help="closed loop: the clients read their streams on one processor that spends "
                        "MS ms per token, as a threaded Python benchmark does (needs --concurrency)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--calibration", default="published", choices=("vidur", "published"),
                   help="roofline factors: 'published' (default, fitted on published GPU "
                        "measurements: `flowyard validate`) or 'vidur'")
    _add_engine_flag(g)
    g.add_argument("--quiet", action="store_true", help="no progress bar")


def _add_engine_flag(p) -> None:
    from flowyard.costmodel.engines import engine_profile_names

    p.add_argument("--engine-profile", default=None, choices=engine_profile_names(),
                   help="host-side costs of the emulated serving stack (default: vllm-v1, "
                        "today's vLLM; `flowyard validate` fits each on its own sources)")


def _config(args: argparse.Namespace, policy: str):
    from flowyard.sim.run import SimConfig

    return SimConfig(
        trace=args.trace, model=args.model, hardware=args.hardware, tp=args.tp,
        instances=args.instances, prefill_instances=args.prefill_instances, policy=policy,
        rate_scale=args.rate_scale, duration=args.duration, num_requests=args.num_requests,
        rate=args.rate, ttft_slo=args.ttft_slo, tpot_slo=args.tpot_slo,
        ttft_slo_by_length=args.ttft_slo_by_length, seed=args.seed,
        chunk_size=args.chunk_size, max_num_seqs=args.max_num_seqs,
        prefix_caching=args.enable_prefix_caching, profile=args.profile,
        snapshot_staleness=args.snapshot_staleness, predictor_error=args.predictor_error,
        concurrency=args.concurrency, think_time=args.think_time,
        client_chunk_s=args.client_token_ms / 1e3, calibration=args.calibration,
        mix=args.mix, tile=args.tile, engine_profile=args.engine_profile,
    )


def _recorded(cfg) -> dict:
    """The config a result file records, with the engine profile the run resolved to."""
    from flowyard.costmodel.engines import get_engine_profile

    return {**cfg.as_dict(), "engine_profile": get_engine_profile(cfg.engine_profile).name}


def _validate_names(args: argparse.Namespace, policies: Sequence[str]) -> None:
    """Fail fast, before loading anything heavy, on names that are not in a catalog."""
    from flowyard.costmodel import get_hardware, get_model
    from flowyard.policies.registry import build_policy, PolicyOptions

    if args.profile is None:
        get_model(args.model)
    get_hardware(args.hardware)
    from flowyard.sim.run import build_cost_model

    predictor = build_cost_model(_config(args, policies[0]))  # what SLO-aware policies need
    for p in policies:
        build_policy(p, PolicyOptions(num_instances=args.instances, num_prefill=args.prefill_instances,
                                      predictor=predictor))


def _bar_on(args: argparse.Namespace) -> bool:
    """Progress bars only for a person watching: not with --quiet, not when the JSON goes to
    standard output (`--json -`), and only when both stdout and stderr are terminals (a
    redirected stdout means a script or a log is the reader; the bar itself draws on stderr)."""
    return (not getattr(args, "quiet", False) and getattr(args, "json", None) != "-"
            and sys.stdout.isatty() and sys.stderr.isatty())


def _human(args: argparse.Namespace):
    """Where tables and notes go: stderr when standard output carries the JSON."""
    return sys.stderr if getattr(args, "json", None) == "-" else sys.stdout


class _Bar(Protocol):
    """The progress bar's update: steps done, of how many (None: unknown), a new label."""

    def __call__(self, done: int, total: int | None, label: str | None = None) -> None: ...


@contextmanager
def _progress(enabled: bool, label: str) -> Iterator[_Bar | None]:
    if not enabled:
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    with Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(label, total=None)

        def update(done: int, total: int | None, label: str | None = None) -> None:
            bar.update(task, completed=done, total=total, description=label or None)  # None: keep the label
        yield update


def cmd_simulate(args: argparse.Namespace) -> int:
    from flowyard.bench.report import format_table, write_json
    from flowyard.sim.run import load_workload, simulate

    for flag in ("json", "plot", "timeline"):
        check_output_path(getattr(args, flag), f"--{flag}")
    _validate_names(args, [args.policy])
    cfg = _config(args, args.policy)
    workload = load_workload(cfg)
    timeline = None
    if args.timeline:
        from flowyard.cluster.timeline import Timeline

        timeline = Timeline()
    out = _human(args)
    with _progress(_bar_on(args), f"simulating {cfg.policy}") as progress:
        summary, result = simulate(cfg, workload, progress=progress, timeline=timeline)
    if timeline is not None:
        timeline.write(args.timeline)
        print(f"wrote the timeline to {args.timeline} (open it in https://ui.perfetto.dev)", file=sys.stderr)
    print(format_table(summary), file=out)
    if cfg.concurrency is not None:
        print(f"closed loop: {cfg.concurrency} clients, think time {cfg.think_time:g} s, "
              f"client {1e3 * cfg.client_chunk_s:g} ms per token "
              f"(arrivals are send times; rates over {summary.duration_s:,.1f} s)", file=out)
    print(f"events: {result.events:,}  steps: {result.steps:,}  simulated time: {result.sim_time:,.1f} s  "
          f"events/s: {result.events / max(result.wall_s, 1e-9):,.0f}", file=out)
    extra = {"config": _recorded(cfg), "events": result.events, "sim_time_s": result.sim_time}
    blocking = result.preemption_blocking
    if blocking:
        ms = {"count": len(blocking), "mean": 1e3 * sum(blocking) / len(blocking), "max": 1e3 * max(blocking)}
        extra["preemption_blocking_ms"] = ms
        print(f"preemptions: {len(blocking):,}  blocking mean {ms['mean']:.2f} ms"
              f"  max {ms['max']:.2f} ms", file=out)
    if args.json:
        write_json(summary, args.json, extra=extra)
        if args.json != "-":
            print(f"wrote {args.json}", file=out)
    if args.plot:
        from flowyard.bench.plot import plot_cdf

        plot_cdf({summary.policy: result.states}, args.plot, slo=cfg.ttft_slo,
                 title=f"{cfg.trace}: TTFT CDF")
        print(f"wrote {args.plot}")
    return 0


def cmd_goodput(args: argparse.Namespace) -> int:
    from flowyard.bench.report import format_goodput_table, write_goodput_json
    from flowyard.sim.run import load_workload

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not policies:
        raise UsageError("--policies needs at least one policy name")
    if args.concurrency is not None:  # the searched variable is the open-loop arrival rate
        raise UsageError("goodput searches the arrival rate, which closed-loop clients do not have: "
                         "run `flowyard simulate --concurrency N` for each N instead")
    if args.scale_lo >= args.scale_hi:
        raise UsageError(f"--scale-lo ({args.scale_lo:g}) must be below --scale-hi ({args.scale_hi:g}): "
                         "both are rate scales, multiples of the trace's recorded rate")
    for flag in ("json", "plot"):
        check_output_path(getattr(args, flag), f"--{flag}")
    _validate_names(args, policies)
    base = _config(args, policies[0])
    workload = load_workload(base)
    # The search runs in req/s; a rate r replays the trace at rate scale r / base_rate.
    mean_rate = len(workload.requests) / max(workload.duration, 1e-9)
    out, bar_on = _human(args), _bar_on(args)
    from flowyard import sweep as sweeps
    from flowyard.sweep.jobs import goodput_searches, sweep_from_args

    with _progress(bar_on, "goodput search") as bar:
        def on_point(policy: str, rate: float, scale: float, a: float) -> None:
            line = f"  {policy:>16}  {rate:8.2f} req/s (x{scale:6.2f})  attainment {a:6.1%}"
            if bar is None and not args.quiet:
                print(line, file=sys.stderr)

        sweep = sweep_from_args(args, None if bar is None else (lambda done, total: bar(done, total)))
        prev = sweeps.use(sweep)
        try:
            results = goodput_searches(base, policies, workload, lo=args.scale_lo * mean_rate,
                                       hi=args.scale_hi * mean_rate, target=args.target, tol=args.tol,
                                       on_point=on_point)
        finally:
            sweeps.use(prev)
    print(format_goodput_table(results), file=out)
    print(f"rate scale x1 = the trace as recorded, {mean_rate:.3f} req/s on average", file=out)
    if args.json:
        write_goodput_json(results, args.json, extra={"config": _recorded(base), "base_rate_rps": mean_rate})
        if args.json != "-":
            print(f"wrote {args.json}", file=out)
    if args.plot:
        from flowyard.bench.plot import plot_goodput

        plot_goodput(results, args.plot, target=args.target, title=f"{base.trace}: SLO attainment vs rate scale")
        print(f"wrote {args.plot}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flowyard", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("simulate", help="replay a trace in the cluster simulator")
    _add_workload_flags(p)
    p.add_argument("--policy", default="vllm", help="scheduling policy")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    p.add_argument("--plot", default=None, metavar="PATH", help="write the TTFT CDF as PNG")
    p.add_argument("--timeline", default=None, metavar="PATH",
                   help="write a Chrome/Perfetto trace of steps, KV transfers, decisions and requests")
    p.set_defaults(func=cmd_simulate)
    g = sub.add_parser("goodput", help="search the goodput of several policies on one workload")
    _add_workload_flags(g)
    g.add_argument("--policies", default="vllm,distserve", help="comma-separated policy names")
    g.add_argument("--target", type=fraction, default=0.9, help="SLO-attainment target in (0, 1] (default 0.9)")
    g.add_argument("--scale-lo", type=positive_float, default=0.25, help="lowest rate scale tried")
    g.add_argument("--scale-hi", type=positive_float, default=4.0, help="first upper rate scale")
    g.add_argument("--tol", type=positive_float, default=0.05, help="relative search tolerance")
    g.add_argument("--json", default=None, metavar="PATH")
    g.add_argument("--plot", default=None, metavar="PATH", help="write attainment vs rate as PNG")
    from flowyard.sweep.jobs import add_sweep_flags

    add_sweep_flags(g)
    g.set_defaults(func=cmd_goodput)
    from flowyard.bench.cli_bench import add_bench_parser
    from flowyard.experiments.cli_reproduce import add_reproduce_parser
    from flowyard.costmodel.cli_validate import add_validate_parser
    from flowyard.engine.cli_profile import add_profile_parser
    from flowyard.server.cli_serve import add_serve_parser

    add_reproduce_parser(sub)
    add_serve_parser(sub)
    add_bench_parser(sub)
    add_profile_parser(sub)
    add_validate_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (UsageError, ValueError, MissingExtra) as e:  # catalog, trace and config errors are ValueErrors
        print(f"flowyard: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as e:
        print(f"flowyard: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
