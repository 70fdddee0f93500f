"""sluice.offload(module) (python/sluice/offload.py) inside diffusers' whole
AnimaModularPipeline: its default blocks (AnimaAutoBlocks) from a prompt and a negative
prompt, the text encoder step included (Qwen3 hidden states and T5 ids), then the text
conditioner, the denoise loop with its guider and the VAE decode. Every component is tiny and
random and built here, offline: a Qwen3Model with a byte-level BPE Qwen2Tokenizer and a
Unigram T5 tokenizer over a few words, and the transformer, VAE and text conditioner of
diffusers' own Anima pipeline tests. On the CPU device (plain, and strict with
SLUICE_STRICT_DEVICE=1); on the torch test accelerator (SLUICE_TEST_DEVICE=testaccel) the
pipeline runs on the accelerator from given initial latents (it has no generator), the VAE
(not offloaded, on the host) decoding there, and the other cases are skipped, saying why.

Checks: with the transformer, the text conditioner and the Qwen3 text encoder offloaded
(bf16 storage of bf16 modules) the latents and images are the pipeline's without
offloading, bit for bit, each module's forwards ran through sluice, and remove() gives every
tensor back bit for bit, where it was, with its requires_grad flag; with the transformer
offloaded in fp8 storage they are exactly what diffusers'
enable_layerwise_casting(float8_e4m3fn, bfloat16) gives with the same skip list."""
import copy
import pathlib
import sys

import pytest
import torch

import sluice

from offload_helpers import COSMOS_CONFIG, DEVICE, DIFFUSERS_DEFAULT_SKIPS, assert_restored, offload, snapshot

# The example's tiny tokenizers (built from a word list, nothing downloaded).
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples" / "python"))
from diffusers_anima import tokenizers  # noqa: E402

torch.set_num_threads(1)

# The words the tokenizers know whole; anything else falls back to bytes (Qwen) or <unk> (T5).
WORDS = ("a", "cat", "bad", "quality", "blurry")
PROMPT, NEGATIVE_PROMPT = "a cat", "bad quality"


def quiet(blocks):
    # The pipeline's set_progress_bar_config reaches only its top-level blocks; the denoise
    # loop is nested (denoise.text2image.denoise).
    for block in blocks.sub_blocks.values():
        if hasattr(block, "set_progress_bar_config"):
            block.set_progress_bar_config(disable=True)
        quiet(block)
    return blocks


def anima_pipeline(any_device=False):
    """The default AnimaModularPipeline, every module bf16 but the VAE (fp32 as diffusers'
    tests build it; it is never offloaded). Returns the pipeline and the three modules that
    hold its Linear layers: transformer, text conditioner, text encoder."""
    if DEVICE != "cpu" and not any_device:
        # The pipeline makes its latents on the device its components report, with a
        # torch.Generator there: the test accelerator has none.
        pytest.skip("the pipeline's own tensors need a device with generators: CPU device only")
    diffusers = pytest.importorskip("diffusers")
    transformers = pytest.importorskip("transformers")

    tokenizer, t5 = tokenizers(WORDS)
    assert tokenizer.tokenize(PROMPT) == ["a", "Ġcat"] and t5.tokenize(PROMPT) == ["▁a", "▁cat"]
    torch.manual_seed(0)
    transformer = diffusers.CosmosTransformer3DModel(**COSMOS_CONFIG).eval().to(torch.bfloat16)
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKLQwenImage(base_dim=24, z_dim=4, dim_mult=[1, 2, 4], num_res_blocks=1,
                                           temperal_downsample=[False, True], latents_mean=[0.0] * 4,
                                           latents_std=[1.0] * 4).eval()
    torch.manual_seed(0)
    conditioner = diffusers.AnimaTextConditioner(source_dim=16, target_dim=16, model_dim=16, num_layers=2,
                                                 num_attention_heads=4, target_vocab_size=32128,
                                                 min_sequence_length=16).eval().to(torch.bfloat16)
    assert len(t5) <= conditioner.config.target_vocab_size  # the adapter embeds the T5 ids
    torch.manual_seed(0)
    # diffusers' tests/pipelines/anima/test_anima.py's Qwen3, its vocabulary cut to the tokenizer's.
    text_encoder = transformers.Qwen3Model(transformers.Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=1000000.0, head_dim=4,
        attention_bias=False)).eval().to(torch.bfloat16)
    pipe = diffusers.AnimaModularPipeline(blocks=quiet(diffusers.AnimaAutoBlocks()))
    pipe.update_components(transformer=transformer, vae=vae, text_conditioner=conditioner, text_encoder=text_encoder,
                           tokenizer=tokenizer, t5_tokenizer=t5,
                           scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0))
    return pipe, transformer, conditioner, text_encoder


