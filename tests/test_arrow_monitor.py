"""Arrow's instance monitor: the flip of P→D instances holding stranded prompts back towards
prefill on a tick (no arrival needed), its overload guard, and the cool-down that keeps the
monitor from cycling an instance P→D→P every tick."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from conftest import FixedLink, LinearCost
from flowyard.core.request import SLO, Request, RequestState
from flowyard.policies.arrow.router import ArrowConfig
from flowyard.policies.arrow.pools import Pool
from flowyard.policies.registry import PolicyOptions, build_policy
from flowyard.sim.cluster import Topology
from flowyard.sim.simulator import Simulator
from test_arrow import View, router, snap

STRANDED = [(0, 6000)] * 2  # two queued prompts: ~1.3 s predicted delay, over a 1 s TTFT SLO


def views(d_interval: float = 0.01):
    """P instance 0 busy, P→D instance 1 with stranded prompts and 3 decodes, D 2 and 3."""
    return View({0: snap(0, queue=[(0, 500)]), 1: snap(1, queue=STRANDED, decoding=3, running_tokens=900),
                 2: snap(2, decoding=2, running_tokens=400, interval=d_interval),
                 3: snap(3, decoding=1, running_tokens=200, interval=d_interval)})


P2D = {0: Pool.P, 1: Pool.P2D, 2: Pool.D, 3: Pool.D}


def test_tick_flips_a_p2d_instance_with_stranded_prompts_back_towards_prefill():
    r = router(P2D, ttft_slo=1.0, tpot_slo=0.05)
    r.tick(views(), 0.5)
    assert r.pools.moves == [(0.5, 1, Pool.P2D, Pool.D2P)]  # it still decodes: D→P first
    # Alg. 2 now moves the decodes of its prompts to a D instance instead of keeping them
    st = RequestState(Request(id=0, arrival=0.0, prompt_len=100, output_len=5, slo=SLO(tpot=0.05)),
                      num_computed=100, num_output=1)
    assert r.route_decode(st, 1, views(), 0.6) == 3


@pytest.mark.parametrize("why, pools, view, cfg", [
    ("overload rule: D instances near the TPOT threshold", P2D, views(d_interval=0.04), {}),
    ("nothing stranded", P2D, View(views().snaps | {1: snap(1, queue=[(0, 500)], decoding=3)}), {}),
    ("no D instance would be left to decode", {0: Pool.P, 1: Pool.P2D, 2: Pool.P, 3: Pool.P}, views(), {}),
    ("rule off", P2D, views(), {"unstrand": False}),
])
def test_tick_leaves_p2d_instances_alone(why, pools, view, cfg):
    r = router(pools, ttft_slo=1.0, tpot_slo=0.05, **cfg)
    r.tick(view, 0.5)
    assert not r.pools.moves, why


def test_cooldown_keeps_the_monitor_from_cycling_an_instance():
    st = RequestState(Request(id=7, arrival=0.0, prompt_len=100, output_len=10, slo=SLO(tpot=0.05)),
                      num_computed=100, num_output=1)
    pools = {0: Pool.P, 1: Pool.P, 2: Pool.D, 3: Pool.D, 4: Pool.P}
    queue4 = {4: snap(4, queue=[(0, 6000)] * 4)}
    light = View(views().snaps | queue4)
    # decodes over TPOT: Alg. 4 flips the P instance with the least prefill delay, 1, to P→D
    slow = View(views(d_interval=0.5).snaps | {0: snap(0, queue=[(0, 6000)] * 3), 1: snap(1, queue=STRANDED)}
                | queue4)
    hot = View(views(d_interval=0.5).snaps | queue4)  # decodes over TPOT again
    for cooldown, back_at in ((0.0, 1.0), (1.0, 1.5)):
        r = router(pools, ttft_slo=1.0, tpot_slo=0.05, flip_cooldown=cooldown, monitor_periods=1)
        assert r.route_decode(st, 0, slow, 0.5) == 1 and r.pools.of[1] is Pool.P2D
        r.tick(light, 1.0)  # decode light again, prompts stranded on 1: flip it back, after the cool-down
        r.tick(light, 1.5)
        assert [m for m in r.pools.moves if m[2] is Pool.P2D][0] == (back_at, 1, Pool.P2D, Pool.D2P)
    # case 2 then wants a prefill instance for decode; Alg. 4 prefers D→P instances, but not
    # instance 1 until its cool-down has passed: P→D→P→D takes at least two cool-downs
    r.tick(hot, 2.0)  # (r: cool-down 1 s, instance 1 flipped back at 1.5)
    assert r.pools.of[1] is Pool.D2P and r.pools.moves[-1] == (2.0, 0, Pool.P, Pool.P2D)
    r.tick(hot, 2.5)
    assert r.pools.moves[-1] == (2.5, 1, Pool.D2P, Pool.P2D)


def test_flip_cooldown_is_validated():
    with pytest.raises(ValueError):
        ArrowConfig(flip_cooldown=-1.0)


def burst_then_silence() -> list[Request]:
    """Medium prompts whose decodes fill the D instances, then a burst of long prompts; no
    arrival after 0.42 s. Alg. 2/4 flip both P instances, still holding queued long prompts,
    to P→D, and a D instance is idle by 2.5 s."""
    slo = SLO(ttft=1.0, tpot=0.05)
    wave = [Request(id=i, arrival=0.01 * i, prompt_len=1500, output_len=40, slo=slo) for i in range(24)]
    return wave + [Request(id=24 + i, arrival=0.3 + 0.005 * i, prompt_len=4000, output_len=10, slo=slo)
                   for i in range(24)]


def run_burst(paper_only: bool):
    cost = LinearCost(capacity=20_000)
    pol = build_policy("arrow", PolicyOptions(num_instances=4, predictor=cost))
    gs = pol.global_scheduler
    if paper_only:  # the monitor of §5.5 alone (flips towards decode only, no cool-down)
        gs.dispatcher.cfg = dataclasses.replace(gs.dispatcher.cfg, unstrand=False, flip_cooldown=0.0)
    res = Simulator(burst_then_silence(), pol, cost, Topology(1, FixedLink(), FixedLink())).run()
    assert all(s.num_output == s.req.output_len for s in res.states)  # every request completes
    ttft = [s.first_token_time - s.req.arrival for s in res.states]
    return max(s.first_token_time for s in res.states), float(np.percentile(ttft, 90)), res.sim_time, gs


def test_stranded_prompts_drain_sooner_after_a_burst_followed_by_silence():
    drain0, p90_0, end0, gs0 = run_burst(paper_only=True)
    drain, p90, end, gs = run_burst(paper_only=False)
    last_arrival = max(r.arrival for r in burst_then_silence())
    back = [m for m in gs.pools.moves if m[2] is Pool.P2D and m[3] in (Pool.D2P, Pool.P)]
    assert back and all(t > last_arrival + 1.0 for t, *_ in back)  # on ticks, long after arrivals
    assert not any(m[2] is Pool.P2D and m[3] is not Pool.D for m in gs0.pools.moves)
    # measured: drain 9.30 -> 5.04 s, P90 TTFT 4.40 -> 4.06 s, makespan 9.5 -> 5.5 s
    assert drain < 0.7 * drain0 and end < 0.7 * end0 and p90 < p90_0
