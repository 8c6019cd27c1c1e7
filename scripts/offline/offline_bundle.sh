#!/usr/bin/env bash
# Download what an air-gapped GPU node needs to run diffring next to its CUDA torch:
# the project's wheels for the node's Python and platform (none that a CUDA-torch image
# already has: scripts/offline/offline_skip.txt) and the Debian packages Mooncake links,
# without installing anything here. Then, on the node: bash DIR/install_offline.sh DIR
#
#   bash scripts/offline/offline_bundle.sh --python 3.12 --platform manylinux_2_28_x86_64 --out DIR
#        [--mooncake mooncake-transfer-engine-cuda13|mooncake-transfer-engine|...-non-cuda]
#        [--extras sage] [--skip NAME]... [--skip-file FILE] [--with REQ]... [--no-debs]
#        [--max-mb 60]
#
# Needs pip and `packaging` (the project's .venv has both; scripts/bootstrap.sh makes it),
# apt-get for the .debs (Debian/Ubuntu, amd64) and readelf (binutils) to slim Mooncake.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
exec "$PY" -m scripts.offline.offline_bundle "$@"
