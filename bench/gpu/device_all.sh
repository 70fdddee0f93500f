#!/usr/bin/env bash
# bench/gpu/device_all.sh: the one-shot GPU proof (issue 10 §6). One command on a bare GPU
# machine (an H200 with CUDA torch, cmake, ninja and nvcc, but none of sluice's Debian
# packages and no network), within an internal time budget of 8 minutes:
#   env       the environment it found (nvidia-smi, torch, CUDA, nvcc, cmake, cores, the
#             Python modules compare.py needs), first, to stdout and $OUT/env.txt;
#   build     configures its own build folder (Release, SLUICE_WITH_CUDA=ON, Hopper only:
#             CMAKE_CUDA_ARCHITECTURES=90) against the python's torch and the Debian
#             packages carried in .gpu/ (bench/gpu/prepare_carry.sh), and builds only the
#             targets below;                                               -> build.log
#   tests     the device, fp8 (the CUDA kernel's bit-exactness), engine, model cache and
#             fault tests, in parallel, with SLUICE_TEST_DEVICE=cuda so their [env-device]
#             cases (tests/device_env.h) run on the GPU;                   -> tests.txt
#   upcast    the fused fp8 -> bf16 upcast kernel against a device-to-device copy of the
#             same bytes (bench/gpu/upcast_cuda_bench.cpp);                -> upcast.txt
#   pipeline  the anima-2b table at 1024^2 and 512^2 (bench/bench_pipeline.cpp: bf16 and
#             fp8 resident, --max-resident 0.75/0.5/0.25/0, the byte budget of an 8 GB
#             card and one of 2 GiB, less than the model), then one `sluice run` under
#             the 2 GiB budget with its stats;                            -> pipeline.txt
#   compare   bench/gpu/compare.py side by side against diffusers' group offloading and an
#             InvokeAI-style partial load (builds the Python bindings first);
#                                                              -> compare.md, compare.json
# Each phase writes its file to $OUT the moment it ends and rewrites $OUT/summary.txt
# (pass/fail/skip per phase), so a run cut short still returns what it did. Each phase has
# its own time limit, capped by what is left of the budget; a phase with too little left is
# skipped with a note. $OUT gets at most those 8 files (the device tool returns no more).
#
#   bash bench/gpu/prepare_carry.sh                  # here, once: fills .gpu/ (< 20 MB)
#   bash bench/gpu/device_all.sh                     # there, with .gpu carried
#   bash bench/gpu/device_all.sh --dry-run-cpu       # here: the same phases on the CPU device
#
# --dry-run-cpu runs every phase on the CPU-as-device backend with small presets
# (anima-tiny, 64 px), in one to two minutes on 2 cores, reusing an already built build folder
# (it configures and builds nothing); ctest runs it ("bench: device_all.sh --dry-run-cpu").
#
# Options and environment:
#   --dry-run-cpu        see above
#   --build-dir DIR      build folder (env SLUICE_BUILD_DIR; default: build-device-all on a
#                        GPU, build with --dry-run-cpu)
#   --budget-s N         total seconds (env SLUICE_DEVICE_ALL_BUDGET_S; default 480, 300
#                        with --dry-run-cpu)
#   --phases LIST        run only these of tests,upcast,pipeline,compare (env and build always)
#   OUT                  results folder (default: a new temporary folder, printed)
#   PYTHON               python with torch (default: python3, or .venv's when python3 has none)
#   SLUICE_PYINSTALL     a folder where the Python bindings are already installed
#                        (pip --target); default: build them (dry run: <build>/pyinstall when
#                        it holds them, as ctest's "python: pip install ./python" leaves it)
#   SLUICE_COMMIT        the commit to report when the tree has no .git (env.txt)
set -uo pipefail  # no -e: a failing phase is recorded and the next one still runs
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT" || exit 1
START=$SECONDS

