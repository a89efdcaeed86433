#!/usr/bin/env bash
# The project's test command (README): install, then run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
python3 -m pytest "$@"
