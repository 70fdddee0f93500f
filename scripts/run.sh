#!/usr/bin/env bash
# Sets up (scripts/setup.sh), builds, and runs sluice's main job on its embedded default.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
exec "$ROOT/${SLUICE_BUILD_DIR:-build}/cli/sluice" run "$@"
