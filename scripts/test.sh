#!/usr/bin/env bash
# Sets up (scripts/setup.sh), builds, and runs the whole test suite through ctest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT/${SLUICE_BUILD_DIR:-build}"
# OpenMP worker threads spin-wait by default, which starves the other test processes on
# small machines (2 cores in CI): make them sleep instead.
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-passive}"
ctest --output-on-failure -j "$(nproc)" "$@"
