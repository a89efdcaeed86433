"""The per-instance bookkeeping and the tick grid every executor shares (`flowyard.cluster.turns`,
`flowyard.cluster.ticks`): their rules, and that the simulator keeps them."""

from __future__ import annotations

import pytest

from conftest import FixedLink, LinearCost
from flowyard.cluster.ticks import Ticks
from flowyard.cluster.turns import Turns
from flowyard.core.request import Request
from flowyard.policies.registry import PolicyOptions, build_policy
from flowyard.sim.cluster import Topology
from flowyard.sim.simulator import Simulator


def test_turns_queue_first_come_first_served_and_a_stepped_instance_goes_to_the_back():
    queued = []
    turns = Turns(on_queued=queued.append)
    assert turns.kick(2) and turns.kick(0) and not turns.kick(2)  # already queued
    assert turns.pop() == 2
    turns.running = 2
    assert not turns.kick(2)  # stepping: not queued again
    turns.running = None
    turns.stepped(2, ran=True)  # after its turn, behind those already waiting
    assert list(turns.ready) == [0, 2] and queued == [2, 0, 2]


def test_an_idle_instance_keeps_its_earliest_wake_up_still_to_come():
    timers = []
    turns = Turns(on_timer=lambda i, t: timers.append((i, t)))
    turns.stepped(1, ran=False, wake=None, now=0.0)  # waits for an event only
    turns.stepped(1, ran=False, wake=0.0, now=0.0)  # not still to come
    assert turns.next_wake() is None
    turns.wait(1, 2.0, now=0.0)
    turns.wait(1, 3.0, now=0.5)  # later than the one it has
    turns.wait(1, 1.5, now=0.5)  # earlier: replaces it
    assert timers == [(1, 2.0), (1, 1.5)] and turns.next_wake() == 1.5
    assert not turns.due(1, 1.4) and turns.due(1, 1.5) and turns.next_wake() is None
    turns.wait(0, 1.0, now=0.0)
    turns.wait(3, 1.0, now=0.0)
    turns.wake_due(1.0)
    assert list(turns.ready) == [0, 3]


def test_ticks_keep_a_grid_from_the_first_arrival():
    ticks = Ticks(0.5)
    assert not ticks.due(10.0)  # not started
    ticks.start(1.0)
    ticks.start(1.2)  # a later arrival leaves the grid alone
    assert ticks.next == 1.5 and not ticks.due(1.4)
    assert ticks.due(1.5) and ticks.next == 2.0
    assert not ticks.due(2.0, before=True)  # an event at the tick's own time comes first
    assert ticks.due(2.1, before=True) and ticks.next == 2.5
    assert ticks.due(4.2) and ticks.next == 4.5  # slept through several: one tick, same grid
    ticks.end()
    ticks.start(6.0)  # the workload is over: no new grid
    assert ticks.next is None and ticks.delay(5.0) is None and not ticks.due(100.0)
    assert Ticks(None).delay(0.0) is None
    with pytest.raises(ValueError, match="period"):
        Ticks(0.0)


@pytest.mark.parametrize("shared_device", [False, True])
def test_the_simulator_ticks_on_the_grid_through_idle_gaps(shared_device):
    """From the first arrival to the last request's end, idle or not: the grid the runtimes
    keep too (tests/test_runtime.py), so no policy ticks itself from dispatches."""
    reqs = [Request(0, 0.3, prompt_len=64, max_tokens=4), Request(1, 5.0, prompt_len=64, max_tokens=4)]
    pol = build_policy("round-robin", PolicyOptions(num_instances=2))
    gs = pol.global_scheduler
    gs.period = 0.5
    ticks: list[float] = []
    gs.tick = lambda view, now: ticks.append(now)
    sim = Simulator(reqs, pol, LinearCost(capacity=4096), Topology(1, FixedLink(), FixedLink()),
                    shared_device=shared_device)
    res = sim.run()
    assert len(res.completed) == 2
    assert ticks == pytest.approx([0.3 + 0.5 * k for k in range(1, len(ticks) + 1)])
    assert ticks[-1] >= res.states[1].finish_time > ticks[-2]  # the last one still fires
    assert any(1.0 < t < 5.0 for t in ticks)  # through the idle gap
    assert sim.core.ticks.next is None


def test_the_simulator_steps_instances_of_a_shared_device_in_turns():
    """Two instances on one device never run at once: each step starts when the one before ends."""
    reqs = [Request(i, 0.0, prompt_len=128, max_tokens=3) for i in range(4)]
    pol = build_policy("round-robin", PolicyOptions(num_instances=2))
    spans: list[tuple[int, float]] = []
    sim = Simulator(reqs, pol, LinearCost(capacity=4096), Topology(1, FixedLink(), FixedLink()), shared_device=True,
                    on_step=lambda i, plan, n: spans.append((i, sim.now)))
    sim.run()
    ends = [t for _, t in spans]
    assert ends == sorted(ends) and len(set(ends)) == len(ends)  # one at a time
    assert {i for i, _ in spans} == {0, 1}
