#!/usr/bin/env bash
# Mutation test of the engine's fences (Note [strict device]). It finds its own candidates:
# every call of the device's ordering API -- `wait(`, `record(`, `record_use(`,
# `synchronize(` -- on a line of offload/*/*.cpp or cache/*.cpp (comment lines aside, and the
# files that implement the device API rather than call it, see `implementers` below). Each
# candidate is removed on its own (its file:line deleted), the test binary named for it is
# rebuilt (--target only) and that one test runs under the strict CPU device, which must
# fail. A candidate is either
#  - a fence: marked `FENCE(Fn)` in the source (catcher[Fn] names its test) or listed in
#    `caught_by` (keyed by file and line text, so that line moves do not matter), or
#  - listed in `not_fence` with the reason it orders nothing the hazard tracker could see.
# A candidate in neither table fails the run, as does a removal that no test notices.
# Prints one line per candidate; exits non-zero if any is unclassified or not caught.
#
# Usage: scripts/fence_mutations.sh [--list] [--groups] [--only REGEX] [build-dir]
#   --list    classify the candidates and print them, build and run nothing (fast)
#   --groups  also remove each FENCE(Fn) group whole (all its lines at once), as before
#   --only    only candidates whose "file:line: text" matches REGEX
#   --check-listed  also remove each candidate listed as no fence, and run the whole stream
#             and engine tests under the strict device: a listed line whose removal fails a
#             test is reported (timing events fail stats checks, not the hazard tracker)
#   build-dir default: build (already configured). JOBS: build parallelism (default 2).
set -euo pipefail
cd "$(dirname "$0")/.."
list=0 groups=0 only="" check_listed=0
while (($#)); do
  case $1 in
    --list) list=1; shift ;;
    --groups) groups=1; shift ;;
    --check-listed) check_listed=1; shift ;;
    --only) only=$2; shift 2 ;;
    -*) echo "fence_mutations: unknown option $1" >&2; exit 2 ;;
    *) break ;;
  esac
done
build=${1:-build}

# Fences marked in the source -> the test that must catch their removal, as
# "binary::test name" (binary default: sluice_test_streams).
declare -A catcher=(
  [F1]="streams: streamed forwards through a wrapping ring match the model"
  [F2]="streams: streamed forwards through a wrapping ring match the model"
  [F3]="streams: streamed forwards through a wrapping ring match the model"
  [F4]="streams: detach right after a forward with prefetches in flight"
  [F5]="streams: a forward on a host-provided stream then detach on the default stream"
  [F6]="streams: forwards alternate between two host streams"
  [F7]="streams: a forward right after attach reads resident layers after their copies"
  [F8]="streams: a bounce slot's reuse never waits for compute the device is still running"
  [F9]="streams: a forward right after placing LoRA sidecars reads them after their copies"
  [F10]="streams: a forward right after placing LoRA sidecars reads them after their copies"
)

# Unmarked candidates that are fences too: "file|line text (trimmed)" -> test.
declare -A caught_by=(
  ["offload/device/bounce_ring.cpp|device_.record(*s.done, StreamKind::copy);"]="streams: a bounce slot's reuse never waits for compute the device is still running"
  ["offload/device/staging_ring.cpp|device_.record(*s.copy_done, StreamKind::copy);"]="streams: streamed forwards through a wrapping ring match the model"
  ["offload/engine/forward_pass.cpp|device_.record(*last_end_, StreamKind::compute);"]="streams: forwards alternate between two host streams"
  ["offload/engine/model_records.cpp|device.record_use(e.dev, StreamKind::copy);"]="sluice_test_model_records::model records: an allocation failing after the first extra gives the placed ones back after their copies"
)

