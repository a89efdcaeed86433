"""The engine's thread tuner (engine/threads.py), on a simulated clock: it keeps the count on a
quiet machine, moves when the other count is clearly faster, and moves back."""

from __future__ import annotations

import pytest

from flowyard.engine.threads import ThreadTuner, shape_key


class Machine:
    """Step times by thread count; `speed[n]` is one step's seconds at n threads."""

    def __init__(self, speed: dict[int, float]) -> None:
        self.speed, self.now, self.threads, self.sets = speed, 0.0, 2, []

    def set(self, n: int) -> None:
        self.threads = n
        self.sets.append(n)

    def run(self, tuner: ThreadTuner, steps: int, keys=lambda i: "decode", extra=None) -> list[int]:
        """`steps` steps of shape keys(i); extra[i] adds seconds to step i (noise)."""
        used = []
        for i in range(steps):
            tuner.begin(keys(i))
            used.append(self.threads)
            self.now += self.speed[self.threads] + (extra or {}).get(i, 0.0)
            tuner.end()
        return used


def _tuner(m: Machine, **kw) -> ThreadTuner:
    return ThreadTuner(2, set_threads=m.set, clock=lambda: m.now, **kw)


def test_a_quiet_machine_keeps_every_thread_and_probes_rarely():
    m = Machine({1: 0.040, 2: 0.025})
    t = _tuner(m)
    used = m.run(t, 2000)  # 50 s of steps: probes at 0, 10 and 30 s (the period doubles from 5 s)
    assert t.current == 2 and t.switches == 0
    assert used.count(1) == 3 * 3  # three one-thread steps a probe
    assert used.count(1) * (0.040 - 0.025) / m.now < 0.01


def test_a_shared_core_moves_to_one_thread_and_back_when_it_is_free():
    m = Machine({1: 0.11, 2: 0.50})  # another process holds one of the two cores
    t = _tuner(m)
    assert m.run(t, 8) == [2, 1, 2, 1, 2, 1, 1, 1]  # the first steps probe: a server may start on a busy machine
    assert t.current == 1 and t.switches == 1
    m.speed = {1: 0.040, 2: 0.025}  # the other process is gone
    m.run(t, 400)
    assert t.current == 2 and t.switches == 2


def test_a_slowdown_starts_a_probe_at_once():
    m = Machine({1: 0.040, 2: 0.025})
    t = _tuner(m)
    m.run(t, 4000)  # 100 s: the period has grown to 80 s
    m.speed = {1: 0.11, 2: 0.50}  # another process starts
    used = m.run(t, 8)
    assert used == [2, 2, 1, 2, 1, 2, 1, 1]  # the first slow step is seen, the next ones probe
    assert t.current == 1


def test_one_noisy_pair_keeps_the_count():
    m = Machine({1: 0.11, 2: 0.50})
    t = _tuner(m, period=0.0)
    used = m.run(t, 6, extra={5: 1.0})  # three pairs (2, 1): the last one-thread step is slow
    assert used == [2, 1, 2, 1, 2, 1]
    assert t.current == 2 and t.switches == 0
    assert m.run(t, 6) == [2, 1, 2, 1, 2, 1] and t.current == 1


def test_pairs_need_steps_of_one_shape():
    m = Machine({1: 0.11, 2: 0.50})
    t = _tuner(m, period=0.0, patience=24)
    m.run(t, 24, keys=lambda i: i)  # every step a different shape: no pair, no move
    assert t.current == 2 and t.switches == 0
    m.run(t, 6)
    assert t.current == 1


def test_a_probe_runs_the_candidate_only_as_the_second_step_of_a_pair():
    """Two instances stepped in turn: shapes alternate, so no two steps in a row pair; the probe
    must not run them at the candidate while it waits (an earlier version ran 22 in a row)."""
    m = Machine({1: 0.040, 2: 0.025})
    t = _tuner(m)
    used = m.run(t, 24, keys=lambda i: i % 2)
    assert used == [2] * 24 and t.switches == 0
    used = m.run(t, 600, keys=lambda i: i // 2)  # pairs of one shape: 3 candidate steps a probe
    assert used.count(1) <= 3 * 2 and t.current == 2


def test_a_single_thread_never_probes():
    m = Machine({1: 0.1})
    m.threads = 1
    t = ThreadTuner(1, set_threads=m.set, clock=lambda: m.now, period=0.0)
    m.run(t, 50)
    assert m.sets == [] and t.current == 1


def test_decode_steps_pair_within_a_power_of_two():
    assert shape_key(0, 0, 12) == shape_key(0, 0, 9) != shape_key(0, 0, 16)
    assert shape_key(0, 0, 3) != shape_key(1, 0, 3)
    assert shape_key(0, 100, 3) is None  # a step with prompt tokens never probes


def test_steps_with_prompts_run_at_the_current_count_and_teach_nothing():
    m = Machine({1: 0.11, 2: 0.50})
    t = _tuner(m)
    assert m.run(t, 10, keys=lambda i: None) == [2] * 10 and t.switches == 0
    assert m.run(t, 6) == [2, 1, 2, 1, 2, 1] and t.current == 1


def test_max_threads_is_checked():
    with pytest.raises(ValueError, match="max_threads"):
        ThreadTuner(0)


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_serve_rejects_a_bad_thread_count(value, capsys):
    from flowyard.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--threads", value])
    assert "--threads" in capsys.readouterr().err
