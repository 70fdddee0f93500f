#!/usr/bin/env bash
# Mutation test of the engine's fences (Note [strict device]): for each fence marked
# `FENCE(Fn)` in offload/, delete its line(s), rebuild the stream tests, and check that the
# test named for it fails under the strict CPU device. Prints one line per fence and exits
# non-zero if any removal went unnoticed. Sources are restored after each mutation (and on
# exit). Usage: scripts/fence_mutations.sh [build-dir]   (default: build, already configured)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
[[ -f $build/build.ninja || -f $build/Makefile ]] || { echo "fence_mutations: $build is not a configured build directory (run scripts/setup.sh first)" >&2; exit 2; }

# fence -> the test that must catch its removal (tests/test_streams.cpp)
declare -A catcher=(
  [F1]="streams: streamed forwards through a wrapping ring match the model"
  [F2]="streams: streamed forwards through a wrapping ring match the model"
  [F3]="streams: streamed forwards through a wrapping ring match the model"
  [F4]="streams: detach right after a forward with prefetches in flight"
  [F5]="streams: a forward on a host-provided stream then detach on the default stream"
  [F6]="streams: forwards alternate between two host streams"
  [F7]="streams: a forward right after attach reads resident layers after their copies"
  [F8]="streams: pageable layers stream through the bounce ring"
)
bin=$build/tests/sluice_test_streams
backup=$(mktemp -d)
restore() { if compgen -G "$backup/*" > /dev/null; then for f in "$backup"/*; do cp "$f" "offload/$(basename "$f")"; done; fi; }
trap 'restore; rm -rf "$backup"' EXIT

build_tests() { cmake --build "$build" --target sluice_test_streams -j"${JOBS:-2}" > "$backup.log" 2>&1 || { cat "$backup.log" >&2; return 1; }; }

build_tests
SLUICE_LOG_LEVEL=off "$bin" > /dev/null 2>&1 || { echo "fence_mutations: the stream tests fail without any mutation" >&2; exit 1; }

names=$("$bin" --list-test-names-only || true)  # Catch2 v2 exits with the count
for f in "${!catcher[@]}"; do
  grep -Fxq "${catcher[$f]}" <<< "$names" || { echo "fence_mutations: $f's test \"${catcher[$f]}\" does not exist" >&2; exit 2; }
done

missed=0
for fence in $(grep -oh 'FENCE(F[0-9]*)' offload/*.cpp | sort -u | tr -d 'FENCE()'); do
  files=$(grep -l "FENCE(F$fence)" offload/*.cpp)
  for f in $files; do cp "$f" "$backup/"; sed -i "/FENCE(F$fence)/d" "$f"; done
  test_name=${catcher[F$fence]:-}
  if [[ -z $test_name ]]; then echo "F$fence: no test named for it"; missed=1; restore; continue; fi
  if ! build_tests; then echo "F$fence: does not build without it"; missed=1; restore; continue; fi
  if SLUICE_LOG_LEVEL=off timeout 300 "$bin" "$test_name" > "$backup.out" 2>&1; then
    echo "F$fence ($(echo "$files" | tr '\n' ' ')): NOT CAUGHT by \"$test_name\""
    missed=1
  else
    why=$(grep -m1 -o 'strict device: hazard: [^(]*' "$backup.out" || grep -m1 'FAILED' "$backup.out" || echo "failed")
    echo "F$fence ($(echo "$files" | tr '\n' ' ')): caught by \"$test_name\": $why"
  fi
  restore
  rm -f "$backup"/*
done
build_tests
exit $missed
