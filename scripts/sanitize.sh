#!/usr/bin/env bash
# Builds sluice with sanitizers in a build dir of its own and runs tests under them.
#
#   bash scripts/sanitize.sh asan   # ASan + UBSan, build-asan/: the whole suite except the
#                                   # Python reference-parity tests (label "parity")
#   bash scripts/sanitize.sh tsan   # TSan, build-tsan/: the concurrent tests (engine, CPU
#                                   # device, staging ring, fault injection, faults, model
#                                   # cache)
#
# Extra arguments go to ctest (e.g. -R engine). libtorch itself is not instrumented; the
# few reports that come from inside it are suppressed by tests/sanitizers/*.supp, where
# each entry says why. Exits non-zero on any sanitizer report or test failure.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
KIND="${1:-}"
shift || true
SUPP="$ROOT/tests/sanitizers"
JOBS="${SLUICE_SANITIZE_JOBS:-$(nproc)}"

case "$KIND" in
  asan) BUILD=build-asan; SAN="address;undefined" ;;
  tsan) BUILD=build-tsan; SAN="thread" ;;
  *) echo "usage: sanitize.sh asan|tsan [ctest args...]" >&2; exit 2 ;;
esac

# Packages and the venv (libtorch), without building the normal tree.
SLUICE_SETUP_ONLY=1 bash "$ROOT/scripts/setup.sh"

if [ ! -f "$BUILD/build.ninja" ]; then
  cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_PREFIX_PATH="$("$ROOT/.venv/bin/python" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')" \
    -DSLUICE_PYTHON="$ROOT/.venv/bin/python" -DSLUICE_SANITIZE="$SAN" -DSLUICE_BUILD_BENCH=OFF \
    -DSLUICE_WITH_CUDA=OFF >/dev/null
fi

TSAN_TESTS=(engine device staging_ring fault_injection faults model_cache)
# Their cases' names start with their subjects (tests/README.md), which ctest names carry.
TSAN_SUBJECTS=("engine" "device" "staging ring" "fault injection" "faults" "model_cache")

start=$(date +%s)
if [ "$KIND" = asan ]; then
  cmake --build "$BUILD" -j "$JOBS"
else
  cmake --build "$BUILD" -j "$JOBS" --target "${TSAN_TESTS[@]/#/sluice_test_}"
fi
echo "[sanitize] $KIND build: $(( $(date +%s) - start )) s"

export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-passive}"
# Every report fails the run (exitcode), with a symbolized stack.
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0:exitcode=86:strict_string_checks=1:detect_stack_use_after_return=1:check_initialization_order=1}"
export LSAN_OPTIONS="${LSAN_OPTIONS:-suppressions=$SUPP/lsan.supp:print_suppressions=0}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1:suppressions=$SUPP/ubsan.supp}"
export TSAN_OPTIONS="${TSAN_OPTIONS:-halt_on_error=1:exitcode=86:second_deadlock_stack=1:suppressions=$SUPP/tsan.supp}"

cd "$BUILD"
start=$(date +%s)
if [ "$KIND" = asan ]; then
  ctest --output-on-failure -j "$JOBS" -LE parity "$@"
else
  regex="^($(IFS='|'; echo "${TSAN_SUBJECTS[*]}")): "  # the plain entries, not the strict ones
  ctest --output-on-failure -j "$JOBS" -R "$regex" "$@"
fi
echo "[sanitize] $KIND tests: $(( $(date +%s) - start )) s"
