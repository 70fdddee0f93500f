#!/usr/bin/env bash
# Builds examples/cpp against the *installed* sluice package (cmake --install of the build
# folder into a prefix, then find_package(sluice) from a separate project) and runs it.
# Used by ctest; also the reference for hosts wiring sluice into their own CMake.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${SLUICE_BUILD_DIR:-$ROOT/build}"
PREFIX="${SLUICE_INSTALL_PREFIX:-$BUILD_DIR/install}"
PY="${SLUICE_PYTHON:-$ROOT/.venv/bin/python}"
OUT="$BUILD_DIR/example-cpp"
cmake --install "$BUILD_DIR" --prefix "$PREFIX" >/dev/null
TORCH_PREFIX="$("$PY" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')"
cmake -S "$ROOT/examples/cpp" -B "$OUT" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_PREFIX_PATH="$PREFIX;$TORCH_PREFIX" -DCMAKE_CXX_COMPILER_LAUNCHER="$(command -v ccache || true)" >/dev/null
cmake --build "$OUT" >/dev/null
"$OUT/embed_example" "$@"
