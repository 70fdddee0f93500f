"""sluice.offload(module) (python/sluice/offload.py) on models loaded the way frontends load
them: saved with save_pretrained() and loaded back with from_pretrained(torch_dtype=...),
which keeps the model's _keep_in_fp32_modules in float32 beside the bf16 (or fp16) layers,
and driven by the library's own loops (transformers' generate()). Tiny random models, built
offline: diffusers' WanTransformer3DModel, CosmosTransformer3DModel and
FluxTransformer2DModel at the configurations of diffusers' own tests, transformers'
T5EncoderModel, and a Qwen3ForCausalLM. On the CPU device (plain, and strict with
SLUICE_STRICT_DEVICE=1), and on the torch test accelerator (SLUICE_TEST_DEVICE=testaccel;
there Wan is skipped, saying why).

Checks, the contract of offload() for such models:
  - a model whose layers have several dtypes offloads without compute=: each streamed layer
    computes in the dtype it had (a layer kept in float32 computes in float32), so lossless
    storage (bf16 storage of a bf16 model, fp16 of an fp16 one, its float32 layers kept
    float32) gives the unoffloaded model's outputs bit for bit;
  - fp8 storage with no skip= keeps in their own dtype exactly the layers that diffusers'
    enable_layerwise_casting(float8_e4m3fn, <the model's dtype>) skips when given no skip
    arguments (the model's _skip_layerwise_casting_patterns and _keep_in_fp32_modules plus
    diffusers' DEFAULT_SKIP_MODULES_PATTERN, whose "^proj_out$" keeps a top-level proj_out),
    and computes what that computes, bit for bit;
  - the offloaded module's forward keeps its signature, so generate() still passes
    logits_to_keep (its prefill computes the last position's logits only) and generates the
    same tokens;
  - remove() gives every tensor back bit for bit, where it was."""
import copy
import inspect

import pytest
import torch

from offload_helpers import COSMOS_CONFIG, DEVICE, assert_restored, bits, offload, on_device, snapshot
from test_offload import WAN_CONFIG, denoise, wan_denoise

torch.set_num_threads(1)

FP8 = torch.float8_e4m3fn


def loaded(cls, make, tmp_path, dtype):
    """The model make() builds (seed 0), saved with save_pretrained() and loaded back with
    cls.from_pretrained(torch_dtype=dtype), as a frontend loads it."""
    torch.manual_seed(0)
    make().save_pretrained(tmp_path / cls.__name__)
    return cls.from_pretrained(tmp_path / cls.__name__, torch_dtype=dtype).eval()


def weight_dtypes(module):
    return {m.weight.dtype for m in module.modules() if type(m) in (torch.nn.Linear, torch.nn.Embedding)}


def assert_bits(got, want, what):
    """got is want bit for bit (dtype, shape, bytes); else says by how much it is not."""
    assert (got.dtype, tuple(got.shape)) == (want.dtype, tuple(want.shape)), what
    if not torch.equal(bits(got), bits(want)):
        diff = (got.double() - want.double()).abs().max().item()
        raise AssertionError(f"{what}: not bit for bit, largest |difference| {diff:.4g} "
                             f"(of values up to {want.double().abs().max().item():.4g})")


def layerwise_cast(module, compute_dtype):
    """A deep copy of the diffusers model with enable_layerwise_casting(float8_e4m3fn,
    compute_dtype) and no skip arguments: the reference of fp8 storage with no skip=."""
    ref = copy.deepcopy(module)
    ref.enable_layerwise_casting(storage_dtype=FP8, compute_dtype=compute_dtype)
    return ref


# --- diffusers' Wan transformer: a float32 time embedder beside bf16 layers -----------------

