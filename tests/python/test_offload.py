"""sluice.offload(module) (python/sluice/offload.py) on torch modules someone else wrote:
toy modules, diffusers' CosmosTransformer3DModel (the transformer of diffusers'
AnimaModularPipeline) at a tiny random configuration taken from diffusers' own Anima
pipeline tests, and a second family, diffusers' WanTransformer3DModel, likewise (the whole
AnimaModularPipeline is test_offload_pipeline.py's). On the CPU device (plain, and strict
with SLUICE_STRICT_DEVICE=1), and on the torch test accelerator
(SLUICE_TEST_DEVICE=testaccel; there the Wan cases are skipped, saying why).

Checks: bf16 storage gives the module's outputs bit for bit; fp8 storage gives what the
weights' fp8 round trip gives, and for the Cosmos and Wan transformers exactly what
diffusers' enable_layerwise_casting(float8_e4m3fn, bfloat16) gives with the same skip list;
remove() gives every tensor back bit for bit, where it was, with its requires_grad flag;
misuse gets one clear error."""
import copy

import pytest
import torch

import sluice
from offload_helpers import (COSMOS_CONFIG, DEVICE, DIFFUSERS_DEFAULT_SKIPS, assert_restored, offload, on_device,
                             snapshot)

torch.set_num_threads(1)

class Toy(torch.nn.Module):
    """Linear layers with and without bias, a LayerNorm and a buffer between them, and a
    layer that runs only when asked (a conditional branch)."""

    def __init__(self):
        super().__init__()
        self.proj_in = torch.nn.Linear(32, 64)
        self.norm = torch.nn.LayerNorm(64)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(64, 64, bias=False) for _ in range(3)])
        self.extra = torch.nn.Linear(64, 64)
        self.proj_out = torch.nn.Linear(64, 16)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 64))

    def forward(self, x, *, use_extra=False, fail_at=None):
        x = self.norm(self.proj_in(x)) * self.scale.to(x.dtype)
        for i, b in enumerate(self.blocks):
            if fail_at == i:
                raise RuntimeError("failing on purpose")
            x = torch.nn.functional.gelu(b(x))
        if use_extra:
            x = self.extra(x)
        return self.proj_out(x)


def toy(dtype=torch.bfloat16):
    torch.manual_seed(0)
    return Toy().to(dtype)


def test_bf16_storage_is_bit_identical_and_remove_restores_everything():
    m = toy()
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    want = [m(x), m(x, use_extra=True)]
    snap = snapshot(m)
    handle = offload(m, storage="bfloat16", max_resident=0.0)
    assert m.norm.weight.data_ptr() != snap["norm.weight"][1]  # the module's own norm moved to the device
    with torch.no_grad():
        for _ in range(2):  # the second forward runs on the recorded order
            assert torch.equal(m(on_device(x)).cpu(), want[0])
            assert torch.equal(m(on_device(x), use_extra=True).cpu(), want[1])  # a layer the first forward never called
    stats = handle.stats()
    assert stats["forward_count"] == 4
    assert stats["model"]["streamed_layers"] > 0
    handle.remove()
    assert_restored(m, snap)
    assert torch.equal(m(x), want[0])


def test_fp8_storage_computes_the_fp8_round_trip():
    m = toy()
    ref = copy.deepcopy(m)
    for name, mod in ref.named_modules():
        if isinstance(mod, torch.nn.Linear) and name != "proj_out":
            mod.weight.data = mod.weight.data.to(torch.float8_e4m3fn).to(torch.bfloat16)
            if mod.bias is not None:
                mod.bias.data = mod.bias.data.to(torch.float8_e4m3fn).to(torch.bfloat16)
    x = torch.randn(2, 32, dtype=torch.bfloat16)
    snap = snapshot(m)
    handle = offload(m, storage="float8_e4m3fn", skip=["^proj_out$"])
    with torch.no_grad():
        assert torch.equal(m(on_device(x)).cpu(), ref(x))
    handle.remove()
    assert_restored(m, snap)


def test_a_forward_that_raises_leaves_the_module_usable():
    m = toy()
    x = torch.randn(2, 32, dtype=torch.bfloat16)
    want = m(x)
    handle = offload(m, storage="bfloat16", max_resident=0.0)
    with torch.no_grad():
        with pytest.raises(RuntimeError, match="failing on purpose"):
            m(on_device(x), fail_at=1)
        assert torch.equal(m(on_device(x)).cpu(), want)
    handle.remove()


def test_misuse_gets_one_clear_error():
    m = toy()
    handle = sluice.offload(m)
    with pytest.raises(sluice.InvalidArgument, match="already offloaded"):
        sluice.offload(m)
    handle.remove()
    with pytest.raises(sluice.InvalidArgument, match="already removed"):
        handle.remove()
    with pytest.raises(sluice.InvalidArgument, match="no torch.nn.Linear"):
        sluice.offload(torch.nn.LayerNorm(8))
    meta = toy().to("meta")
    with pytest.raises(sluice.InvalidArgument, match="'proj_in.weight' is on meta"):
        sluice.offload(meta)
    mixed = toy()
    mixed.proj_out.float()
    with pytest.raises(sluice.InvalidArgument, match="several dtypes"):
        sluice.offload(mixed)
    with pytest.raises(sluice.InvalidArgument, match="storage"):
        sluice.offload(toy(), storage="int4")


# --- diffusers' Cosmos transformer (AnimaModularPipeline's), tiny --------------------------

def cosmos():
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    return diffusers.CosmosTransformer3DModel(**COSMOS_CONFIG).eval().to(torch.bfloat16)


