"""`flowyard bench`: the command-line face of `run_bench`, with vLLM-style flag names.

Flags mirror `vllm bench serve` where one exists (--base-url, --endpoint, --model,
--num-prompts, --request-rate, --burstiness, --max-concurrency, --goodput, --seed) so a
benchmark script moves between the two tools by changing the program name; the workload
flags (--trace, --rate-scale, --duration) are `flowyard simulate`'s, so a measured run and a
simulated run of the same slice of a trace are asked for the same way.

Errors are one line on stderr: bad flag values exit 2 (argparse, or a bad trace name), a
server that is down or a failed run exits 1. Nothing here prints a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator

from flowyard.cliargs import positive_float, positive_int, rate

if TYPE_CHECKING:
    from flowyard.bench.serve_bench import BenchResult

EXIT_USAGE = 2
DEFAULT_PROMPTS = 1000  # vLLM's --num-prompts default, used when neither a count nor a duration is given


def _slo(text: str) -> str:
    from flowyard.bench.serve_bench import parse_goodput

    try:
        parse_goodput(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the `bench` subcommand on `subparsers` (from `add_subparsers`); returns it.
    It sets `func=cmd_bench`, which returns the exit code."""
    p = subparsers.add_parser(
        "bench", help="load-test a running OpenAI-compatible server (like vllm bench serve)",
        description="Replay a trace (or a Poisson/Gamma load with the trace's lengths) against "
                    "any OpenAI-compatible server and report TTFT/TPOT/ITL/E2EL and goodput.")
    s = p.add_argument_group("server")
    s.add_argument("--base-url", default="http://127.0.0.1:8000", help="server URL (with or without /v1)")
    s.add_argument("--endpoint", choices=("chat", "completions"), default="chat",
                   help="/v1/chat/completions or /v1/completions")
    s.add_argument("--model", default=None, help="model name (default: first of GET /v1/models)")
    s.add_argument("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY)")
    s.add_argument("--timeout", type=positive_float, default=300.0,
                   help="per-request deadline in seconds, connection to last token")
    s.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos/min_tokens (for servers that reject them)")
    w = p.add_argument_group("workload")
    w.add_argument("--trace", default="azure-conv", help="bundled trace name or a trace file path")
    w.add_argument("--num-prompts", type=positive_int, default=None,
                   help=f"send the first N requests (default {DEFAULT_PROMPTS} unless --duration)")
    w.add_argument("--duration", type=positive_float, default=None,
                   help="send only the requests of the trace's first DURATION seconds")
    w.add_argument("--rate-scale", type=positive_float, default=1.0,
                   help="multiply the trace's rate (timestamps x 1/scale)")
    w.add_argument("--request-rate", type=rate, default=None,
                   help="re-time as Poisson/Gamma at this req/s; inf = all at once "
                        "(default: the trace's own timestamps)")
    w.add_argument("--burstiness", type=positive_float, default=1.0,
                   help="Gamma shape of inter-arrival gaps: 1 = Poisson, <1 burstier, >1 smoother")
    w.add_argument("--max-concurrency", type=positive_int, default=None, help="most requests in flight")
    w.add_argument("--max-input-len", type=positive_int, default=None, help="cap prompt lengths (tokens)")
    w.add_argument("--max-output-len", type=positive_int, default=None, help="cap output lengths (tokens)")
    w.add_argument("--seed", type=int, default=0, help="seed for arrivals and prompt words")
    o = p.add_argument_group("results")
    o.add_argument("--goodput", nargs="+", type=_slo, default=None, metavar="NAME:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:10000 (milliseconds)")
    o.add_argument("--ttft-slo-by-length", default=None, metavar="L1:S1,L2:S2",
                   help="TTFT SLO S_i (seconds) for prompts of at least L_i tokens, as `flowyard simulate`'s; "
                        "overrides --goodput's ttft for those prompts")
    o.add_argument("--send-slo", action="store_true",
                   help="send each request's SLO as flowyard's x-slo-ttft-ms / x-slo-tpot-ms headers, so "
                        "SLO-aware policies schedule by the SLOs the run is judged on")
    o.add_argument("--json", default=None, metavar="PATH",
                   help="write results (vLLM keys too); - writes them to standard output")
    o.add_argument("--save-result", action="store_true",
                   help="as vllm bench serve: write the results JSON (per-request ttfts, itls, latencies, ...) "
                        "to --result-dir/--result-filename")
    o.add_argument("--result-dir", default=".", metavar="DIR",
                   help="with --save-result, created if missing (default .)")
    o.add_argument("--result-filename", default=None, metavar="NAME",
                   help="with --save-result (default {label}-{rate}qps-{model}-{time}.json)")
    o.add_argument("--label", default=None, help="the results' label and file-name prefix (default flowyard)")
    o.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_bench)
    return p


def _error(msg: str, code: int) -> int:
    print(f"flowyard: error: {msg}", file=sys.stderr)
    return code


