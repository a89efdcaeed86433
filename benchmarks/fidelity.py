"""Simulator fidelity: profile the real engine, simulate a trace slice with that profile, run the
same slice (same arrivals, lengths and policy) on the real engine, and compare.

The real run replays arrivals in wall-clock time through `LLMEngine` in this process (no HTTP,
so the client does not steal the 2 cores from the engine); both runs are summarised by the same
metrics code from the same `RequestState` fields.
With --instances N --policy P the real side is a `RayCluster` (one process and one thread
per instance), timed by the driver as outputs arrive, and the profile is taken on one thread.
With --local as well, the real side is a `LocalCluster` (the N engines in this process, stepped
in turn by one thread) and the simulator runs with `shared_device=True`, its model of that.
Run: python benchmarks/fidelity.py [--requests 40] [--rate 1.0] [--dtype float32]
     python benchmarks/fidelity.py --instances 2 --policy distserve --rate 1.5
     python benchmarks/fidelity.py --instances 2 --policy distserve --local --rate 0.5
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import time

from flowyard.core.metrics import summarize
from flowyard.costmodel.link import Link
from flowyard.costmodel.profiled import ProfiledCostModel
from flowyard.engine.engine_config import EngineConfig, default_token_budget
from flowyard.engine.llm_engine import LLMEngine
from flowyard.engine.profiler import default_grid, measure_engine_overhead, run_profile
from flowyard.engine.sampling import SamplingParams
from flowyard.policies.registry import PolicyOptions, build_policy
from flowyard.sim.cluster import Topology
from flowyard.sim.simulator import Simulator
from flowyard.workloads import clip, load_trace, retime


# A second engine decoding a batch forever on one thread: the neighbour an instance has when
# several share this machine's cores and memory bus.
NEIGHBOUR = """
import torch; torch.set_num_threads(1)
from flowyard.engine.engine_config import EngineConfig
from flowyard.engine.llm_engine import LLMEngine
from flowyard.engine.sampling import SamplingParams
e = LLMEngine.from_path(None, EngineConfig(kv_cache_memory_mb=128))
while True:
    e.generate([[100 + i] * 64 for i in range(8)], SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
"""


class _NoLink:
    def transfer_time(self, nbytes: float) -> float:
        return 0.0


def workload(n: int, rate: float, max_in: int, max_out: int, seed: int):
    w = clip(load_trace("azure-conv"), max_requests=n)
    w = retime(w, "poisson", rate=rate, seed=seed)
    reqs = [dataclasses.replace(r, prompt_len=min(r.prompt_len, max_in), output_len=min(r.output_len, max_out),
                                max_tokens=min(r.output_len, max_out)) for r in w.requests]
    return reqs


def run_real(engine, reqs) -> tuple[list, float]:
    """Replay arrivals on the wall clock through an LLMEngine or a LocalCluster; returns the
    request states (a request's state object follows it from engine to engine)."""
    states, pending = [], sorted(reqs, key=lambda r: r.arrival)
    start = time.monotonic()
    for e in getattr(engine, "engines", [engine]):
        e._t0 = start  # the engines' clock reads 0 at the first arrival, like the trace
    i = 0
    while i < len(pending) or engine.has_unfinished():
        now = time.monotonic() - start
        while i < len(pending) and pending[i].arrival <= now:
            r = pending[i]
            rid = f"r{r.id}"
            engine.add_request(rid, [(r.id * 131 + j) % 40000 + 100 for j in range(r.prompt_len)],
                               SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True))
            owner = engine.engines[engine._where[rid]] if hasattr(engine, "engines") else engine
            states.append((r.arrival, owner.tracked(rid).state))
            i += 1
        if engine.has_unfinished():
            engine.step()
        elif i < len(pending):
            time.sleep(max(0.0, min(0.01, pending[i].arrival - (time.monotonic() - start))))
    # TTFT counts from the trace arrival, as a client sees it (a request that arrives while a
    # step runs waits for the step boundary, in a server too).
    return [dataclasses.replace(st, req=dataclasses.replace(st.req, arrival=t)) for t, st in states], \
        time.monotonic() - start


def run_ray(cluster, reqs) -> tuple[list, float]:
    """Replay arrivals against a RayCluster; token times are when the driver sees them."""
    import numpy as np

    from flowyard.core.request import RequestState, Status

    pending = sorted(reqs, key=lambda r: r.arrival)
    times: dict[str, list[float]] = {}
    start, i = time.monotonic(), 0
    while i < len(pending) or cluster.has_unfinished():
        now = time.monotonic() - start
        while i < len(pending) and pending[i].arrival <= now:
            r = pending[i]
            cluster.add_request(f"r{r.id}", [(r.id * 131 + j) % 40000 + 100 for j in range(r.prompt_len)],
                                SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True))
            times[f"r{r.id}"] = []
            i += 1
        if cluster.has_unfinished():
            for o in cluster.step():
                t = time.monotonic() - start
                times[o.request_id] += [t] * len(o.new_token_ids)
        elif i < len(pending):
            time.sleep(max(0.0, min(0.01, pending[i].arrival - (time.monotonic() - start))))
    states = []
    for r in reqs:
        st = RequestState(r)
        st.record_tokens(np.array(times[f"r{r.id}"]))
        st.status, st.finish_time = Status.FINISHED, st.token_times[-1][-1]
        states.append(st)
    return states, time.monotonic() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--rate", type=float, default=1.0)
    ap.add_argument("--max-input", type=int, default=384)
    ap.add_argument("--max-output", type=int, default=48)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="a small profiling grid")
    ap.add_argument("--instances", type=int, default=1)
    ap.add_argument("--policy", default="vllm")
    ap.add_argument("--contended-profile", action="store_true",
                    help="profile while another engine process decodes (instances share cores here)")
    ap.add_argument("--link-gbps", type=float, default=8.0, help="modelled KV link (Ray object store)")
    ap.add_argument("--local", action="store_true",
                    help="with --instances: the instances in this process (LocalCluster), not Ray actors")
    args = ap.parse_args()
    cfg = EngineConfig(dtype=args.dtype, kv_cache_memory_mb=256, enable_prefix_caching=False)
    engine = LLMEngine.from_path(None, cfg)
    if args.instances > 1 and not args.local:
        import torch

        torch.set_num_threads(1)  # each Ray actor runs one thread
    print(f"machine: {platform.processor() or platform.machine()}; model {engine.model_name} {args.dtype}")
    t = time.perf_counter()
    neighbour = None
    if args.contended_profile:
        import subprocess
        import sys

        neighbour = subprocess.Popen([sys.executable, "-c", NEIGHBOUR], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        time.sleep(8)  # let it load and start decoding
    prof = run_profile(engine.runner, grid=default_grid(quick=args.quick), repeats=3, name=engine.model_name)
    prof["engine_overhead_s"] = measure_engine_overhead(engine)
    if neighbour is not None:
        neighbour.kill()
    cost = ProfiledCostModel(prof, kv_capacity_tokens=engine.kv.capacity_tokens)
    print(f"profiled in {time.perf_counter() - t:.0f} s; engine overhead {prof['engine_overhead_s'] * 1e3:.2f} ms/step; fit error {', '.join(f'{k} {v:.0%}' for k, v in cost.fit_error.items())}")
    reqs = workload(args.requests, args.rate, args.max_input, args.max_output, args.seed)

    opts = PolicyOptions(num_instances=args.instances, chunk_size=cfg.max_num_batched_tokens or default_token_budget(),
                         max_num_seqs=cfg.max_num_seqs, shared_device=args.local)
    link = Link(args.link_gbps * 1e9 / 8, 2e-3) if args.instances > 1 else _NoLink()
    sim = Simulator(reqs, build_policy(args.policy, opts), cost, Topology(1, link, link),
                    block_size=cfg.block_size, shared_device=args.local).run()
    simulated = summarize(sim.states, policy="simulated")
    if args.instances > 1 and args.local:
        from flowyard.runtime.cluster import LocalCluster

        cluster = LocalCluster(engine.model, engine.tokenizer, build_policy(args.policy, opts), cfg)
        states, wall = run_real(cluster, reqs)
    elif args.instances > 1:
        import ray

        from flowyard.runtime.ray_cluster import RayCluster

        ray.init(num_cpus=args.instances, include_dashboard=False, log_to_driver=False)
        cluster = RayCluster(None, build_policy(args.policy, opts), dataclasses.replace(cfg, threads=1))
        states, wall = run_ray(cluster, reqs)
        cluster.shutdown()
        ray.shutdown()
    else:
        states, wall = run_real(engine, reqs)
    real = summarize(states, policy="real")
    print(f"\n{args.policy} on {args.instances} instance(s); {len(reqs)} requests of azure-conv, Poisson {args.rate} req/s, prompts <= {args.max_input}, "
          f"outputs <= {args.max_output}; real run {wall:.0f} s")
    print(f"{'metric':<22} {'real':>10} {'simulated':>10} {'rel. error':>10}")
    rows = [("TTFT p50 (ms)", real.ttft["p50"], simulated.ttft["p50"], 1e3),
            ("TTFT p90 (ms)", real.ttft["p90"], simulated.ttft["p90"], 1e3),
            ("TPOT p50 (ms)", real.tpot["p50"], simulated.tpot["p50"], 1e3),
            ("TPOT p90 (ms)", real.tpot["p90"], simulated.tpot["p90"], 1e3),
            ("throughput (tok/s)", real.output_tokens_per_s, simulated.output_tokens_per_s, 1)]
    for name, r, s, k in rows:
        print(f"{name:<22} {r * k:>10.1f} {s * k:>10.1f} {(s - r) / r:>+10.1%}")


if __name__ == "__main__":
    main()
