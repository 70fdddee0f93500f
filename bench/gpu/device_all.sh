#!/usr/bin/env bash
# bench/gpu/device_all.sh: the GPU proof (issue 10 §6, issue 27 §3), in three phases, each
# one call of the device tool (under 9 minutes) on a bare 16-core H100/H200 machine whose
# python has CUDA torch, nvcc, cmake and ninja and nothing else: no network, none of
# sluice's Debian packages (they are carried in .gpu/, see bench/gpu/prepare_carry.sh).
#
#   phase        what it runs                                           expected   cap
#   build-tests  configures and builds its own build folder (Release,    ~6 min    480 s
#                SLUICE_WITH_CUDA=ON, Hopper only), kept for the next
#                call on the same machine; then the device, fp8, engine,
#                model cache and fault tests with SLUICE_TEST_DEVICE=cuda
#                and, beside them, the Python bindings into the build
#                folder                          -> build.log, tests.txt
#   pipeline     the fused fp8 -> bf16 upcast kernel against a device    ~4 min    420 s
#                copy (upcast.txt); the anima-2b table at 1024^2 and
#                512^2 (bench_pipeline: bf16 and fp8 resident,
#                --max-resident 0.75/0.5/0.25/0, budgets of 8 GiB and
#                2 GiB) and one `sluice run` under 2 GiB with its stats
#                                                -> upcast.txt, pipeline.txt
#   compare      bench/gpu/compare.py side by side against diffusers'    ~3 min    420 s
#                group offloading and an InvokeAI-style partial load
#                                                -> compare.md, compare.json
#   offload      (optional) bench/offload_vs_diffusers.py --device      ~2 min    300 s
#                cuda: sluice.offload(module) against diffusers' group
#                offloading (with and without use_stream) on one
#                random-weight CosmosTransformer3DModel (8 blocks,
#                hidden 2048, ~1 GB of bf16), with each mode's host
#                RAM over the model it stores (issue 31)
#                                                -> offload.md
#   compiled     (optional) the same bench's eager sluice rows and      ~4 min    420 s
#                their torch.compile twins (--compiled, inductor): the
#                compiled-and-offloaded step time against the eager
#                offloaded one, same run, same model (issue 38)
#                                                -> compiled.md
# The expected times are estimates (no GPU machine has run this yet); each phase stops
# itself at its cap, which leaves a margin under 9 minutes. Every call also writes env.txt
# (nvidia-smi, torch, nvcc, cmake, cores, python modules) and summary.txt.
#
#   bash bench/gpu/prepare_carry.sh                     # here, once: fills .gpu/ (< 20 MB)
#   bash bench/gpu/device_all.sh --phase build-tests    # there, one call each, .gpu carried,
#   bash bench/gpu/device_all.sh --phase pipeline       #   on the same (warm) machine
#   bash bench/gpu/device_all.sh --phase compare
#   bash bench/gpu/device_all.sh --phase offload        #   (optional, any time after build-tests)
#   bash bench/gpu/device_all.sh --phase compiled       #   (optional, any time after build-tests)
#   bash bench/gpu/device_all.sh --phase all            # the five in order (~19 min: not one call)
#   bash bench/gpu/device_all.sh --dry-run-cpu          # here: the same phases on the CPU device
#
# Status of a phase: pass, fail, or "not run": cut by its time cap, skipped for lack of
# time, or its prerequisite missing or failed. "not run" never counts as a pass. A later
# phase needs the build folder a completed build-tests build left ("not run: build folder
# missing, run --phase build-tests first" on a fresh machine). If build-tests is cut while
# building, run it again: the build continues where it stopped.
# summary.txt lists every phase, this call's and earlier calls' (a copy is kept in the
# state folder, by default in the build folder); its last line counts them:
#   phases: 2 passed, 0 failed, 1 not run
# The optional phases (offload, compiled) are counted there once they ran; until then their
# lines say so.
# Running build-tests again forgets the later phases' results (they ran on the older build).
# Exit code: 0 when every phase this call was asked for passed, 1 otherwise, 2 on a usage
# error.
#
# --dry-run-cpu runs the same phases on the CPU-as-device backend with small presets
# (anima-tiny, 64 px), reusing an already built build folder (it configures and builds
# nothing; the bindings are built only when the folder has none); default --phase all.
# ctest runs it ("bench: device_all.sh --dry-run-cpu") and checks that a phase cut short is
# "not run" (bench/gpu/check_device_all_cut.sh).
#
# Options and environment:
#   --phase P            build-tests, pipeline, compare, offload, compiled or all (required on
#                        a GPU)
#   --dry-run-cpu        see above
#   --build-dir DIR      build folder (env SLUICE_BUILD_DIR; default: build-device-all on a
#                        GPU, build with --dry-run-cpu)
#   --state-dir DIR      where the phases' results persist between calls (env
#                        SLUICE_DEVICE_ALL_STATE; default: DIR/device_all_state, DIR the
#                        build folder)
#   --cap-s N|P=N,...    each phase's time cap in seconds, or one phase's (env
#                        SLUICE_DEVICE_ALL_PHASE_CAP_S); counted from the script's start
#   SLUICE_DEVICE_ALL_MIN_S  the fewest seconds a step may start with (default: per step,
#                        15 to 60); a testing knob: small values make a small cap cut a
#                        step while it runs instead of skipping it
#   OUT                  results folder (default: a new temporary folder, printed)
#   PYTHON               python with torch (default: python3, or .venv's when python3 has none)
#   SLUICE_PYINSTALL     a folder where the Python bindings are already installed
#                        (pip --target); default: <build folder>/pyinstall, built by
#                        build-tests (or compare) when it lacks them
#   SLUICE_COMMIT        the commit to report when the tree has no .git (env.txt)
set -uo pipefail  # no -e: a failing step is recorded and the next one still runs
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT" || exit 1
START=$SECONDS
SELF="$ROOT/bench/gpu/device_all.sh"

