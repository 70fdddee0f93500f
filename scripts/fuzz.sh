#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz, clang + ASan + UBSan) into build-fuzz/ and runs
# them, each on its committed seed corpus (tests/fuzz/corpus/<target>) plus a working
# corpus in build-fuzz/corpus/<target> that keeps what the runs find.
#
#   bash scripts/fuzz.sh [target|all] [seconds]
#     target   safetensors_header | lora_keys | size_parse | all (default)
#     seconds  run time per target (default 60)
#
# Crash inputs are written to build-fuzz/crashes/<target>/; the script exits non-zero when
# a target crashed. Reproduce one with: build-fuzz/tests/fuzz/fuzz_<target> <crash file>.
# Every line of libFuzzer's final stats (executions, cov:, ft:, corpus size) is printed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
TARGET="${1:-all}"
SECONDS_PER="${2:-60}"
BUILD="${SLUICE_FUZZ_BUILD_DIR:-build-fuzz}"
ALL=(safetensors_header lora_keys size_parse)

case "$TARGET" in
  all) TARGETS=("${ALL[@]}") ;;
  safetensors_header|lora_keys|size_parse) TARGETS=("$TARGET") ;;
  *) echo "fuzz.sh: unknown target '$TARGET' (use ${ALL[*]} or all)" >&2; exit 2 ;;
esac
[[ "$SECONDS_PER" =~ ^[0-9]+$ ]] || { echo "fuzz.sh: seconds must be a whole number, got '$SECONDS_PER'" >&2; exit 2; }

# Packages and the venv (torch's headers and libraries for the safetensors target), no build.
SLUICE_SETUP_ONLY=1 bash "$ROOT/scripts/setup.sh"
# clang and its libFuzzer/sanitizer runtimes (Debian 12: clang 14).
missing=()
for p in clang libclang-rt-14-dev; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if ((${#missing[@]})); then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if [ ! -f "$BUILD/build.ninja" ]; then
  CC=clang CXX=clang++ cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_PREFIX_PATH="$("$ROOT/.venv/bin/python" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')" \
    -DSLUICE_FUZZ=ON -DSLUICE_BUILD_TESTS=OFF -DSLUICE_BUILD_BENCH=OFF -DSLUICE_USE_PCH=OFF \
    -DSLUICE_WITH_CUDA=OFF >/dev/null
fi
cmake --build "$BUILD" -j "$(nproc)" --target "${TARGETS[@]/#/fuzz_}"

# Findings that are not bugs of ours must not stop the run: libtorch is not instrumented,
# and its static initialisers allocate without freeing at exit.
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=0:abort_on_error=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
status=0
for t in "${TARGETS[@]}"; do
  work="$BUILD/corpus/$t"
  crashes="$BUILD/crashes/$t"
  mkdir -p "$work" "$crashes"
  dict=()
  [ -f "tests/fuzz/$t.dict" ] && dict=(-dict="tests/fuzz/$t.dict")
  echo "== fuzz_$t for ${SECONDS_PER}s"
  log="$BUILD/fuzz_$t.log"
  set +e
  "$BUILD/tests/fuzz/fuzz_$t" "${dict[@]}" -max_total_time="$SECONDS_PER" -print_final_stats=1 \
    -artifact_prefix="$crashes/" -max_len=65536 -timeout=10 -rss_limit_mb=4096 \
    "$work" "tests/fuzz/corpus/$t" >"$log" 2>&1
  rc=$?
  set -e
  # The last status line (cov:, ft:, corp:, exec/s) and the final stats.
  grep -E '^#[0-9]+' "$log" | tail -1 || true
  grep -E '^stat::' "$log" || true
  if [ $rc -ne 0 ]; then
    echo "fuzz_$t: FAILED (exit $rc); see $log and $crashes/" >&2
    grep -E 'ERROR|SUMMARY|runtime error|Test unit written' "$log" | head -20 >&2 || true
    status=1
  fi
done
exit $status
