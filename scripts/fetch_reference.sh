#!/usr/bin/env bash
# Fetches the independent InvokeAI code the Python tests (tests/python/) run against, from
# the pinned `invokeai` wheel on PyPI, into git-ignored folders; none of it is committed here.
#
#   .deps/reference/invokeai_anima/anima_transformer.py
#       InvokeAI's self-contained Anima (imports only torch and einops): the reference of
#       the parity tests (test_parity.py, reference_anima.py).
#   .deps/reference/pkg/invokeai/...
#       A minimal importable `invokeai` package for test_offload_frontends.py: the Anima
#       transformer, its ControlNet-LLLite adapter and its regional-prompting patch as
#       InvokeAI ships them, plus the few modules of InvokeAI those import. The packages'
#       own __init__.py files are written here empty (InvokeAI's import its whole app), and
#       one module is a stub (invokeai/backend/util/devices.py, see below).
#
# Every extracted file is pinned by its sha256: a changed file means a changed reference.
# Safe to re-run: does nothing when every file is already there with the expected checksum
# (and the written files with their content).
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
PKG="$ROOT/.deps/reference/pkg"

# The package tree's files from the InvokeAI wheel (invokeai/backend/...): "sha256  member", each
# extracted to $PKG/member.
#   anima_transformer.py         AnimaTransformer (torch, einops)
#   control_net_lllite.py        AnimaControlNetLLLite (torch)
#   anima_transformer_patch.py   patch_anima_for_regional_prompting -> regional_prompting
#   regional_prompting.py        AnimaRegionalPromptingExtension -> the three below, devices
#   anima/conditioning_data.py   AnimaRegionalTextConditioning -> stable_diffusion's Range
#   stable_diffusion/diffusion/conditioning_data.py   Range (-> regional_prompt_data)
#   stable_diffusion/diffusion/regional_prompt_data.py  (torch only)
#   util/mask.py                 to_standard_float_mask (torch only)
PKG_MEMBERS="\
709f1a685bb2559f416debba32262aa2db552eff9117eda649699ce1e4c016b3  invokeai/backend/anima/anima_transformer.py
56ed40847192ba6a3386c78d07200acf879605adbfe06f7a23df5ba39ba34d85  invokeai/backend/anima/control_net_lllite.py
a5370532ed5334e3cb6e3b58c2485fbb5c04e5c68f1105a576a91d6980bd5d02  invokeai/backend/anima/anima_transformer_patch.py
42b955b97b78c1853274f81f1c42cf906501ed8992523a35aa0109bc559dcbce  invokeai/backend/anima/regional_prompting.py
e8d59f5d7442d3ada921092e630296f88dec2457cae4c8b0e3407c4640e7c58a  invokeai/backend/anima/conditioning_data.py
dae0fe4249e39d12b02ef6a0f472b91a9b127ba4a76d29a73e55c62dcceb49b6  invokeai/backend/stable_diffusion/diffusion/conditioning_data.py
8233ac8a90021cdcaece658143d79e6c5834f21df9d0c5fd83837e6d678d44e7  invokeai/backend/stable_diffusion/diffusion/regional_prompt_data.py
c1edc714db2aff082350237fa8b9d6f43dfeccb4a975688907fe5b57f3c421bc  invokeai/backend/util/mask.py"
# The packages, each with an empty __init__.py written here.
PKG_PACKAGES="invokeai invokeai/backend invokeai/backend/anima invokeai/backend/stable_diffusion
  invokeai/backend/stable_diffusion/diffusion invokeai/backend/util"

log() { printf '[fetch_reference] %s\n' "$*" >&2; }

have_file() { [ -f "$DEST" ] && echo "$SHA256  $DEST" | sha256sum -c --status; }

# "sha256  $PKG/member" lines for sha256sum -c.
pkg_sums() { printf '%s\n' "$PKG_MEMBERS" | sed "s#  #  $PKG/#"; }
have_pkg() { pkg_sums | sha256sum -c --status 2>/dev/null; }