# Candidates that are no fence, with the reason.
declare -A not_fence=(
  ["offload/device/bounce_ring.cpp|device_.record(*done, StreamKind::copy);"]="the unpinned fallback: a copy from pageable memory already returns once its source is read (DeviceBackend::is_pinned); compute is ordered by the staging slot's copy_done (F1); this wait only makes the fallback synchronous as documented"
  ["offload/device/bounce_ring.cpp|done->synchronize();"]="the same unpinned fallback's wait"
  ["offload/engine/model_records.cpp|device.synchronize();  // reports a failed parameter copy here (apply_plan's first synchronize orders them)"]="error reporting at attach: apply_plan's synchronize and the applier's F7 order the parameter copies before any forward"
  ["offload/engine/model_residency.cpp|device_->synchronize();"]="clear (detach) and apply_plan: frees are stream-safe (F4, F5: Note [stream-safe frees]), so these order nothing the tracker checks; they report a failed copy at a defined point, and detach's lets release_cached_memory give back blocks still waiting for a copy (without it \"engine: a budget cut and detaching give freed device memory back to the allocator's driver\" fails: reserved memory stays)"
  ["offload/engine/forward_recorder.cpp|device_.record(*anchor_->event, StreamKind::compute);"]="timing: the forward's anchor event for elapsed times and the trace"
  ["offload/engine/forward_recorder.cpp|device_.record(*u.end, StreamKind::compute);"]="timing: the forward's end event, read by resolve()"
  ["offload/engine/forward_recorder.cpp|device_.record(*e, StreamKind::compute);"]="timing: mark(), a compute-stream timestamp"
  ["offload/engine/forward_recorder.cpp|u.end->synchronize();"]="timing: resolve() waits before reading a forward's events (elapsed_ms needs them done)"
  ["offload/engine/forward_recorder.cpp|sp.a->synchronize();"]="timing: resolve() reading a span's events"
  ["offload/engine/forward_recorder.cpp|sp.b->synchronize();"]="timing: resolve() reading a span's events"
  ["offload/engine/forward_recorder.cpp|u.acc.marks[i]->synchronize();"]="timing: resolve() reading the calibration marks"
  ["offload/engine/model_budget.cpp|device.record_use(d, StreamKind::copy);  // freed later without waiting for anything else"]="F9's synchronize already orders the sidecar copies before any free; kept for a backend whose synchronize does not cover the copy stream"
  ["offload/device/staging_ring.cpp|if (start) device_.record(*start, StreamKind::copy);"]="timing: the copy span's start event"
  ["offload/device/staging_ring.cpp|if (end) device_.record(*end, StreamKind::copy);"]="timing: the copy span's end event"
  ["offload/device/staging_ring.cpp|device_.synchronize();"]="end_use's fallback when recording the release throws (reached only through an exception from record())"
  ["offload/engine/residency_applier.cpp|for (const at::Tensor* t : {&w, &b, &s}) device_.record_use(*t, StreamKind::copy);  // a second guard behind F7"]="apply() synchronizes after the resident copies (F7, and its error path) before anything can free them: no free can meet a copy in flight; kept so that a free does not depend on that synchronize"
  ["offload/engine/residency_applier.cpp|device_.synchronize();"]="apply()'s error path: waits before undoing a failed residency change (the frees that follow are stream-safe)"
  ["cache/cache_locking.cpp|idle_.wait(g, [&] { return !e.running; });"]="a host condition variable (Note [cache locking]), no device call"
  ["cache/cache_locking.cpp|loaded_.wait(g, [&] { return !e.loading; });"]="a host condition variable (Note [cache locking]), no device call"
  ["cache/cache_locking.cpp|idle_.wait(g, [&] {"]="a host condition variable (Note [cache locking]), no device call"
  ["cache/cache_locking.cpp|idle_.wait(g, [&] { return !e.running && e.run_waiters == 0 && budget_waiters_ == 0; });"]="a host condition variable (Note [cache locking]), no device call"
)

# Files that implement the device API (their calls are the device's own machinery, the
# oracle the strict device checks against), not callers of it: the two backends, the
# allocator part's own code, and the CPU device's parts (its copy worker, the strict
# device's tracker glue, the tracker).
implementers='offload/device/(cpu_device|torch_device|hazard_tracker|device|device_allocator|copy_worker|strict_tracking)\.cpp'

candidates() {
  grep -nE '(^|[^A-Za-z_])(wait|record|record_use|synchronize)\(' offload/*/*.cpp cache/*.cpp |
    grep -vE '^[^:]+:[0-9]+:[[:space:]]*//' | grep -vE "^$implementers:" || true
}

trim() { sed -E 's/^[[:space:]]+//; s/[[:space:]]+$//' <<< "$1"; }

# The test for a candidate: "binary::name", or "" with the reason in $reason.
classify() {  # file text
  local file=$1 text=$2 key fence
  key="$file|$(trim "$text")"
  reason=""
  fence=$(grep -oE 'FENCE\(F[0-9]+\)' <<< "$text" | head -1 | tr -d 'FENCE()' || true)
  if [[ -n $fence ]]; then test_of=${catcher[F$fence]:-}; [[ -n $test_of ]] || reason="UNCLASSIFIED: F$fence has no test in catcher"; return; fi
  if [[ -n ${caught_by[$key]:-} ]]; then test_of=${caught_by[$key]}; return; fi
  test_of=""
  if [[ -n ${not_fence[$key]:-} ]]; then reason="not a fence: ${not_fence[$key]}"; else reason="UNCLASSIFIED: in no table"; fi
}

