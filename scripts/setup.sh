#!/usr/bin/env bash
# Installs everything sluice needs on a fresh Debian 12 machine, then configures and
# builds it. Safe to re-run: each step is skipped when its result is already there.
#
#   SLUICE_SETUP_FOR   test (default): everything, and build every target (tests, benchmarks);
#                      run: only what the `sluice` command needs (scripts/run.sh): no
#                      test-only packages (chromium, diffusers, transformers, the reference
#                      Anima), and build only the `sluice` command and its libraries. The build folder
#                      is configured the same way, so a later test setup reuses it.
#   SLUICE_BUILD_DIR   build folder (default: build)
#   Torch_DIR          use this libtorch (2.7.1 to 2.15.x, CPU, CUDA or ROCm) instead of the venv's
#   SLUICE_CMAKE_ARGS  extra arguments for the CMake configure step
#   SLUICE_SETUP_ONLY  1: install packages and the venv, then stop (no configure/build);
#                      scripts/fuzz.sh and scripts/sanitize.sh configure their own build dirs
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
BUILD_DIR="${SLUICE_BUILD_DIR:-build}"
VENV="$ROOT/.venv"
TORCH_VERSION="2.11.0"

log() { printf '[setup] %s\n' "$*" >&2; }

FOR="${SLUICE_SETUP_FOR:-test}"
case "$FOR" in
  run | test) ;;
  *) printf '[setup] SLUICE_SETUP_FOR=%s: expected run or test\n' "$FOR" >&2; exit 2 ;;
esac

# 1. Debian packages. Catch2 and Google Benchmark are needed to configure (tests and
# benchmarks are part of the build), so the run setup installs them too; they are small.
APT_PKGS=(build-essential cmake ninja-build ccache python3-venv python3-dev libspdlog-dev libmimalloc-dev catch2
          libbenchmark-dev nlohmann-json3-dev libcli11-dev libpng-dev)
# Test-only: a headless browser for the timeline SVG's rendering test
# (tests/python/test_timeline_browser.py, which fails without it).
if [ "$FOR" = test ]; then
  APT_PKGS+=(chromium)
fi
missing=()
for p in "${APT_PKGS[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]})); then
  log "installing Debian packages: ${missing[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# 2. The project venv: torch for libtorch and for the reference-parity tests.
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV"
  "$PY" -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.__version__.split('+')[0] == '$TORCH_VERSION' else 1)" 2>/dev/null; then
  log "installing torch==$TORCH_VERSION into $VENV (about 3 GB, a few minutes)"
  "$VENV/bin/pip" install -q --upgrade pip >/dev/null
  "$VENV/bin/pip" install -q "torch==$TORCH_VERSION"
fi
if [ "$FOR" = test ]; then
  # numpy/einops/safetensors: the parity tests; pytest + scikit-build-core: building and
  # testing the Python bindings (python/, installed with --no-build-isolation against this torch).
  "$VENV/bin/python" -c "import numpy, einops, safetensors, pytest, scikit_build_core" 2>/dev/null ||
    "$VENV/bin/pip" install -q numpy einops safetensors pytest "scikit-build-core>=0.10"
  # diffusers (+ accelerate, which its group offloading needs): the diffusers parity test and
  # bench/gpu/compare.py. Pinned: bench/gpu/anima_diffusers.py maps keys onto this version's
  # CosmosTransformer3DModel.
  "$VENV/bin/python" -c "import diffusers, accelerate" 2>/dev/null || "$VENV/bin/pip" install -q "diffusers==0.42.1" "accelerate==1.15.0"
  # torchvision, the build matching torch 2.11: diffusers' Cosmos transformer (Anima's) resizes
  # its padding mask with it (tests/python/test_offload.py, examples/python/diffusers_anima.py).
  "$VENV/bin/python" -c "import torchvision" 2>/dev/null || "$VENV/bin/pip" install -q "torchvision==0.26.0"
  # transformers (+ tokenizers): the whole Anima pipeline's text encoder step (test_offload_pipeline.py, the example).
  "$VENV/bin/python" -c "import transformers" 2>/dev/null || "$VENV/bin/pip" install -q "transformers==5.25.0"
  # The independent reference Anima for the parity tests (tests/python/).
  VENV="$VENV" bash "$ROOT/scripts/fetch_reference.sh"
fi

if [ "${SLUICE_SETUP_ONLY:-0}" = 1 ]; then
  exit 0
fi

# 3. Configure and build.
TORCH_ARGS=()
if [ -n "${Torch_DIR:-}" ]; then
  TORCH_ARGS=(-DTorch_DIR="$Torch_DIR")
else
  # -W ignore: without numpy (a run setup installs none) torch warns that it is missing.
  TORCH_ARGS=(-DCMAKE_PREFIX_PATH="$("$VENV/bin/python" -W ignore -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')")
fi
if [ ! -f "$BUILD_DIR/build.ninja" ]; then
  log "configuring $BUILD_DIR"
  # shellcheck disable=SC2086
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "${TORCH_ARGS[@]}" \
    -DSLUICE_PYTHON="$VENV/bin/python" -DSLUICE_BUILD_PYTHON=ON ${SLUICE_CMAKE_ARGS:-} >/dev/null
fi
if [ "$FOR" = run ]; then
  log "building the sluice command in $BUILD_DIR"
  cmake --build "$BUILD_DIR" -j "$(nproc)" --target sluice_cli
else
  log "building $BUILD_DIR"
  cmake --build "$BUILD_DIR" -j "$(nproc)"
fi
