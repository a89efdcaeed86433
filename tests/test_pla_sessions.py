"""PLA-Serve's session-affine routing: a later turn re-prefills on the instance holding its
history, classified by the tokens it really computes there (PLA-Serve §2.1, §3.2)."""

from __future__ import annotations

import numpy as np
import pytest

from flowyard.core.request import SLO, Request
from flowyard.costmodel import make_cost_model
from flowyard.policies.framework.contracts import InstanceSnapshot, Role
from flowyard.policies.pla.selector import PLAConfig
from flowyard.policies.registry import PolicyOptions, build_policy
from flowyard.sim.run import SimConfig, build_topology
from flowyard.sim.simulator import Simulator
from flowyard.workloads import Workload, multi_turn_sessions

COST = make_cost_model("qwen2.5-14b", "h200")
TOPO = build_topology(SimConfig(hardware="h200"))


class View:
    """A ClusterView with a queue of `waiting[i]` prompt tokens on prefill instance i."""

    def __init__(self, waiting: dict[int, int], decode=(4, 5)) -> None:
        self.waiting, self.decode = waiting, list(decode)

    def instances(self, role=None):
        return list(self.waiting) if role is Role.PREFILL else self.decode if role is Role.DECODE else []

    def snapshot(self, i):
        return InstanceSnapshot(instance=i, role=Role.PREFILL, num_running=0, num_waiting=0,
                                waiting_tokens=self.waiting[i], running_tokens=0, kv_free_blocks=100,
                                kv_total_blocks=100, block_size=16)


def turn(i, session, t, prompt, history=0):
    return Request(id=i, arrival=float(i), prompt_len=prompt, output_len=10, session=session, turn=t,
                   history_len=history)


def spatial_router(tolerance=0.05):
    pol = build_policy("pla-spatial", PolicyOptions(num_instances=6, num_prefill=4, predictor=COST,
                                                    pla=PLAConfig(affinity_tolerance=tolerance)))
    return pol.global_scheduler.dispatcher  # the PLA parts; pools: short [0, 1], long [2, 3]


FIRST = turn(0, "a", 0, 3000)  # long: the long pool
LATER = turn(1, "a", 1, 3040, history=3010)  # 3000 cached there (2992 in whole blocks) + 48 new


def test_a_later_turn_goes_home_and_is_classified_by_its_uncached_tokens():
    r = spatial_router()
    view = View({0: 0, 1: 0, 2: 0, 3: 0})
    assert r.route(FIRST, view, 0.0) == 2
    view.waiting[2] = 2000  # home is busier than the rest of the long pool, not clearly worse
    assert r.route(LATER, view, 1.0) == 2  # a short re-prefill (48 tokens over 2992) at home
    assert (r.sessions.sent_home, r.sessions.sent_away) == (1, 0)
    # with no known home the whole prompt is computed: a long fill, so the long pool
    fresh = spatial_router()
    assert fresh.route(LATER, View({0: 0, 1: 0, 2: 5, 3: 0}), 1.0) == 3
    # affinity off: the old routing by the declared history sends it to the short pool
    off = spatial_router(tolerance=None)
    off.route(FIRST, view, 0.0)
    assert off.route(LATER, View({0: 0, 1: 0, 2: 0, 3: 0}), 1.0) in (0, 1)


@pytest.mark.parametrize("tolerance, home", [(0.05, False), (0.5, True)])
def test_a_clearly_worse_home_is_left_by_the_tolerance(tolerance, home):
    r = spatial_router(tolerance)
    r.route(FIRST, View({0: 0, 1: 0, 2: 0, 3: 0}), 0.0)
    # 5,000 queued tokens (~0.24 s) at home against 0.14 s of recomputed history elsewhere
    got = r.route(LATER, View({0: 0, 1: 0, 2: 5000, 3: 0}), 1.0)
    assert got == (2 if home else 3)
    assert r.sessions.home("a")[0] == got  # the next turn follows this one


def conversations(n=160, rate=4.0):
    rng = np.random.default_rng(0)
    t = np.cumsum(rng.exponential(1 / rate, n))
    base = [Request(id=i, arrival=float(t[i] - t[0]), prompt_len=int(rng.integers(1000, 4000)),
                    output_len=int(rng.integers(20, 200)), slo=SLO(ttft=0.4)) for i in range(n)]
    return multi_turn_sessions(Workload("syn", base), turns_mean=4, seed=0, max_new_tokens=64,
                               think_time=2.0).requests


def replay(policy, reqs, tolerance):
    pol = build_policy(policy, PolicyOptions(num_instances=8, num_prefill=4, predictor=COST,
                                             pla=PLAConfig(affinity_tolerance=tolerance)))
    computed: dict[int, int] = {}

    def on_step(i, plan, k):
        for s in plan.prefills:
            computed[s.state.id] = computed.get(s.state.id, 0) + s.n

    res = Simulator(reqs, pol, COST, TOPO, prefix_caching=True, on_step=on_step).run()
    return res.states, computed, pol.global_scheduler


@pytest.mark.parametrize("policy", ["pla", "pla-spatial", "pla-mix"])
def test_later_turns_hit_the_prefix_cache_with_affinity(policy):
    reqs = conversations()
    on, c_on, router = replay(policy, reqs, 0.05)
    off, c_off, _ = replay(policy, reqs, None)
    later = [s.id for s in on if s.req.turn > 0]
    assert len(later) > 80 and router.dispatcher.sessions.sent_home >= 0.9 * len(later)
    tokens_on, tokens_off = sum(c_on[i] for i in later), sum(c_off[i] for i in later)
    assert tokens_on < 0.7 * tokens_off  # the history is not computed again
    ttft = {k: np.mean([s.first_token_time - s.req.arrival for s in states if s.req.turn > 0])
            for k, states in (("on", on), ("off", off))}
    assert ttft["on"] < 0.9 * ttft["off"]
    # a turn that went home computes only what its previous turn did not leave there: the
    # prompt's full blocks, and in mix mode (decoded there too) the reply's as well
    prev: dict[str, object] = {}
    home = 0
    for s in sorted(on, key=lambda s: (s.req.session, s.req.turn)):
        p = prev.get(s.req.session)
        where = s.prefill_instance if policy != "pla-mix" else s.instance
        if p is not None and where is not None and where == p[0]:
            assert c_on[s.id] == s.req.prompt_len - p[1] // 16 * 16
            home += 1
        kept = s.req.prompt_len + (s.req.target_output - 1 if policy == "pla-mix" else 0)
        prev[s.req.session] = (where, kept)
    assert home >= 0.8 * len(later)
