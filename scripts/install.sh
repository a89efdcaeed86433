#!/usr/bin/env bash
# Install flowyard and everything its tests need, from this checkout, on a fresh machine.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --upgrade pip >/dev/null 2>&1 || true
python3 -m pip install -q -e ".[test]"
