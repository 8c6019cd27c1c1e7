#!/usr/bin/env bash
# The test command: sets up everything on a fresh machine (apt packages, .venv, CPU torch,
# the project with its test extras), then lint, type check and the whole test-suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
PY=.venv/bin/python
$PY -m ruff check .
$PY -m mypy
.venv/bin/lint-imports
$PY -m pytest -q -p no:cacheprovider "$@"
