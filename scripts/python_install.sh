#!/usr/bin/env bash
# Builds and installs the sluice Python package (python/) against an installed sluice and
# the project venv's torch.
#
#   bash scripts/python_install.sh              # into the project venv (.venv)
#   bash scripts/python_install.sh --target DIR # into DIR (tests import it from there)
#
# Steps: `cmake --install` the C++ package from the build folder into a prefix, then
# `pip install --no-build-isolation ./python`, which runs CMake through scikit-build-core
# and compiles only the bindings (torch is never downloaded a second time).
#
# scikit-build-core (the build backend) comes from, in this order:
#   1. the python itself, when it imports it;
#   2. SLUICE_WHEELHOUSE, a folder of wheels (bench/gpu/prepare_carry.sh carries
#      scikit-build-core, packaging and pathspec in .gpu/buildwhl): installed with
#      `pip install --no-index --no-deps` into a temporary folder put on PYTHONPATH, never
#      into the python's own site-packages;
#   3. with SLUICE_OFFLINE=1: nowhere. The bindings are then built with plain CMake, no pip
#      (python/CMakeLists.txt configured, built and installed into the target, the package's
#      .py files copied beside _C); the same module, without pip's metadata (dist-info);
#   4. otherwise the package index (`pip install scikit-build-core`, which needs a network).
# SLUICE_PY_BUILD=cmake takes path 3 whatever is installed.
#
#   SLUICE_BUILD_DIR       build folder (default: build)
#   SLUICE_INSTALL_PREFIX  where the C++ package goes (default: $SLUICE_BUILD_DIR/install)
#   SLUICE_PYTHON          the python (default: .venv/bin/python)
#   SLUICE_WHEELHOUSE      see 2. above; SLUICE_OFFLINE=1: never reach a package index
#   CMAKE_PREFIX_PATH      (colon-separated) where sluice's own dependencies are, if not in /usr
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${SLUICE_BUILD_DIR:-$ROOT/build}"
PREFIX="${SLUICE_INSTALL_PREFIX:-$BUILD_DIR/install}"
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

cmake --install "$BUILD_DIR" --prefix "$PREFIX" >/dev/null
export CMAKE_PREFIX_PATH="$PREFIX${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
if [ "$BACKEND" = pip ]; then
  "$PY" -m pip install -q --no-build-isolation --no-deps "${TARGET[@]}" "$ROOT/python"
  exit 0
fi

# Plain CMake: what scikit-build-core would run, without it.
DEST="$TARGET_DIR"
[ -n "$DEST" ] || DEST="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')"
PYBUILD="$BUILD_DIR/python-cmake"
GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
cmake -S "$ROOT/python" -B "$PYBUILD" "${GEN[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DPython_EXECUTABLE="$PY" -DCMAKE_PREFIX_PATH="${CMAKE_PREFIX_PATH//:/;}" >/dev/null
cmake --build "$PYBUILD"
cmake --install "$PYBUILD" --prefix "$DEST" >/dev/null
cp "$ROOT"/python/sluice/*.py "$DEST/sluice/"
echo "python_install.sh: built with plain CMake into $DEST/sluice"