PHASE_ORDER=(build-tests pipeline compare)
# Optional phases: run by name and by --phase all, counted in the summary once they ran.
OPTIONAL_PHASES=(offload compiled)  # names of at most 12 characters (the summary's column)
declare -A CAP_GPU=([build-tests]=480 [pipeline]=420 [compare]=420 [offload]=300 [compiled]=420)
# GPU: estimates (never run on one yet). CPU: measured here, 2 cores (see README).
declare -A EXPECT_GPU=([build-tests]="~6 min on 16 cores (estimate)" [pipeline]="~4 min (estimate)" [compare]="~3 min (estimate)"
                       [offload]="~2 min (estimate)" [compiled]="~4 min (estimate)")
declare -A CAP_CPU=([build-tests]=240 [pipeline]=150 [compare]=240 [offload]=150 [compiled]=240)
declare -A EXPECT_CPU=([build-tests]="~5 s on 2 cores" [pipeline]="~5 s on 2 cores" [compare]="~15 s on 2 cores"
                       [offload]="~40 s on 2 cores" [compiled]="~70 s on 2 cores")

MODE=gpu
PHASE=""
BUILD="${SLUICE_BUILD_DIR:-}"
STATE="${SLUICE_DEVICE_ALL_STATE:-}"
CAPS="${SLUICE_DEVICE_ALL_PHASE_CAP_S:-}"
PASS_ARGS=()  # what a child of --phase all gets
usage_error() { echo "device_all.sh: $* (see --help)" >&2; exit 2; }
while (($#)); do
  case "$1" in
    --dry-run-cpu) MODE=cpu; PASS_ARGS+=("$1"); shift ;;
    --phase) [ $# -ge 2 ] || usage_error "--phase needs a value"; PHASE="$2"; shift 2 ;;
    --build-dir) [ $# -ge 2 ] || usage_error "--build-dir needs a value"; BUILD="$2"; PASS_ARGS+=("$1" "$2"); shift 2 ;;
    --state-dir) [ $# -ge 2 ] || usage_error "--state-dir needs a value"; STATE="$2"; PASS_ARGS+=("$1" "$2"); shift 2 ;;
    --cap-s) [ $# -ge 2 ] || usage_error "--cap-s needs a value"; CAPS="$2"; PASS_ARGS+=("$1" "$2"); shift 2 ;;
    --phases|--budget-s) usage_error "'$1' is gone: the proof runs as --phase build-tests, then --phase pipeline, then --phase compare, one call each, each with its own cap (--cap-s)" ;;
    -h|--help) sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d'; exit 0 ;;
    *) usage_error "unknown argument '$1'" ;;
  esac
done
if [ -z "$PHASE" ]; then
  [ "$MODE" = cpu ] || usage_error "name a phase: --phase build-tests, then pipeline, then compare, then offload and compiled (one call each), or all"
  PHASE=all
fi
case " ${PHASE_ORDER[*]} ${OPTIONAL_PHASES[*]} all " in *" $PHASE "*) ;; *) usage_error "unknown phase '$PHASE'" ;; esac
if [ "$MODE" = gpu ]; then
  : "${BUILD:=$ROOT/build-device-all}"
  DEVICE=cuda
else
  : "${BUILD:=$ROOT/build}"
  DEVICE=cpu
