#!/usr/bin/env bash
# Builds and installs the sluice Python package against the project venv's torch, through
# the same command a frontend's environment uses (README, "Installing into an environment
# you already have"): `pip install --no-build-isolation <checkout>`, here over the
# project's own build folder (-C build-dir), so nothing setup.sh built is compiled again.
#
#   bash scripts/python_install.sh              # into the project venv (.venv)
#   bash scripts/python_install.sh --target DIR # into DIR (tests import it from there)
#
# scikit-build-core (the build backend) comes from, in this order:
#   1. the python itself, when it imports it;
#   2. SLUICE_WHEELHOUSE, a folder of wheels (bench/gpu/prepare_carry.sh carries
#      scikit-build-core, packaging and pathspec in .gpu/buildwhl): installed with
#      `pip install --no-index --no-deps` into a temporary folder put on PYTHONPATH, never
#      into the python's own site-packages;
#   3. with SLUICE_OFFLINE=1: nowhere. The module is then built with plain CMake, no pip
#      (the build folder's _C target, copied beside the package's .py files); the same
#      module, without pip's metadata (dist-info);
#   4. otherwise the package index (`pip install scikit-build-core`, which needs a network).
# SLUICE_PY_BUILD=cmake takes path 3 whatever is installed.
#
#   SLUICE_BUILD_DIR       build folder (default: build), configured by scripts/setup.sh
#   SLUICE_PYTHON          the python (default: .venv/bin/python)
#   SLUICE_WHEELHOUSE      see 2. above; SLUICE_OFFLINE=1: never reach a package index
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${SLUICE_BUILD_DIR:-$ROOT/build}"
PY="${SLUICE_PYTHON:-$ROOT/.venv/bin/python}"
OFFLINE="${SLUICE_OFFLINE:-0}"
TARGET_DIR=""
TARGET=()
if [ "${1:-}" = "--target" ]; then
  [ -n "${2:-}" ] || { echo "python_install.sh: --target needs a folder" >&2; exit 2; }
  TARGET_DIR="$2"
  rm -rf "$TARGET_DIR"
  TARGET=(--target "$TARGET_DIR")
elif [ -n "${1:-}" ]; then
  echo "python_install.sh: unknown argument '$1' (expected --target DIR)" >&2
  exit 2
fi
[ -f "$BUILD_DIR/build.ninja" ] || { echo "python_install.sh: no build in '$BUILD_DIR' (run scripts/setup.sh)" >&2; exit 1; }

BACKEND="${SLUICE_PY_BUILD:-pip}"
if [ "$BACKEND" = pip ] && ! "$PY" -c "import scikit_build_core" 2>/dev/null; then
  if [ -n "${SLUICE_WHEELHOUSE:-}" ] && compgen -G "$SLUICE_WHEELHOUSE/scikit_build_core-*.whl" >/dev/null; then
    TOOLS="$(mktemp -d "${TMPDIR:-/tmp}/sluice_buildtools.XXXXXX")"
    trap 'rm -rf "$TOOLS"' EXIT
    echo "python_install.sh: scikit-build-core from $SLUICE_WHEELHOUSE (offline) into $TOOLS"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$TOOLS" "$SLUICE_WHEELHOUSE"/*.whl
    export PYTHONPATH="$TOOLS${PYTHONPATH:+:$PYTHONPATH}"
    "$PY" -c "import scikit_build_core" || { echo "python_install.sh: scikit-build-core from $SLUICE_WHEELHOUSE does not import" >&2; exit 1; }
  elif [ "$OFFLINE" = 1 ]; then
    echo "python_install.sh: no scikit-build-core (not installed, no wheel in SLUICE_WHEELHOUSE='${SLUICE_WHEELHOUSE:-}'), offline: building the bindings with plain CMake"
    BACKEND=cmake
  else
    "$PY" -m pip install -q "scikit-build-core>=0.10"
  fi
fi
[ "$OFFLINE" = 1 ] && export PIP_NO_INDEX=1  # whatever pip does below, it reaches no index

if [ "$BACKEND" = pip ]; then
  # The build folder is setup.sh's: pip reconfigures it with the python's own values (the
  # same ones) and builds what is not built yet, then installs the python component.
  "$PY" -m pip install -q --no-build-isolation --no-deps "${TARGET[@]}" -C build-dir="$BUILD_DIR" \
    -C cmake.define.SLUICE_BUILD_PYTHON=ON "$ROOT"
  # pip's configure left SKBUILD* in the cache: without them the folder is setup.sh's again.
  cmake -U 'SKBUILD*' "$BUILD_DIR" >/dev/null
  exit 0
fi

# Plain CMake: what scikit-build-core would run, without it.
DEST="$TARGET_DIR"
[ -n "$DEST" ] || DEST="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')"
cmake "$BUILD_DIR" -DSLUICE_BUILD_PYTHON=ON -DPython_EXECUTABLE="$PY" >/dev/null
cmake --build "$BUILD_DIR" --target _C
cmake --install "$BUILD_DIR" --component python --prefix "$DEST" >/dev/null
mkdir -p "$DEST/sluice"
cp "$ROOT"/python/sluice/*.py "$DEST/sluice/"
echo "python_install.sh: built with plain CMake into $DEST/sluice"
