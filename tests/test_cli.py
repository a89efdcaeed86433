"""The `flowyard` command line, end to end through `main(argv)`."""

from __future__ import annotations

import json

import pytest

from flowyard.cli import main

SMALL = ["--trace", "azure-conv", "--num-requests", "150", "--instances", "2", "--quiet"]


@pytest.mark.parametrize(
    "flag,value,listed",
    [("--trace", "nope", "azure-conv"), ("--model", "gpt-9", "llama-3-8b"),
     ("--hardware", "tpu", "h100"), ("--policy", "magic", "distserve-cp2k")],
)
def test_unknown_names_list_valid_ones_and_exit_2(capsys, flag, value, listed):
    argv = ["simulate", *SMALL, flag, value]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("flowyard: error:") and listed in err and len(err.splitlines()) == 1


def test_bad_flag_values_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["simulate", "--instances", "0"])
    assert e.value.code == 2
    assert main(["simulate", *SMALL, "--ttft-slo-by-length", "abc"]) == 2
    assert "flowyard: error:" in capsys.readouterr().err


def test_broken_trace_file_names_file_and_line(tmp_path, capsys):
    bad = tmp_path / "t.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"
                   "2023-11-16 18:15:47.0,abc,5\n")
    assert main(["simulate", "--trace", str(bad), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "t.csv" in err and "line 3" in err


def test_simulate_prints_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "r.json"
    png = tmp_path / "cdf.png"
    assert main(["simulate", *SMALL, "--policy", "distserve", "--json", str(out), "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "Serving Benchmark Result" in text and "Mean TTFT (ms)" in text
    data = json.loads(out.read_text())
    for key in ("policy", "requests", "completed", "slo_attainment", "throughput_rps",
                "output_tokens_per_s", "wall_s"):
        assert key in data
    for key in ("ttft", "tpot", "e2e"):
        assert set(data[key]) >= {"mean", "p50", "p90", "p99"}
    assert data["requests"] == data["completed"] == 150
    assert png.stat().st_size > 1000


def test_goodput_searches_each_policy(tmp_path):
    out, png = tmp_path / "g.json", tmp_path / "g.png"
    argv = ["goodput", *SMALL, "--policies", "vllm,round-robin", "--hardware", "a100-40g",
            "--scale-lo", "1", "--scale-hi", "8", "--tol", "0.2", "--json", str(out), "--plot", str(png)]
    assert main(argv) == 0
    results = json.loads(out.read_text())["results"]
    assert [r["policy"] for r in results] == ["vllm", "round-robin"]
    for r in results:
        assert r["goodput_rps"] > 0 and len(r["curve"]) >= 2
    assert png.stat().st_size > 1000


def test_json_to_missing_directory_is_a_clear_error_before_the_run(tmp_path, capsys, monkeypatch):
    """A bad output path costs nothing: it is refused before the simulation starts."""
    import flowyard.sim.run

    def no_run(*a, **k):
        raise AssertionError("the simulation ran before the output path was checked")

    monkeypatch.setattr(flowyard.sim.run, "simulate", no_run)
    for flag in ("--json", "--plot", "--timeline"):
        assert main(["simulate", *SMALL, flag, str(tmp_path / "no" / "r.json")]) == 2
        err = capsys.readouterr().err
        assert "no/r.json" in err and flag in err and "does not exist" in err
    assert main(["simulate", *SMALL, "--json", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err
    assert main(["goodput", *SMALL, "--json", str(tmp_path / "no" / "g.json")]) == 2


@pytest.mark.parametrize("target", ["1.5", "0", "-0.2", "nan", "x"])
def test_goodput_rejects_a_target_that_is_not_a_share(capsys, target):
    with pytest.raises(SystemExit) as e:
        main(["goodput", *SMALL, "--target", target])
    assert e.value.code == 2
    assert "(0, 1]" in capsys.readouterr().err


def test_goodput_scale_error_names_the_scales_typed(capsys):
    assert main(["goodput", *SMALL, "--scale-lo", "4", "--scale-hi", "2"]) == 2
    err = capsys.readouterr().err
    assert "--scale-lo (4)" in err and "--scale-hi (2)" in err and "req/s" not in err.split("(2)")[0]


def test_json_to_stdout_keeps_stdout_clean(capsys):
    """`--json -`: the JSON alone on standard output (tables and notes on stderr), so it pipes
    into jq; progress bars stay off there (and whenever stderr is not a terminal)."""
    import json

    from flowyard.cli import main

    assert main(["simulate", "--trace", "azure-code", "--duration", "20", "--policy", "vllm", "--json", "-"]) == 0
    cap = capsys.readouterr()
    assert json.loads(cap.out)["policy"] == "vllm" and "TTFT" in cap.err
    assert main(["goodput", "--trace", "azure-code", "--duration", "20", "--policies", "vllm",
                 "--scale-hi", "2", "--tol", "0.5", "--json", "-"]) == 0
    cap = capsys.readouterr()
    assert json.loads(cap.out)["results"][0]["policy"] == "vllm" and "goodput" in cap.err.lower()


class _Terminal:
    """A text stream that says it is a terminal (what rich and `_bar_on` check)."""

    def __init__(self, tty: bool) -> None:
        import io

        self.buf, self.tty = io.StringIO(), tty

    def isatty(self) -> bool:
        return self.tty

    def __getattr__(self, name):
        return getattr(self.buf, name)


@pytest.mark.parametrize("out_tty,err_tty,argv,shown", [
    (True, True, [], True),
    (True, True, ["--quiet"], False),
    (True, True, ["--json", "-"], False),
    (False, True, [], False),  # stdout redirected to a file or a pipe
    (True, False, [], False),  # stderr redirected
])
def test_progress_bar_only_on_a_terminal(monkeypatch, out_tty, err_tty, argv, shown):
    """Issue 17: bars on simulate (and goodput/reproduce, same switch) for a person at a
    terminal; off under --quiet, under --json to stdout, and when either stream is redirected."""
    out, err = _Terminal(out_tty), _Terminal(err_tty)
    monkeypatch.setattr("sys.stdout", out)
    monkeypatch.setattr("sys.stderr", err)
    monkeypatch.setenv("TERM", "xterm-256color")
    monkeypatch.delenv("NO_COLOR", raising=False)
    calls = []
    import flowyard.sim.run as run

    real = run.simulate
    monkeypatch.setattr(run, "simulate", lambda *a, progress=None, **kw: calls.append(progress) or real(
        *a, progress=progress, **kw))
    assert main(["simulate", "--trace", "azure-code", "--duration", "30", "--policy", "vllm", *argv]) == 0
    assert (calls[0] is not None) == shown
    assert ("simulating vllm" in err.buf.getvalue()) == shown


def test_goodput_and_reproduce_share_the_switch():
    import argparse

    from flowyard.cli import _bar_on, build_parser

    parser = build_parser()
    for argv in (["goodput", "--policies", "vllm"], ["reproduce", "pla", "--quick"], ["simulate"]):
        args = parser.parse_args(argv)
        assert isinstance(args, argparse.Namespace) and not _bar_on(args)  # pytest's streams are not terminals


def test_a_missing_optional_dependency_names_the_extra(monkeypatch, capsys):
    """`flowyard serve --ray` without Ray installed: one line naming `flowyard[ray]`, exit 2,
    before any model loads."""
    import sys

    from flowyard.optional import MissingExtra, require

    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed
    with pytest.raises(MissingExtra, match=r"flowyard\[ray\]"):
        require("ray", "--ray")
    monkeypatch.setattr("flowyard.server.cli_serve._bind", lambda host, port: None)
    assert main(["serve", "--ray", "--instances", "2", "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert "flowyard[ray]" in err and "loading" not in err and len(err.strip().splitlines()) == 1
