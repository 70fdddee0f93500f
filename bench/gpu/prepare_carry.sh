#!/usr/bin/env bash
# Fills .gpu/ (git-ignored) with what bench/gpu/device_all.sh needs on a GPU machine that
# cannot reach a package registry and has none of sluice's Debian packages:
#   .gpu/debs/       every Debian package the build's find_package calls need (the -dev
#                    packages and their shared libraries: spdlog, fmt, nlohmann-json, CLI11,
#                    mimalloc, Catch2, Google Benchmark), fetched with `apt-get download`;
#                    device_all.sh unpacks them there with `dpkg -x` into .gpu/sysroot, never /;
#   .gpu/whl/        the diffusers wheel (pure Python), which the GPU machine's image lacks;
#                    device_all.sh installs it there only when it does not import;
#   .gpu/buildwhl/   scikit-build-core and what it imports (packaging, pathspec), pure Python:
#                    the Python bindings' build backend, for a python without it.
#                    scripts/python_install.sh installs them from there with --no-index into
#                    a temporary folder (SLUICE_WHEELHOUSE); nothing is fetched there;
#   .gpu/reference/  InvokeAI's reference Anima DiT (scripts/fetch_reference.sh), for
#                    compare.py's InvokeAI-style contender;
#   .gpu/commit.txt  the commit (and whether the tree was dirty) the folder was made at.
# Run here, once per change of the lists below; it prints the folder's size and fails over
# 20 MB. Then carry ".gpu" (docs/BENCHMARKS.md has the command).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
OUT=.gpu
PY="${SLUICE_PYTHON:-$ROOT/.venv/bin/python}"
LIMIT_MB=20

# The packages behind cmake/SluiceDependencies.cmake's find_package calls (Torch aside,
# which the GPU machine's python provides), with the runtime libraries the -dev ones link.
DEBS=(libspdlog-dev libspdlog1.10 libfmt-dev libfmt9 nlohmann-json3-dev libcli11-dev
      libmimalloc-dev libmimalloc2.0 catch2 libbenchmark-dev libbenchmark1debian)
# diffusers is pinned (bench/gpu/anima_diffusers.py maps keys onto this version). What it
# and compare.py import beside it (numpy, safetensors, einops, huggingface_hub, Pillow,
# regex, requests, filelock) is in the GPU machine's image; device_all.sh checks and
# names anything missing in env.txt. (importlib_metadata, also listed by diffusers, is
# imported only on Python < 3.8.)
WHEELS=("diffusers==0.42.1")
# The bindings' build backend (pyproject.toml) and its needs on Python >= 3.11, at
# the versions the project venv builds with.
BUILD_WHEELS=("scikit-build-core==1.1.2" "packaging==26.4" "pathspec==1.1.1")

rm -rf "$OUT/debs" "$OUT/whl" "$OUT/buildwhl" "$OUT/sysroot"
mkdir -p "$OUT/whl" "$OUT/buildwhl" "$OUT/debs" "$OUT/reference"
(cd "$OUT/debs" && apt-get download -q "${DEBS[@]}" >/dev/null)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d "$OUT/whl" "${WHEELS[@]}"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d "$OUT/buildwhl" "${BUILD_WHEELS[@]}"
VENV="$ROOT/.venv" bash scripts/fetch_reference.sh
cp .deps/reference/invokeai_anima/anima_transformer.py "$OUT/reference/"
{
  echo "commit $(git rev-parse HEAD 2>/dev/null || echo unknown)"
  if [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]; then echo "tree dirty (uncommitted changes)"; else echo "tree clean"; fi
  echo "prepared $(date -u +%Y-%m-%dT%H:%M:%SZ)"
} >"$OUT/commit.txt"

ls -1 "$OUT/debs" "$OUT/whl" "$OUT/buildwhl"
kb=$(du -sk "$OUT" | cut -f1)
echo "prepare_carry: $OUT is $((kb / 1024)).$(((kb % 1024) * 10 / 1024)) MB ($kb KiB; limit $LIMIT_MB MB)"
if ((kb > LIMIT_MB * 1024)); then
  echo "prepare_carry: $OUT is over $LIMIT_MB MB" >&2
  exit 1
fi