def denoise(transformer, steps=2, device="cpu"):
    """Two Euler steps of flow matching with classifier-free guidance, as the pipeline's
    denoise loop calls the transformer (a cond and an uncond call per step)."""
    g = torch.Generator().manual_seed(1)
    move = on_device if device != "cpu" else (lambda t: t)
    latents = move(torch.randn(1, 4, 1, 8, 8, generator=g))
    cond = move(torch.randn(1, 12, 16, generator=g).to(torch.bfloat16))
    uncond = move(torch.randn(1, 11, 16, generator=g).to(torch.bfloat16))
    mask = move(torch.zeros(1, 1, 32, 32, dtype=torch.bfloat16))
    sigmas = [1.0, 0.5, 0.0]
    with torch.no_grad():
        for i in range(steps):
            t = move(torch.tensor([sigmas[i]], dtype=torch.bfloat16))
            preds = [transformer(hidden_states=latents.to(torch.bfloat16), timestep=t, encoder_hidden_states=e,
                                 padding_mask=mask, return_dict=False)[0] for e in (cond, uncond)]
            v = preds[1] + 4.0 * (preds[0] - preds[1])
            latents = latents + (sigmas[i + 1] - sigmas[i]) * v.float()
    return latents.cpu()


def test_cosmos_transformer_bf16_storage_is_bit_identical():
    tr = cosmos()
    want = denoise(tr)
    snap = snapshot(tr)
    handle = offload(tr, storage="bfloat16", max_resident=0.0)
    assert torch.equal(denoise(tr, device=DEVICE), want)
    stats = handle.stats()
    assert stats["forward_count"] == 4
    handle.remove()
    assert_restored(tr, snap)


def test_cosmos_transformer_fp8_storage_matches_diffusers_layerwise_casting():
    tr = cosmos()
    ref = copy.deepcopy(tr)
    ref.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    want = denoise(ref)
    handle = offload(tr, storage="float8_e4m3fn", skip=DIFFUSERS_DEFAULT_SKIPS)
    got = denoise(tr, device=DEVICE)
    stats = handle.stats()
    handle.remove()
    # The same layers stored in fp8 (the model declares patch_embed, final_layer, norm and
    # learnable_pos_embed; the defaults add proj_out), the same upcast, the same math.
    assert torch.equal(got, want)
    assert stats["model"]["layers"] == 38


# --- a second family: diffusers' Wan transformer, tiny -------------------------------------

# diffusers tests/models/transformers/test_models_transformer_wan.py's configuration.
WAN_CONFIG = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
                  text_dim=16, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
                  qk_norm="rms_norm_across_heads", rope_max_seq_len=32)


def wan():
    if DEVICE != "cpu":
        pytest.skip("Wan's patch embedding is a Conv3d, which the test accelerator does not implement")
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    return diffusers.WanTransformer3DModel(**WAN_CONFIG).eval().to(torch.bfloat16)


def wan_denoise(transformer, steps=2, device="cpu"):
    """Euler steps with classifier-free guidance, the transformer called as Wan's pipeline calls it."""
    g = torch.Generator().manual_seed(2)
    move = on_device if device != "cpu" else (lambda t: t)
    latents = move(torch.randn(1, 4, 2, 16, 16, generator=g))
    pos = move(torch.randn(1, 12, 16, generator=g).to(torch.bfloat16))
    neg = move(torch.randn(1, 12, 16, generator=g).to(torch.bfloat16))
    sigmas = [1.0, 0.5, 0.0]
    with torch.no_grad():
        for i in range(steps):
            t = move(torch.tensor([sigmas[i] * 1000.0]))
            x = latents.to(torch.bfloat16)
            cond = transformer(hidden_states=x, timestep=t, encoder_hidden_states=pos, return_dict=False)[0]
            unc = transformer(hidden_states=x, timestep=t, encoder_hidden_states=neg, return_dict=False)[0]
            latents = latents + (sigmas[i + 1] - sigmas[i]) * (unc + 5.0 * (cond - unc)).float()
    return latents.cpu()


def test_wan_transformer_bf16_bit_identical_and_fp8_matches_layerwise_casting():
    tr = wan()
    want = wan_denoise(tr)
    ref = copy.deepcopy(tr)
    ref.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    want8 = wan_denoise(ref)
    snap = snapshot(tr)
    handle = offload(tr, storage="bfloat16", max_resident=0.0)
    assert torch.equal(wan_denoise(tr, device=DEVICE), want)
    handle.remove()
    assert_restored(tr, snap)
    handle = offload(tr, storage="float8_e4m3fn", skip=DIFFUSERS_DEFAULT_SKIPS)
    assert torch.equal(wan_denoise(tr, device=DEVICE), want8)
    handle.remove()
    assert_restored(tr, snap)


def test_forwards_from_several_threads_take_turns():
    import threading

    m = toy()
    x = torch.randn(2, 32, dtype=torch.bfloat16)
    want = m(x)
    handle = offload(m, storage="bfloat16", max_resident=0.0)
    results, errors = [], []

    def work():
        try:
            with torch.no_grad():
                for _ in range(5):
                    results.append(torch.equal(m(on_device(x)).cpu(), want))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    handle.remove()
    assert not errors
    assert results == [True] * 15


def test_a_linear_subclass_keeps_its_own_forward():
    class Scaled(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    m = toy()
    m.proj_out = Scaled(64, 16).to(torch.bfloat16)
    x = torch.randn(2, 32, dtype=torch.bfloat16)
    want = m(x)
    handle = offload(m, storage="bfloat16", max_resident=0.0)
    with torch.no_grad():
        assert torch.equal(m(on_device(x)).cpu(), want)
    assert "forward" not in m.proj_out.__dict__
    assert handle.stats()["model"]["layers"] == 5  # proj_in, three blocks, extra: not the subclass
    handle.remove()
