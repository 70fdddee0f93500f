#!/usr/bin/env bash
# bench/gpu/run.sh: builds sluice on a GPU machine, runs the GPU tests and prints the GPU
# numbers of docs/BENCHMARKS.md, within 8 minutes (building included):
#  - H2D bandwidth from pinned and from pageable memory, and D2D bandwidth;
#  - for anima-2b at 1024^2 and 512^2 (random weights): the step time of one guided
#    sampling step (a batch of 2) for bf16 fully resident, fp8 fully resident and
#    --max-resident 0.75/0.5/0.25/0, each with bytes streamed, achieved H2D GB/s, stall
#    ms, the floor max(compute, bytes / pinned H2D bandwidth) and the ratio to it
#    (sluice_bench_pipeline, see bench/bench_pipeline.cpp);
#  - one `sluice run` of the embedded default (anima-2b at a 50% budget), with its stats.
# It also runs end to end on the CPU device (`--device cpu`, small preset), which is how
# it is checked on machines without a GPU.
#
#   bash bench/gpu/run.sh [--device cuda|cuda:N|cpu] [--preset NAME] [--resolutions PX,PX]
#                         [--reps N] [--skip-tests]
#
# Environment:
#   SLUICE_DEPS_PREFIX  colon-separated install prefixes to add to CMAKE_PREFIX_PATH (and
#                       their lib folders to LD_LIBRARY_PATH): where the Debian -dev
#                       packages sluice builds against were unpacked on a machine that
#                       lacks them, e.g. "$PWD/.gl/deb/usr". Needed there: libspdlog-dev,
#                       libspdlog1.10, libfmt-dev, libfmt9, libmimalloc-dev, libmimalloc2.0,
#                       nlohmann-json3-dev, libcli11-dev, catch2, libbenchmark-dev,
#                       libbenchmark1debian (unpack each with `dpkg -x PKG.deb DIR`).
#   PYTHON              python whose torch provides libtorch (default: python3, or the
#                       project's .venv when python3 has no torch)
#   SLUICE_BUILD_DIR    build folder (default: build-gpu; an existing configured folder,
#                       e.g. build, is reused as it is)
#   TORCH_CUDA_ARCH_LIST  CUDA architectures to compile (default 9.0: Hopper, the H200)
#   SLUICE_GPU_BUDGET_S   total seconds allowed (default 480); later phases get what is left
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
START=$SECONDS
BUDGET="${SLUICE_GPU_BUDGET_S:-480}"

DEVICE=cuda
PRESET=""
RESOLUTIONS=""
REPS=""
SKIP_TESTS=0
while (($#)); do
  case "$1" in
    --device) DEVICE="$2"; shift 2 ;;
    --preset) PRESET="$2"; shift 2 ;;
    --resolutions) RESOLUTIONS="$2"; shift 2 ;;
    --reps) REPS="$2"; shift 2 ;;
    --skip-tests) SKIP_TESTS=1; shift ;;
    -h|--help) sed -n '2,30p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) echo "bench/gpu/run.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
case "$DEVICE" in
  cpu) CUDA=0; : "${PRESET:=anima-small}"; : "${RESOLUTIONS:=256}"; : "${REPS:=3}" ;;
  cuda|cuda:[0-9]*) CUDA=1; : "${PRESET:=anima-2b}"; : "${RESOLUTIONS:=1024,512}"; : "${REPS:=5}" ;;
  *) echo "bench/gpu/run.sh: --device must be cpu, cuda or cuda:N, got '$DEVICE'" >&2; exit 2 ;;
esac

log() { printf '[gpu-bench %4ds] %s\n' "$((SECONDS - START))" "$*"; }
left() { echo $((BUDGET - (SECONDS - START))); }
# Runs "$@" with whatever is left of the budget (at least 10 s) as its time limit.
timed() {
  local t; t=$(left)
  ((t < 10)) && t=10
  timeout --signal=TERM --kill-after=10 "$t" "$@"
}

# --- Tools and dependencies --------------------------------------------------------
PY="${PYTHON:-python3}"
if ! "$PY" -c 'import torch' 2>/dev/null && [ -x "$ROOT/.venv/bin/python" ]; then PY="$ROOT/.venv/bin/python"; fi
TORCH_PREFIX="$("$PY" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')"
PREFIXES="$TORCH_PREFIX"
if [ -n "${SLUICE_DEPS_PREFIX:-}" ]; then
  IFS=':' read -ra deps <<<"$SLUICE_DEPS_PREFIX"
  for d in "${deps[@]}"; do
    [ -z "$d" ] && continue
    PREFIXES="$PREFIXES;$d"
    for lib in "$d/lib/x86_64-linux-gnu" "$d/lib"; do
      [ -d "$lib" ] && export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    done
  done
