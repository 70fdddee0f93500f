#!/usr/bin/env bash
# Sets up (scripts/setup.sh), builds, and runs sluice's main job on its embedded default:
# `sluice run` when the build has it, otherwise one forward pass of a generated anima-small
# model (a random-weight checkpoint in the real key layout, on random inputs).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
SLUICE="$ROOT/${SLUICE_BUILD_DIR:-build}/cli/sluice"
if "$SLUICE" run --help >/dev/null 2>&1; then
  exec "$SLUICE" run "$@"
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$SLUICE" make-checkpoint --config anima-small --seed 0 --out "$work/anima-small.safetensors"
"$ROOT/.venv/bin/python" - "$work/inputs.safetensors" <<'PY'
import sys, torch
from safetensors.torch import save_file
g = torch.Generator().manual_seed(0)
save_file({"x": torch.randn(1, 16, 1, 32, 32, generator=g),
           "timesteps": torch.tensor([0.5]),
           "context": torch.randn(1, 64, 128, generator=g)}, sys.argv[1])
PY
"$SLUICE" inspect "$work/anima-small.safetensors"
"$SLUICE" forward --checkpoint "$work/anima-small.safetensors" --inputs "$work/inputs.safetensors" \
  --output "$work/velocity.safetensors" --dtype float32 "$@"
"$ROOT/.venv/bin/python" -c "
import sys; from safetensors.torch import load_file
v = load_file(sys.argv[1])['velocity']
print(f'velocity {tuple(v.shape)} {v.dtype}: mean {v.mean():.6f} std {v.std():.6f} finite={bool(v.isfinite().all())}')
" "$work/velocity.safetensors"