def test_wan_loaded_in_bf16_offloads_without_compute_bit_identical_and_fp8_matches_layerwise_casting(tmp_path):
    if DEVICE != "cpu":
        pytest.skip("Wan's patch embedding is a Conv3d, which the test accelerator does not implement")
    diffusers = pytest.importorskip("diffusers")
    cls = diffusers.WanTransformer3DModel
    tr = loaded(cls, lambda: cls(**WAN_CONFIG), tmp_path, torch.bfloat16)
    # _keep_in_fp32_modules (rope, time_embedder, scale_shift_table, norm1..3) kept the time
    # embedder's two Linear layers float32; every other layer is bf16.
    assert tr.condition_embedder.time_embedder.linear_1.weight.dtype == torch.float32
    assert tr.condition_embedder.time_embedder.linear_2.weight.dtype == torch.float32
    assert weight_dtypes(tr) == {torch.bfloat16, torch.float32}
    want = wan_denoise(tr)
    ref = layerwise_cast(tr, torch.bfloat16)
    # What diffusers casts: the blocks' layers; not proj_out (its "^proj_out$" default), nor
    # the condition embedder (the model's own pattern; the time embedder stays float32).
    assert ref.blocks[0].attn1.to_q.weight.dtype == FP8
    assert ref.proj_out.weight.dtype == torch.bfloat16
    assert ref.condition_embedder.time_embedder.linear_1.weight.dtype == torch.float32
    want8 = wan_denoise(ref)
    snap = snapshot(tr)

    # bf16 storage, no compute=: the bf16 layers stored as they are, the float32 ones kept
    # float32 and computing in float32: the model's own outputs.
    handle = offload(tr, storage="bfloat16", max_resident=0.0)
    got = wan_denoise(tr, device=DEVICE)
    assert handle.stats()["forward_count"] == 4
    handle.remove()
    assert_bits(got, want, "bf16 storage of the bf16-loaded Wan")
    assert_restored(tr, snap)

    # fp8 storage, neither skip= nor compute=: what enable_layerwise_casting gives.
    handle = offload(tr, storage="float8_e4m3fn", max_resident=0.0)
    got8 = wan_denoise(tr, device=DEVICE)
    handle.remove()
    assert_bits(got8, want8, "fp8 storage without skip= against enable_layerwise_casting(fp8, bf16)")
    assert_restored(tr, snap)
    assert_bits(wan_denoise(tr), want, "the Wan after remove()")


# --- diffusers' Cosmos transformer (the Anima pipeline's) ----------------------------------

def test_cosmos_loaded_in_bf16_bit_identical_and_fp8_without_skip_matches_layerwise_casting(tmp_path):
    diffusers = pytest.importorskip("diffusers")
    cls = diffusers.CosmosTransformer3DModel
    tr = loaded(cls, lambda: cls(**COSMOS_CONFIG), tmp_path, torch.bfloat16)
    # Its _keep_in_fp32_modules is learnable_pos_embed, which this configuration
    # (extra_pos_embed_type=None) does not have: every layer is bf16.
    assert weight_dtypes(tr) == {torch.bfloat16}
    want = denoise(tr)
    ref = layerwise_cast(tr, torch.bfloat16)
    assert ref.transformer_blocks[0].attn1.to_q.weight.dtype == FP8
    assert ref.proj_out.weight.dtype == torch.bfloat16  # diffusers' default "^proj_out$"
    want8 = denoise(ref)
    snap = snapshot(tr)

    handle = offload(tr, storage="bfloat16", max_resident=0.0)
    got = denoise(tr, device=DEVICE)
    handle.remove()
    assert_bits(got, want, "bf16 storage of the bf16-loaded Cosmos")
    assert_restored(tr, snap)

    handle = offload(tr, storage="float8_e4m3fn", max_resident=0.0)
    got8 = denoise(tr, device=DEVICE)
    stats = handle.stats()
    handle.remove()
    assert_bits(got8, want8, "fp8 storage without skip= against enable_layerwise_casting(fp8, bf16)")
    assert stats["forward_count"] == 4
    assert_restored(tr, snap)


# --- diffusers' Flux transformer: proj_out is skipped by diffusers' defaults only ------------

# diffusers tests/models/transformers/test_models_transformer_flux.py's configuration.
FLUX_CONFIG = dict(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
                   num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 4, 8])


