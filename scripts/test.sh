#!/usr/bin/env bash
# The project's test command (README): install into the checkout's .venv, then run the whole
# suite, lint, type-check, and build the docs site with its link check (what CI runs). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$(bash scripts/install.sh | tail -n 1)
BIN=$(dirname "$PY")
# The dashboard's page test drives Debian's chromium through Playwright (its own browser
# download cannot be fetched here); install the browser when it is missing and we can.
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo -n"
  ($SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null) \
    || echo "warning: could not install chromium; the browser test will be skipped" >&2
fi
"$BIN/ruff" check --quiet flowyard tests benchmarks   # pyproject.toml [tool.ruff.lint]
"$BIN/mypy" --no-error-summary flowyard   # pyproject.toml [tool.mypy]; silent when clean, fails on an error
NO_MKDOCS_2_WARNING=1 "$BIN/mkdocs" build --strict --quiet --site-dir "$(mktemp -d)"
# Two workers by default (CI has 2 cores; many tests wait on servers, actors and subprocesses),
# one test file per worker so module fixtures (a Ray session, a loaded model) are set up once.
# PYTEST_WORKERS=0 runs everything in this process.
"$PY" -m pytest -n "${PYTEST_WORKERS:-2}" --dist loadfile "$@"
