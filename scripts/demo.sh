#!/usr/bin/env bash
# The main job: set-up on a fresh machine, then the whole pipeline on tiny local models.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh demo
exec .venv/bin/python -m scripts.demo "$@"
