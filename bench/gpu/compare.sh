#!/usr/bin/env bash
# Builds sluice and its Python bindings against this machine's torch, then runs the
# side-by-side (bench/gpu/compare.py; its header has the device-time budget). Meant for a
# bare GPU machine with carried dependencies (bench/gpu/prepare_carry.sh fills .gpu/), but
# also runs where scripts/setup.sh has been run. Arguments go to compare.py (default: the
# GPU sweep, anima-2b at 1024 and 512).
#
#   bash bench/gpu/compare.sh                                  # on the GPU machine
#   bash bench/gpu/compare.sh --device cpu --preset anima-tiny --resolutions 64
#
#   SLUICE_BUILD_DIR  build folder (default: build-gpu; an existing build is reused)
#   SLUICE_PYTHON     the Python with torch (default: python3)
#   OUT               where compare.json and compare.md go (default: the build folder)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
BUILD="${SLUICE_BUILD_DIR:-$ROOT/build-gpu}"
PY="${SLUICE_PYTHON:-python3}"
RESULTS="${OUT:-$BUILD}"
t0=$SECONDS
log() { printf '[compare.sh %4ds] %s\n' "$((SECONDS - t0))" "$*" >&2; }

PREFIXES=("$("$PY" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')")
if [ -d .gpu/debs ]; then
  log "unpacking carried Debian packages into .gpu/sysroot"
  for f in .gpu/debs/*.deb; do dpkg -x "$f" .gpu/sysroot; done
  PREFIXES+=("$ROOT/.gpu/sysroot/usr")
  export LD_LIBRARY_PATH="$ROOT/.gpu/sysroot/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
if ! "$PY" -c "import diffusers" 2>/dev/null; then
  [ -d .gpu/whl ] || { echo "compare.sh: diffusers is missing and no .gpu/whl was carried" >&2; exit 1; }
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/compare-site .gpu/whl/*.whl
  export PYTHONPATH="/tmp/compare-site${PYTHONPATH:+:$PYTHONPATH}"
fi
REF_ARGS=()
[ -f .gpu/reference/anima_transformer.py ] && REF_ARGS=(--reference "$ROOT/.gpu/reference/anima_transformer.py")

if [ ! -x "$BUILD/cli/sluice" ]; then
  log "configuring $BUILD"
  prefix_path="$(IFS=';'; echo "${PREFIXES[*]}")"
  cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DSLUICE_BUILD_TESTS=OFF -DSLUICE_BUILD_BENCH=OFF \
    -DCMAKE_PREFIX_PATH="$prefix_path" -DSLUICE_PYTHON="$(command -v "$PY")" >/dev/null
  log "building"
  cmake --build "$BUILD" -j "$(nproc)"
fi
log "installing the Python bindings"
CMAKE_PREFIX_PATH="$(IFS=':'; echo "${PREFIXES[*]}")" SLUICE_BUILD_DIR="$BUILD" SLUICE_PYTHON="$PY" \
  bash scripts/python_install.sh --target /tmp/compare-sluice-py
export PYTHONPATH="/tmp/compare-sluice-py${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$RESULTS"
log "running compare.py"
PYTHONUNBUFFERED=1 "$PY" bench/gpu/compare.py --sluice-cli "$BUILD/cli/sluice" "${REF_ARGS[@]}" \
  --workdir /tmp/compare-work --json "$RESULTS/compare.json" "$@" | tee "$RESULTS/compare.md"
log "done"
