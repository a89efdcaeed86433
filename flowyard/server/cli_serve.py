"""`flowyard serve`: the OpenAI-compatible server on the real engine."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from typing import Any

from flowyard.cliargs import positive_int


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="start the OpenAI-compatible server (embedded model by default)")
    p.add_argument("--model", default=None,
                   help="Hugging Face model directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name", default=None, help="name clients use (default: the model's)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: bfloat16 where the CPU has native bfloat16 matmuls (or on a GPU), else float32")
    p.add_argument("--kv-cache-memory", type=int, default=384, metavar="MIB", help="KV cache size in MiB")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="chunked-prefill token budget (default: 512 on a CPU, where bigger steps prefill "
                        "hardly faster and delay every prompt in them; 2048 on a GPU, as vLLM)")
    p.add_argument("--max-waiting", type=int, default=256, help="queue bound; past it requests get 503 + Retry-After")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--attention", default="paged", choices=["paged", "grouped", "exact"],
                   help="decode attention: paged (default, fastest: reads KV blocks in place), grouped "
                        "(gather + one SDPA call) or exact (bitwise transformers, slowest)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8_e5m2"],
                   help="KV cache storage: auto (the model dtype) or fp8_e5m2 (half the bytes per "
                        "decode step and twice the tokens per MB; vLLM's CPU fp8 KV)")
    p.add_argument("--quantization", default=None, choices=["int8", "int4", "w8a8"],
                   help="quantised linears (CPU): int8 / int4 weight-only (int8 per channel, int4 per "
                        "group of 32) speed up few-stream decode; w8a8 adds int8 activations per token "
                        "on batches of 5+ rows (prefill 2.6x, 32 streams 1.5x); slightly different tokens")
    p.add_argument("--instances", type=int, default=1, help="engine instances in this process")
    p.add_argument("--policy", default="vllm",
                   help="scheduling policy across instances (vllm, round-robin, least-load, distserve, ...)")
    p.add_argument("--prefill-instances", type=int, default=None, help="prefill instances of PD policies")
    p.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                   help="queue order of the instances' batch schedulers: arrival, or the requests' "
                        "`priority` field (lower first), as vLLM's --scheduling-policy")
    p.add_argument("--ray", action="store_true",
                   help="one process per instance as Ray actors (a local Ray cluster unless --ray-address)")
    p.add_argument("--ray-address", default=None, help="join an existing Ray cluster (implies --ray)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="pin torch's CPU threads (default: torch's count, halved while measured steps run "
                   "faster on fewer, e.g. when another process holds a core)")
    p.add_argument("--profile", default=None, metavar="PATH",
                   help="SLO-aware policies (flowprefill) predict step times with this `flowyard "
                        "profile` of the engine (default: the roofline of --hardware)")
    p.add_argument("--hardware", default="cpu", help="roofline hardware for the predictor (cpu, h100, ...)")
    p.add_argument("--preemption", default="operator", choices=["operator", "layer", "chunk"],
                   help="flowprefill: where a running prefill may be suspended")
    p.add_argument("--timeline", default=None, metavar="PATH",
                   help="on shutdown, write a Chrome/Perfetto trace of steps, KV transfers, decisions and requests")
    p.add_argument("--log-level", default="warning")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from flowyard.engine.async_engine import AsyncLLMEngine
    from flowyard.engine.engine_config import EngineConfig, resolve_dtype
    from flowyard.engine.llm_engine import LLMEngine
    from flowyard.server.app import build_app

    if args.instances < 1:
        raise ValueError(f"--instances must be at least 1, got {args.instances}")
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    # Everything a user can get wrong is checked before the model loads (tens of seconds):
    # the policy's name, the timeline's path, and the port, which is bound now and handed to
    # uvicorn, so that "serving on :PORT" is never printed for a port someone else holds.
    from flowyard.cliargs import check_output_path
    from flowyard.policies.registry import policy_spec

    policy_spec(args.policy)
    check_output_path(args.timeline, "--timeline")
    if args.ray or args.ray_address is not None:
        from flowyard.optional import require

        require("ray", "running instances as Ray actors (--ray)")
    sock = _bind(args.host, args.port)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    config = EngineConfig(
        dtype=args.dtype, kv_cache_memory_mb=args.kv_cache_memory, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_waiting=args.max_waiting, enable_prefix_caching=not args.no_prefix_caching,
        threads=args.threads, attention=args.attention, quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    print(f"flowyard: loading {args.model or 'embedded SmolLM2-135M-Instruct'} ({resolve_dtype(args.dtype)}) ...",
          file=sys.stderr, flush=True)
    use_ray = args.ray or args.ray_address is not None
    policy = None
    from flowyard.cluster.core import DecisionLog

    timeline, decisions = None, None
    if args.timeline:
        from flowyard.cluster.timeline import Timeline

        timeline = Timeline()
    else:  # the recent decisions, for /dashboard
        decisions = DecisionLog(limit=5000)
    if (args.instances > 1 or args.policy != "vllm" or use_ray or timeline is not None
            or args.scheduling_policy != "fcfs"):
        from flowyard.policies.flowprefill.scheduler import FlowPrefillConfig
        from flowyard.policies.registry import PolicyOptions, build_policy, policy_requires_predictor

        # Every policy runs in one process or on Ray alike. A policy that predicts step times
        # (SLO-aware ones) gets this engine's profile or the served model's roofline; the
        # registry says which do, so serve never keeps its own list.
        predictor = _predictor(args) if policy_requires_predictor(args.policy) else None
        policy = build_policy(args.policy, PolicyOptions(
            num_instances=args.instances, num_prefill=args.prefill_instances,
            chunk_size=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs, predictor=predictor,
            flowprefill=FlowPrefillConfig(granularity=args.preemption, max_num_seqs=args.max_num_seqs),
            shared_device=not use_ray))  # in one process the engines take turns on one thread
        if args.scheduling_policy == "priority":
            import dataclasses

            policy.configs = {r: dataclasses.replace(c, order="priority") for r, c in policy.configs.items()}
    # One LLMEngine, a LocalCluster or a RayCluster: AsyncLLMEngine drives any of them through
    # the same surface (add_request, step, abort, has_unfinished, num_waiting), duck-typed.
    engine: Any
    if use_ray:
        from flowyard.runtime.ray_cluster import RayCluster

        assert policy is not None  # --ray always builds a policy (the condition above)
        engine = RayCluster(args.model, policy, config, address=args.ray_address, timeline=timeline,
                            decisions=decisions)
    else:
        single = LLMEngine.from_path(args.model, config)
        single.warm_up()  # the instances of a LocalCluster share its model, so this warms them too
        engine = single
        if policy is not None:
            from flowyard.runtime.cluster import LocalCluster

            engine = LocalCluster(single.model, single.tokenizer, policy, config, single.model_name,
                                  timeline=timeline, decisions=decisions)
    if policy is not None:
        where = "Ray actors" if use_ray else "this process"
        print(f"flowyard: {args.instances} instance(s) in {where}, policy {policy.name} "
              f"(roles: {', '.join(r.value for r in policy.roles)})", file=sys.stderr)
    client = AsyncLLMEngine(engine, start=False)  # its loop runs on this (the main) thread, below
    app = build_app(client, api_key=args.api_key, served_model_name=args.served_model_name)
    name = args.served_model_name or engine.model_name
    print(f"flowyard: serving {name!r} on http://{args.host}:{args.port}/v1 "
          f"(max_model_len {engine.max_model_len})",
          file=sys.stderr, flush=True)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level))
    http = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="flowyard-http", daemon=True)
    for sig in (signal.SIGTERM, signal.SIGINT):  # uvicorn off the main thread installs no handlers
        signal.signal(sig, _raise_interrupt)
    try:
        http.start()
        client.run_forever(until=lambda: not http.is_alive())
        while http.is_alive():  # the engine failed: keep answering (/health says so) until stopped
            http.join(timeout=0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.should_exit = True
        http.join(timeout=10)
        client.shutdown()
        if use_ray:
            engine.shutdown()
        if timeline is not None:
            timeline.write(args.timeline)
            print(f"flowyard: wrote the timeline to {args.timeline}", file=sys.stderr)
    return 0 if server.started else 1


def _bind(host: str, port: int):
    """The listening socket, bound as uvicorn binds it (SO_REUSEADDR, IPv6 where the host is
    one); a port in use is a one-line error naming it."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e} "
                         "(another server holds the port? pick one with --port)") from None
    sock.set_inheritable(True)
    return sock


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _predictor(args: argparse.Namespace):
    """What an SLO-aware policy predicts TTFT and batch latency with: a profile of this engine
    when given, else the roofline of the served model's architecture on --hardware."""
    from pathlib import Path

    from flowyard.costmodel import make_cost_model

    if args.profile:
        from flowyard.costmodel.profiled import ProfiledCostModel

        return ProfiledCostModel(args.profile)
    if args.model is None:
        return make_cost_model("smollm2-135m", args.hardware)
    config = Path(args.model) / "config.json"
    if config.is_file():
        return make_cost_model(str(config), args.hardware)
    raise ValueError(f"--policy {args.policy} on {args.model} needs --profile PATH "
                     "(a `flowyard profile` of this engine) to predict prefill times")
