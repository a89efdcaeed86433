"""The score-ordered instance index (`flowyard.cluster.index`) answers what a scan of every
snapshot answers: with touches noted in batches, with scores read straight off the schedulers
(`direct`), and inside the simulator on a cluster large enough to use it."""

from dataclasses import dataclass

from flowyard.cluster.index import INDEX_MIN, Touched
from flowyard.sim.run import SimConfig, build_cost_model, load_workload, simulate


@dataclass
class _Sched:
    load: int


@dataclass
class _Snap:
    load: int


def _score(s: _Snap) -> int:
    return s.load


def _scan(scheds: list[_Sched]) -> int:
    return min(range(len(scheds)), key=lambda i: (scheds[i].load, i))


def _touched(scheds: list[_Sched], reads: list[int]) -> Touched:
    def snapshot(i: int) -> _Snap:
        reads.append(i)
        return _Snap(scheds[i].load)

    return Touched(snapshot, lambda i: scheds[i])  # type: ignore[arg-type]


def test_batched_touches_give_the_scan_answer() -> None:
    scheds = [_Sched((7 * i) % 5) for i in range(40)]
    reads: list[int] = []
    t = _touched(scheds, reads)
    idx = t.ranked("load", _score, lambda: range(40))  # type: ignore[arg-type]
    assert idx.least() == _scan(scheds)
    for step in range(200):
        i = (step * 13) % 40
        scheds[i].load = (scheds[i].load + step) % 9
        t.touch(i)
        t.touch(i)  # touched twice before a query: scored once
        if step % 3 == 0:
            reads.clear()
            assert idx.least() == _scan(scheds)
            assert len(reads) <= 3  # only the instances touched since the last answer


def test_index_made_after_touches_scores_everything_once() -> None:
    scheds = [_Sched(i % 3) for i in range(10)]
    reads: list[int] = []
    t = _touched(scheds, reads)
    t.touch(4)
    idx = t.ranked("load", _score, lambda: range(10))  # type: ignore[arg-type]
    assert idx.least() == 0 and sorted(reads) == list(range(10))


def test_a_direct_score_reads_the_scheduler_not_a_snapshot() -> None:
    def direct_score(s: _Snap) -> int:
        return s.load

    direct_score.direct = lambda sched: sched.load  # type: ignore[attr-defined]
    scheds = [_Sched(9 - i) for i in range(10)]
    reads: list[int] = []
    t = _touched(scheds, reads)
    idx = t.ranked("direct", direct_score, lambda: range(10))  # type: ignore[arg-type]
    assert idx.least() == 9
    scheds[3].load = -1
    t.touch(3)
    assert idx.least() == 3 and reads == []  # no snapshot was built
    plain = Touched(t.snapshot).ranked("plain", direct_score, lambda: range(10))  # type: ignore[arg-type]
    assert plain.least() == 3 and len(reads) == 10  # without a scheduler accessor: snapshots


def _run(cfg: SimConfig, w, cost) -> tuple:
    summary, res = simulate(cfg, w, cost_model=cost)
    d = summary.to_dict()
    d.pop("wall_s", None)
    return d, [(s.id, s.instance, s.first_token_time, s.finish_time, s.num_output, s.preemptions)
               for s in res.states]


def test_simulator_index_routes_as_the_scan(monkeypatch) -> None:
    import flowyard.cluster.index as index

    n = INDEX_MIN + 8
    cfg = SimConfig(trace="azure-code", instances=n, policy="vllm", rate_scale=n / 8, duration=40.0)
    w, cost = load_workload(cfg), build_cost_model(cfg)
    indexed = _run(cfg, w, cost)
    monkeypatch.setattr(index, "INDEX_MIN", 10**9)
    assert _run(cfg, w, cost) == indexed
