#!/usr/bin/env python3
"""A full denoising loop on sluice's Python bindings, the way an image-generation frontend
would drive it: encode the prompt with the LLM adapter, then flow-matching Euler with
classifier-free guidance, then save the final latent.

    python examples/python_denoise.py                       # generated anima-small on the CPU
    python examples/python_denoise.py --checkpoint anima.safetensors --device cuda \
        --vram-budget 50% --qwen prompt_qwen.safetensors --steps 30 --cfg 4.5

Text conditioning: --qwen FILE gives a safetensors file with `qwen_hidden` [1, S, D] (the
Qwen3 0.6B last hidden states of the prompt), `t5_ids` [1, S_t] (T5 token ids) and
optionally `t5_weights` [1, S_t]; the negative prompt is `neg_qwen_hidden`/`neg_t5_ids` in
the same file (else an empty prompt of zeros). Without --qwen the conditioning is random
(seeded), which is what a benchmark wants. The sampler is the same as `sluice run`'s
(models/sampling.h): sigma_i = shift(1 - i/N) with shift(t) = s*t / (1 + (s-1)*t), and
x <- x + (sigma_next - sigma) * v, v = v_uncond + cfg * (v_cond - v_uncond).
"""
import argparse
import sys
import time

import torch
from safetensors.torch import load_file, save_file

import sluice


def flow_sigmas(steps: int, shift: float):
    out = []
    for i in range(steps + 1):
        t = 1.0 - i / steps
        out.append(shift * t / (1.0 + (shift - 1.0) * t))
    return out


def progress(step: int, steps: int, sigma: float, ms: float) -> None:
    width = 30
    done = int(width * (step + 1) / steps)
    sys.stdout.write(f"\r[{'#' * done}{'.' * (width - done)}] step {step + 1}/{steps} sigma {sigma:.3f} {ms:7.1f} ms")
    sys.stdout.flush()
    if step + 1 == steps:
        sys.stdout.write("\n")


def conditioning(args, m, info, generator):
    adapter = info["adapter"]
    if args.qwen:
        f = load_file(args.qwen)
        cond = m.encode_text(f["qwen_hidden"], f["t5_ids"], f.get("t5_weights"))
        if "neg_qwen_hidden" in f:
            uncond = m.encode_text(f["neg_qwen_hidden"], f["neg_t5_ids"], f.get("neg_t5_weights"))
        else:
            uncond = torch.zeros_like(cond)
        return cond, uncond
    tokens = 12
    qwen = torch.randn(1, tokens, adapter["source_dim"], generator=generator)
    ids = torch.randint(0, adapter["vocab_size"], (1, tokens), generator=generator)
    cond = m.encode_text(qwen, ids)
    uncond = m.encode_text(torch.zeros_like(qwen), torch.zeros_like(ids))
    return cond, uncond


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", help="Anima .safetensors (default: a generated --preset model)")
    p.add_argument("--preset", default="anima-small", help="generated model when no --checkpoint")
    p.add_argument("--device", default="cpu")
    p.add_argument("--vram-budget", default="")
    p.add_argument("--max-resident", type=float, default=None)
    p.add_argument("--storage", default="float8_e4m3fn")
    p.add_argument("--qwen", help="safetensors with qwen_hidden + t5_ids (see the docstring)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--cfg", type=float, default=4.5)
    p.add_argument("--shift", type=float, default=3.0)
    p.add_argument("--resolution", type=int, default=256, help="image side in pixels (latent = /8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default="latent.safetensors")
    args = p.parse_args()
    if args.steps < 1 or args.resolution < 8:
        p.error("--steps must be >= 1 and --resolution >= 8")

    cache = sluice.ModelCache(device=args.device, vram_budget=args.vram_budget, resolution=args.resolution)
    model = cache.load(args.checkpoint or args.preset, storage=args.storage, max_resident=args.max_resident,
                       seed=args.seed)
    info = model.info
    print(f"model {model.name}: residency {model.residency_map()}")

    g = torch.Generator().manual_seed(args.seed)
    side = args.resolution // 8
    x = torch.randn(1, info["in_channels"], 1, side, side, generator=g)
    sigmas = flow_sigmas(args.steps, args.shift)
    with model.lock() as m:
        cond, uncond = conditioning(args, m, info, g)
        context = torch.cat([uncond, cond]).float()
        for i in range(args.steps):
            t0 = time.perf_counter()
            s, s_next = sigmas[i], sigmas[i + 1]
            # One forward on a batch of 2 (uncond, cond): streamed weights cross the bus once.
            v = m(torch.cat([x, x]), torch.full((2,), s), context).float()
            v_uncond, v_cond = v[:1], v[1:]
            x = x + (s_next - s) * (v_uncond + args.cfg * (v_cond - v_uncond))
            progress(i, args.steps, s, (time.perf_counter() - t0) * 1e3)

    stats = model.stats()
    fwd = stats["forwards"]
    streamed = sum(f["bytes_streamed"] for f in fwd)
    print(f"{len(fwd)} forwards, {streamed / 2**20:.1f} MiB streamed, "
          f"stall {sum(f['stall_ms'] for f in fwd):.1f} ms, wall {sum(f['wall_ms'] for f in fwd):.1f} ms, "
          f"resident {stats['model']['resident_bytes'] / 2**20:.1f} of {stats['model']['total_bytes'] / 2**20:.1f} MiB")
    save_file({"latent": x.contiguous()}, args.output)
    print(f"saved {args.output}: latent {list(x.shape)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
