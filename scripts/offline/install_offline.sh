#!/usr/bin/env bash
# Install a bundle made by scripts/offline/offline_bundle.sh, with no network, next to the CUDA torch
# that is already installed. Nothing is replaced: pip installs the bundled wheels with
# --no-index and checks that everything else the project needs (torch included) is there
# already; a missing one stops it with pip's message naming the package.
#
#   bash install_offline.sh DIR [--python PY] [--target SITE_DIR]
#   source DIR/env.sh       # LD_LIBRARY_PATH (and PYTHONPATH with --target) for the services
#
# The Debian packages are not installed either: they are unpacked with `dpkg -x` into
# DIR/debroot, and DIR/lib gets a link to each of their shared libraries whose soname the
# system's loader does not know already (ldconfig -p), so system libraries always win.
# --target installs into SITE_DIR instead of the interpreter's environment (pip then cannot
# see what the interpreter has, so the requirements are checked by importing them instead).
#
# A bundle made with a source extra (--extras sage2: SageAttention2's Hopper kernel) carries
# its source and build script: the kernel is built here with the node's nvcc (about three
# minutes on 16 cores), unless DIR/built/ holds a wheel built once for this Python and torch
# (copy the bundle folder from a node of the same image after its install). A node that
# cannot build it (no nvcc, another CUDA major version, no compiler) gets everything else
# installed and exit status 3, with what is missing named; the DiT stage then refuses that
# backend at load.
set -euo pipefail
if [ $# -lt 1 ] || [ "$1" = "-h" ] || [ "$1" = "--help" ]; then
  sed -n '2,14p' "$0"; exit 2
fi
DIR=$(cd "$1" && pwd)
shift
PY=python3
TARGET=""
while [ $# -gt 0 ]; do
  case "$1" in
    --python) PY="$2"; shift 2 ;;
    --target) TARGET="$2"; shift 2 ;;
    *) echo "install_offline.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
[ -f "$DIR/manifest.json" ] || { echo "$DIR has no manifest.json: not a bundle" >&2; exit 2; }

want=$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["python"])' "$DIR/manifest.json")
have=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
if [ "$want" != "$have" ]; then
  echo "bundle is for Python $want, $PY is $have: rebuild it with --python $have" >&2
  exit 2
fi
"$PY" -c 'import torch' 2>/dev/null || echo "warning: $PY has no torch; the bundle brings none" >&2

# 1. Python packages, from the bundle only.
pip_args=(-m pip install -q --no-index --find-links "$DIR/wheels" --only-binary=:all:
          --disable-pip-version-check --no-cache-dir)
