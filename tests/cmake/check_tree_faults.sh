#!/usr/bin/env bash
# scripts/check_tree.py catches each fault it is for: in a scratch git tree, one broken
# reference at a time must fail the check with a line naming it, and the clean tree passes.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
check="$here/../../scripts/check_tree.py"
py=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

clean_tree() {
  rm -rf "$work/t" && mkdir -p "$work/t"/{offload/device,offload/engine,include/sluice,runtime}
  cd "$work/t" && git init -q .
  cat > offload/device/device.h <<'X'
#pragma once
// The device. Note [device rule]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Explained here; see runtime/util.h.
X
  cat > offload/engine/engine.h <<'X'
#pragma once
#include "offload/device/device.h"
// Uses the device (Note [device rule] in device.h).
X
  echo '// Utilities.' > runtime/util.h
  cat > include/sluice/sluice.hpp <<'X'
#pragma once
// The public API (README, "Layout"; sluice/sluice.hpp).
X
}

failures=0
expect_fault() {  # description, expected text
  local out rc=0
  out=$("$py" "$check" "$work/t" 2>&1) || rc=$?
  if [[ $rc -ne 1 || "$out" != *"$2"* ]]; then
    echo "FAIL: $1: expected exit 1 and '$2', got exit $rc:"; echo "$out"; failures=$((failures + 1))
  else
    echo "ok: $1: $(grep -F -- "$2" <<< "$out" | head -1)"
  fi
}

clean_tree
"$py" "$check" "$work/t" > /dev/null || { echo "FAIL: the clean scratch tree does not pass"; exit 1; }
echo "ok: the clean scratch tree passes"

clean_tree; echo '// Uses Note [no such note].' >> offload/engine/engine.h
expect_fault "a note cited but defined nowhere" "Note [no such note] is defined nowhere"

clean_tree; printf '// Note [device rule]\n// ~~~~~~~~~~~~~~~~~~~\n' >> runtime/util.h
expect_fault "a note defined twice" "Note [device rule] is defined 2 times"

clean_tree; echo '// As Note [device rule] in util.h says.' >> offload/engine/engine.h
expect_fault "a note cited in a file that does not define it" "cites Note [device rule] in util.h, but it is defined in offload/device/device.h"

clean_tree; echo '// Details in offload/device/gone.h.' >> offload/engine/engine.h
expect_fault "a comment naming a file that does not exist" "names offload/device/gone.h, which is no file of the tree"

clean_tree; echo '// Stored as runtime/util.h says.' >> include/sluice/sluice.hpp
expect_fault "a public header citing an internal header" "a public header cites runtime/util.h"

clean_tree; echo '// As Note [device rule] says.' >> include/sluice/sluice.hpp
expect_fault "a public header citing an internal note" "a public header cites Note [device rule]"

clean_tree; echo '#include "offload/engine/engine.h"' >> offload/device/device.h
expect_fault "the device layer including the engine" "offload/device/ includes offload/engine/, a folder above it"

clean_tree; echo '// stray' > offload/loose.cpp
expect_fault "a source file directly in offload/" "offload/loose.cpp: a source file directly in offload/"

clean_tree; mkdir -p tests && printf 'TEST_CASE("thing: it works; " "it is one line", "[strict]") {}\n' > tests/test_thing.cpp
expect_fault "a test case name with ';'" "tests/test_thing.cpp:1: test case name has ';'"
exit $failures