split_test() {  # "binary::name" -> $tbin $tname
  if [[ $1 == *::* ]]; then tbin=${1%%::*}; tname=${1#*::}; else tbin=sluice_test_streams; tname=$1; fi
}

missed=0
mapfile -t lines < <(candidates)
if ((list)); then
  for l in "${lines[@]}"; do
    file=${l%%:*}; rest=${l#*:}; text=${rest#*:}
    [[ -z $only || $l =~ $only ]] || continue
    classify "$file" "$text"
    if [[ -n $test_of ]]; then echo "$file:${rest%%:*}: fence, test \"$test_of\""; else echo "$file:${rest%%:*}: $reason"; [[ $reason == UNCLASSIFIED* ]] && missed=1; fi
  done
  exit $missed
fi

[[ -f $build/build.ninja || -f $build/Makefile ]] || { echo "fence_mutations: $build is not a configured build directory (run scripts/setup.sh first)" >&2; exit 2; }
backup=$(mktemp -d)
restore() { if compgen -G "$backup/*.orig" > /dev/null; then for f in "$backup"/*.orig; do cp "$f" "$(basename "$f" .orig | tr '%' '/')"; done; rm -f "$backup"/*.orig; fi; }
trap 'restore; rm -rf "$backup" "$backup.log" "$backup.out"' EXIT

build_target() { cmake --build "$build" --target "$1" -j"${JOBS:-2}" > "$backup.log" 2>&1 || { tail -20 "$backup.log" >&2; return 1; }; }
run_test() {  # binary name -> 0 if the test ran and passed, 1 if it failed; exits if it did not run
  local rc=0
  # Catch reads a comma as a separator of test specs: escape it.
  # (through sh, so that the abort a hazard causes is reported in the test's output, not here)
  SLUICE_STRICT_DEVICE=1 SLUICE_LOG_LEVEL=off sh -c '"$@"; exit $?' sh timeout 300 "$build/tests/$1" "${2//,/\\,}" \
    > "$backup.out" 2>&1 || rc=1
  if grep -qE 'No tests ran|No test cases matched' "$backup.out"; then
    echo "fence_mutations: \"$2\" matched no test in $1" >&2
    exit 2
  fi
  return $rc
}
save() { cp "$1" "$backup/$(tr '/' '%' <<< "$1").orig"; }

# Every named test exists and passes unmutated.
declare -A checked=()
for t in "${catcher[@]}" "${caught_by[@]}"; do
  split_test "$t"
  [[ -n ${checked[$tbin]:-} ]] || { build_target "$tbin" || exit 2; checked[$tbin]=1; }
  grep -Fxq "$tname" < <("$build/tests/$tbin" --list-test-names-only || true) ||
    { echo "fence_mutations: test \"$tname\" does not exist in $tbin" >&2; exit 2; }
  run_test "$tbin" "$tname" || { echo "fence_mutations: \"$tname\" fails without any mutation" >&2; cat "$backup.out" >&2; exit 1; }
done

report() {  # label test
  local label=$1 why
  split_test "$2"
  if ! build_target "$tbin"; then echo "$label: does not build without it"; missed=1; return; fi
  if run_test "$tbin" "$tname"; then
    echo "$label: NOT CAUGHT by \"$tname\""
    missed=1
  else
    why=$(grep -m1 -o 'strict device: hazard: [^(]*' "$backup.out" || grep -m1 -E 'FAILED|REQUIRE|CHECK\(' "$backup.out" || echo "failed")
    echo "$label: caught by \"$tname\": $why"
  fi
}

start=$SECONDS
for l in "${lines[@]}"; do
  [[ -z $only || $l =~ $only ]] || continue
  file=${l%%:*}; rest=${l#*:}; n=${rest%%:*}; text=${rest#*:}
  label="$file:$n \`$(trim "$text")\`"
  classify "$file" "$text"
  if [[ -z $test_of ]]; then
    echo "$label: $reason"
    [[ $reason == UNCLASSIFIED* ]] && missed=1
    if ((check_listed)) && [[ $reason == not\ a\ fence* ]]; then
      save "$file"
      sed -i "${n}d" "$file"
      t0=$SECONDS
      if build_target sluice_test_streams && build_target sluice_test_engine; then
        failed=""
        for b in sluice_test_streams sluice_test_engine; do
          SLUICE_STRICT_DEVICE=1 SLUICE_LOG_LEVEL=off sh -c '"$@"; exit $?' sh timeout 600 "$build/tests/$b" > "$backup.out" 2>&1 ||
            failed+="$b: $(grep -m1 -o 'strict device: hazard: [^(]*' "$backup.out" || awk '/^-------------------------/ { getline; print; exit }' "$backup.out"); "
        done
        echo "  removed: ${failed:-no stream or engine test fails} ($((SECONDS - t0)) s)"
      else
        echo "  removed: does not build"
      fi
      restore
    fi
    continue
  fi
  save "$file"
  sed -i "${n}d" "$file"
  t0=$SECONDS
  report "$label" "$test_of"
  restore
  echo "  ($((SECONDS - t0)) s)"
done

if ((groups)); then
  for fence in $(grep -ohE 'FENCE\(F[0-9]+\)' offload/*/*.cpp | sort -u | tr -d 'FENCE()'); do
    [[ -z $only || "F$fence" =~ $only ]] || continue
    files=$(grep -l "FENCE(F$fence)" offload/*/*.cpp)
    for f in $files; do save "$f"; sed -i "/FENCE(F$fence)/d" "$f"; done
    test_of=${catcher[F$fence]:-}
    if [[ -z $test_of ]]; then echo "F$fence: no test named for it"; missed=1; restore; continue; fi
    report "F$fence (all its lines: $(echo "$files" | tr '\n' ' '))" "$test_of"
    restore
  done
fi

# Leave the binaries built from the unmutated sources.
((check_listed)) && checked[sluice_test_engine]=1
for b in "${!checked[@]}"; do build_target "$b" || true; done
echo "fence_mutations: done in $((SECONDS - start)) s, $( ((missed)) && echo "SOME NOT CAUGHT OR UNCLASSIFIED" || echo "every candidate caught or listed")"
exit $missed
