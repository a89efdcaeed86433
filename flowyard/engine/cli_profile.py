"""`flowyard profile`: measure this engine's operator times into a profile for the simulator."""

from __future__ import annotations

import argparse
import sys


def add_profile_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="measure the engine's per-operator times into a profile")
    p.add_argument("--model", default=None, help="HF directory or .gguf (default: embedded SmolLM2-135M)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: bfloat16 where the CPU has native bfloat16 matmuls (or on a GPU), else float32")
    p.add_argument("--out", default="profile.json", help="where to write the profile (JSON)")
    p.add_argument("--quantization", default=None, choices=["int8", "int4", "w8a8"],
                   help="profile the engine with quantised linears (as serve --quantization)")
    p.add_argument("--quick", action="store_true", help="a small grid (about a minute on 2 cores)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per grid point (median kept)")
    p.add_argument("--passes", type=int, default=1,
                   help="time the whole grid this many times and keep each operator's median over the passes "
                        "(steadier on a shared machine, where a slow minute skews one point's back-to-back repeats)")
    p.add_argument("--kv-cache-memory", type=int, default=384, metavar="MIB",
                   help="KV cache the profiled instance would have (its simulated capacity)")
    p.add_argument("--serving-timeline", default=None, metavar="TIMELINE",
                   help="measure nothing: fit what serving adds to the steps of --from's profile (per sampled "
                        "row, per step, a scale) on this `flowyard serve --timeline` trace, and write the profile "
                        "with those terms to --out (flowyard.costmodel.serving)")
    p.add_argument("--from", dest="base", default=None, metavar="PROFILE",
                   help="with --serving-timeline: the profile the served engine ran with")
    p.add_argument("--client-ttft-ms", type=float, default=None,
                   help="with --serving-timeline: the client's median TTFT of that run, for the frontend latency")
    p.add_argument("--export-timeline", default=None, metavar="TIMELINE",
                   help="with --serving-timeline: a `flowyard serve --timeline` trace of a policy that moves "
                        "requests between instances (e.g. distserve), to fit the time a source spends exporting "
                        "each moved request's KV (serving.fit_export; the simulator charges it per move)")
    p.add_argument("--serving-scale", type=float, default=None, metavar="X",
                   help="with --serving-timeline: hold the scale at X and fit only the per-row and per-step "
                        "terms (1 for instances that take turns on one thread, `serve` without --ray; "
                        "default: fitted)")
    p.set_defaults(func=cmd_profile)


def cmd_fit_serving(args: argparse.Namespace) -> int:
    from flowyard.cliargs import check_output_path
    from flowyard.costmodel.serving import fit_serving_files

    if args.base is None:
        raise ValueError("--serving-timeline needs --from PROFILE: the profile the served engine ran with")
    check_output_path(args.out, "--out")
    if args.serving_scale is not None and not args.serving_scale > 0:
        raise ValueError(f"--serving-scale must be a positive number, got {args.serving_scale:g}")
    ttft = args.client_ttft_ms / 1e3 if args.client_ttft_ms is not None else None
    t = fit_serving_files(args.base, args.serving_timeline, args.out, client_ttft_p50=ttft,
                          export_timeline=args.export_timeline, scale=args.serving_scale)
    print(f"served step = {t.scale:.3f} x profiled price + {t.row_s * 1e3:.3f} ms per sampled row "
          f"+ {t.step_s * 1e3:.3f} ms per step; frontend {t.frontend_s * 1e3:.1f} ms; KV export "
          f"{t.export_s * 1e3:.1f} ms a move "
          f"({t.steps} steps; median |error| {t.median_error_before:.1%} -> {t.median_error_after:.1%})")
    print(f"wrote {args.out}")
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    if args.serving_timeline is not None:
        return cmd_fit_serving(args)
    for flag, value in (("--export-timeline", args.export_timeline), ("--serving-scale", args.serving_scale)):
        if value is not None:
            raise ValueError(f"{flag} goes with --serving-timeline (the fit of a served profile)")
    import torch

    from flowyard.costmodel.profiled import ProfiledCostModel
    from flowyard.engine.engine_config import EngineConfig
    from flowyard.engine.llm_engine import LLMEngine
    from flowyard.engine.profiler import default_grid, measure_engine_overhead, run_profile, save_profile

    if args.repeats < 1 or args.passes < 1:
        raise ValueError("--repeats and --passes must be at least 1")
    from flowyard.cliargs import check_output_path

    check_output_path(args.out, "--out")  # before minutes of measuring
    engine = LLMEngine.from_path(args.model, EngineConfig(dtype=args.dtype, kv_cache_memory_mb=args.kv_cache_memory,
                                                          quantization=args.quantization))
    grid = default_grid(quick=args.quick)
    print(f"flowyard: profiling {engine.model_name} ({args.dtype}) over {len(grid)} batch shapes ...",
          file=sys.stderr)
    progress = (lambda i, n: print(f"  {i}/{n}", file=sys.stderr, end="\r")) if sys.stderr.isatty() else None
    prof = run_profile(engine.runner, grid=grid, repeats=args.repeats, name=engine.model_name, progress=progress,
                       passes=args.passes)
    prof["kv_capacity_tokens"] = engine.kv.capacity_tokens
    prof["engine_overhead_s"] = measure_engine_overhead(engine)
    save_profile(prof, args.out)
    fit = ProfiledCostModel(prof)
    print(f"{'operator':<14} {'median |rel. error| of the fit':>32}")
    for op, err in fit.fit_error.items():
        print(f"{op:<14} {err:>31.1%}")
    print(f"engine overhead per step outside the forward pass: {prof['engine_overhead_s'] * 1e3:.2f} ms")
    del torch
    print(f"wrote {args.out}; use it with: flowyard simulate --profile {args.out} ...")
    return 0
