"""PLA-Serve's session-affine routing on multi-turn conversations, in the simulator.

ShareGPT lengths chained into sessions (`multi_turn_sessions`: mean 4 turns, follow-ups of at
most 64 new tokens, 5 s think time), 3,000 requests at 24 req/s, Qwen2.5-14B on 8 simulated
H200 (4P4D for the PD policies), TTFT SLO 0.4 s, TPOT SLO 0.2 s, prefix caching on. For each
policy (`name` or `name:off` for PLA with `PLAConfig(affinity_tolerance=None)`) it prints the
TTFT attainment, the share of the later turns' prompt tokens that were not computed (found in
the prefix cache), their TTFT and the TPOT of all requests.

    python benchmarks/pla_sessions.py [pla pla:off pla-spatial pla-spatial:off pla-mix pla-mix:off distserve vllm]
"""

from __future__ import annotations

import sys
import time

import numpy as np

from flowyard.costmodel import make_cost_model
from flowyard.policies.pla.selector import PLAConfig
from flowyard.policies.registry import PolicyOptions, build_policy
from flowyard.sim.run import SimConfig, build_topology, load_workload
from flowyard.sim.simulator import Simulator
from flowyard.workloads import multi_turn_sessions, with_slo

DEFAULT = ["pla", "pla:off", "pla-spatial", "pla-spatial:off", "pla-mix", "pla-mix:off", "distserve", "vllm"]


def main(specs: list[str]) -> None:
    cost = make_cost_model("qwen2.5-14b", "h200")
    topo = build_topology(SimConfig(hardware="h200"))
    cfg = SimConfig(trace="sharegpt", model="qwen2.5-14b", hardware="h200", instances=8, rate=24,
                    num_requests=3000, prefix_caching=True)
    reqs = with_slo(multi_turn_sessions(load_workload(cfg), turns_mean=4, max_new_tokens=64, think_time=5),
                    ttft=0.4, tpot=0.2).requests
    print(f"{'policy':16} {'TTFT att.':>9} {'cached':>7} {'later TTFT mean/P90':>20} {'TPOT P90':>9}  wall")
    for spec in specs:
        name, _, flag = spec.partition(":")
        pla = PLAConfig(affinity_tolerance=None) if flag == "off" else None
        pol = build_policy(name, PolicyOptions(num_instances=8, predictor=cost, pla=pla))
        computed: dict[int, int] = {}

        def on_step(i, plan, k, computed=computed):
            for s in plan.prefills:
                computed[s.state.id] = computed.get(s.state.id, 0) + s.n

        t0 = time.perf_counter()
        states = Simulator(reqs, pol, cost, topo, prefix_caching=True, on_step=on_step).run().states
        wall = time.perf_counter() - t0
        ttft = np.array([s.first_token_time - s.req.arrival for s in states])
        later = [s for s in states if s.req.turn > 0]
        lt = np.array([s.first_token_time - s.req.arrival for s in later])
        cached = 1 - sum(computed.get(s.id, 0) for s in later) / sum(s.req.prompt_len for s in later)
        tpot = np.array([(s.all_token_times()[-1] - s.first_token_time) / (s.num_output - 1)
                         for s in states if s.num_output > 1])
        print(f"{spec:16} {np.mean(ttft <= 0.4):9.3f} {cached:7.1%} {lt.mean() * 1e3:9.0f} /{np.percentile(lt, 90) * 1e3:5.0f} ms"
              f" {np.percentile(tpot, 90) * 1e3:6.1f} ms  {wall:.1f} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or DEFAULT)
