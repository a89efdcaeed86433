"""The quickstart's install step on the interpreters a new user has: a distribution's Python
marked EXTERNALLY-MANAGED (PEP 668; pip refuses to install into it) and one without `venv`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
INSTALL = ROOT / "scripts" / "install.sh"


def _externally_managed_python() -> str | None:
    for exe in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if not os.access(exe, os.X_OK):
            continue
        probe = subprocess.run([exe, "-c", "import sys, sysconfig; print(sysconfig.get_path('stdlib')); "
                                "print(sys.version_info >= (3, 11))"], capture_output=True, text=True)
        lines = probe.stdout.split()
        if probe.returncode == 0 and lines[-1] == "True" and (Path(lines[0]) / "EXTERNALLY-MANAGED").exists():
            return exe
    return None


def _run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(INSTALL), *args], cwd=ROOT, env={**os.environ, **env},
                          capture_output=True, text=True, timeout=900)


@pytest.mark.skipif(_externally_managed_python() is None,
                    reason="no EXTERNALLY-MANAGED Python >= 3.11 on this machine")
def test_install_works_from_an_externally_managed_python(tmp_path: Path) -> None:
    """pip refuses `pip install` into this interpreter; the script installs into its own
    virtual environment instead, and a second run reuses it."""
    exe = _externally_managed_python()
    venv = tmp_path / "venv"
    first = _run({"PYTHON": exe, "VENV": str(venv)}, "--runtime")
    assert first.returncode == 0, first.stderr[-2000:]
    py = first.stdout.strip().splitlines()[-1]
    assert Path(py) == venv / "bin" / "python"
    check = subprocess.run([py, "-c", "import flowyard, torch; from flowyard.engine.embedded import "
                            "embedded_model_path; print(embedded_model_path())"], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr[-2000:]
    assert check.stdout.strip().endswith(".gguf")
    assert (venv / "bin" / "flowyard").exists()
    again = _run({"PYTHON": exe, "VENV": str(venv)}, "--runtime")
    assert again.returncode == 0 and "creating" not in again.stderr  # reused, not rebuilt


def test_a_python_without_venv_gets_a_one_line_message(tmp_path: Path) -> None:
    """Debian's python3 without python3.X-venv cannot make environments: say which package."""
    fake = tmp_path / "python3"
    fake.write_text(f'#!/bin/sh\ncase "$*" in *ensurepip*) exit 1;; esac\nexec {sys.executable} "$@"\n')
    fake.chmod(0o755)
    res = _run({"PYTHON": str(fake), "VENV": str(tmp_path / "venv")})
    assert res.returncode != 0
    ver = f"{sys.version_info[0]}.{sys.version_info[1]}"
    assert f"python{ver}-venv" in res.stderr and not (tmp_path / "venv").exists()


def test_an_old_python_is_named(tmp_path: Path) -> None:
    fake = tmp_path / "python3"
    fake.write_text('#!/bin/sh\ncase "$*" in *"version_info < (3, 11)"*) exit 1;; esac\n'
                    f'exec {sys.executable} "$@"\n')
    fake.chmod(0o755)
    res = _run({"PYTHON": str(fake), "VENV": str(tmp_path / "venv")})
    assert res.returncode != 0 and "older than 3.11" in res.stderr