MODE=gpu
BUILD="${SLUICE_BUILD_DIR:-}"
BUDGET="${SLUICE_DEVICE_ALL_BUDGET_S:-}"
PHASES="tests,upcast,pipeline,compare"
while (($#)); do
  case "$1" in
    --dry-run-cpu) MODE=cpu; shift ;;
    --build-dir) BUILD="$2"; shift 2 ;;
    --budget-s) BUDGET="$2"; shift 2 ;;
    --phases) PHASES="$2"; shift 2 ;;
    -h|--help) sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d'; exit 0 ;;
    *) echo "device_all.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
if [ "$MODE" = gpu ]; then
  : "${BUILD:=$ROOT/build-device-all}" "${BUDGET:=480}"
  DEVICE=cuda
else
  : "${BUILD:=$ROOT/build}" "${BUDGET:=300}"
  DEVICE=cpu
fi
case "$BUILD" in /*) ;; *) BUILD="$ROOT/$BUILD" ;; esac
OUT="${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/device_all.XXXXXX")}"
mkdir -p "$OUT"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/device_all_work.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

log() { printf '[device_all %4ds] %s\n' "$((SECONDS - START))" "$*"; }
left() { echo $((BUDGET - (SECONDS - START))); }
# allot CAP MIN: the seconds a phase may run (CAP, or what is left if less); fails when
# fewer than MIN are left.
allot() {
  local t; t=$(left)
  ((t > $1)) && t=$1
  ((t >= $2)) || return 1
  echo "$t"
}
run_for() { local t=$1; shift; timeout --signal=TERM --kill-after=10 "$t" "$@"; }
wants() { [[ ",$PHASES," == *",$1,"* ]]; }

SUMMARY=()
FAILED=0
record() {  # PHASE STATUS DETAIL
  SUMMARY+=("$(printf '%-9s %-5s %s' "$1" "$2" "$3")")
  [ "$2" = fail ] && FAILED=1
  {
    echo "device_all.sh ($MODE, device $DEVICE), $((SECONDS - START)) s of a $BUDGET s budget so far"
    printf '%s\n' "${SUMMARY[@]}"
  } >"$OUT/summary.txt"
  log "$1: $2 $3"
}
# A phase with no time left: a note; in a dry run a failure, so that the check cannot pass
# by doing nothing.
out_of_time() {
  if [ "$MODE" = cpu ]; then record "$1" fail "(out of time: $(left) s left)"; else record "$1" skip "(out of time: $(left) s left)"; fi
}

# --- Python, dependencies --------------------------------------------------------------
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
# The Debian packages carried in .gpu/debs, unpacked once into .gpu/sysroot (never into /).
if [ "$MODE" = gpu ] && [ -d .gpu/debs ]; then
  if [ ! -f .gpu/sysroot/.unpacked ]; then
    mkdir -p .gpu/sysroot
    for f in .gpu/debs/*.deb; do dpkg -x "$f" .gpu/sysroot; done
    touch .gpu/sysroot/.unpacked
  fi
  PREFIXES+=("$ROOT/.gpu/sysroot/usr")
  export LD_LIBRARY_PATH="$ROOT/.gpu/sysroot/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
# diffusers, carried as a wheel, when the python lacks it.
if ! "$PY" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("diffusers") is None)' 2>/dev/null && compgen -G ".gpu/whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$WORK/site" .gpu/whl/*.whl &&
    export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
fi
if [ "$MODE" = gpu ] && ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi

# --- env -------------------------------------------------------------------------------
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
{
  echo "device_all.sh --$MODE, $(date -u +%Y-%m-%dT%H:%M:%SZ), budget $BUDGET s"
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
  echo "build folder: $BUILD; results: $OUT"
  echo "CMAKE_PREFIX_PATH: $(IFS=';'; echo "${PREFIXES[*]}")"
} 2>&1 | tee "$OUT/env.txt"
if [ "$MODE" = gpu ] && [ "$(cat "$WORK/cuda_ok" 2>/dev/null)" != 1 ]; then
  record env fail "(torch sees no CUDA device: every GPU phase below is meaningless)"
else
  record env pass "(env.txt)"
fi

# --- build -----------------------------------------------------------------------------
TEST_NAMES=(device fp8 engine model_cache faults)
TARGETS=(sluice_cli sluice_bench_pipeline)
for t in "${TEST_NAMES[@]}"; do TARGETS+=("sluice_test_$t"); done
[ "$MODE" = gpu ] && TARGETS+=(sluice_bench_gpu_upcast)
if [ "$MODE" = cpu ]; then
  # The dry run reuses a build (ctest's own folder); it builds nothing.
  missing=()
  for t in cli/sluice bench/sluice_bench_pipeline "${TEST_NAMES[@]/#/tests/sluice_test_}"; do
    [ -x "$BUILD/$t" ] || missing+=("$t")
  done
  if ((${#missing[@]})); then
    record build fail "(dry run: $BUILD lacks ${missing[*]}; build it first, e.g. scripts/setup.sh)"
  else
    record build skip "(dry run: reused $BUILD)"
  fi
elif ! t=$(allot 330 60); then
  out_of_time build
else
  export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
  b0=$SECONDS
  if [ ! -f "$BUILD/build.ninja" ]; then
    log "configuring $BUILD"
    run_for "$t" cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_PREFIX_PATH="$(IFS=';'; echo "${PREFIXES[*]}")" -DSLUICE_PYTHON="$PY" \
      -DSLUICE_WITH_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DSLUICE_BUILD_TESTS=ON -DSLUICE_BUILD_BENCH=ON \
      >"$OUT/build.log" 2>&1
    rc=$?
  else
    rc=0
  fi
  if ((rc == 0)) && t=$(allot 330 30); then
    log "building ${TARGETS[*]} (-j $(nproc))"
    run_for "$t" cmake --build "$BUILD" -j "$(nproc)" --target "${TARGETS[@]}" >>"$OUT/build.log" 2>&1
    rc=$?
  fi
  if ((rc == 0)); then
    record build pass "($((SECONDS - b0)) s; build.log)"
  else
    tail -30 "$OUT/build.log"
    record build fail "(rc $rc after $((SECONDS - b0)) s$( ((rc == 124)) && echo ', timed out'); build.log)"
  fi
fi

# --- the Python bindings compare.py imports: built in the background during the tests ---
# (not during the timed phases), so the compare phase need not wait for them.
PYINSTALL="${SLUICE_PYINSTALL:-}"
[ -z "$PYINSTALL" ] && [ "$MODE" = cpu ] && PYINSTALL="$BUILD/pyinstall"
BIND_PID=""
BIND_RC=0
if wants compare && [ -x "$BUILD/cli/sluice" ] && ! { [ -n "$PYINSTALL" ] && [ -f "$PYINSTALL/sluice/__init__.py" ]; } &&
  t=$(allot 300 40); then
  PYINSTALL="$WORK/pyinstall"
  log "building the Python bindings into $PYINSTALL (in the background)"
  CMAKE_PREFIX_PATH="$(IFS=':'; echo "${PREFIXES[*]}")" SLUICE_BUILD_DIR="$BUILD" SLUICE_PYTHON="$PY" \
    SLUICE_INSTALL_PREFIX="$WORK/install" run_for "$t" bash scripts/python_install.sh --target "$PYINSTALL" \
    >"$WORK/pyinstall.log" 2>&1 &
  BIND_PID=$!
fi
wait_bindings() {
  if [ -n "$BIND_PID" ]; then
    wait "$BIND_PID"
    BIND_RC=$?
    BIND_PID=""
    log "Python bindings: rc $BIND_RC"
  fi
}

# --- tests -----------------------------------------------------------------------------
if wants tests; then
  if ! t=$(allot 150 20); then
    out_of_time tests
  else
    declare -A pids=() filters=()
    for name in "${TEST_NAMES[@]}"; do
      bin="$BUILD/tests/sluice_test_$name"
      [ -x "$bin" ] || continue
      filter=()
      if [ "$MODE" = cpu ]; then
        # Only the device-generic cases (and fp8's CUDA ones, which say they skip here).
        if [ "$name" = fp8 ]; then filter=("*CUDA*"); else filter=("[env-device]"); fi
      fi
      # One intra-op thread each: the CPU device's copy worker needs a core (offload/cpu_device.h).
      SLUICE_TEST_DEVICE="$DEVICE" OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive SLUICE_LOG_LEVEL=warn \
        run_for "$t" "$bin" "${filter[@]}" >"$WORK/test_$name.log" 2>&1 &
      pids[$name]=$!
      filters[$name]="${filter[*]:-all cases}"
    done
    passed=0
    skipped=0
    failed_names=()
    : >"$OUT/tests.txt"
    for name in "${TEST_NAMES[@]}"; do
      if [ -z "${pids[$name]:-}" ]; then
        failed_names+=("$name(not built)")
        echo "=== sluice_test_$name: not built" >>"$OUT/tests.txt"
        continue
      fi
      wait "${pids[$name]}"
      rc=$?
      n=$(grep -c "is not available: skipped" "$WORK/test_$name.log")
      skipped=$((skipped + n))
      { echo "=== sluice_test_$name (SLUICE_TEST_DEVICE=$DEVICE, ${filters[$name]}): rc $rc"; cat "$WORK/test_$name.log"; } >>"$OUT/tests.txt"
      if ((rc == 0)); then passed=$((passed + 1)); else failed_names+=("$name(rc $rc)"); fi
    done
    detail="$passed/${#TEST_NAMES[@]} executables passed on $DEVICE"
    ((skipped)) && detail+=", $skipped cases skipped (device not available)"
    ((${#failed_names[@]})) && detail+="; failed: ${failed_names[*]}"
    if ((${#failed_names[@]})); then
      record tests fail "($detail; tests.txt)"
    elif [ "$MODE" = gpu ] && ((skipped)); then
      record tests fail "($detail: the GPU was not tested; tests.txt)"
    else
      record tests pass "($detail; tests.txt)"
    fi
  fi
fi

wait_bindings  # the timed phases below run alone

# --- upcast ----------------------------------------------------------------------------
if wants upcast; then
  bin="$BUILD/bench/gpu/sluice_bench_gpu_upcast"
  if [ ! -x "$bin" ]; then
    if [ "$MODE" = cpu ]; then record upcast skip "(not built: this build has no CUDA sources)"; else record upcast fail "(not built)"; fi
  elif ! t=$(allot 60 15); then
    out_of_time upcast
  else
    run_for "$t" "$bin" --benchmark_min_time=0.2 >"$OUT/upcast.txt" 2>&1
    rc=$?
    if ((rc != 0)); then
      record upcast fail "(rc $rc; upcast.txt)"
    elif grep -q "no CUDA device" "$OUT/upcast.txt"; then
      if [ "$MODE" = cpu ]; then record upcast skip "(no CUDA device here; upcast.txt)"; else record upcast fail "(no CUDA device; upcast.txt)"; fi
    else
      record upcast pass "(upcast.txt)"
    fi
  fi
fi

# --- pipeline --------------------------------------------------------------------------
if wants pipeline; then
  if [ "$MODE" = gpu ]; then
    # 8GiB: all of an 8 GB card's memory as the budget (a real one has a little less free);
    # anima-2b's ~2 GB of fp8 fit there whole. 2GiB (a quarter of it working memory at
    # 1024 px) is less than the model, so that row and the `sluice run` stream.
    BUDGET_ROWS=8GiB,2GiB
    RUN_BUDGET=2GiB
    PIPE_ARGS=(--device cuda --presets anima-2b --resolutions "1024,512" --reps 5 --warmup 2)
    RUN_ARGS=(--device cuda --synthetic anima-2b --resolution 1024 --steps 4)
  else
    # anima-tiny is 0.2 MB of fp8 weights: 8MiB holds it whole, 200KiB keeps part streamed.
    BUDGET_ROWS=8MiB,200KiB
    RUN_BUDGET=200KiB
    PIPE_ARGS=(--device cpu --presets anima-tiny --resolutions 64 --reps 2 --warmup 1)
    RUN_ARGS=(--device cpu --synthetic anima-tiny --resolution 64 --steps 2)
  fi
  bench="$BUILD/bench/sluice_bench_pipeline"
  if [ ! -x "$bench" ] || [ ! -x "$BUILD/cli/sluice" ]; then
    record pipeline fail "(sluice_bench_pipeline or sluice not built)"
  elif ! t=$(allot 200 20); then
    out_of_time pipeline
  else
    p0=$SECONDS
    OMP_WAIT_POLICY=passive run_for "$t" "$bench" "${PIPE_ARGS[@]}" --budgets "$BUDGET_ROWS" --markdown \
      2>&1 | tee "$OUT/pipeline.txt"
    rc=${PIPESTATUS[0]}
    rc2=1
    if ((rc == 0)) && t=$(allot $((200 - (SECONDS - p0))) 10); then
      echo >>"$OUT/pipeline.txt"
      echo "sluice run ${RUN_ARGS[*]} --vram-budget $RUN_BUDGET" | tee -a "$OUT/pipeline.txt"
      OMP_WAIT_POLICY=passive SLUICE_LOG_LEVEL=warn run_for "$t" "$BUILD/cli/sluice" run "${RUN_ARGS[@]}" \
        --vram-budget "$RUN_BUDGET" --stats-json "$WORK/run_stats.json" 2>&1 | tee -a "$OUT/pipeline.txt"
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
    fi
    if ((rc != 0)); then
      record pipeline fail "(sluice_bench_pipeline rc $rc; pipeline.txt)"
    elif ((rc2 != 0)); then
      record pipeline fail "(the table ran; sluice run rc $rc2; pipeline.txt)"
    else
      record pipeline pass "($((SECONDS - p0)) s; pipeline.txt)"
    fi
  fi
fi

# --- compare ---------------------------------------------------------------------------
if wants compare; then
  if [ "$MODE" = gpu ]; then
    CMP_ARGS=(--device cuda --preset anima-2b --resolutions "1024,512" --steps 3 --warmup 1)
  else
    CMP_ARGS=(--device cpu --preset anima-tiny --resolutions 64 --steps 3 --warmup 1)
  fi
  [ -f .gpu/reference/anima_transformer.py ] && CMP_ARGS+=(--reference "$ROOT/.gpu/reference/anima_transformer.py")
  wait_bindings
  if [ ! -x "$BUILD/cli/sluice" ]; then
    record compare fail "(sluice not built)"
  elif ! t=$(allot 270 40); then
    out_of_time compare
  else
    c0=$SECONDS
    rc=$BIND_RC
    ((rc == 0)) || { tail -30 "$WORK/pyinstall.log" | tee "$OUT/compare.md"; }
    if ((rc != 0)); then
      record compare fail "(building the Python bindings failed, rc $rc; compare.md)"
    elif ! t=$(allot $((270 - (SECONDS - c0))) 20); then
      out_of_time compare
    else
      PYTHONPATH="$PYINSTALL${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
        OMP_WAIT_POLICY=passive SLUICE_LOG_LEVEL=warn \
        run_for "$t" "$PY" bench/gpu/compare.py "${CMP_ARGS[@]}" --sluice-cli "$BUILD/cli/sluice" \
        --workdir "$WORK/compare" --json "$OUT/compare.json" --check-rel-l2 0.05 2>&1 | tee "$OUT/compare.md"
      rc=${PIPESTATUS[0]}
      if ((rc == 0)); then
        record compare pass "($((SECONDS - c0)) s; every contender within 5e-2 rel-L2 of sluice fully resident; compare.md, compare.json)"
      else
        record compare fail "(rc $rc$( ((rc == 124)) && echo ', timed out'); compare.md)"
      fi
    fi
  fi
fi

record total "$( ((FAILED)) && echo fail || echo pass)" "($((SECONDS - START)) s of $BUDGET s; results in $OUT)"
cat "$OUT/summary.txt"
exit "$FAILED"
