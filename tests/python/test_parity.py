#!/usr/bin/env python3
"""Reference parity: sluice's Anima against InvokeAI's independent implementation.

One case per run (ctest runs one entry per case, see CMakeLists.txt):

    test_parity.py --sluice build/cli/sluice --reference .deps/.../anima_transformer.py \
        --case tiny-fp32 --workdir build/tests/python/parity/tiny-fp32

Flow: `sluice make-checkpoint` -> seeded random inputs -> `sluice forward` -> reference
forward on the same checkpoint (goldens are made here, never stored) -> relative L2
||sluice - ref|| / ||ref|| per output, against the case's tolerance. Exit status 0 when
every output is within tolerance, 1 otherwise (2 for a broken setup).
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch
from safetensors.torch import load_file, save_file

from reference_anima import rel_l2  # run as a script: its folder is on sys.path

HERE = os.path.dirname(os.path.abspath(__file__))

# Tolerances on relative L2: fp32 runs must agree to rounding; bf16 runs accumulate
# rounding differences through every block (different but equally valid op orders).
TOL = {"float32": 1e-5, "bfloat16": 1e-2}


def case(config, dtype="float32", B=1, T=1, H=16, W=16, S=8, adapter=False, S_t=6, weights=False,
         ckpt_dtype=None, seed=1234, threads=0):
    return dict(config=config, dtype=dtype, B=B, T=T, H=H, W=W, S=S, adapter=adapter, S_t=S_t, weights=weights,
                ckpt_dtype=ckpt_dtype or dtype, seed=seed, threads=threads)


# A JSON config (written by the driver) for the temporal-padding case: patch_temporal 2.
TEMPORAL_PATCH_CONFIG = {"preset": "anima-tiny", "name": "anima-tiny-pt2", "patch_temporal": 2}

CASES = {
    "tiny-fp32": case("anima-tiny"),
    "tiny-bf16": case("anima-tiny", dtype="bfloat16"),
    "small-fp32": case("anima-small", H=32, W=32, S=16),
    "small-bf16": case("anima-small", dtype="bfloat16", H=32, W=32, S=16),
    # Odd H/W: both need padding to the patch size, and the output is cropped back.
    "tiny-odd-15x17-fp32": case("anima-tiny", H=15, W=17),
    "tiny-batch2-fp32": case("anima-tiny", B=2, S=5),
    "tiny-frames3-fp32": case("anima-tiny", T=3, H=8, W=10),
    "tiny-frames3-patcht2-fp32": case("@temporal_patch", T=3, H=8, W=8),
    # The adapter path: qwen hidden + T5 ids (+ per-token weights) -> context -> DiT.
    "tiny-adapter-fp32": case("anima-tiny", adapter=True, S=7, S_t=9),
    "tiny-adapter-weights-b2-fp32": case("anima-tiny", adapter=True, B=2, S=7, S_t=9, weights=True),
    "small-adapter-weights-bf16": case("anima-small", dtype="bfloat16", adapter=True, S=12, S_t=10, weights=True),
    # The real anima-2b width and depth on a 16x16 latent: generated in bf16 (4 GB on disk),
    # run in fp32 by both sides (8 GB each, one after the other), deleted afterwards.
    "anima-2b-fp32": case("anima-2b", adapter=True, S=12, S_t=10, weights=True, ckpt_dtype="bfloat16"),
}


class Fail(Exception):
    pass


def run(cmd, what, env=None):
    t0 = time.perf_counter()
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    dt = time.perf_counter() - t0
    if p.returncode != 0:
        sys.stderr.write(p.stderr)
        raise Fail(f"{what} failed with exit code {p.returncode}: {' '.join(cmd)}")
    if p.stderr.strip():
        sys.stderr.write(p.stderr)
    # ru_maxrss of children: the largest peak of any step so far (KiB on Linux).
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / (1024 * 1024)
    print(f"  {what}: {dt:.2f}s (largest child peak RSS so far {peak:.2f} GiB)")
    return p.stdout


def make_inputs(c, cfg, path):
    g = torch.Generator().manual_seed(c["seed"])
    B = c["B"]
    t = {
        "x": torch.randn(B, cfg["in_channels"], c["T"], c["H"], c["W"], generator=g),
        # sigma in (0, 1): distinct per batch element so a batch mix-up shows.
        "timesteps": torch.rand(B, generator=g) * 0.9 + 0.05,
    }
    if c["adapter"]:
        a = cfg["adapter"]
        t["qwen_hidden"] = torch.randn(B, c["S"], a["source_dim"], generator=g)
        t["t5_ids"] = torch.randint(0, a["vocab_size"], (B, c["S_t"]), generator=g, dtype=torch.int64)
        if c["weights"]:
            t["t5_weights"] = torch.rand(B, c["S_t"], generator=g) * 1.5 + 0.25
    else:
        t["context"] = torch.randn(B, c["S"], cfg["crossattn_emb_channels"], generator=g)
    save_file(t, path)
    return t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sluice", required=True)
    ap.add_argument("--reference", required=True, help="path of InvokeAI's anima_transformer.py")
    ap.add_argument("--case", required=True, choices=sorted(CASES))
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint and outputs")
    args = ap.parse_args()
    c = CASES[args.case]

    if not os.path.isfile(args.reference):
        print(f"test_parity: reference not found at {args.reference}; run scripts/fetch_reference.sh",
              file=sys.stderr)
        return 2
    os.makedirs(args.workdir, exist_ok=True)
    w = lambda name: os.path.join(args.workdir, name)  # noqa: E731
    ckpt, inputs, out_s, out_r = w("ckpt.safetensors"), w("inputs.safetensors"), w("sluice.safetensors"), w(
        "reference.safetensors")
    config = c["config"]
    if config == "@temporal_patch":
        config = w("config_pt2.json")
        with open(config, "w") as f:
            json.dump(TEMPORAL_PATCH_CONFIG, f)

    print(f"parity case {args.case}: config {c['config']}, dtype {c['dtype']}, checkpoint {c['ckpt_dtype']}, "
          f"B={c['B']} T={c['T']} H={c['H']} W={c['W']}" + (f", adapter S={c['S']} S_t={c['S_t']}"
                                                           f"{' +weights' if c['weights'] else ''}" if c['adapter']
                                                           else f", context S={c['S']}"))
    t_start = time.perf_counter()
    try:
        info = json.loads(run([args.sluice, "inspect", "--config", config, "--json"], "sluice inspect"))
        cfg = info["config"]
        with open(w("config.json"), "w") as f:
            json.dump(cfg, f)
        run([args.sluice, "make-checkpoint", "--config", config, "--seed", str(c["seed"]), "--out", ckpt,
             "--dtype", c["ckpt_dtype"]], "sluice make-checkpoint")
        make_inputs(c, cfg, inputs)
        # --storage: weights kept in the run dtype like the reference's (forward stores fp8 by default).
        run([args.sluice, "forward", "--checkpoint", ckpt, "--inputs", inputs, "--output", out_s, "--config", config,
             "--compute", c["dtype"], "--storage", c["dtype"], "--device", "cpu"], "sluice forward")
        run([sys.executable, os.path.join(HERE, "reference_anima.py"), "--module", args.reference, "--checkpoint",
             ckpt, "--config", w("config.json"), "--inputs", inputs, "--output", out_r, "--dtype", c["dtype"]],
            "reference forward")
        got, want = load_file(out_s), load_file(out_r)
        keys = ["context", "velocity"] if c["adapter"] else ["velocity"]
        tol = TOL[c["dtype"]]
        ok = True
        for k in keys:
            if k not in got:
                raise Fail(f"sluice output has no '{k}'")
            a, b = got[k], want[k]
            if tuple(a.shape) != tuple(b.shape):
                raise Fail(f"'{k}': sluice shape {tuple(a.shape)} != reference shape {tuple(b.shape)}")
            if not torch.isfinite(a.float()).all():
                raise Fail(f"'{k}': sluice output has non-finite values")
            if b.float().norm() == 0:
                raise Fail(f"'{k}': reference output is all zeros; the comparison would be vacuous")
            e = rel_l2(a, b)
            verdict = "ok" if e <= tol else "FAIL"
            ok = ok and e <= tol
            print(f"  {k} {tuple(a.shape)} {str(a.dtype).replace('torch.', '')}: rel-L2 {e:.3e} (tol {tol:.0e}) "
                  f"{verdict}")
    except Fail as e:
        print(f"test_parity: {args.case}: {e}", file=sys.stderr)
        return 1
    finally:
        if not args.keep:
            for p in (ckpt, out_s, out_r):
                if os.path.exists(p):
                    os.remove(p)
    print(f"  total: {time.perf_counter() - t_start:.2f}s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
