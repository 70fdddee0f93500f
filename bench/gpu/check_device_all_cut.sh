#!/usr/bin/env bash
# Checks that bench/gpu/device_all.sh tells the truth about phases that did not run, on the
# CPU device (--dry-run-cpu), reusing a built build folder. ctest runs it ("bench:
# device_all.sh --dry-run-cpu reports a phase cut short as not run"). Four calls, sharing
# one state folder as calls on one GPU machine would:
#   1. --phase pipeline --build-dir <missing>  -> "not run: build folder missing", exit != 0;
#   2. --phase build-tests, every phase capped at 1 s: the build is found, the tests are
#      skipped for lack of time -> build-tests "not run", exit != 0;
#   3. --phase pipeline, no cap                -> pass, exit 0;
#   4. --phase compare, capped at 6 s with SLUICE_DEVICE_ALL_MIN_S=1: compare.py (about 13 s
#      here, most of it before its first result) is cut while it runs -> "not run", exit != 0, and the summary's
#      last line is exactly "phases: 1 passed, 0 failed, 2 not run" (pipeline's pass from
#      call 3 kept, build-tests' "not run" from call 2 kept);
#   5. --phase build-tests capped at 1 s again: pipeline's result is dropped (it ran on the
#      previous build) -> "phases: 0 passed, 0 failed, 3 not run".
# Any other outcome fails the check (exit 1), naming what differed.
#
#   bash bench/gpu/check_device_all_cut.sh --build-dir build [--work DIR]
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BUILD="$ROOT/build"
WORKDIR=""
while (($#)); do
  case "$1" in
    --build-dir) BUILD="$2"; shift 2 ;;
    --work) WORKDIR="$2"; shift 2 ;;
    *) echo "check_device_all_cut.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
if [ -z "$WORKDIR" ]; then
  WORKDIR="$(mktemp -d "${TMPDIR:-/tmp}/device_all_cut.XXXXXX")"
  trap 'rm -rf "$WORKDIR"' EXIT
fi
rm -rf "$WORKDIR"
mkdir -p "$WORKDIR"
STATE="$WORKDIR/state"
DA=(bash "$ROOT/bench/gpu/device_all.sh" --dry-run-cpu --build-dir "$BUILD" --state-dir "$STATE")
FAILS=0
bad() { echo "CHECK FAILED: $*"; FAILS=$((FAILS + 1)); }
ok() { echo "check ok: $*"; }

call() {  # N ENV... -- ARGS...: runs device_all.sh, OUT=$WORKDIR/out<N>; sets RC, SUM
  local n=$1; shift
  local envs=()
  while [ "$1" != -- ]; do envs+=("$1"); shift; done
  shift
  echo "=== call $n: ${envs[*]} device_all.sh --dry-run-cpu $*"
  env "${envs[@]}" OUT="$WORKDIR/out$n" "${DA[@]}" "$@" >"$WORKDIR/call$n.log" 2>&1
  RC=$?
  SUM="$WORKDIR/out$n/summary.txt"
  sed 's/^/    /' "$SUM" 2>/dev/null || { bad "call $n wrote no summary.txt"; tail -20 "$WORKDIR/call$n.log"; }
  echo "    (exit $RC)"
}
# expect_line SUMMARY PHASE STATUS [DETAIL_REGEX]
expect_line() {
  local line
  line=$(grep -E "^$2 " "$1" | head -1)
  if [[ "$line" =~ ^$2\ +$3\ \  ]] && { [ -z "${4:-}" ] || [[ "$line" =~ $4 ]]; }; then
    ok "$2 is '$3'${4:+ (matches /$4/)}"
  else
    bad "expected '$2' to be '$3'${4:+ matching /$4/}, got: ${line:-no line}"
  fi
}
expect_last() {
  local last
  last=$(tail -1 "$1")
  if [ "$last" = "$2" ]; then ok "last line '$2'"; else bad "last line: expected '$2', got '$last'"; fi
}
expect_rc() {  # zero|nonzero
  if [ "$1" = zero ] && ((RC == 0)); then ok "exit 0"
  elif [ "$1" = nonzero ] && ((RC != 0)); then ok "exit $RC (non-zero)"
  else bad "exit $RC, expected $1"; fi
}

call 1 -- --phase pipeline --build-dir "$WORKDIR/no-such-build" --state-dir "$WORKDIR/state1"
expect_rc nonzero
expect_line "$SUM" pipeline "not run" "build folder missing.*run --phase build-tests first"
expect_last "$SUM" "phases: 0 passed, 0 failed, 3 not run"

call 2 SLUICE_DEVICE_ALL_PHASE_CAP_S=1 -- --phase build-tests
expect_rc nonzero
expect_line "$SUM" build-tests "not run"
grep -qE "^  tests +not run +\(skipped" "$SUM" && ok "tests skipped for lack of time" || bad "tests not reported as skipped"
expect_last "$SUM" "phases: 0 passed, 0 failed, 3 not run"

call 3 -- --phase pipeline
expect_rc zero
expect_line "$SUM" pipeline pass
expect_last "$SUM" "phases: 1 passed, 0 failed, 2 not run"

call 4 SLUICE_DEVICE_ALL_PHASE_CAP_S=compare=6 SLUICE_DEVICE_ALL_MIN_S=1 -- --phase compare
expect_rc nonzero
expect_line "$SUM" compare "not run"
expect_line "$SUM" pipeline pass
expect_line "$SUM" build-tests "not run"
grep -qE "^  compare +not run +\((cut after|skipped)" "$SUM" && ok "compare.py cut or skipped by the cap: $(grep -E '^  compare ' "$SUM" | cut -c23-)" || bad "compare step not reported as cut"
expect_last "$SUM" "phases: 1 passed, 0 failed, 2 not run"

call 5 SLUICE_DEVICE_ALL_PHASE_CAP_S=1 -- --phase build-tests
expect_rc nonzero
expect_line "$SUM" pipeline "not run" "not run yet"
expect_last "$SUM" "phases: 0 passed, 0 failed, 3 not run"

if ((FAILS)); then
  echo "check_device_all_cut.sh: $FAILS check(s) failed (logs in $WORKDIR)"
  exit 1
fi
echo "check_device_all_cut.sh: every check passed"