fi
case "$BUILD" in /*) ;; *) BUILD="$ROOT/$BUILD" ;; esac
: "${STATE:=$BUILD/device_all_state}"
case "$STATE" in /*) ;; *) STATE="$ROOT/$STATE" ;; esac
export OUT="${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/device_all.XXXXXX")}"
mkdir -p "$OUT"

# cap_of PHASE: its cap in seconds (--cap-s N applies to all; P=N to one).
cap_of() {
  local c item
  if [ "$MODE" = gpu ]; then c=${CAP_GPU[$1]}; else c=${CAP_CPU[$1]}; fi
  if [[ "$CAPS" =~ ^[0-9]+$ ]]; then
    c=$CAPS
  elif [ -n "$CAPS" ]; then
    IFS=',' read -r -a items <<<"$CAPS"
    for item in "${items[@]}"; do
      [[ "$item" =~ ^([a-z-]+)=([0-9]+)$ ]] || usage_error "--cap-s: '$item' is not N or PHASE=N"
      [ "${BASH_REMATCH[1]}" = "$1" ] && c=${BASH_REMATCH[2]}
    done
  fi
  echo "$c"
}
expect_of() { if [ "$MODE" = gpu ]; then echo "${EXPECT_GPU[$1]}"; else echo "${EXPECT_CPU[$1]}"; fi; }

# --- summary: one block per phase in $STATE/<phase>.txt; summary.txt is built from them ---
# A block's first line is "<phase> <status> <detail>", then "  <step> <status> <detail>".
status_of_block() {  # FILE -> pass | fail | not run
  local s
  s=$(head -1 "$1" | cut -c14-21 | sed 's/ *$//')
  case "$s" in pass|fail|"not run") echo "$s" ;; *) echo "not run" ;; esac
}
write_summary() {  # THIS_CALL_LINE
  local p f st np=0 nf=0 nn=0
  mkdir -p "$STATE"
  {
    echo "device_all.sh ($MODE, device $DEVICE); build folder $BUILD; state $STATE"
    for p in "${PHASE_ORDER[@]}"; do
      f="$STATE/$p.txt"
      if [ -f "$f" ]; then
        cat "$f"
        st=$(status_of_block "$f")
      else
        printf '%-12s %-8s %s\n' "$p" "not run" "(not run yet: bash bench/gpu/device_all.sh $([ "$MODE" = cpu ] && echo '--dry-run-cpu ')--phase $p; expected $(expect_of "$p"), cap $(cap_of "$p") s)"
        st="not run"
      fi
      case "$st" in pass) np=$((np + 1)) ;; fail) nf=$((nf + 1)) ;; *) nn=$((nn + 1)) ;; esac
    done
    for p in "${OPTIONAL_PHASES[@]}"; do
      f="$STATE/$p.txt"
      if [ -f "$f" ]; then
        cat "$f"
        st=$(status_of_block "$f")
        case "$st" in pass) np=$((np + 1)) ;; fail) nf=$((nf + 1)) ;; *) nn=$((nn + 1)) ;; esac
      else
        printf '%-12s %-8s %s\n' "$p" "-" "(optional, not counted until it runs: bash bench/gpu/device_all.sh $([ "$MODE" = cpu ] && echo '--dry-run-cpu ')--phase $p; expected $(expect_of "$p"), cap $(cap_of "$p") s)"
      fi
    done
    echo "$1"
    echo "phases: $np passed, $nf failed, $nn not run"
  } >"$OUT/summary.txt.tmp"
  mv "$OUT/summary.txt.tmp" "$OUT/summary.txt"
  cp "$OUT/summary.txt" "$STATE/summary.txt"
}

# --- --phase all: each phase as its own run of this script, as separate calls would ------
if [ "$PHASE" = all ]; then
  rc_all=0
  for p in "${PHASE_ORDER[@]}" "${OPTIONAL_PHASES[@]}"; do
    bash "$SELF" "${PASS_ARGS[@]}" --phase "$p"
    rc=$?
    ((rc == 0)) || rc_all=1
  done
  write_summary "this call: --phase all, $((SECONDS - START)) s: $( ((rc_all)) && echo 'not every phase passed (exit 1)' || echo 'every phase passed (exit 0)')"
  echo
  cat "$OUT/summary.txt"
  exit "$rc_all"
fi

# --- one phase ---------------------------------------------------------------------------
CAP=$(cap_of "$PHASE")
EXPECT=$(expect_of "$PHASE")
WORK="$(mktemp -d "${TMPDIR:-/tmp}/device_all_work.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$STATE"
log() { printf '[device_all %s %4ds] %s\n' "$PHASE" "$((SECONDS - START))" "$*"; }
left() { echo $((CAP - (SECONDS - START))); }
# allot OWN MIN: sets T, the seconds a step may run (OWN, or what is left of the phase's cap
# if less, then BY_CAP=1); fails when fewer than MIN (or SLUICE_DEVICE_ALL_MIN_S) are left.
allot() {
  local l min=${SLUICE_DEVICE_ALL_MIN_S:-$2}
  l=$(left)
  T=$1
  BY_CAP=0
  if ((l < T)); then T=$l; BY_CAP=1; fi
  ((T >= min && T > 0))
}
run_for() { local t=$1; shift; timeout --signal=TERM --kill-after=10 "$t" "$@"; }

STEPS=()
step() {  # NAME STATUS DETAIL
  STEPS+=("$(printf '  %-10s %-8s %s' "$1" "$2" "$3")")
  log "$1: $2 $3"
  save_block
}
# Records a step's outcome from its exit code: a timeout is "not run" when the phase's cap
# cut it, "fail" when the step's own limit did (a hang).
step_rc() {  # NAME RC DETAIL_IF_PASS
  local rc=$2
  if ((rc == 0)); then
    step "$1" pass "$3"
  elif ((rc == 124 || rc == 137)) && ((BY_CAP)); then
    step "$1" "not run" "(cut after $T s by the phase's $CAP s cap: run this phase again)"
  elif ((rc == 124 || rc == 137)); then
    step "$1" fail "(timed out: still running after its own limit of $T s)"
  else
    step "$1" fail "(rc $rc)"
  fi
}
no_time() { local l; l=$(left); ((l < 0)) && l=0; step "$1" "not run" "(skipped: $l s left of the phase's $CAP s cap)"; }
phase_status() {
  local s st=pass
  for s in "${STEPS[@]}"; do
    case "$(echo "$s" | cut -c14-21 | sed 's/ *$//')" in
      fail) st=fail ;;
      "not run") [ "$st" = pass ] && st="not run" ;;
    esac
  done
  ((${#STEPS[@]})) || st="not run"
  echo "$st"
}
CALL_TIME="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
FINAL=0
save_block() {
  local st note why="" s
  st=$(phase_status)
  # The phase line names the first step behind a fail or a "not run".
  if [ "$st" != pass ]; then
    for s in "${STEPS[@]}"; do
      if [ "$(echo "$s" | cut -c14-21 | sed 's/ *$//')" = "$st" ]; then
        why=" - $(echo "$s" | cut -c3-12 | sed 's/ *$//'): $(echo "$s" | cut -c23- | sed 's/^(//; s/)$//')"
        break
      fi
    done
  fi
  # Until the phase ends its block says "not run": a call killed from outside leaves no pass.
  ((FINAL)) || { [ "$st" = pass ] && st="not run"; note=", unfinished"; }
  {
    printf '%-12s %-8s %s\n' "$PHASE" "$st" "($((SECONDS - START)) s of its $CAP s cap, expected $EXPECT; call at $CALL_TIME${note:-})$why"
    printf '%s\n' "${STEPS[@]}"
  } >"$STATE/$PHASE.txt"
  write_summary "this call: --phase $PHASE$( ((FINAL)) && echo ": $st (exit $([ "$st" = pass ] && echo 0 || echo 1))" || echo ': running')"
}

# A new build-tests makes the later phases' results stale: they ran on the previous build.
if [ "$PHASE" = build-tests ]; then
  rm -f "$STATE/pipeline.txt" "$STATE/compare.txt" "$STATE/offload.txt" "$STATE/compiled.txt"
fi

# --- Python, the carried packages ----------------------------------------------------------
PY="${PYTHON:-python3}"
if ! "$PY" -c 'import torch' 2>/dev/null && [ -x "$ROOT/.venv/bin/python" ]; then PY="$ROOT/.venv/bin/python"; fi
PY="$(command -v "$PY" || echo "$PY")"
# One torch import (seconds each on a loaded machine): its cmake prefix and whether it sees
# a CUDA device go to $WORK, its versions to env.txt below.
TORCH_INFO="$("$PY" - "$WORK" <<'PY' 2>&1
import sys
try:
    import torch, torch.utils
except Exception as e:  # noqa: BLE001
    print(f"torch: not importable ({e})")
    sys.exit(0)
open(f"{sys.argv[1]}/torch_prefix", "w").write(torch.utils.cmake_prefix_path)
ok = torch.cuda.is_available()
open(f"{sys.argv[1]}/cuda_ok", "w").write("1" if ok else "0")
line = f"torch {torch.__version__}, built with CUDA {torch.version.cuda}, HIP {torch.version.hip}, cuda available {ok}"
if ok:
    p = torch.cuda.get_device_properties(0)
    line += f", device 0: {p.name}, {p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs, sm_{p.major}{p.minor}"
print(line)
PY
)"
PREFIXES=("$(cat "$WORK/torch_prefix" 2>/dev/null)")
# The Debian packages carried in .gpu/debs, unpacked into .gpu/sysroot (never into /), once
# per set of packages; a failed unpack leaves no sysroot and fails the phase.
SYSROOT="$ROOT/.gpu/sysroot"
UNPACK_ERR=""
unpack_deb() {  # DEB DEST: dpkg -x, or (no dpkg) the data member of the ar archive
  if command -v dpkg >/dev/null; then
    dpkg -x "$1" "$2"
  else
    "$PY" - "$1" "$2" <<'PY'
import io, sys, tarfile
deb, dest = sys.argv[1], sys.argv[2]
with open(deb, "rb") as f:
    data = f.read()
if not data.startswith(b"!<arch>\n"):
    sys.exit(f"{deb}: not an ar archive")
pos = 8
while pos + 60 <= len(data):
    name = data[pos:pos + 16].decode().strip().rstrip("/")
    size = int(data[pos + 48:pos + 58].decode().strip())
    body = data[pos + 60:pos + 60 + size]
    if name.startswith("data.tar"):
        with tarfile.open(fileobj=io.BytesIO(body), mode="r:*") as t:
            kw = {"filter": "tar"} if hasattr(tarfile, "tar_filter") else {}
            t.extractall(dest, **kw)
        sys.exit(0)
    pos += 60 + size + (size & 1)
sys.exit(f"{deb}: no data.tar member")
PY
  fi
}
if [ "$MODE" = gpu ] && compgen -G ".gpu/debs/*.deb" >/dev/null; then
  want="$(cd .gpu/debs && ls -1 ./*.deb | LC_ALL=C sort | tr '\n' ' ')"
  if [ "$(cat "$SYSROOT/.unpacked" 2>/dev/null)" != "$want" ]; then
    rm -rf "$SYSROOT"
    mkdir -p "$SYSROOT"
    for f in .gpu/debs/*.deb; do
      if ! err=$(unpack_deb "$f" "$SYSROOT" 2>&1); then
        UNPACK_ERR="unpacking $f failed: $(echo "$err" | tail -3 | tr '\n' ' ')"
        rm -rf "$SYSROOT"
        break
      fi
    done
    [ -z "$UNPACK_ERR" ] && echo "$want" >"$SYSROOT/.unpacked"
  fi
  if [ -z "$UNPACK_ERR" ]; then
    # find_package looks in <prefix>/lib/<arch>/cmake only where CMake sets
    # CMAKE_LIBRARY_ARCHITECTURE: the multiarch cmake folders are named as prefixes of their
    # own (<prefix>/<name>*/ then matches), for this build and the bindings' alike.
    PREFIXES+=("$SYSROOT/usr")
    for d in "$SYSROOT"/usr/lib/*-linux-gnu*/cmake "$SYSROOT"/usr/lib/cmake "$SYSROOT"/usr/share/cmake; do
      [ -d "$d" ] && PREFIXES+=("$d")
    done
    for d in "$SYSROOT"/usr/lib/*-linux-gnu*; do
      [ -d "$d" ] && export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    done
  fi
fi
if [ "$MODE" = gpu ] && ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi
export PIP_NO_INDEX=1 SLUICE_OFFLINE=1  # nothing below reaches a package index
[ -d "$ROOT/.gpu/buildwhl" ] && export SLUICE_WHEELHOUSE="$ROOT/.gpu/buildwhl"

# --- env ---------------------------------------------------------------------------------
commit_line() {
  if git -C "$ROOT" rev-parse HEAD >/dev/null 2>&1; then
    echo "commit $(git -C "$ROOT" rev-parse HEAD)$( [ -n "$(git -C "$ROOT" status --porcelain --untracked-files=no)" ] && echo ' (with uncommitted changes)')"
  elif [ -n "${SLUICE_COMMIT:-}" ]; then
    echo "commit $SLUICE_COMMIT (from SLUICE_COMMIT)"
  elif [ -f .gpu/commit.txt ]; then
    echo "no .git here; .gpu/ was prepared at: $(tr '\n' ' ' <.gpu/commit.txt)"
  else
    echo "commit unknown (no .git, no SLUICE_COMMIT)"
  fi
}
# tree_id: a hash of the source tree (build folders, .gpu, .git and caches left out), so a
# later phase can tell that the build folder was built from this tree.
tree_id() {
  local rel=""
  case "$BUILD" in "$ROOT"/*) rel="./${BUILD#"$ROOT"/}" ;; esac
  find . \( -type d \( -name .git -o -name .gpu -o -name .venv -o -name .deps -o -name .whl -o -name .gl \
    -o -name __pycache__ -o -name .pytest_cache -o -path './build*' -o -path ./python/build -o -path "${rel:-./.none}" \) \) \
    -prune -o -type f -print0 | LC_ALL=C sort -z | xargs -0 sha1sum | sha1sum | cut -c1-16
}
{
  echo "device_all.sh --phase $PHASE ($MODE), $CALL_TIME, cap $CAP s, expected $EXPECT"
  commit_line
  echo "host: $(uname -srm), $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2 / 1048576}' /proc/meminfo) RAM"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv 2>&1
  else
    echo "nvidia-smi: not found"
  fi
  echo "python: $PY ($("$PY" --version 2>&1))"
  echo "$TORCH_INFO"
  # Presence and version without importing (diffusers and accelerate take seconds).
  "$PY" - <<'PY' 2>&1
import importlib.metadata as md, importlib.util
mods = []
for m, dist in [("diffusers", "diffusers"), ("numpy", "numpy"), ("safetensors", "safetensors"), ("einops", "einops"),
                ("huggingface_hub", "huggingface_hub"), ("PIL", "pillow"), ("regex", "regex"), ("requests", "requests"),
                ("filelock", "filelock"), ("accelerate", "accelerate"), ("scikit_build_core", "scikit_build_core")]:
    if importlib.util.find_spec(m) is None:
        mods.append(f"{m} MISSING")
        continue
    try:
        mods.append(f"{m} {md.version(dist)}")
    except md.PackageNotFoundError:
        mods.append(f"{m} (version unknown)")
print("python modules: " + ", ".join(mods))
PY
  echo "nvcc: $(nvcc --version 2>/dev/null | grep -E 'release' || echo 'not found')"
  echo "cmake: $(cmake --version 2>/dev/null | head -1 || echo 'not found'); ninja: $(ninja --version 2>/dev/null || echo 'not found')"
  echo "c++: $(c++ --version 2>/dev/null | head -1 || echo 'not found')"
  echo "dpkg: $(command -v dpkg || echo 'not found (the carried packages are unpacked by python)')"
  echo "carried: $(ls -d .gpu/debs .gpu/whl .gpu/buildwhl .gpu/reference 2>/dev/null | tr '\n' ' ')${UNPACK_ERR:+; $UNPACK_ERR}"
  echo "build folder: $BUILD; state: $STATE; results: $OUT"
  echo "CMAKE_PREFIX_PATH: $(IFS=';'; echo "${PREFIXES[*]}")"
} 2>&1 | tee "$OUT/env.txt"
ENV_PROBLEMS=""
[ "$MODE" = gpu ] && [ "$(cat "$WORK/cuda_ok" 2>/dev/null)" != 1 ] &&
  ENV_PROBLEMS+="torch sees no CUDA device: the GPU steps below would prove nothing; "
[ -n "$UNPACK_ERR" ] && ENV_PROBLEMS+="$UNPACK_ERR; "
if [ -n "$ENV_PROBLEMS" ]; then
  step env fail "(${ENV_PROBLEMS}env.txt)"
else
  step env pass "(env.txt)"
fi

TEST_NAMES=(device fp8 engine model_cache faults)
NEEDED=(cli/sluice bench/sluice_bench_pipeline "${TEST_NAMES[@]/#/tests/sluice_test_}")
[ "$MODE" = gpu ] && NEEDED+=(bench/gpu/sluice_bench_gpu_upcast)
PYINSTALL="${SLUICE_PYINSTALL:-$BUILD/pyinstall}"
bindings_ready() { [ -f "$PYINSTALL/sluice/__init__.py" ] && compgen -G "$PYINSTALL/sluice/_C*.so" >/dev/null; }
# Starts the bindings' build into $PYINSTALL in the background (BIND_PID), under OWN s.
# In build-tests they are a head start for compare (BIND_LATER=1): not finishing them there
# in time is "n/a" (compare builds them), a build error still fails.
BIND_PID=""
BIND_LATER=0
start_bindings() {  # OWN MIN
  if ! allot "$1" "$2"; then
    if ((BIND_LATER)); then step bindings n/a "(no time left here: --phase compare builds them)"; else no_time bindings; fi
    return 1
  fi
  BIND_T=$T
  BIND_BY_CAP=$BY_CAP
  log "building the Python bindings into $PYINSTALL (at most $T s, in the background)"
  CMAKE_PREFIX_PATH="$(IFS=':'; echo "${PREFIXES[*]}")" SLUICE_BUILD_DIR="$BUILD" SLUICE_PYTHON="$PY" \
    SLUICE_INSTALL_PREFIX="$WORK/install" run_for "$T" bash scripts/python_install.sh --target "$PYINSTALL" \
    >"$WORK/bindings.log" 2>&1 &
  BIND_PID=$!
}
wait_bindings() {  # LOG: appends the bindings' log there, records the step
  [ -n "$BIND_PID" ] || return 0
  wait "$BIND_PID"
  local rc=$?
  BIND_PID=""
  { echo "=== Python bindings (scripts/python_install.sh --target $PYINSTALL): rc $rc"; cat "$WORK/bindings.log"; } >>"$1"
  if ((BIND_LATER)) && ((rc == 124 || rc == 137)) && ((BIND_BY_CAP)); then
    step bindings n/a "(cut after $BIND_T s by the phase's cap: --phase compare builds them)"
    return 0
  fi
  T=$BIND_T BY_CAP=$BIND_BY_CAP step_rc bindings "$rc" "(into $PYINSTALL; $(grep -q 'plain CMake' "$WORK/bindings.log" && echo 'plain CMake, no scikit-build-core' || echo 'pip + scikit-build-core'))"
}

# --- the build a later phase needs -------------------------------------------------------
# build_ready: the build folder exists, holds every binary, and build-tests recorded a
# completed build there (on a GPU: of this very tree). Sets WHY otherwise.
build_ready() {
  local missing=() t
  if [ ! -d "$BUILD" ]; then
    WHY="build folder missing ($BUILD), run --phase build-tests first"
    return 1
  fi
  for t in "${NEEDED[@]}"; do [ -x "$BUILD/$t" ] || missing+=("$t"); done
  if ((${#missing[@]})); then
    WHY="build folder $BUILD incomplete (lacks ${missing[*]}), run --phase build-tests first"
    return 1
  fi
  if [ ! -f "$STATE/build.ok" ]; then
    WHY="no completed build-tests build recorded in $STATE, run --phase build-tests first"
    return 1
  fi
  if [ "$MODE" = gpu ] && [ "$(cat "$STATE/build.ok")" != "$(tree_id)" ]; then
    WHY="the build folder was built from another tree than this one, run --phase build-tests first"
    return 1
  fi
}

# --- phase build-tests -------------------------------------------------------------------
phase_build_tests() {
  rm -f "$STATE/build.ok"
  local rc
  if [ "$MODE" = cpu ]; then
    # The dry run reuses a build (ctest's own folder); it builds nothing.
    local missing=() t
    for t in "${NEEDED[@]}"; do [ -x "$BUILD/$t" ] || missing+=("$t"); done
    if ((${#missing[@]})); then
      step build fail "(dry run: $BUILD lacks ${missing[*]}; build it first, e.g. scripts/setup.sh)"
    else
      step build pass "(dry run: reused $BUILD, built nothing)"
      echo "dry run" >"$STATE/build.ok"
    fi
  else
    local targets=(sluice_cli sluice_bench_pipeline sluice_bench_gpu_upcast "${TEST_NAMES[@]/#/sluice_test_}")
    local b0=$SECONDS
    export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
    rc=0
    : >"$OUT/build.log"
    if [ ! -f "$BUILD/build.ninja" ]; then
      if allot 120 60; then
        log "configuring $BUILD"
        run_for "$T" cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
          -DCMAKE_PREFIX_PATH="$(IFS=';'; echo "${PREFIXES[*]}")" -DSLUICE_PYTHON="$PY" \
          -DSLUICE_WITH_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DSLUICE_BUILD_TESTS=ON -DSLUICE_BUILD_BENCH=ON \
          >>"$OUT/build.log" 2>&1
        rc=$?
      else
        rc=-1
      fi
    fi
    if ((rc == 0)) && allot 450 30; then
      log "building ${targets[*]} (-j $(nproc))"
      run_for "$T" cmake --build "$BUILD" -j "$(nproc)" --target "${targets[@]}" >>"$OUT/build.log" 2>&1
      rc=$?
    elif ((rc == 0)); then
      rc=-1
    fi
    if ((rc == -1)); then
      no_time build
    elif ((rc == 0)); then
      tree_id >"$STATE/build.ok"
      step build pass "($((SECONDS - b0)) s; build.log)"
    else
      tail -30 "$OUT/build.log"
      step_rc build "$rc" ""
      [ -f "$BUILD/build.ninja" ] && ((rc == 124 || rc == 137)) && ((BY_CAP)) &&
        log "the build folder is kept: --phase build-tests again continues the build"
    fi
  fi
  if [ ! -f "$STATE/build.ok" ]; then
    step tests "not run" "(the build did not complete)"
    return
  fi
  # The bindings for compare.py, built beside the tests (not during the timed phases).
  if bindings_ready; then
    step bindings pass "(already in $PYINSTALL)"
  elif [ "$MODE" = cpu ]; then
    step bindings n/a "(dry run: built nothing here; compare builds them if $PYINSTALL lacks them)"
  else
    BIND_LATER=1 start_bindings 300 60
  fi
  # The tests may take what the build left of the cap: if they are cut, the next run of
  # this phase rebuilds nothing and gives them nearly all of it.
  if ! allot 450 20; then
    no_time tests
  else
    local tests_t=$T tests_by_cap=$BY_CAP
    declare -A pids=() filters=()
    local name bin filter
    for name in "${TEST_NAMES[@]}"; do
      bin="$BUILD/tests/sluice_test_$name"
      filter=()
      if [ "$MODE" = cpu ]; then
        # Only the device-generic cases (and fp8's CUDA ones, which say they skip here).
        if [ "$name" = fp8 ]; then filter=("*CUDA*"); else filter=("[env-device]"); fi
      fi
      # One intra-op thread each: the CPU device's copy worker needs a core (offload/device/cpu_device.h).
      SLUICE_TEST_DEVICE="$DEVICE" OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive SLUICE_LOG_LEVEL=warn \
        run_for "$tests_t" "$bin" "${filter[@]}" >"$WORK/test_$name.log" 2>&1 &
      pids[$name]=$!
      filters[$name]="${filter[*]:-all cases}"
    done
    local passed=0 skipped=0 n cut=0 failed_names=()
    : >"$OUT/tests.txt"
    for name in "${TEST_NAMES[@]}"; do
      wait "${pids[$name]}"
      rc=$?
      n=$(grep -c "is not available: skipped" "$WORK/test_$name.log")
      skipped=$((skipped + n))
      { echo "=== sluice_test_$name (SLUICE_TEST_DEVICE=$DEVICE, ${filters[$name]}): rc $rc"; cat "$WORK/test_$name.log"; } >>"$OUT/tests.txt"
      if ((rc == 0)); then
        passed=$((passed + 1))
      elif ((rc == 124 || rc == 137)) && ((tests_by_cap)); then
        cut=$((cut + 1))
      else
        failed_names+=("$name(rc $rc)")
      fi
    done
    local detail="$passed/${#TEST_NAMES[@]} executables passed on $DEVICE"
    ((skipped)) && detail+=", $skipped cases skipped (device not available)"
    ((${#failed_names[@]})) && detail+="; failed: ${failed_names[*]}"
    ((cut)) && detail+="; $cut cut after $tests_t s by the phase's $CAP s cap"
    if ((${#failed_names[@]})); then
      step tests fail "($detail; tests.txt)"
    elif [ "$MODE" = gpu ] && ((skipped)); then
      step tests fail "($detail: the GPU was not tested; tests.txt)"
    elif ((cut)); then
      step tests "not run" "($detail: run this phase again; tests.txt)"
    else
      step tests pass "($detail; tests.txt)"
    fi
  fi
  BIND_LATER=1 wait_bindings "$OUT/build.log"
}

# --- phase pipeline ----------------------------------------------------------------------
phase_pipeline() {
  if ! build_ready; then
    step pipeline "not run" "(not run: $WHY)"
    return
  fi
  local bin="$BUILD/bench/gpu/sluice_bench_gpu_upcast" rc rc2
  if [ "$MODE" = cpu ]; then
    step upcast n/a "(dry run: the CUDA kernel has no CPU path; not counted)"
  elif ! allot 60 15; then
    no_time upcast
  else
    run_for "$T" "$bin" --benchmark_min_time=0.2 >"$OUT/upcast.txt" 2>&1
    rc=$?
    if ((rc == 0)) && grep -q "no CUDA device" "$OUT/upcast.txt"; then
      step upcast fail "(no CUDA device; upcast.txt)"
    else
      step_rc upcast "$rc" "(upcast.txt)"
    fi
  fi

  local budget_rows run_budget pipe_args run_args
  if [ "$MODE" = gpu ]; then
    # 8GiB: all of an 8 GB card's memory as the budget (a real one has a little less free);
    # anima-2b's ~2 GB of fp8 fit there whole. 2GiB (a quarter of it working memory at
    # 1024 px) is less than the model, so that row and the `sluice run` stream.
    budget_rows=8GiB,2GiB
    run_budget=2GiB
    pipe_args=(--device cuda --presets anima-2b --resolutions "1024,512" --reps 5 --warmup 2)
    run_args=(--device cuda --synthetic anima-2b --resolution 1024 --steps 4)
  else
    # anima-tiny is 0.2 MB of fp8 weights: 8MiB holds it whole, 200KiB keeps part streamed.
    budget_rows=8MiB,200KiB
    run_budget=200KiB
    pipe_args=(--device cpu --presets anima-tiny --resolutions 64 --reps 2 --warmup 1)
    run_args=(--device cpu --synthetic anima-tiny --resolution 64 --steps 2 --compute bfloat16)  # its 200KiB holds bf16 skips
  fi
  if ! allot 300 20; then
    no_time pipeline
    return
  fi
  local p0=$SECONDS
  OMP_WAIT_POLICY=passive run_for "$T" "$BUILD/bench/sluice_bench_pipeline" "${pipe_args[@]}" \
    --budgets "$budget_rows" --markdown 2>&1 | tee "$OUT/pipeline.txt"
  rc=${PIPESTATUS[0]}
  step_rc pipeline "$rc" "(the table: $((SECONDS - p0)) s; pipeline.txt)"
  ((rc == 0)) || return
  if ! allot 90 10; then
    no_time "sluice-run"
    return
  fi
  echo >>"$OUT/pipeline.txt"
  echo "sluice run ${run_args[*]} --vram-budget $run_budget" | tee -a "$OUT/pipeline.txt"
  OMP_WAIT_POLICY=passive SLUICE_LOG_LEVEL=warn run_for "$T" "$BUILD/cli/sluice" run "${run_args[@]}" \
    --vram-budget "$run_budget" --stats-json "$WORK/run_stats.json" 2>&1 | tee -a "$OUT/pipeline.txt"
  rc2=${PIPESTATUS[0]}
  if ((rc2 == 0)); then
    "$PY" - "$WORK/run_stats.json" <<'PY' 2>&1 | tee -a "$OUT/pipeline.txt"
import json, sys
s = json.load(open(sys.argv[1]))
f = s["forwards"]
steady = f[1:] if len(f) > 1 else f
avg = lambda k: sum(x.get(k, 0) for x in steady) / len(steady)
d = s["device"]
print(f"sluice run stats: {s['model']['name']} on {d['name']}: {len(f)} forwards, resident "
      f"{s['model']['resident_bytes'] / 1e6:.1f} of {s['model']['total_bytes'] / 1e6:.1f} MB under a budget of "
      f"{s['budget']['budget_bytes'] / 1e6:.1f} MB, device peak {d.get('peak_bytes', 0) / 1e6:.1f} MB; per forward after "
      f"the first: {avg('wall_ms'):.1f} ms, {avg('bytes_streamed') / 1e6:.1f} MB streamed at {avg('h2d_gbps'):.2f} GB/s, "
      f"stall {avg('stall_ms'):.1f} ms")
PY
  fi
  step_rc "sluice-run" "$rc2" "(under $run_budget, its stats at the end of pipeline.txt)"
}

# --- the Python side of compare and offload: diffusers and the bindings -------------------
python_side() {  # LOG: where a failed bindings build's tail goes
  # diffusers, carried as a wheel, when the python lacks it.
  if ! "$PY" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("diffusers") is None)' 2>/dev/null &&
    compgen -G ".gpu/whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$WORK/site" .gpu/whl/*.whl &&
      export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
  fi
  if bindings_ready; then
    step bindings pass "(already in $PYINSTALL)"
  elif start_bindings 300 60; then
    wait_bindings "$WORK/bindings_all.log"
    bindings_ready || tail -30 "$WORK/bindings_all.log" | tee -a "$1"
  fi
}

# --- phase compare -----------------------------------------------------------------------
phase_compare() {
  if ! build_ready; then
    step compare "not run" "(not run: $WHY)"
    return
  fi
  : >"$OUT/compare.md"
  python_side "$OUT/compare.md"
  if ! bindings_ready; then
    step compare "not run" "(the Python bindings are not in $PYINSTALL)"
    return
  fi
  local args
  if [ "$MODE" = gpu ]; then
    args=(--device cuda --preset anima-2b --resolutions "1024,512" --steps 3 --warmup 1)
  else
    args=(--device cpu --preset anima-tiny --resolutions 64 --steps 3 --warmup 1)
  fi
  [ -f .gpu/reference/anima_transformer.py ] && args+=(--reference "$ROOT/.gpu/reference/anima_transformer.py")
  if ! allot 400 40; then
    no_time compare
    return
  fi
  local c0=$SECONDS rc
  PYTHONPATH="$PYINSTALL${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    OMP_WAIT_POLICY=passive SLUICE_LOG_LEVEL=warn \
    run_for "$T" "$PY" bench/gpu/compare.py "${args[@]}" --sluice-cli "$BUILD/cli/sluice" \
    --workdir "$WORK/compare" --json "$OUT/compare.json" --check-rel-l2 0.05 2>&1 | tee -a "$OUT/compare.md"
  rc=${PIPESTATUS[0]}
  step_rc compare "$rc" "($((SECONDS - c0)) s; every contender within 5e-2 rel-L2 of sluice fully resident; compare.md, compare.json)"
}

# Whether phase NAME can run bench/offload_vs_diffusers.py: the build, the bindings and
# diffusers are there. Starts $OUT/NAME.md with the Python side's versions; otherwise records
# the step (not run, or failed when diffusers is missing) and returns 1.
offload_bench_ready() {  # NAME
  local name="$1"
  if ! build_ready; then
    step "$name" "not run" "(not run: $WHY)"
    return 1
  fi
  : >"$OUT/$name.md"
  python_side "$OUT/$name.md"
  if ! bindings_ready; then
    step "$name" "not run" "(the Python bindings are not in $PYINSTALL)"
    return 1
  fi
  if ! "$PY" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("diffusers") is None)' 2>/dev/null; then
    step "$name" fail "(diffusers is not importable and no wheel was carried: bash bench/gpu/prepare_carry.sh, carry .gpu)"
    return 1
  fi
}

# --- phase offload (optional) ------------------------------------------------------------
# bench/offload_vs_diffusers.py: sluice.offload(module) against diffusers' group offloading,
# each mode in a fresh process, on the diffusers the python has or the carried wheel (as
# compare does; the bench has its own stand-in for torchvision). Pass: the table printed
# with sluice's bf16 and fp8 rows timed (what the ctest entry checks on the CPU device).
phase_offload() {
  offload_bench_ready offload || return 0
  local args
  if [ "$MODE" = gpu ]; then
    # ~1 GB of bf16 (hidden 2048, 8 blocks), 1024 tokens: sluice's auto budget (its working
    # memory + half the model) streams about half of it. Each of the five modes builds the
    # model in its own process.
    args=(--device cuda --layers 8 --heads 16 --head-dim 128 --latent 64 --steps 10 --warmup 3 --timeout 120)
  else
    args=(--device cpu --quick --timeout 60)
  fi
  offload_bench_phase offload 280 40 "each mode's host RAM over the model it stores" "a sluice row was not timed" \
    '^\| sluice\.offload storage=bfloat16 \| [0-9.]+ \|' '^\| sluice\.offload storage=float8_e4m3fn \| [0-9.]+ \|' \
    -- "${args[@]}"
}

# bench/offload_vs_diffusers.py with ARGS, under the phase's allotment T, the bindings on
# PYTHONPATH, its output appended to $OUT/FILE; its exit code in BENCH_RC.
offload_bench() {  # FILE ARGS...
  local file="$1"
  shift
  PYTHONPATH="$PYINSTALL${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    OMP_WAIT_POLICY=passive SLUICE_LOG_LEVEL=warn \
    run_for "$T" "$PY" bench/offload_vs_diffusers.py "$@" 2>&1 | tee -a "$OUT/$file"
  BENCH_RC=${PIPESTATUS[0]}
}

# The rest of phases offload and compiled: the allotment (SECONDS, at least MIN), the bench
# with ARGS into $OUT/NAME.md, and the verdict: a pass needs exit 0 and a line matching each
# PATTERN (else fail with WHAT_MISSING); the pass line says WHAT.
offload_bench_phase() {  # NAME SECONDS MIN WHAT WHAT_MISSING PATTERN... -- ARGS...
  local name="$1" secs="$2" min="$3" what="$4" missing="$5"
  shift 5
  local patterns=()
  while [ "$1" != "--" ]; do
    patterns+=("$1")
    shift
  done
  shift
  if ! allot "$secs" "$min"; then
    no_time "$name"
    return
  fi
  local o0=$SECONDS rc p
  offload_bench "$name.md" "$@"
  rc=$BENCH_RC
  if ((rc == 0)); then
    for p in "${patterns[@]}"; do
      if ! grep -qE "$p" "$OUT/$name.md"; then
        step "$name" fail "($missing; $name.md)"
        return
      fi
    done
  fi
  step_rc "$name" "$rc" "($((SECONDS - o0)) s; $what; $name.md)"
}

# --- phase compiled (optional) -----------------------------------------------------------
# bench/offload_vs_diffusers.py --compiled: sluice's bf16 and fp8 rows, each eager and under
# torch.compile (inductor, the first call's compilation timed apart), on phase offload's model.
# Pass: each compiled row timed, and its "compiled vs eager offloaded" line printed with the
# ratio to its eager row (the timed steps compile nothing again: the bench refuses that).
phase_compiled() {
  offload_bench_ready compiled || return 0
  local args
  if [ "$MODE" = gpu ]; then
    # phase offload's model; baseline, sluice bf16 and fp8, eager and compiled.
    args=(--device cuda --layers 8 --heads 16 --head-dim 128 --latent 64 --steps 10 --warmup 3 --timeout 150
      --modes sluice-bf16,sluice-fp8 --compiled)
  else
    args=(--device cpu --quick --timeout 150 --modes sluice-fp8 --compiled)
  fi
  offload_bench_phase compiled 400 60 "compiled-and-offloaded against eager-offloaded step time" \
    "a compiled row or its ratio to the eager row is missing" \
    '^\| sluice\.offload storage=float8_e4m3fn \+ torch\.compile \| [0-9.]+ \|' \
    '^compiled vs eager offloaded: .*: [0-9.]+x;' -- "${args[@]}"
}

case "$PHASE" in
  build-tests) phase_build_tests ;;
  pipeline) phase_pipeline ;;
  compare) phase_compare ;;
  offload) phase_offload ;;
  compiled) phase_compiled ;;
esac
FINAL=1
save_block
ST=$(phase_status)
echo
cat "$OUT/summary.txt"
[ "$ST" = pass ]
