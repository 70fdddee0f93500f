#!/usr/bin/env bash
# sluice against another torch than the project's pinned one, as a frontend installs it:
# a fresh venv with that torch from PyPI, then the one command of README's "Installing into
# an environment you already have". ctest runs each step as an entry (tests/ends/), for
# torch 2.7.1 (InvokeAI's CUDA pin, the oldest supported) and 2.15.0 (the newest).
#
#   bash scripts/torch_end.sh VERSION install  # fresh venv + torch==VERSION, then
#                                               # pip install --no-build-isolation <checkout>;
#                                               # fails if that changed the venv's torch
#   bash scripts/torch_end.sh VERSION cpp      # the C++ engine and model-cache tests (plain
#                                               # and strict) and torch_compat's, built
#                                               # against that torch; then
#                                               # examples/cpp against the installed package
#   bash scripts/torch_end.sh VERSION python   # the Python suite against the installed package
#   bash scripts/torch_end.sh VERSION clean    # removes the venv and the build folder (6.5 GiB
#                                               # an end at bc6e125: torch's CUDA wheels), keeping
#                                               # the logs; ctest runs it after the end's last step,
#                                               # so that one end at a time is on disk
#
#   SLUICE_ENDS_DIR  where each version's venv and build folder go (default: build/torch-ends)
#   SLUICE_PYTHON    the python the venvs are made from (default: python3)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VERSION="${1:-}"
STEP="${2:-}"
case "$VERSION" in
  2.7.1) VISION=0.22.1 ;;
  # No torchvision for 2.15 on PyPI yet: 0.29.2 (built for 2.14, which it pins), without its
  # dependencies. It loads into 2.15 and runs (diffusers' Cosmos transformer resizes its
  # padding mask with it; its compiled ops, such as nms, work too).
  2.15.0) VISION=0.29.2 ;;
  *) echo "torch_end.sh: VERSION '$VERSION': expected 2.7.1 or 2.15.0" >&2; exit 2 ;;
esac
DIR="${SLUICE_ENDS_DIR:-$ROOT/build/torch-ends}/$VERSION"
VENV="$DIR/venv"
PY="$VENV/bin/python"
BUILD="$DIR/build"
# The venv's own build tools (PyPI's cmake, ninja) for every step, as pip used them: a
# folder configured by one CMake and reconfigured by another is rebuilt whole.
export PATH="$VENV/bin:$PATH"
log() { printf '[torch %s %s] %s\n' "$VERSION" "$STEP" "$*"; }
# Reconfigures the end's build folder; torch's CMake package warns at length (kineto,
# nvrtc's hash): the output goes to a log, shown only when the step fails.
configure() {
  cmake -Wno-dev "$BUILD" "$@" >"$DIR/configure.log" 2>&1 || { tail -n 30 "$DIR/configure.log"; exit 1; }
}
torch_of() { "$PY" -m pip list --format freeze 2>/dev/null | grep -E '^(torch|nvidia-[a-z0-9-]+)==' | sort; }

