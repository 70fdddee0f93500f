#!/usr/bin/env bash
# Fills .gpu/ (git-ignored) with what bench/gpu/compare.sh needs on a GPU machine that cannot
# reach a registry: the diffusers wheel (pure Python; its dependencies, accelerate included,
# are in that machine's image), the Debian packages sluice builds against (header-only ones
# plus spdlog/fmt/mimalloc and their shared libraries, unpacked there into .gpu/sysroot, not
# into /), and InvokeAI's reference Anima DiT (scripts/fetch_reference.sh). About 10 MB.
# Run here, once; then carry ".gpu" (docs/BENCHMARKS.md has the device-tool command).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
OUT=.gpu
PY="${SLUICE_PYTHON:-$ROOT/.venv/bin/python}"
mkdir -p "$OUT/whl" "$OUT/debs" "$OUT/reference"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d "$OUT/whl" "diffusers==0.42.1"
(cd "$OUT/debs" && apt-get download -q libspdlog-dev libspdlog1.10 libfmt-dev libfmt9 nlohmann-json3-dev \
  libmimalloc-dev libmimalloc2.0 libcli11-dev >/dev/null)
VENV="$ROOT/.venv" bash scripts/fetch_reference.sh
cp .deps/reference/invokeai_anima/anima_transformer.py "$OUT/reference/"
du -sh "$OUT"