@contextmanager
def _progress(enabled: bool) -> Iterator[Any]:
    """A request counter on stderr, as `flowyard simulate`'s: only when both stdout and stderr
    are terminals (and not --quiet or --json -, which the caller folds into `enabled`)."""
    if not enabled or not (sys.stdout.isatty() and sys.stderr.isatty()):
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    with Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("requests", total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)


def _row(label: str, value: object) -> str:
    return f"{label + ':':<40} {value}"


def format_extra(result: BenchResult) -> str:
    """vLLM's result lines that flowyard's table lacks, plus the first errors (as vLLM lists
    up to 10)."""
    m = result.vllm_metrics()
    lines = [_row("Model", result.model), _row("Endpoint", result.config.get("url", "")),
             _row("Failed requests", m["failed"]),
             _row("Total token throughput (tok/s)", f"{m['total_token_throughput']:.2f}"),
             _row("Peak concurrent requests", m["max_concurrent_requests"])]
    if m["request_goodput"] is not None:
        lines.append(_row("Goodput SLOs (ms)", " ".join(f"{k}:{v:g}" for k, v in result.goodput.items())))
        lines.append(_row("Request goodput (req/s)", f"{m['request_goodput']:.2f}"))
    errs = result.errors()
    for i, err in errs[:10]:
        lines.append(f"  request {i}: {err}")
    if len(errs) > 10:
        lines.append(f"  ... and {len(errs) - 10} more failed requests")
    return "\n".join(lines)


def _result_filename(args: argparse.Namespace, result: BenchResult) -> str:
    """vLLM's default name: {backend}-{rate}qps[-concurrency{n}]-{model}-{YYYYmmdd-HHMMSS}.json."""
    import datetime

    rate = "inf" if args.request_rate in (None, float("inf")) else f"{args.request_rate:g}"
    conc = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
    model = str(result.model).replace("/", "_")
    label = (args.label or "flowyard").replace("/", "_")
    return f"{label}-{rate}qps{conc}-{model}-{datetime.datetime.now():%Y%m%d-%H%M%S}.json"


def cmd_bench(args: argparse.Namespace) -> int:
    """Run `flowyard bench`; returns the exit code (0 ok, 1 run failed, 2 bad input)."""
    from flowyard.bench.client import BenchError
    from flowyard.bench.loadgen import cap_lengths
    from flowyard.bench.report import format_table, write_json
    from flowyard.bench.serve_bench import run_bench
    from flowyard.workloads import clip, load_trace, scale_rate

    try:
        w = load_trace(args.trace, seed=args.seed)
        if args.rate_scale != 1.0:
            w = scale_rate(w, args.rate_scale)
        num = args.num_prompts
        if args.duration is not None:
            w = clip(w, duration=args.duration)
        elif num is None:
            num = DEFAULT_PROMPTS
        w = cap_lengths(w, args.max_input_len, args.max_output_len)
    except ValueError as e:  # unknown trace, unreadable file, bad values
        return _error(str(e), EXIT_USAGE)
    try:
        from flowyard.cliargs import check_output_path

        check_output_path(args.json, "--json")  # before the run, so a bad path costs nothing
    except ValueError as e:
        return _error(str(e), EXIT_USAGE)
    if args.save_result:  # as vLLM, create --result-dir; before the run, so a bad one costs nothing
        try:
            os.makedirs(args.result_dir, exist_ok=True)
        except OSError as e:
            return _error(f"cannot create --result-dir {args.result_dir!r}: {e.strerror or e}", EXIT_USAGE)
    try:
        with _progress(not args.quiet and args.json != "-") as progress:
            result = run_bench(args.base_url, w, endpoint=args.endpoint, model=args.model,
                               api_key=args.api_key, max_concurrency=args.max_concurrency,
                               request_rate=args.request_rate, burstiness=args.burstiness,
                               goodput=args.goodput, timeout=args.timeout, num_prompts=num,
                               seed=args.seed, ignore_eos=args.ignore_eos, progress=progress,
                               ttft_slo_by_length=args.ttft_slo_by_length, send_slo=args.send_slo)
    except ValueError as e:
        return _error(str(e), EXIT_USAGE)
    except BenchError as e:
        return _error(str(e), 1)
    except KeyboardInterrupt:
        return 130
    result.config["label"] = args.label
    out = sys.stderr if args.json == "-" else sys.stdout
    print(format_table(result.summary), file=out)
    print(format_extra(result), file=out)
    paths = [args.json] if args.json else []
    if args.save_result:
        paths.append(os.path.join(args.result_dir, args.result_filename or _result_filename(args, result)))
    for path in paths:
        try:
            write_json(result.summary, path, extra={**result.vllm_metrics(), **result.config})
        except OSError as e:
            return _error(str(e), 1)
        if path != "-":
            print(f"wrote {path}", file=out)
    if result.summary.completed == 0:
        first = result.errors()[0][1] if result.errors() else "no response"
        return _error(f"all {len(result.outputs)} requests failed (first error: {first})", 1)
    return 0


__all__ = ["add_bench_parser", "cmd_bench", "format_extra"]
