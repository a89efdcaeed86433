"""Large workloads: tiling in time, superposing traces, and their command-line flags."""

import json

import pytest

from flowyard.cli import main
from flowyard.core.request import Request
from flowyard.sim.run import SimConfig, load_workload
from flowyard.workloads import Workload
from flowyard.workloads.scale import overlay, parse_mix, tile


def _w(name: str, arrivals: list[float], session: str | None = None) -> Workload:
    return Workload(name, [Request(i, a, 10 + i, output_len=5, session=session) for i, a in enumerate(arrivals)])


def test_tile_repeats_back_to_back_with_fresh_sessions() -> None:
    w = tile(_w("a", [0.0, 1.0, 3.0], session="s"), 3)
    assert [r.arrival for r in w.requests] == [0.0, 1.0, 3.0, 4.0, 5.0, 7.0, 8.0, 9.0, 11.0]
    assert [r.id for r in w.requests] == list(range(9))
    assert [r.prompt_len for r in w.requests] == [10, 11, 12] * 3
    assert {r.session for r in w.requests} == {"s", "s#1", "s#2"}


def test_overlay_merges_by_arrival_and_keeps_sessions_apart() -> None:
    w = overlay([_w("a", [0.0, 2.0], session="x"), _w("b", [1.0, 2.0], session="x")])
    assert [r.arrival for r in w.requests] == [0.0, 1.0, 2.0, 2.0]
    assert [r.id for r in w.requests] == [0, 1, 2, 3]
    assert [r.session for r in w.requests] == ["x", "x#1", "x", "x#1"]  # ties: the first part first
    assert w.name == "a+b"


def test_parse_mix_and_bad_input() -> None:
    assert parse_mix("azure-code:2, burstgpt") == [("azure-code", 2.0), ("burstgpt", 1.0)]
    for bad in ("", "a:x", "a:-1", "a:0"):
        with pytest.raises(ValueError):
            parse_mix(bad)
    with pytest.raises(ValueError):
        SimConfig(tile=0)


def test_config_builds_tiled_mixed_workload() -> None:
    base = load_workload(SimConfig(trace="azure-conv", duration=30))
    w = load_workload(SimConfig(trace="azure-conv", duration=30, mix="azure-code:1", tile=2))
    code = load_workload(SimConfig(trace="azure-code", duration=base.duration + 1e-9))  # clipped to base's span
    assert len(w.requests) == 2 * (len(base.requests) + len(code.requests))
    assert all(a.arrival <= b.arrival for a, b in zip(w.requests, w.requests[1:]))


def test_cli_tile_flag_and_json_config(tmp_path) -> None:
    out = tmp_path / "r.json"
    assert main(["simulate", "--trace", "azure-conv", "--duration", "20", "--tile", "2", "--instances", "2",
                 "--quiet", "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    one = load_workload(SimConfig(trace="azure-conv", duration=20))
    assert d["requests"] == 2 * len(one.requests) and d["config"]["tile"] == 2
    assert main(["simulate", "--trace", "azure-conv", "--duration", "20", "--quiet", "--json", str(out)]) == 0
    assert "tile" not in json.loads(out.read_text())["config"]  # unchanged JSON without the knobs
    assert main(["simulate", "--mix", "azure-code:x", "--quiet"]) == 2