def run_anima(pipe):
    with torch.no_grad():
        out = pipe(prompt=PROMPT, negative_prompt=NEGATIVE_PROMPT, generator=torch.Generator().manual_seed(0),
                   num_inference_steps=2, height=32, width=32, max_sequence_length=16, output_type="pt",
                   output=["latents", "images"])
    return out["latents"], out["images"]


def streamed_counts(module):
    """(layers sluice manages, layers it streams): every Linear and Embedding (the modules have
    no convolution); an embedding stays resident (its lookup needs the whole table)."""
    linears = sum(type(m) is torch.nn.Linear for m in module.modules())
    embeddings = sum(type(m) is torch.nn.Embedding for m in module.modules())
    return linears + embeddings, linears


def test_anima_pipeline_with_transformer_conditioner_and_text_encoder_offloaded_is_bit_identical():
    pipe, *modules = anima_pipeline()
    want_latents, want_images = run_anima(pipe)
    snaps = [snapshot(m) for m in modules]
    # Three modules of one pipeline, each streamed layer by layer (bf16 storage: their weights as they are).
    handles = [offload(m, storage="bfloat16", max_resident=0.0) for m in modules]
    latents, images = run_anima(pipe)
    stats = [h.stats() for h in handles]
    for h in handles:
        h.remove()
    assert torch.equal(latents, want_latents)
    assert torch.equal(images, want_images)
    # transformer: 2 steps x (cond, uncond); conditioner and text encoder: the prompt and the negative prompt.
    for module, s, forwards in zip(modules, stats, (4, 2, 2)):
        assert s["forward_count"] == forwards, type(module).__name__
        assert (s["model"]["layers"], s["model"]["streamed_layers"]) == streamed_counts(module)
        for f in s["forwards"]:
            assert f["kind"] == type(module).__name__
            assert not f["aborted"] and f["bytes_streamed"] > 0
    for module, snap in zip(modules, snaps):
        assert_restored(module, snap)
    assert all(torch.equal(a, b) for a, b in zip(run_anima(pipe), (want_latents, want_images)))


def test_anima_pipeline_fp8_matches_diffusers_layerwise_casting():
    pipe, transformer, _, _ = anima_pipeline()
    reference = copy.deepcopy(transformer)
    reference.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    pipe.update_components(transformer=reference)
    want_latents, want_images = run_anima(pipe)
    pipe.update_components(transformer=transformer)
    snap = snapshot(transformer)
    handle = offload(transformer, storage="float8_e4m3fn", skip=DIFFUSERS_DEFAULT_SKIPS)
    latents, images = run_anima(pipe)
    stats = handle.stats()
    handle.remove()
    assert torch.equal(latents, want_latents)
    assert torch.equal(images, want_images)
    assert stats["forward_count"] == 4
    assert_restored(transformer, snap)


