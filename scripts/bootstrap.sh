#!/usr/bin/env bash
# One-stop set-up for a fresh machine: system packages, a virtual environment in .venv,
# CPU torch first (a plain `torch` requirement would pull a multi-GB CUDA build), then the
# project with its test extras. Idempotent: a second run only checks what is there.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV="${DIFFRING_VENV:-$ROOT/.venv}"

need_apt=()
# Mooncake's wheel links libibverbs.so.1; pyverbs backs the rdma ring transport.
dpkg -s libibverbs1 >/dev/null 2>&1 || need_apt+=(libibverbs1)
dpkg -s python3-pyverbs >/dev/null 2>&1 || need_apt+=(python3-pyverbs)
# The ring protocol's model check (tests/integration/test_ring_model.py): spin, and gcc for spin's
# preprocessing and for compiling the verifier it generates.
dpkg -s spin >/dev/null 2>&1 || need_apt+=(spin)
dpkg -s gcc >/dev/null 2>&1 || need_apt+=(gcc)
# The status page is tested in a real browser: Debian's chromium, driven by playwright
# (playwright's own browser download cannot work here).
dpkg -s chromium >/dev/null 2>&1 || need_apt+=(chromium)
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq "${need_apt[@]}"
fi

if [ ! -x "$VENV/bin/python" ]; then
  python3.11 -m venv "$VENV" 2>/dev/null || python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
stamp="$VENV/.diffring-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  "$PY" -m pip install -q --upgrade pip
  "$PY" -m pip install -q torch==2.13.0
  "$PY" -m pip install -q -e ".[test]"
  touch "$stamp"
fi
