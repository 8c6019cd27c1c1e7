#!/usr/bin/env bash
# Set-up for a fresh machine, for one of the two commands:
#   bash scripts/bootstrap.sh demo   what scripts/demo.sh needs
#   bash scripts/bootstrap.sh test   what scripts/test.sh needs (the demo's, and more)
# Idempotent: a second run only checks what is there.
#
# demo: apt libibverbs1 (Mooncake's wheel links libibverbs.so.1); a virtual environment in
#       .venv; CPU torch==2.13.0 first (scripts/install_torch.py: PyTorch's CPU index where it
#       answers, else what pip finds, said with its size -- a plain `torch` requirement would
#       pull the multi-GB CUDA build); then the project with its `cpu` extra (Mooncake's
#       non-CUDA wheel).
# test: also apt python3-pyverbs (the rdma ring transport), spin and gcc (the ring protocol's
#       model check), chromium (the status page and the API docs are tested in a real
#       browser, driven by playwright: its own browser download cannot work here); the
#       project with its `test` extra (pytest, ruff, mypy, import-linter, openai, playwright,
#       ...).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV="${DIFFRING_VENV:-$ROOT/.venv}"
FOR="${1:-test}"
case "$FOR" in
  demo) packages=(libibverbs1); extra=cpu ;;
  test) packages=(libibverbs1 python3-pyverbs spin gcc chromium); extra=test ;;
  *) echo "usage: bash scripts/bootstrap.sh demo|test" >&2; exit 2 ;;
esac

need_apt=()
for p in "${packages[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || need_apt+=("$p")
done
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "[set-up] apt: ${need_apt[*]}"
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "[set-up] virtual environment: $VENV"
  python3.11 -m venv "$VENV" 2>/dev/null || python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
# The test set-up includes the demo's: either stamp will do for the demo.
stamp="$VENV/.diffring-installed-$extra"
done_already() {
  for s in "$@"; do
    if [ -f "$s" ] && [ ! pyproject.toml -nt "$s" ]; then return 0; fi
  done
  return 1
}
if [ "$FOR" = demo ] && done_already "$stamp" "$VENV/.diffring-installed-test"; then exit 0; fi
if [ "$FOR" = test ] && done_already "$stamp"; then exit 0; fi
"$PY" -m pip install -q --upgrade pip
"$PY" scripts/install_torch.py --version 2.13.0
echo "[set-up] the project and its '$extra' extra (pip install -e .[$extra])"
# setuptools' warnings while it builds the editable wheel are about its own future, not ours.
PYTHONWARNINGS=ignore "$PY" -m pip install -q -e ".[$extra]"
touch "$stamp"
