"""Running `flowyard serve` as a process in tests: a free port, and waiting for /health."""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(server: subprocess.Popen, base: str, timeout: float = 120) -> None:
    """Until `base`/health answers 200; fails with the server's stderr if it exits first."""
    deadline = time.monotonic() + timeout
    while True:
        assert server.poll() is None, server.stderr.read()[-3000:]
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        assert time.monotonic() < deadline, "the server did not come up"
        time.sleep(0.3)