# Writes stdin to $1 unless it already holds exactly that (no rewrite, no new mtime).
write_if_changed() {
  local dest="$1" tmp
  mkdir -p "$(dirname "$dest")"
  tmp="$(mktemp "$dest.XXXXXX")"
  cat >"$tmp"
  if cmp -s "$tmp" "$dest"; then rm -f "$tmp"; else mv -f "$tmp" "$dest"; fi
}

write_pkg_skeleton() {
  local p
  for p in $PKG_PACKAGES; do
    write_if_changed "$PKG/$p/__init__.py" </dev/null
  done
  # InvokeAI's real devices.py imports its whole app config (pydantic_settings, `deprecated`,
  # invokeai.app, invokeai.configs, ...). The tested path uses one thing of it:
  # regional_prompting.py's _prepare_cross_attn_mask asks TorchDevice.choose_torch_device()
  # where to build the cross-attention mask. This stub keeps InvokeAI's own precedence for
  # that: the calling thread's session device (set_session_device, as InvokeAI's multi-GPU
  # workers pin it) first, else the host (InvokeAI's answer with its default config on a
  # machine without cuda/xpu/mps; the tests pin the device they run on). Nothing else of
  # the real module is here.
  write_if_changed "$PKG/invokeai/backend/util/devices.py" <<'PY'
"""STUB written by scripts/fetch_reference.sh, not InvokeAI's devices.py (which imports
InvokeAI's whole app config): only what regional_prompting.py uses, TorchDevice's session
device and choose_torch_device()."""
import threading
from typing import Optional, Union

import torch


class TorchDevice:
    CPU_DEVICE = torch.device("cpu")
    _session_device = threading.local()

    @classmethod
    def normalize(cls, device: Union[str, torch.device]) -> torch.device:
        return torch.device(device)

    @classmethod
    def set_session_device(cls, device: Union[str, torch.device]) -> None:
        cls._session_device.device = cls.normalize(device)

    @classmethod
    def get_session_device(cls) -> Optional[torch.device]:
        return getattr(cls._session_device, "device", None)

    @classmethod
    def clear_session_device(cls) -> None:
        if hasattr(cls._session_device, "device"):
            del cls._session_device.device

    @classmethod
    def choose_torch_device(cls) -> torch.device:
        return cls.get_session_device() or cls.CPU_DEVICE
PY
}

write_pkg_skeleton
if have_file && have_pkg; then
  exit 0
fi

mkdir -p "$CACHE" "$DEST_DIR"
WHEEL="$CACHE/invokeai-$INVOKEAI_VERSION-py3-none-any.whl"
if [ ! -f "$WHEEL" ]; then
  log "downloading invokeai==$INVOKEAI_VERSION (wheel only, no dependencies)"
  "$VENV/bin/pip" download -q --no-deps "invokeai==$INVOKEAI_VERSION" -d "$CACHE"
fi
# Extracts each "member dest" pair of stdin from the wheel (atomically, via a .tmp file).
extract() {
  "$VENV/bin/python" -c '
import os, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    for line in sys.stdin:
        if not line.strip():
            continue
        member, dest = line.split()
        data = z.read(member)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        tmp = dest + ".tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, dest)
' "$WHEEL"
}
if ! have_file; then
  echo "$MEMBER $DEST" | extract
  if ! have_file; then
    log "error: $MEMBER from invokeai $INVOKEAI_VERSION does not have the expected sha256"
    rm -f "$DEST"
    exit 1
  fi
  log "reference at ${DEST#"$ROOT"/}"
fi
if ! have_pkg; then
  printf '%s\n' "$PKG_MEMBERS" | awk -v pkg="$PKG" '{ print $2, pkg "/" $2 }' | extract
  if ! have_pkg; then
    log "error: these files from invokeai $INVOKEAI_VERSION do not have the expected sha256:"
    pkg_sums | sha256sum -c 2>/dev/null | grep -v ': OK$' >&2 || true
    exit 1
  fi
  log "InvokeAI package tree at ${PKG#"$ROOT"/}"
fi