def test_anima_pipeline_modules_share_one_model_cache_budget():
    pipe, *modules = anima_pipeline()
    want_latents, want_images = run_anima(pipe)
    snaps = [snapshot(m) for m in modules]
    sizes = [sum(t.numel() * t.element_size() for t in m.state_dict().values()) for m in modules]
    # Room beside the working memory for the largest module (the conditioner, whose 32128-row
    # embedding stays resident) and half of the others, not for all three: each forward
    # takes its share from the modules not running.
    mib = 1 << 20
    room = max(sizes) + (sum(sizes) - max(sizes)) // 2
    cache = sluice.ModelCache(device=DEVICE, vram_budget=str(mib + room), working_memory=str(mib))
    names = ["transformer", "text conditioner", "text encoder"]
    handles = [sluice.offload(m, cache=cache, name=n, storage="bfloat16") for m, n in zip(modules, names)]
    latents, images = run_anima(pipe)
    stats = cache.stats()["cache"]
    held = {m["name"]: m for m in stats["models_held"]}
    per_module = [h.stats() for h in handles]
    for h in handles:
        h.remove()
    assert torch.equal(latents, want_latents)
    assert torch.equal(images, want_images)
    assert set(held) == set(names)
    assert stats["vram_reserved_bytes"] <= stats["vram_limit_bytes"]  # the shares never pass the budget
    assert stats["device_unloads"] + stats["device_drops"] > 0  # modules gave way to each other
    assert [s["forward_count"] for s in per_module] == [4, 2, 2]
    assert cache.stats()["cache"]["models_held"] == []  # remove() took each out
    for module, snap in zip(modules, snaps):
        assert_restored(module, snap)


@pytest.mark.parametrize("storage", ["bfloat16", "float8_e4m3fn"])
def test_anima_pipeline_runs_on_the_sluice_device_with_its_modules_offloaded(storage):
    """The whole pipeline where sluice streams to, its modules all on the host first: their
    placeholders put the pipeline's inputs on the sluice device (its .device), and every
    step but the VAE's runs there. Initial latents are given (the test accelerator has no
    generator) and, off the CPU device, the VAE decodes where it is, on the host (not offloaded).
    bf16 storage: the plain pipeline's latents and images on the host, bit for bit. fp8
    storage of the transformer (the text modules in bf16): those of the pipeline whose
    transformer has diffusers' enable_layerwise_casting, on the host, bit for bit."""
    pipe, *modules = anima_pipeline(any_device=True)
    latents0 = torch.randn(1, 4, 1, 4, 4, generator=torch.Generator().manual_seed(7))  # 32 px: 4 x 4 latents

    def run(first):
        with torch.no_grad():
            out = pipe(prompt=PROMPT, negative_prompt=NEGATIVE_PROMPT, latents=first, num_inference_steps=2, height=32,
                       width=32, max_sequence_length=16, output_type="pt", output=["latents", "images"])
        return out["latents"], out["images"]

    transformer = modules[0]
    if storage == "bfloat16":
        want_latents, want_images = run(latents0)
        kwargs = [{}, {}, {}]
    else:
        reference = copy.deepcopy(transformer)
        reference.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
        pipe.update_components(transformer=reference)
        want_latents, want_images = run(latents0)
        pipe.update_components(transformer=transformer)
        kwargs = [{"storage": storage, "skip": DIFFUSERS_DEFAULT_SKIPS}, {}, {}]
    snaps = [snapshot(m) for m in modules]
    handles = [offload(m, **{"storage": "bfloat16", "max_resident": 0.0, **kw}) for m, kw in zip(modules, kwargs)]
    assert pipe._execution_device.type == DEVICE
    decode = pipe.vae.decode
    if DEVICE != "cpu":
        pipe.vae.decode = lambda z, *args, **kwargs: decode(z.cpu(), *args, **kwargs)
    try:
        latents, images = run(latents0.to(pipe._execution_device))
    finally:
        pipe.vae.__dict__.pop("decode", None)
    stats = [h.stats() for h in handles]
    for h in handles:
        h.remove()
    assert latents.device.type == DEVICE
    assert torch.equal(latents.cpu(), want_latents)
    assert torch.equal(images.cpu(), want_images)
    assert [s["forward_count"] for s in stats] == [4, 2, 2]
    for module, snap in zip(modules, snaps):
        assert_restored(module, snap)
