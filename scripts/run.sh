#!/usr/bin/env bash
# Sets up (scripts/setup.sh), builds, and runs sluice's main job on its embedded default:
# `sluice run` with no arguments. That is a flow-matching denoising loop over a generated
# model under a device budget: on a GPU, anima-2b (random weights) at a 50% VRAM budget; on
# the CPU, anima-medium in CPU-as-device mode with half of its weights streamed (about a
# minute on 2 cores). Extra arguments are passed on to `sluice run` (see `sluice run --help`).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SLUICE_SETUP_FOR=run bash "$ROOT/scripts/setup.sh"
exec "$ROOT/${SLUICE_BUILD_DIR:-build}/cli/sluice" run "$@"
