#!/usr/bin/env bash
# Sets up (scripts/setup.sh), builds, and runs the whole test suite through ctest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# The suite's disk at its peak (README "Two commands"): the venv, the build folder, one torch end
# at a time and the largest parity checkpoint, about 18 GiB. A machine's free disk varies;
# a short one is said first, not found out 40 minutes in as "No space left on device".
peak_gib=18
free_kib=$(df -Pk "$ROOT" | awk 'NR == 2 { print $4 }')
echo "[test] $((free_kib / 1048576)) GiB free on the disk of $ROOT; the suite needs about $peak_gib GiB at its peak"
if [ "$free_kib" -lt $((peak_gib * 1048576)) ]; then
  echo "[test] warning: less than $peak_gib GiB free: the torch-ends entries and the anima-2b parity case may fail with 'No space left on device'" >&2
fi
bash "$ROOT/scripts/setup.sh"
cd "$ROOT/${SLUICE_BUILD_DIR:-build}"
# OpenMP worker threads spin-wait by default, which starves the other test processes on
# small machines (2 cores in CI): make them sleep instead.
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-passive}"
ctest --output-on-failure -j "$(nproc)" "$@"