def flux_denoise(transformer, steps=2, device="cpu"):
    """Euler steps of flow matching, the transformer called with the inputs of diffusers'
    Flux model tests (4 x 4 packed latents, 48 text tokens, pooled text, position ids)."""
    g = torch.Generator().manual_seed(3)
    move = on_device if device != "cpu" else (lambda t: t)
    latents = move(torch.randn(1, 4 * 4, 4, generator=g))
    text = move(torch.randn(1, 48, 32, generator=g).to(torch.bfloat16))
    pooled = move(torch.randn(1, 32, generator=g).to(torch.bfloat16))
    txt_ids = move(torch.randn(48, 3, generator=g))
    img_ids = move(torch.randn(4 * 4, 3, generator=g))
    sigmas = [1.0, 0.5, 0.0]
    with torch.no_grad():
        for i in range(steps):
            t = move(torch.tensor([sigmas[i]]))
            v = transformer(hidden_states=latents.to(torch.bfloat16), encoder_hidden_states=text,
                            pooled_projections=pooled, timestep=t, img_ids=img_ids, txt_ids=txt_ids,
                            return_dict=False)[0]
            latents = latents + (sigmas[i + 1] - sigmas[i]) * v.float()
    return latents.cpu()


def test_flux_fp8_without_skip_keeps_proj_out_as_layerwise_casting_does(tmp_path):
    diffusers = pytest.importorskip("diffusers")
    cls = diffusers.FluxTransformer2DModel
    tr = loaded(cls, lambda: cls(**FLUX_CONFIG), tmp_path, torch.bfloat16)
    assert weight_dtypes(tr) == {torch.bfloat16}
    # The model's own patterns are pos_embed and norm: proj_out (top level) is kept by
    # diffusers' DEFAULT_SKIP_MODULES_PATTERN alone; the single blocks' proj_out is cast.
    ref = layerwise_cast(tr, torch.bfloat16)
    assert ref.proj_out.weight.dtype == torch.bfloat16
    assert ref.single_transformer_blocks[0].proj_out.weight.dtype == FP8
    assert ref.x_embedder.weight.dtype == FP8
    want8 = flux_denoise(ref)
    snap = snapshot(tr)
    handle = offload(tr, storage="float8_e4m3fn", max_resident=0.0)
    got8 = flux_denoise(tr, device=DEVICE)
    handle.remove()
    assert_bits(got8, want8, "fp8 storage without skip= against enable_layerwise_casting(fp8, bf16)")
    assert_restored(tr, snap)


# --- transformers' T5 encoder loaded in fp16: its `wo` layers stay float32 ----------------

