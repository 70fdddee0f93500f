#!/usr/bin/env bash
# Sets up (scripts/setup.sh), builds, and runs the whole test suite through ctest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT/${SLUICE_BUILD_DIR:-build}"
ctest --output-on-failure -j "$(nproc)" "$@"