fi
log "python $PY, torch $("$PY" -c 'import torch; print(torch.__version__)'), device $DEVICE, $(nproc) cores"
if ((CUDA)); then
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
fi

# --- Build ---------------------------------------------------------------------------
BUILD="${SLUICE_BUILD_DIR:-build-gpu}"
if [ ! -f "$BUILD/build.ninja" ]; then
  log "configuring $BUILD"
  mkdir -p "$BUILD"
  cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$PREFIXES" \
    -DSLUICE_PYTHON="$PY" -DSLUICE_BUILD_TESTS=ON -DSLUICE_BUILD_BENCH=ON \
    -DSLUICE_WITH_CUDA="$( ((CUDA)) && echo AUTO || echo OFF)" ${SLUICE_CMAKE_ARGS:-} >"$BUILD/gpu-bench.configure.log" 2>&1 ||
    { tail -40 "$BUILD/gpu-bench.configure.log"; exit 1; }
  grep -E "sluice: torch" "$BUILD/gpu-bench.configure.log" || true
fi
TESTS=(sluice_test_device sluice_test_fp8 sluice_test_dtype_policy sluice_test_engine)
TARGETS=(sluice_cli sluice_bench_pipeline)
((SKIP_TESTS)) || TARGETS+=("${TESTS[@]}")
log "building ${TARGETS[*]}"
timed cmake --build "$BUILD" -j "$(nproc)" --target "${TARGETS[@]}" >"$BUILD/gpu-bench.build.log" 2>&1 ||
  { tail -40 "$BUILD/gpu-bench.build.log"; log "build failed"; exit 1; }
log "built"

# --- Tests ---------------------------------------------------------------------------
FAILED=0
if ((! SKIP_TESTS)); then
  for t in "${TESTS[@]}"; do
    bin="$BUILD/tests/$t"
    # One intra-op thread: the CPU device's copy worker needs a core (offload/cpu_device.h).
    if OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive SLUICE_LOG_LEVEL=warn timed "$bin" >"$BUILD/gpu-bench.$t.log" 2>&1; then
      log "$t: $(tail -3 "$BUILD/gpu-bench.$t.log" | grep -E 'passed|assertions' | head -1)"
    else
      FAILED=1
      log "$t FAILED:"
      tail -30 "$BUILD/gpu-bench.$t.log"
    fi
  done
fi

# --- Pipeline table ------------------------------------------------------------------
log "sluice_bench_pipeline --device $DEVICE --presets $PRESET --resolutions $RESOLUTIONS"
timed "$BUILD/bench/sluice_bench_pipeline" --device "$DEVICE" --presets "$PRESET" --resolutions "$RESOLUTIONS" \
  --reps "$REPS" --markdown || { log "sluice_bench_pipeline failed"; FAILED=1; }

# --- The main job ------------------------------------------------------------------
STATS="$(mktemp)"
trap 'rm -f "$STATS"' EXIT
if ((CUDA)); then
  RUN_ARGS=(--device "$DEVICE")  # the embedded default on a GPU: anima-2b at a 50% budget
else
  RUN_ARGS=(--device cpu --synthetic "$PRESET" --steps 2 --resolution 128 --max-resident 0.5)
fi
log "sluice run ${RUN_ARGS[*]}"
if timed "$BUILD/cli/sluice" run "${RUN_ARGS[@]}" --stats-json "$STATS"; then
  "$PY" - "$STATS" <<'PY' || FAILED=1
import json, sys
s = json.load(open(sys.argv[1]))
f = s["forwards"]
steady = f[1:] if len(f) > 1 else f
avg = lambda k: sum(x[k] for x in steady) / len(steady)
print(f"sluice run: {s['model']['name']} on {s['device']['name']}: {len(f)} forwards, "
      f"resident {s['model']['resident_bytes'] / 1e6:.1f} of {s['model']['total_bytes'] / 1e6:.1f} MB, "
      f"device peak {s['device']['peak_bytes'] / 1e6:.1f} MB of budget {s['budget']['budget_bytes'] / 1e6:.1f} MB; "
      f"per forward: {avg('wall_ms'):.1f} ms, {avg('bytes_streamed') / 1e6:.1f} MB streamed at "
      f"{avg('h2d_gbps'):.2f} GB/s, stall {avg('stall_ms'):.1f} ms, upcast {avg('upcast_ms'):.1f} ms")
PY
else
  log "sluice run failed"
  FAILED=1
fi

log "done in $((SECONDS - START)) s (budget $BUDGET s)$( ((FAILED)) && echo ', WITH FAILURES')"
exit "$FAILED"