def t5_fp16(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(d_model=32, d_ff=64, num_layers=2, num_heads=2, d_kv=16, vocab_size=100,
                                   feed_forward_proj="gated-gelu")
    cls = transformers.T5EncoderModel
    return loaded(cls, lambda: cls(config), tmp_path, torch.float16)


def fp8_round_trip(module, dtype):
    """A deep copy whose nn.Linear and nn.Embedding layers in `dtype` (T5 has no subclass of
    them), but for a weight another module holds too (a tied table moves, it does not
    stream), have their weights' fp8 round trip: what fp8 storage computing in `dtype`
    computes, layer by layer, as diffusers' layerwise casting does."""
    ref = copy.deepcopy(module)
    holders = {}
    for m in ref.modules():
        for p in m._parameters.values():
            if p is not None:
                holders[id(p)] = holders.get(id(p), 0) + 1
    cast = []
    for name, m in ref.named_modules():
        if type(m) in (torch.nn.Linear, torch.nn.Embedding) and m.weight.dtype == dtype \
                and holders[id(m.weight)] == 1:
            for p in m._parameters.values():
                if p is not None:
                    p.data = p.data.to(FP8).to(dtype)
            cast.append(name)
    return ref, cast


def test_t5_encoder_loaded_in_fp16_keeps_wo_float32_bit_identical_and_fp8(tmp_path):
    enc = t5_fp16(tmp_path)
    # transformers' _keep_in_fp32_modules for T5 is {"wo"}: the gated FFN's output layers
    # stay float32 under torch_dtype=float16; T5DenseGatedActDense casts its input to them.
    for block in enc.encoder.block:
        assert block.layer[1].DenseReluDense.wo.weight.dtype == torch.float32
        assert block.layer[1].DenseReluDense.wi_0.weight.dtype == torch.float16
    assert type(enc.encoder.block[0].layer[1].DenseReluDense).__name__ == "T5DenseGatedActDense"
    assert enc.shared.weight is enc.encoder.embed_tokens.weight  # tied: moves, does not stream
    ids = torch.randint(0, 100, (2, 7), generator=torch.Generator().manual_seed(4))

    def encode(model, device="cpu"):
        with torch.no_grad():
            return model(input_ids=on_device(ids) if device != "cpu" else ids).last_hidden_state.cpu()

    want = encode(enc)
    ref, cast = fp8_round_trip(enc, torch.float16)
    assert not any(name.endswith(".wo") for name in cast) and any(name.endswith(".wi_0") for name in cast)
    want8 = encode(ref)
    snap = snapshot(enc)

    # fp16 storage, no compute=: lossless, the float32 `wo` layers computing in float32.
    handle = offload(enc, storage="float16", max_resident=0.0)
    got = encode(enc, device=DEVICE)
    handle.remove()
    assert_bits(got, want, "fp16 storage of the fp16-loaded T5 encoder")
    assert_restored(enc, snap)

    # fp8 storage, no skip=: `wo` is under _keep_in_fp32_modules (float32, computing in
    # float32); the other streamed layers stored fp8, computing in fp16.
    handle = offload(enc, storage="float8_e4m3fn", max_resident=0.0)
    got8 = encode(enc, device=DEVICE)
    handle.remove()
    assert torch.isfinite(got8).all()
    assert_bits(got8, want8, "fp8 storage without skip= against the fp16 layers' fp8 round trip")
    assert_restored(enc, snap)


# --- transformers' generate() on an offloaded causal LM --------------------------------------

def test_generate_on_an_offloaded_causal_lm_keeps_logits_to_keep_and_its_tokens(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3Config(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      max_position_embeddings=64, tie_word_embeddings=False)
    cls = transformers.Qwen3ForCausalLM
    lm = loaded(cls, lambda: cls(config), tmp_path, torch.bfloat16)
    assert "logits_to_keep" in inspect.signature(lm.forward).parameters
    ids = torch.tensor([[5, 17, 42, 8, 3, 61]])
    shapes = []
    hook = lm.lm_head.register_forward_hook(lambda mod, args, out: shapes.append(tuple(out.shape)))

    def generate(device="cpu"):
        shapes.clear()
        x = on_device(ids) if device != "cpu" else ids
        with torch.no_grad():
            out = lm.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=3, do_sample=False,
                              pad_token_id=0)
        return out.cpu(), list(shapes)

    want, want_shapes = generate()
    assert tuple(want.shape) == (1, 6 + 3)
    assert want_shapes[0] == (1, 1, 100)  # generate() passed logits_to_keep=1 to the prefill
    snap = snapshot(lm)
    handle = offload(lm, storage="bfloat16", max_resident=0.0)
    # The wrapped forward keeps the model's signature (generate() reads it).
    sig = inspect.signature(lm.forward)
    assert "logits_to_keep" in sig.parameters, f"the offloaded forward's signature is {sig}"
    got, got_shapes = generate(device=DEVICE)
    stats = handle.stats()
    handle.remove()
    hook.remove()
    assert got_shapes[0] == (1, 1, 100), f"the prefill computed logits of shape {got_shapes[0]}"
    assert got_shapes == want_shapes
    assert torch.equal(got, want), f"generated {got.tolist()}, want {want.tolist()}"
    assert stats["forward_count"] == len(want_shapes)  # one sluice forward per generation step
    assert_restored(lm, snap)
