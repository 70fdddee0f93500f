#!/usr/bin/env bash
# The build's answer to a torch outside 2.7.1..2.15.x, or to no torch at all: configuring
# stops with one line naming what was found and the supported range (issue 38).
#   1. pip's path (SKBUILD set): the Python's torch is asked before CMake reads torch's
#      package; a stand-in Python reports 2.6.0, then 2.16.0, then fails to import torch.
#   2. Torch_DIR's path: a stand-in torch package whose version file says 2.6.0.
# Each configure must fail and print the expected line exactly once, whole on one line.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/sluice_torch_range.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
fail=0

expect() {  # NAME EXPECTED-LINE CMAKE-ARGS...
  local name="$1" line="$2"
  shift 2
  rm -rf "$WORK/build"
  if cmake -S "$ROOT" -B "$WORK/build" -G Ninja -DSLUICE_BUILD_TESTS=OFF -DSLUICE_BUILD_BENCH=OFF "$@" >"$WORK/out" 2>&1; then
    echo "FAIL $name: configure succeeded"; fail=1; return
  fi
  local n
  n=$(grep -cxF -- "$line" "$WORK/out" || true)
  if [ "$n" = 1 ]; then
    echo "ok   $name: $line"
  else
    echo "FAIL $name: expected the line '$line' once, found it $n times in:"; sed 's/^/    /' "$WORK/out" | head -30; fail=1
  fi
}

fake_python() {  # VERSION (empty: no torch)
  local py="$WORK/python-$1"
  if [ -n "$1" ]; then
    printf '#!/bin/sh\necho %s\necho %s\n' "$1" "$WORK/nowhere" >"$py"
  else
    printf '#!/bin/sh\necho "ModuleNotFoundError: No module named torch" >&2\nexit 1\n' >"$py"
  fi
  chmod +x "$py"
  echo "$py"
}

range="sluice builds against torch 2.7.1 to 2.15.x"
py=$(fake_python 2.6.0)
expect "pip, torch 2.6.0" "  sluice: found torch 2.6.0; $range" -DSKBUILD=2 -DPython_EXECUTABLE="$py"
py=$(fake_python 2.16.0)
expect "pip, torch 2.16.0" "  sluice: found torch 2.16.0; $range" -DSKBUILD=2 -DPython_EXECUTABLE="$py"
py=$(fake_python "")
expect "pip, no torch" "  sluice: no torch in this Python; install torch 2.7.1 to 2.15.x first" -DSKBUILD=2 -DPython_EXECUTABLE="$py"

# A torch package that is only its version: find_package(Torch) succeeds, the check stops it.
mkdir -p "$WORK/torch"
cat >"$WORK/torch/TorchConfigVersion.cmake" <<'CMAKE'
set(PACKAGE_VERSION 2.6.0)
set(PACKAGE_VERSION_COMPATIBLE TRUE)
CMAKE
cat >"$WORK/torch/TorchConfig.cmake" <<'CMAKE'
add_library(torch INTERFACE IMPORTED)
set(TORCH_LIBRARIES torch)
CMAKE
expect "Torch_DIR, torch 2.6.0" "  sluice: found torch 2.6.0; $range" -DTorch_DIR="$WORK/torch"
exit $fail
