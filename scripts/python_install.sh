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
#   SLUICE_BUILD_DIR       build folder (default: build)
#   SLUICE_INSTALL_PREFIX  where the C++ package goes (default: $SLUICE_BUILD_DIR/install)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${SLUICE_BUILD_DIR:-$ROOT/build}"
PREFIX="${SLUICE_INSTALL_PREFIX:-$BUILD_DIR/install}"
PY="${SLUICE_PYTHON:-$ROOT/.venv/bin/python}"
TARGET=()
if [ "${1:-}" = "--target" ]; then
  [ -n "${2:-}" ] || { echo "python_install.sh: --target needs a folder" >&2; exit 2; }
  rm -rf "$2"
  TARGET=(--target "$2")
elif [ -n "${1:-}" ]; then
  echo "python_install.sh: unknown argument '$1' (expected --target DIR)" >&2
  exit 2
fi
[ -f "$BUILD_DIR/build.ninja" ] || { echo "python_install.sh: no build in '$BUILD_DIR' (run scripts/setup.sh)" >&2; exit 1; }
"$PY" -c "import scikit_build_core" 2>/dev/null || "$PY" -m pip install -q "scikit-build-core>=0.10"
cmake --install "$BUILD_DIR" --prefix "$PREFIX" >/dev/null
CMAKE_PREFIX_PATH="$PREFIX${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}" \
  "$PY" -m pip install -q --no-build-isolation --no-deps "${TARGET[@]}" "$ROOT/python"
