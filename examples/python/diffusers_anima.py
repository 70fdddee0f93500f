"""sluice.offload() on diffusers' Anima transformer: the module a diffusers user already has,
streamed through sluice in place, then given back.

    python examples/python/diffusers_anima.py                 # a tiny random transformer, CPU
    python examples/python/diffusers_anima.py --device cuda --vram-budget 50% --layers 28 \
        --heads 16 --head-dim 128                             # anima-2b's shape, random weights

It builds diffusers' CosmosTransformer3DModel (the transformer of AnimaModularPipeline) with
random weights, runs a short flow-matching denoise loop with classifier-free guidance as the
pipeline's loop calls it, once plain and once through sluice.offload(), and prints how far
apart the latents are, the residency and what streamed. With a real pipeline the call is
the same: `handle = sluice.offload(pipe.transformer, device="cuda", vram_budget="6GiB")`
before `pipe(...)`, and `handle.remove()` after.
"""
import argparse
import json
import time

import torch

import sluice


def transformer(args):
    import diffusers
    import torchvision  # noqa: F401  (the Cosmos transformer resizes its padding mask with it)

    torch.manual_seed(0)
    return diffusers.CosmosTransformer3DModel(
        in_channels=16, out_channels=16, num_attention_heads=args.heads, attention_head_dim=args.head_dim,
        num_layers=args.layers, mlp_ratio=4, text_embed_dim=args.heads * args.head_dim, adaln_lora_dim=32,
        max_size=(4, 64, 64), patch_size=(1, 2, 2), rope_scale=(1.0, 4.0, 4.0), concat_padding_mask=True,
        extra_pos_embed_type=None).eval().to(torch.bfloat16)


def denoise(model, args, device):
    g = torch.Generator().manual_seed(1)
    side = args.resolution // 8
    latents = torch.randn(1, 16, 1, side, side, generator=g).to(device)
    width = args.heads * args.head_dim
    cond = torch.randn(1, 32, width, generator=g).to(device, torch.bfloat16)
    uncond = torch.randn(1, 32, width, generator=g).to(device, torch.bfloat16)
    mask = torch.zeros(1, 1, args.resolution, args.resolution, dtype=torch.bfloat16, device=device)
    sigmas = [1.0 - i / args.steps for i in range(args.steps + 1)]
    with torch.no_grad():
        for i in range(args.steps):
            t = torch.tensor([sigmas[i]], dtype=torch.bfloat16, device=device)
            c, u = (model(hidden_states=latents.to(torch.bfloat16), timestep=t, encoder_hidden_states=e,
                          padding_mask=mask, return_dict=False)[0] for e in (cond, uncond))
            latents = latents + (sigmas[i + 1] - sigmas[i]) * (u + 4.0 * (c - u)).float()
    return latents.cpu()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--vram-budget", default="", help='"6GiB", "50%%"; default: stream every layer')
    p.add_argument("--storage", default="float8_e4m3fn")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--resolution", type=int, default=64)
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args()

    model = transformer(args)
    t0 = time.perf_counter()
    plain = denoise(model.to(args.device), args, args.device)
    plain_s = time.perf_counter() - t0
    model.to("cpu")  # sluice.offload takes a module on the host and moves it itself
    handle = sluice.offload(model, device=args.device, vram_budget=args.vram_budget, storage=args.storage,
                            max_resident=None if args.vram_budget else 0.0)
    t0 = time.perf_counter()
    streamed = denoise(model, args, args.device)
    sluice_s = time.perf_counter() - t0
    stats = handle.stats()
    handle.remove()
    diff = (streamed - plain).abs().max().item()
    model_stats = stats["model"]
    print(f"transformer: {model_stats['layers']} Linear layers managed, residency {model_stats['residency']}")
    print(f"plain: {plain_s:.3f} s; through sluice ({args.storage}): {sluice_s:.3f} s, "
          f"{stats['forward_count']} forwards, {sum(f['bytes_streamed'] for f in stats['forwards'])} bytes streamed")
    print(f"largest |latent difference| {diff:.4g} ({'bit-identical' if diff == 0 else 'storage rounding'})")
    print(json.dumps({"device_peak_bytes": stats["device"]["peak_bytes"]}))


if __name__ == "__main__":
    main()
