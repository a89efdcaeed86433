"""`flowyard serve` as a process: its engine loop runs on the main thread and uvicorn on a
second one, so stopping, signals and a port that is taken are the process's own business."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import urllib.request

import pytest

from helpers_models import make_tiny_model
from helpers_serve import free_port, wait_healthy


def _start(model_dir, port: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "flowyard.cli", "serve", "--model", str(model_dir),
                             "--dtype", "float32", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_serve_answers_then_stops_on_a_signal(tmp_path, sig):
    d, _ = make_tiny_model(tmp_path, "llama")
    port = free_port()
    server = _start(d, port)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(server, base)
        body = json.dumps({"model": json.loads(urllib.request.urlopen(base + "/v1/models").read())["data"][0]["id"],
                           "prompt": "the quick brown fox", "max_tokens": 5, "temperature": 0,
                           "ignore_eos": True}).encode()
        req = urllib.request.Request(base + "/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert json.loads(r.read())["usage"]["completion_tokens"] == 5
        server.send_signal(sig)
        assert server.wait(timeout=30) == 0
    finally:
        if server.poll() is None:
            server.kill()


def test_serve_exits_nonzero_when_its_port_is_taken(tmp_path):
    d, _ = make_tiny_model(tmp_path, "llama")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = _start(d, taken.getsockname()[1])
        try:
            assert server.wait(timeout=120) != 0
        finally:
            if server.poll() is None:
                server.kill()


def test_the_cli_bounds_openmp_spinning_before_torch_loads():
    """libgomp reads GOMP_SPINCOUNT once, when torch loads it: the CLI must set it first, and
    leave a user's own value alone."""
    import os

    code = "import os, sys, flowyard.cli; print(os.environ['GOMP_SPINCOUNT'], 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}).stdout.split()
    assert out == ["30000", "False"]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=dict(os.environ, GOMP_SPINCOUNT="7")).stdout.split()
    assert out[0] == "7"


def test_serve_rejects_a_taken_port_before_loading_the_model(tmp_path):
    """The port is bound before the model loads: one line naming it, no "serving on" line."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = subprocess.run([sys.executable, "-m", "flowyard.cli", "serve", "--model", str(tmp_path / "none"),
                              "--port", str(port)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in res.stderr
    assert "loading" not in res.stderr and "serving" not in res.stderr


@pytest.mark.parametrize("argv,msg", [(["--policy", "nope"], "unknown policy 'nope'"),
                                      (["--timeline", "/no/such/dir/t.json"], "does not exist")])
def test_serve_checks_names_and_paths_before_loading_the_model(argv, msg):
    res = subprocess.run([sys.executable, "-m", "flowyard.cli", "serve", "--port", str(free_port()), *argv],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and msg in res.stderr
    assert "loading" not in res.stderr
