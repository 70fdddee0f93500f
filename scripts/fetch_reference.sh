#!/usr/bin/env bash
# Fetches the independent reference Anima used by the parity tests (tests/python/):
# InvokeAI's self-contained anima_transformer.py (imports only torch and einops), taken
# from the pinned `invokeai` wheel on PyPI. Only that one file is extracted, into a
# git-ignored folder; its code is never committed here. Safe to re-run: does nothing when
# the file is already there with the expected checksum.
#
#   VENV   the venv whose pip downloads the wheel (default: <repo>/.venv)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
INVOKEAI_VERSION="6.14.2"
MEMBER="invokeai/backend/anima/anima_transformer.py"
# sha256 of $MEMBER in invokeai $INVOKEAI_VERSION: a changed file means a changed reference.
SHA256="709f1a685bb2559f416debba32262aa2db552eff9117eda649699ce1e4c016b3"
CACHE="$ROOT/.deps/cache"
DEST_DIR="$ROOT/.deps/reference/invokeai_anima"
DEST="$DEST_DIR/anima_transformer.py"

log() { printf '[fetch_reference] %s\n' "$*" >&2; }

have_file() { [ -f "$DEST" ] && echo "$SHA256  $DEST" | sha256sum -c --status; }

if have_file; then
  exit 0
fi

mkdir -p "$CACHE" "$DEST_DIR"
WHEEL="$CACHE/invokeai-$INVOKEAI_VERSION-py3-none-any.whl"
if [ ! -f "$WHEEL" ]; then
  log "downloading invokeai==$INVOKEAI_VERSION (wheel only, no dependencies)"
  "$VENV/bin/pip" download -q --no-deps "invokeai==$INVOKEAI_VERSION" -d "$CACHE"
fi
"$VENV/bin/python" - "$WHEEL" "$MEMBER" "$DEST" <<'PY'
import sys, zipfile, os
wheel, member, dest = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    data = z.read(member)
tmp = dest + ".tmp"
with open(tmp, "wb") as f:
    f.write(data)
os.replace(tmp, dest)
PY
if ! have_file; then
  log "error: $MEMBER from invokeai $INVOKEAI_VERSION does not have the expected sha256"
  rm -f "$DEST"
  exit 1
fi
log "reference at ${DEST#"$ROOT"/}"