# One function, read whole before it runs: the script may be edited while a step runs.
run_step() {
  case "$STEP" in
  install)
    rm -rf "$DIR"
    mkdir -p "$DIR"
    log "fresh venv $VENV with torch==$VERSION from PyPI"
    "${SLUICE_PYTHON:-python3}" -m venv "$VENV"
    "$PY" -m pip install -q --upgrade pip
    "$PY" -m pip install -q "torch==$VERSION"
    # The build tools from PyPI; what the tests need (torchvision without dependencies: it
    # pins a torch).
    "$PY" -m pip install -q "scikit-build-core>=0.10" "cmake>=3.25" ninja pytest numpy einops safetensors \
      "diffusers==0.42.1" "accelerate==1.15.0" "transformers==5.25.0"
    "$PY" -m pip install -q --no-deps "torchvision==$VISION"
    torch_of >"$DIR/torch-before.txt"
    grep -q "^torch==$VERSION" "$DIR/torch-before.txt" || { log "the venv has no torch==$VERSION"; exit 1; }
    log "pip install --no-build-isolation $ROOT (build folder $BUILD)"
    start=$(date +%s)
    "$PY" -m pip install --no-build-isolation -C build-dir="$BUILD" "$ROOT" >"$DIR/pip-install.log" 2>&1 ||
      { tail -n 40 "$DIR/pip-install.log"; log "pip install failed (whole log: $DIR/pip-install.log)"; exit 1; }
    log "built and installed in $(($(date +%s) - start)) s"
    torch_of >"$DIR/torch-after.txt"
    if ! diff -u "$DIR/torch-before.txt" "$DIR/torch-after.txt"; then
      log "installing sluice changed the venv's torch (above)"
      exit 1
    fi
    # Imported from outside the checkout, so that it is the installed package.
    (cd "$DIR" && "$PY" -c "import sluice, torch; print('sluice', sluice.version(), 'on torch', torch.__version__, 'from', sluice.__file__)")
    ;;
  cpp)
    [ -f "$BUILD/CMakeCache.txt" ] || { log "no build in $BUILD: run the install step first"; exit 1; }
    # The same build folder pip used, now with the tests: only the libraries' users are built.
    configure -DSLUICE_BUILD_TESTS=ON -DSLUICE_BUILD_CLI=ON -DSLUICE_PYTHON="$PY" -DSLUICE_TORCH_ENDS=
    cmake --build "$BUILD" --target sluice_test_engine sluice_test_model_cache sluice_test_torch_compat
    (cd "$BUILD" && OMP_WAIT_POLICY=passive ctest --output-on-failure -j "$(nproc)" -R '^(strict )?(engine|model_cache):|^torch_compat:')
    # The C++ library alone, as a host project takes it: cmake --install, then
    # find_package(sluice) from examples/cpp against the same torch, built and run.
    log "examples/cpp against the installed package (find_package(sluice))"
    SLUICE_BUILD_DIR="$BUILD" SLUICE_PYTHON="$PY" SLUICE_LOG_LEVEL=warn bash "$ROOT/scripts/build_example.sh" |
      grep "residency blocks: "
    ;;
  python)
    [ -x "$PY" ] || { log "no venv in $VENV: run the install step first"; exit 1; }
    CLI="$BUILD/cli/sluice"
    if [ ! -x "$CLI" ]; then  # test_bindings.py makes its checkpoints with the sluice command
      configure -DSLUICE_BUILD_CLI=ON
      cmake --build "$BUILD" --target sluice_cli >/dev/null
    fi
    cd "$DIR"  # not the checkout: `import sluice` must find the installed package
    files=(test_bindings.py test_offload.py test_offload_pipeline.py test_offload_guarantees.py)
    # PyTorch's conventions and torch.compile over an offloaded module, on each end.
    files+=(test_python_conventions.py test_offload_compile.py)
    paths=()
    for f in "${files[@]}"; do paths+=("$ROOT/tests/python/$f"); done
    export PYTHONPATH="$ROOT/tests/python" SLUICE_CLI="$CLI" SLUICE_LOG_LEVEL=warn PYTHONDONTWRITEBYTECODE=1 \
      OMP_NUM_THREADS=1
    log "the CPU device"
    "$PY" -m pytest -q -p no:cacheprovider "${paths[@]}"
    log "the strict CPU device"
    SLUICE_STRICT_DEVICE=1 "$PY" -m pytest -q -p no:cacheprovider "${paths[@]}"
    ;;
  clean)
    log "removing $VENV and $BUILD ($(du -sh "$DIR" 2>/dev/null | cut -f1) in $DIR)"
    rm -rf "$VENV" "$BUILD"
    for d in "$VENV" "$BUILD"; do
      [ ! -e "$d" ] || { log "$d is still there after rm -rf"; exit 1; }
    done
    ;;
  *)
    echo "torch_end.sh: STEP '$STEP': expected install, cpp, python or clean" >&2
    exit 2
    ;;
  esac
}
run_step; exit $?
