#!/usr/bin/env bash
# The test command: sets up everything on a fresh machine (apt packages, .venv, CPU torch,
# the project with its test extras), then lint, type check and the whole test-suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh test
PY=.venv/bin/python
$PY -m ruff check .
$PY -m mypy
.venv/bin/lint-imports
# Two pytest processes, a whole module to each at a time (a module's shared fixtures, such as
# a started group, stay in one process), in the order tests/conftest.py puts them: the long
# modules first, so that none is left to run alone at the end.
# The slowest tests are listed at the end: what to look at when the suite grows slower.
$PY -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --no-loadscope-reorder \
  --durations=40 "$@"
