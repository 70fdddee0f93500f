#!/usr/bin/env python3
"""diffusers parity: sluice's Anima DiT against diffusers' `CosmosTransformer3DModel` (the
same DiT under renamed keys), both in fp32 on the same generated checkpoint
and inputs. The key mapping lives in bench/gpu/anima_diffusers.py (shared with the GPU
side-by-side, bench/gpu/compare.py).

    test_diffusers_parity.py --sluice build/cli/sluice --case tiny-fp32 --workdir DIR

Flow: `sluice make-checkpoint` -> seeded random x, timesteps, context -> `sluice forward`
(fp32) -> diffusers forward (fp32) on the mapped weights -> relative L2 of the velocity,
printed and checked against 1e-5. Exit status: 0 pass, 1 fail, 2 broken setup, 77 skipped
(diffusers not importable; ctest reports it as skipped via SKIP_RETURN_CODE).
"""
import argparse
import json
import os
import subprocess
import sys
import time

import torch
from safetensors.torch import load_file, save_file

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "bench", "gpu"))

TOL = 1e-5  # fp32 on both sides: only rounding differs
SKIP = 77

# H and W are multiples of the patch size: sluice pads odd sizes, diffusers does not.
CASES = {
    "tiny-fp32": dict(config="anima-tiny", B=1, T=1, H=16, W=16, S=8, seed=4321),
    "tiny-batch2-frames2-fp32": dict(config="anima-tiny", B=2, T=2, H=8, W=12, S=5, seed=99),
    "small-fp32": dict(config="anima-small", B=1, T=1, H=32, W=32, S=16, seed=7),
}


def run(cmd, what):
    t0 = time.perf_counter()
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if p.returncode != 0:
        sys.stderr.write(p.stderr)
        raise SystemExit(f"test_diffusers_parity: {what} failed with exit code {p.returncode}: {' '.join(cmd)}")
    print(f"  {what}: {time.perf_counter() - t0:.2f}s")
    return p.stdout


def rel_l2(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sluice", required=True, help="the sluice CLI")
    ap.add_argument("--case", required=True, choices=sorted(CASES))
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint and outputs")
    args = ap.parse_args()
    try:
        import diffusers  # noqa: F401
    except ImportError as e:
        print(f"test_diffusers_parity: SKIPPED: diffusers is not importable ({e}); "
              f"scripts/setup.sh installs it into the project venv")
        return SKIP
    import anima_diffusers

    c = CASES[args.case]
    os.makedirs(args.workdir, exist_ok=True)
    w = lambda name: os.path.join(args.workdir, name)  # noqa: E731
    ckpt, inputs, out = w("ckpt.safetensors"), w("inputs.safetensors"), w("sluice.safetensors")
    print(f"diffusers parity {args.case}: {c['config']} fp32, B={c['B']} T={c['T']} H={c['H']} W={c['W']} "
          f"S={c['S']}, diffusers {diffusers.__version__}")
    try:
        cfg = json.loads(run([args.sluice, "inspect", "--config", c["config"], "--json"], "sluice inspect"))["config"]
        run([args.sluice, "make-checkpoint", "--config", c["config"], "--seed", str(c["seed"]), "--out", ckpt,
             "--dtype", "float32"], "sluice make-checkpoint")
        g = torch.Generator().manual_seed(c["seed"])
        x = torch.randn(c["B"], cfg["in_channels"], c["T"], c["H"], c["W"], generator=g)
        t = torch.rand(c["B"], generator=g) * 0.9 + 0.05  # sigma, distinct per batch item
        ctx = torch.randn(c["B"], c["S"], cfg["crossattn_emb_channels"], generator=g)
        save_file({"x": x, "timesteps": t, "context": ctx}, inputs)
        # --storage: weights kept in the run dtype like the reference's (forward stores fp8 by default).
        run([args.sluice, "forward", "--checkpoint", ckpt, "--inputs", inputs, "--output", out, "--config",
             c["config"], "--compute", "float32", "--storage", "float32", "--device", "cpu"], "sluice forward")
        got = load_file(out)["velocity"]

        t0 = time.perf_counter()
        model = anima_diffusers.build_model(cfg, load_file(ckpt), torch.float32)
        with torch.inference_mode():
            want = anima_diffusers.forward(model, x, t, ctx, cfg["concat_padding_mask"])
        print(f"  diffusers forward: {time.perf_counter() - t0:.2f}s")
    finally:
        if not args.keep:
            for p in (ckpt, out):
                if os.path.exists(p):
                    os.remove(p)

    if tuple(got.shape) != tuple(want.shape):
        print(f"test_diffusers_parity: sluice shape {tuple(got.shape)} != diffusers shape {tuple(want.shape)}")
        return 1
    if not torch.isfinite(got).all() or want.norm() == 0:
        print("test_diffusers_parity: non-finite sluice output or an all-zero diffusers output (vacuous)")
        return 1
    e = rel_l2(got, want)
    ok = e < TOL
    print(f"  velocity {tuple(got.shape)}: rel-L2 {e:.3e} (tol {TOL:.0e}) {'ok' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
