"""sluice.offload() in diffusers' Anima pipeline: the modules a diffusers user already has,
streamed through sluice in place, then given back.

    python examples/python/diffusers_anima.py                 # tiny random components, CPU
    python examples/python/diffusers_anima.py --device cuda --vram-budget 50% --layers 28 \
        --heads 16 --head-dim 128 --text-width 1024 --text-layers 28
                                                              # anima-2b's DiT shape, random weights

It builds diffusers' whole AnimaModularPipeline (its default blocks) from random components:
a Qwen3 text encoder with its two tokenizers (built here from a few words, nothing
downloaded), the text conditioner, the Cosmos transformer and the VAE. It runs the pipeline
from a prompt, text encoder step included, once plain and once with the transformer and the
text encoder offloaded through sluice.offload() into one sluice.ModelCache, under one
budget (the transformer in --storage, fp8 by default; the text encoder in bf16, its own
dtype), and prints how far apart the latents and images are, the residency and what
streamed. With a pretrained pipeline the calls are the same:

    cache = sluice.ModelCache(device="cuda", vram_budget="6GiB", working_memory="512MiB")
    handles = [sluice.offload(pipe.transformer, cache=cache),
               sluice.offload(pipe.text_encoder, cache=cache, storage="bfloat16")]
    image = pipe(prompt=...)
    for h in handles: h.remove()
"""
import argparse
import time

import torch

import sluice

WORDS = ("a", "cat", "in", "space", "bad", "quality", "blurry")


def tokenizers(words=WORDS):
    """Qwen's byte-level BPE tokenizer and T5's Unigram tokenizer, over a few whole words
    (tests/python/test_offload_pipeline.py builds its pipeline's with it too).

    Qwen2Tokenizer: the 256 byte symbols and a merge chain per word, then the word after a
    space ("Ġcat"); <|endoftext|> pads. T5TokenizerFast (Unigram, Metaspace, </s> appended):
    <pad> </s> <unk>, the words, a comma and single letters; no sentinel tokens."""
    from tokenizers import pre_tokenizers
    from transformers import Qwen2Tokenizer, T5TokenizerFast

    vocab = {"<|endoftext|>": 0}
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[symbol] = len(vocab)
    merges = []
    for word in words:
        for pair in [(word[:i], word[i]) for i in range(1, len(word))] + [("Ġ", word)]:
            if pair not in merges:
                merges.append(pair)
                vocab.setdefault(pair[0] + pair[1], len(vocab))
    qwen = Qwen2Tokenizer(vocab=vocab, merges=merges)
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0), (",", -3.0)]
    pieces += [("▁" + w, -1.0) for w in words] + [(c, -5.0) for c in "abcdefghijklmnopqrstuvwxyz"]
    t5 = T5TokenizerFast(vocab=pieces, extra_ids=0)
    return qwen, t5


def pipeline(args):
    import diffusers
    import torchvision  # noqa: F401  (the Cosmos transformer resizes its padding mask with it)
    import transformers

    qwen, t5 = tokenizers()
    width = args.text_width
    heads = max(2, width // 64)
    torch.manual_seed(0)
    text_encoder = transformers.Qwen3Model(transformers.Qwen3Config(
        vocab_size=len(qwen), hidden_size=width, intermediate_size=3 * width, num_hidden_layers=args.text_layers,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), head_dim=width // heads,
        max_position_embeddings=512, attention_bias=False)).eval().to(torch.bfloat16)
    torch.manual_seed(0)
    conditioner = diffusers.AnimaTextConditioner(
        source_dim=width, target_dim=width, model_dim=width, num_layers=2, num_attention_heads=heads,
        min_sequence_length=32).eval().to(torch.bfloat16)
    torch.manual_seed(0)
    transformer = diffusers.CosmosTransformer3DModel(
        in_channels=16, out_channels=16, num_attention_heads=args.heads, attention_head_dim=args.head_dim,
        num_layers=args.layers, mlp_ratio=4, text_embed_dim=width, adaln_lora_dim=32,
        max_size=(4, 64, 64), patch_size=(1, 2, 2), rope_scale=(1.0, 4.0, 4.0), concat_padding_mask=True,
        extra_pos_embed_type=None).eval().to(torch.bfloat16)
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKLQwenImage(
        base_dim=16, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=1, temperal_downsample=[False, True, True],
        latents_mean=[0.0] * 16, latents_std=[1.0] * 16).eval()
    pipe = diffusers.AnimaModularPipeline(blocks=diffusers.AnimaAutoBlocks())
    pipe.update_components(text_encoder=text_encoder, tokenizer=qwen, t5_tokenizer=t5, text_conditioner=conditioner,
                           transformer=transformer, vae=vae,
                           scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0))
    return pipe


def generate(pipe, args):
    t0 = time.perf_counter()
    with torch.no_grad():
        out = pipe(prompt=args.prompt, negative_prompt=args.negative_prompt, generator=torch.Generator().manual_seed(0),
                   num_inference_steps=args.steps, height=args.resolution, width=args.resolution,
                   max_sequence_length=64, output_type="pt", output=["latents", "images"])
    return out["latents"].cpu(), out["images"].cpu(), time.perf_counter() - t0


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--vram-budget", default="", help='both modules\': "6GiB", "50%%"; default: stream every layer')
    p.add_argument("--storage", default="float8_e4m3fn", help="the transformer's storage dtype")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--text-width", type=int, default=32, help="the Qwen3 text encoder's and the conditioner's width")
    p.add_argument("--text-layers", type=int, default=2)
    p.add_argument("--resolution", type=int, default=64)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--prompt", default="a cat in space")
    p.add_argument("--negative-prompt", default="blurry, bad quality")
    args = p.parse_args()

    pipe = pipeline(args)
    for name in ("text_encoder", "text_conditioner", "transformer", "vae"):
        getattr(pipe, name).to(args.device)
    plain_latents, plain_images, plain_s = generate(pipe, args)

    # sluice.offload takes the modules where they are (on the device already): their layers
    # stream, their other tensors (norms) stay on the device while they are offloaded, and
    # remove() puts every tensor back there. One cache, one budget: each module's forward
    # gets its share from the one not running.
    cache = sluice.ModelCache(device=args.device, vram_budget=args.vram_budget, working_memory="256MiB")
    stream_all = None if args.vram_budget else 0.0
    handles = {
        "transformer": sluice.offload(pipe.transformer, cache=cache, storage=args.storage, max_resident=stream_all),
        "text_encoder": sluice.offload(pipe.text_encoder, cache=cache, storage="bfloat16", max_resident=stream_all),
    }
    latents, images, sluice_s = generate(pipe, args)
    stats = {name: h.stats() for name, h in handles.items()}
    for h in handles.values():
        h.remove()

    for name, s in stats.items():
        m = s["model"]
        print(f"{name}: {m['layers']} layers managed, residency {m['residency']}, {s['forward_count']} "
              f"forwards, {sum(f['bytes_streamed'] for f in s['forwards'])} bytes streamed, "
              f"device peak {s['device']['peak_bytes']} bytes")
    print(f"pipeline from a prompt, {args.steps} steps at {args.resolution}px: plain {plain_s:.3f} s; "
          f"transformer ({args.storage}) and text encoder (bfloat16) through sluice {sluice_s:.3f} s")
    diff = (latents.float() - plain_latents.float()).abs().max().item()
    image_diff = (images - plain_images).abs().max().item()
    print(f"largest |latent difference| {diff:.4g}, |image difference| {image_diff:.4g} "
          f"({'bit-identical' if diff == 0 and image_diff == 0 else 'storage rounding'})")


if __name__ == "__main__":
    main()