if [ -n "$TARGET" ]; then
  mkdir -p "$TARGET"
  TARGET=$(cd "$TARGET" && pwd)
  # With --target pip sees nothing installed: install the bundle's wheels themselves.
  "$PY" "${pip_args[@]}" --no-deps --target "$TARGET" "$DIR"/wheels/*.whl
else
  "$PY" "${pip_args[@]}" -r "$DIR/requirements.txt"
fi

# 1b. Source extras: built here, or a wheel built once for this Python and torch.
source_field() {  # NAME FIELD: one field of the manifest's entry for source extra NAME
  "$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["sources"][sys.argv[2]][sys.argv[3]])' \
    "$DIR/manifest.json" "$1" "$2"
}
install_source() {  # NAME: build (or find) the extra's wheel, then install it
  local name=$1 builder folder stamp out wheel
  builder=$(source_field "$name" builder)
  folder=$(source_field "$name" folder)
  stamp=$("$PY" -c 'import sys, torch; print("py%d.%d-torch%s" % (sys.version_info[:2] + (torch.__version__,)))' 2>/dev/null || echo no-torch)
  out="$DIR/built/$name/$stamp"
  mkdir -p "$out"
  wheel=$(find "$out" -maxdepth 1 -name '*.whl' | head -n1)
  if [ -n "$wheel" ]; then
    echo "$name: installing $wheel, built once for $stamp"
  else
    if ! "$PY" "$DIR/$builder" --check; then
      echo "install_offline.sh: cannot build the $name kernel on this node (above)" >&2
      return 1
    fi
    rm -rf "${DIR:?}/src/$folder"
    tar -xzf "$DIR/$(source_field "$name" archive)" -C "$DIR/src"
    echo "$name: building from $(source_field "$name" commit) with this node's nvcc"
    "$PY" "$DIR/$builder" --src "$DIR/src/$folder" --out "$out" || return 1
    wheel=$(find "$out" -maxdepth 1 -name '*.whl' | head -n1)
    [ -n "$wheel" ] || return 1
  fi
  if [ -n "$TARGET" ]; then
    "$PY" "${pip_args[@]}" --no-deps --upgrade --target "$TARGET" "$wheel"
  else
    "$PY" "${pip_args[@]}" --no-deps --force-reinstall "$wheel"
  fi
}
SOURCES=$("$PY" -c 'import json,sys; print(" ".join(json.load(open(sys.argv[1])).get("sources", {})))' "$DIR/manifest.json")
NOT_BUILT=""
for name in $SOURCES; do
  install_source "$name" || NOT_BUILT="$NOT_BUILT $name"
done

# 2. Shared libraries of the Debian packages, for the names the system lacks.
LIB="$DIR/lib"
rm -rf "$DIR/debroot" "$LIB"
mkdir -p "$DIR/debroot" "$LIB"
shopt -s nullglob
debs=("$DIR"/debs/*.deb)
if [ ${#debs[@]} -gt 0 ]; then
  command -v dpkg >/dev/null || { echo "dpkg not found: cannot unpack $DIR/debs" >&2; exit 2; }
  for f in "${debs[@]}"; do dpkg -x "$f" "$DIR/debroot"; done
  known=$(ldconfig -p 2>/dev/null | awk '{print $1}' | sort -u)
  linked=0
  # Soname links (libfoo.so.N) are what the loader looks up; link each to its real file.
  while IFS= read -r so; do
    name=$(basename "$so")
    if ! grep -qxF "$name" <<<"$known"; then
      ln -sf "$(readlink -f "$so")" "$LIB/$name"
      linked=$((linked + 1))
    fi
  done < <(find "$DIR/debroot" \( -type f -o -type l \) -regex '.*/lib[^/]*\.so\.[0-9]+' | sort)
  echo "linked $linked shared libraries the system lacks into $LIB"
fi

# 3. The environment the services need.
{
  echo "# generated by install_offline.sh"
  echo "export LD_LIBRARY_PATH=\"$LIB\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}\""
  if [ -n "$TARGET" ]; then
    echo "export PYTHONPATH=\"$TARGET\${PYTHONPATH:+:\$PYTHONPATH}\""
  fi
} >"$DIR/env.sh"

# 4. Check: everything imports, with the environment above.
# shellcheck disable=SC1091
source "$DIR/env.sh"
BUILT_MODULES=""
case " $SOURCES " in *" sage2 "*) case " $NOT_BUILT " in *" sage2 "*) ;;
  *) BUILT_MODULES="sageattention._qattn_sm90" ;; esac ;; esac
BUILT_MODULES="$BUILT_MODULES" "$PY" - <<'PYEOF'
import importlib
import os
mods = ["diffusers", "transformers", "fastapi", "uvicorn", "pydantic", "av", "torch",
        "mooncake.engine", *os.environ["BUILT_MODULES"].split()]
bad = []
for m in mods:
    try:
        mod = importlib.import_module(m)
        print(f"  {m:16s} {getattr(mod, '__version__', 'ok')}")
    except Exception as exc:  # report every one, then fail
        bad.append(f"{m}: {exc}")
if bad:
    raise SystemExit("import check failed:\n  " + "\n  ".join(bad))
PYEOF
if [ -n "$NOT_BUILT" ]; then
  echo "installed, except the kernels of:$NOT_BUILT (what they need is named above; the" \
       "DiT stage refuses those attention backends at load). Install it, then run this" \
       "script again. Before starting services: source $DIR/env.sh" >&2
  exit 3
fi
echo "installed; before starting services: source $DIR/env.sh"
