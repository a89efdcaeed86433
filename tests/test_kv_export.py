"""The time a source instance spends giving up a moved request's KV (Ray copies it into the
object store on the thread that runs its steps): fitted on a served timeline
(`serving.fit_export`) and charged by the simulator before the source's next step."""

from __future__ import annotations

import pytest

from conftest import FixedLink, LinearCost
from flowyard.core.request import SLO, Request
from flowyard.costmodel.serving import ServingTerms, fit_export
from flowyard.policies.registry import PolicyOptions, build_policy
from flowyard.sim.cluster import Topology
from flowyard.sim.simulator import Simulator

TOPO = Topology(1, FixedLink(), FixedLink())


class Exporting(LinearCost):
    def __init__(self, export_s: float) -> None:
        super().__init__()
        self.export_s = export_s

    def kv_export_time(self) -> float:
        return self.export_s


def run(export_s: float, shared_device: bool = False):
    cost = Exporting(export_s)
    reqs = [Request(i, arrival=0.0, prompt_len=5000, output_len=4, slo=SLO()) for i in range(3)]
    pol = build_policy("distserve", PolicyOptions(num_instances=2, num_prefill=1, predictor=cost))
    return {s.id: s for s in Simulator(reqs, pol, cost, TOPO, shared_device=shared_device).run().states}


def test_a_prefill_instance_waits_out_each_moved_requests_export_before_its_next_step():
    free, paying = run(0.0), run(0.05)
    prefill = LinearCost().base + 1e-4 * 5000  # one whole prompt per step (5,000 + 5,000 > 8,192)
    assert free[0].first_token_time == pytest.approx(prefill)
    assert paying[0].first_token_time == pytest.approx(prefill)  # nothing moved before it
    assert paying[1].first_token_time - free[1].first_token_time == pytest.approx(0.05)
    assert paying[2].first_token_time - free[2].first_token_time == pytest.approx(0.10)


def test_on_a_shared_device_every_instance_waits_out_the_export():
    free, paying = run(0.0, shared_device=True), run(0.05, shared_device=True)
    assert paying[0].first_token_time == pytest.approx(free[0].first_token_time)
    # request 0's first decode step, on the other instance, waits for its own KV's export
    assert paying[0].finish_time - free[0].finish_time >= 0.05 - 1e-9
    assert all(paying[i].finish_time > free[i].finish_time for i in range(3))


def _trace(gap_after_move_ms: float) -> list[dict]:
    """Instance 0 prefills and hands every request to instance 1; both step back to back
    with 3.5 ms between steps, and instance 0 pays `gap_after_move_ms` more after a move."""
    ev, t0, t1 = [], 0.0, 0.0
    for i in range(12):
        ev.append({"ph": "X", "cat": "step", "name": "prefill", "pid": 0, "ts": t0, "dur": 100e3})
        ev.append({"ph": "i", "cat": "decision", "name": "handoff", "pid": 0, "ts": t0 + 100e3 + 500,
                   "args": {"request": i, "src": 0, "dst": 1}})
        t0 += 100e3 + 3.5e3 + gap_after_move_ms * 1e3
    for _ in range(40):
        ev.append({"ph": "X", "cat": "step", "name": "decode", "pid": 1, "ts": t1, "dur": 20e3})
        t1 += 20e3 + 3.5e3
    return ev


def test_the_export_time_is_the_sources_busy_gap_beyond_the_others():
    assert fit_export(_trace(12.0)) == pytest.approx(0.012)
    assert fit_export({"traceEvents": _trace(0.0)}) == pytest.approx(0.0, abs=1e-9)
    colocated = [e for e in _trace(12.0) if e["cat"] != "decision"]
    with pytest.raises(ValueError, match="needs a timeline where requests move"):
        fit_export(colocated)


def test_on_one_thread_the_export_delays_the_next_step_of_any_instance():
    """One process: the instances take turns, so the gap a move adds is before whichever step
    runs next (here a decode of the other instance), not before the source's own next step."""
    ev, t = [], 0.0
    for i in range(12):
        ev.append({"ph": "X", "cat": "step", "name": "prefill", "pid": 0, "ts": t, "dur": 50e3})
        ev.append({"ph": "i", "cat": "decision", "name": "handoff", "pid": 0, "ts": t + 50e3 + 300,
                   "args": {"request": i, "src": 0, "dst": 1}})
        t += 50e3 + 2e3 + 3e3  # the serving loop's 2 ms and the export's 3 ms
        for _ in range(3):
            ev.append({"ph": "X", "cat": "step", "name": "decode", "pid": 1, "ts": t, "dur": 10e3})
            t += 10e3 + 2e3
    assert fit_export(ev) == pytest.approx(0.003)


def test_a_profiles_serving_block_carries_the_export_time_and_refuses_a_negative_one():
    assert ServingTerms.from_dict({"export_s": 0.02}).export_s == 0.02
    assert ServingTerms.from_dict({}).export_s == 0.0
    with pytest.raises(ValueError, match="non-negative"):
        ServingTerms.from_dict({"export_s": -1.0})


def test_profile_fits_the_export_time_from_a_timeline_where_requests_move(tmp_path, capsys):
    """`flowyard profile --serving-timeline T --export-timeline X --from P --out O`."""
    import json

    from test_serving_fit import _profile, _served_timeline

    from flowyard.cli import main
    from flowyard.costmodel.profiled import ProfiledCostModel

    base, tl, xtl, out = (tmp_path / n for n in ("p.json", "tl.json", "x.json", "o.json"))
    base.write_text(json.dumps(_profile()))
    tl.write_text(json.dumps(_served_timeline(ProfiledCostModel(_profile({"scale": 1.1})))))
    xtl.write_text(json.dumps({"traceEvents": _trace(9.0)}))
    assert main(["profile", "--serving-timeline", str(tl), "--export-timeline", str(xtl), "--from", str(base),
                 "--out", str(out)]) == 0
    assert "KV export 9.0 ms a move" in capsys.readouterr().out
    assert ProfiledCostModel(str(out)).kv_export_time() == pytest.approx(0.009)
    assert main(["profile", "--export-timeline", str(xtl), "--out", str(out)]) == 2
    assert "--export-timeline goes with --serving-timeline" in capsys.readouterr().err
