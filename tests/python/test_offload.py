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
import os

import pytest
import torch

import sluice
from offload_helpers import (COSMOS_CONFIG, DEVICE, DIFFUSERS_DEFAULT_SKIPS, assert_restored, bits, offload, on_device,
                             snapshot, status_bytes)

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
    assert m.norm.weight.data_ptr() != snap["norm.weight"].ptr  # the module's own norm moved to the device
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
    with pytest.raises(sluice.InvalidArgument, match="no layer to stream"):
        sluice.offload(torch.nn.LayerNorm(8))
    meta = toy().to("meta")
    with pytest.raises(sluice.InvalidArgument, match="'proj_in.weight' is on meta"):
        sluice.offload(meta)
    with pytest.raises(sluice.InvalidArgument, match="storage"):
        sluice.offload(toy(), storage="int4")


# --- host memory: the originals freed while offloaded (issue 31) ---------------------------

def rss_bytes():
    return status_bytes("VmRSS")


def assert_placeholder(p, dtype, shape):
    """A freed weight: same dtype, shape and Parameter, one element of memory."""
    assert isinstance(p, torch.nn.Parameter)
    assert p.dtype == dtype and tuple(p.shape) == tuple(shape)
    assert p.untyped_storage().nbytes() <= p.element_size()
    assert all(s == 0 for s in p.stride())


@pytest.mark.parametrize("originals", ["disk", "ram"])
def test_fp8_storage_gives_the_originals_back_bit_for_bit(originals, tmp_path):
    m = toy()
    # A non-contiguous weight (its strides come back too) and bits that compare equal as
    # values but differ as bytes (-0.0), which only a byte-exact restore keeps.
    m.proj_out.weight.data = m.proj_out.weight.data.t().contiguous().t()
    with torch.no_grad():
        m.blocks[0].weight[0, :4] = -0.0
    snap = snapshot(m)
    x = torch.randn(2, 32, dtype=torch.bfloat16)
    handle = offload(m, storage="float8_e4m3fn", originals=originals, spill_dir=str(tmp_path))
    for lin in (m.proj_in, m.blocks[0], m.proj_out):
        assert_placeholder(lin.weight, torch.bfloat16, lin.weight.shape)
    assert_placeholder(m.proj_in.bias, torch.bfloat16, (64,))
    assert m.proj_in.weight.device.type == DEVICE  # where the module runs now (then home again)
    # The model-level properties code reads keep working (diffusers' ModelMixin.dtype).
    assert next(m.parameters()).dtype == torch.bfloat16
    assert os.listdir(tmp_path) == []  # the spill file has no name
    with torch.no_grad():
        m(on_device(x))
    handle.remove()
    assert_restored(m, snap)
    assert m.proj_out.weight.stride() == (1, 16)


def test_bad_originals_gets_one_clear_error():
    m = toy()
    snap = snapshot(m)
    with pytest.raises(sluice.InvalidArgument, match="originals='tmp'; one of 'disk', 'ram'"):
        offload(m, originals="tmp")
    with pytest.raises(sluice.InvalidArgument, match="spill_dir"):
        offload(m, spill_dir="/nonexistent/sluice-spill")
    assert_restored(m, snap, same_memory=True)


def test_lossless_storage_frees_the_linear_weights_and_rss_does_not_double():
    torch.manual_seed(0)
    # 16 x 8 MiB of bf16 weights: large against the run's noise, and against the staging
    # ring (a few of the largest layer's slots; every layer streams).
    m = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048, bias=False) for _ in range(16)]).to(torch.bfloat16)
    model_bytes = sum(p.numel() * p.element_size() for p in m.parameters())
    x = torch.randn(2, 2048, dtype=torch.bfloat16)
    with torch.no_grad():
        want = m(x)
    snap = snapshot(m)
    before = rss_bytes()
    handle = offload(m, storage="bfloat16", max_resident=0.0)
    for lin in m:
        assert_placeholder(lin.weight, torch.bfloat16, (2048, 2048))
    with torch.no_grad():
        assert torch.equal(m(on_device(x)).cpu(), want)
    # The stored copy is the module's own memory (no second copy); keeping the originals as
    # well would add the whole model (that was 2x, and 3x for fp8 storage).
    grew = rss_bytes() - before
    assert grew < model_bytes // 2, f"RSS grew {grew / 2**20:.1f} MiB for a {model_bytes / 2**20:.0f} MiB model"
    handle.remove()
    assert_restored(m, snap)


def test_state_dict_to_and_load_state_dict_of_an_offloaded_module_raise_until_remove():
    m = toy()
    want = m.state_dict()
    handle = offload(m, storage="float8_e4m3fn")
    with pytest.raises(sluice.InvalidArgument, match=r"state_dict\(\) of an offloaded module; remove\(\) it first"):
        m.state_dict()
    with pytest.raises(sluice.InvalidArgument, match=r"state_dict\(\) of an offloaded module"):
        m.blocks[1].state_dict()  # a streamed layer on its own
    with pytest.raises(sluice.InvalidArgument, match=r"load_state_dict\(\) into an offloaded module"):
        m.load_state_dict(want)
    with pytest.raises(sluice.InvalidArgument, match=r"\.to\(\).*remove\(\) it first"):
        m.to(torch.float32)
    with pytest.raises(sluice.InvalidArgument, match=r"\.to\(\)"):
        m.blocks[0].float()
    handle.remove()
    got = m.state_dict()
    assert set(got) == set(want)
    assert all(torch.equal(bits(got[k]), bits(want[k])) for k in want)
    m.load_state_dict(want)
    m.to(torch.float32)  # the module's own again
    assert m.proj_in.weight.dtype == torch.float32


def test_a_failing_offload_leaves_the_module_untouched(monkeypatch):
    m = toy()
    with torch.no_grad():
        m.blocks[1].weight[3, 5] = float("nan")
    m.norm.weight.requires_grad_(True)
    snap = snapshot(m)
    # Refused by the C++ side while it stores the layers. The layers before it were handed
    # over (their originals freed) one at a time: they come back bit for bit, in new memory.
    with pytest.raises(sluice.InvalidArgument, match="blocks.1"):
        offload(m, storage="float8_e4m3fn")
    assert_restored(m, snap)
    assert m.blocks[2].weight.data_ptr() == snap["blocks.2.weight"].ptr  # never handed over: untouched
    assert "_sluice_offload" not in m.__dict__
    # Failing after the C++ model was made (writing the originals): undone as well.
    impl = __import__("sys").modules["sluice._offload_layers"]

    def full_disk(self, t):
        raise OSError(28, "No space left on device")

    with torch.no_grad():
        m.blocks[1].weight[3, 5] = 0.5
    snap = snapshot(m)
    monkeypatch.setattr(impl.Spill, "write", full_disk)
    with pytest.raises(OSError, match="No space left"):
        offload(m, storage="float8_e4m3fn")
    monkeypatch.undo()
    assert_restored(m, snap)  # proj_in (kept in bf16 by the default skip list) was handed over first
    handle = offload(m, storage="float8_e4m3fn")  # and it offloads as any module
    handle.remove()
    assert_restored(m, snap)


def test_a_linear_whose_weight_another_module_shares_is_not_freed():
    m = toy()
    m.extra.weight = m.blocks[0].weight  # tied: freeing it would leave blocks[0] a placeholder
    x = torch.randn(2, 32, dtype=torch.bfloat16)
    want = m(x, use_extra=True)
    snap = snapshot(m)
    handle = offload(m, storage="bfloat16", max_resident=0.0)
    assert handle.stats()["model"]["layers"] == 4  # proj_in, blocks 1 and 2, proj_out
    assert m.blocks[0].weight.untyped_storage().nbytes() == 64 * 64 * 2
    with torch.no_grad():
        assert torch.equal(m(on_device(x), use_extra=True).cpu(), want)
    handle.remove()
    assert_restored(m, snap)


def test_a_module_on_the_device_comes_back_on_it():
    if DEVICE == "cpu":
        pytest.skip("on the CPU device the device is the host: the other tests cover it")
    sluice.offload(toy(), device=DEVICE).remove()  # loads the device's library (SLUICE_DEVICE_LIBRARY)
    x = torch.randn(2, 32, dtype=torch.bfloat16)
    want = toy()(x)
    on_device(x)  # registers the backend's Python module before Module.to() takes it
    for storage in ("bfloat16", "float8_e4m3fn"):
        m = toy().to(DEVICE)
        m.norm.weight.requires_grad_(True)
        m.proj_in.weight.requires_grad_(True)
        snap = snapshot(m)
        assert snap["proj_in.weight"].device.type == DEVICE
        with pytest.raises(sluice.InvalidArgument, match=f"'proj_in.weight' is on {DEVICE}:0; offload\\(device='cpu'\\)"):
            sluice.offload(m, device="cpu")
        assert_restored(m, snap, same_memory=True)
        handle = offload(m, storage=storage, max_resident=0.0)
        assert m.proj_in.weight.device == snap["proj_in.weight"].device  # the placeholder stays where it was
        assert m.proj_in.weight.untyped_storage().nbytes() <= 2
        with torch.no_grad():
            got = m(on_device(x)).cpu()
        if storage == "bfloat16":
            assert torch.equal(got, want)
        handle.remove()
        assert_restored(m, snap)
        with torch.no_grad():
            assert torch.equal(m(on_device(x)).cpu(), want)  # its own forward, on the device
    # A module from the host runs on the device too: its placeholders say so (a pipeline
    # places its inputs on its first module's .device), and remove() brings it home.
    m = toy()
    snap = snapshot(m)
    handle = offload(m, storage="bfloat16")
    assert m.proj_in.weight.device.type == DEVICE
    with torch.no_grad():
        assert torch.equal(m(on_device(x)).cpu(), want)
    handle.remove()
    assert_restored(m, snap)
    assert m.proj_in.weight.device.type == "cpu"


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


def test_a_linear_subclass_streams_running_its_own_forward():
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
    assert handle.stats()["model"]["layers"] == 6  # proj_in, three blocks, extra and the subclass
    handle.remove()
    assert "_call_impl" not in m.proj_out.__dict__


# --- layers other than Linear, one cache for several modules, traces ------------------------

class Convs(torch.nn.Module):
    """An embedding, convolutions (one with reflect padding and groups) and a Linear, beside
    the kinds sluice leaves to move with the other tensors: an embedding with max_norm (its
    lookup rewrites the table) and a transposed convolution."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(100, 8, padding_idx=0)
        self.renormed = torch.nn.Embedding(10, 8, max_norm=1.0)
        self.conv = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.grouped = torch.nn.Conv1d(8, 8, 3, padding=1, padding_mode="reflect", groups=2, bias=False)
        self.up = torch.nn.ConvTranspose2d(8, 4, 2, stride=2)
        self.head = torch.nn.Linear(4, 4)

    def forward(self, ids):
        e = self.embed(ids) + self.renormed(ids % 10)                 # [B, L, 8]
        x = self.grouped(e.transpose(1, 2))                            # [B, 8, L]
        x = self.conv(x.unsqueeze(-1).expand(-1, -1, -1, 4))           # [B, 8, L, 4]
        return self.head(self.up(x).permute(0, 2, 3, 1))               # [B, 2L, 8, 4]


def test_embeddings_and_convolutions_stream_bit_identical():
    torch.manual_seed(0)
    m = Convs().to(torch.bfloat16)
    ids = torch.randint(0, 100, (2, 6))
    with torch.no_grad():
        want = m(ids)
    snap = snapshot(m)
    handle = offload(m, storage="bfloat16", max_resident=0.0)
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(m(on_device(ids)).cpu(), want)
    stats = handle.stats()
    handle.remove()
    assert_restored(m, snap)
    # embed, conv, grouped, head managed; the embedding stays resident, the other three stream.
    assert stats["model"]["layers"] == 4
    assert stats["model"]["streamed_layers"] == 3
    with torch.no_grad():
        assert torch.equal(m(ids), want)


def test_fp8_convolutions_compute_the_fp8_round_trip():
    torch.manual_seed(1)
    m = Convs().to(torch.bfloat16)
    ref = copy.deepcopy(m)
    for mod in (ref.embed, ref.conv, ref.grouped, ref.head):
        for p in mod.parameters():
            p.data = p.data.to(torch.float8_e4m3fn).to(torch.bfloat16)
    ids = torch.randint(0, 100, (2, 5))
    handle = offload(m, storage="float8_e4m3fn")
    with torch.no_grad():
        assert torch.equal(m(on_device(ids)).cpu(), ref(ids))
    handle.remove()


def two_toys():
    torch.manual_seed(3)
    return Toy().to(torch.bfloat16), Toy().to(torch.bfloat16)


def test_modules_in_one_model_cache_share_its_budget():
    a, b = two_toys()
    x = torch.randn(2, 32, dtype=torch.bfloat16)
    with torch.no_grad():
        want = a(x), b(x)
    size = sum(t.numel() * t.element_size() for t in a.state_dict().values())
    mib = 1 << 20
    # Beside the working memory, room for one toy and a half: each forward takes its share
    # from the other module, which is not running.
    cache = sluice.ModelCache(device=DEVICE, vram_budget=str(mib + size * 3 // 2), working_memory=str(mib))
    ha = sluice.offload(a, cache=cache, name="a", storage="bfloat16")
    hb = sluice.offload(b, cache=cache, name="b", storage="bfloat16")
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(a(on_device(x)).cpu(), want[0])
            assert torch.equal(b(on_device(x)).cpu(), want[1])
    stats = cache.stats()["cache"]
    assert {m["name"] for m in stats["models_held"]} == {"a", "b"}
    assert stats["vram_reserved_bytes"] <= stats["vram_limit_bytes"]
    assert stats["device_unloads"] + stats["device_drops"] > 0
    assert cache.models() == []  # offloaded modules are not sluice.Model handles
    assert ha.stats()["budget"]["budget_bytes"] == mib + size * 3 // 2
    with pytest.raises(sluice.InvalidArgument, match="set the budget with the cache's set_vram_budget"):
        ha.set_vram_budget("64MiB")
    ha.remove()
    hb.remove()
    assert cache.stats()["cache"]["models_held"] == []


def test_the_cache_options_belong_to_the_cache():
    cache = sluice.ModelCache(device=DEVICE)
    m = toy()
    for kwargs in ({"vram_budget": "1GiB"}, {"device": "cpu"}, {"prefetch": 2}, {"trace": True},
                   {"working_memory": "1MiB"}, {"pin_memory": "off"}):
        with pytest.raises(sluice.InvalidArgument, match=f"offload: {next(iter(kwargs))} belong to the ModelCache"):
            sluice.offload(m, cache=cache, **kwargs)
    with pytest.raises(sluice.InvalidArgument, match="cache= takes a sluice.ModelCache, got str"):
        sluice.offload(m, cache="cuda")
    assert "forward" not in m.__dict__
    with pytest.raises(sluice.InvalidArgument, match="prefetch"):
        offload(m, prefetch="soon")
    assert "forward" not in m.__dict__


def test_trace_and_timeline_of_an_offloaded_module(tmp_path):
    import json

    m = toy()
    x = on_device(torch.randn(2, 32, dtype=torch.bfloat16))
    handle = offload(m, storage="bfloat16", max_resident=0.0, trace=True, prefetch=1)
    with torch.no_grad():
        for _ in range(3):
            m(x)
    handle.trace(tmp_path / "trace.json")
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert any("proj_in" in e.get("name", "") for e in events)
    handle.timeline(tmp_path / "step.svg")
    svg = (tmp_path / "step.svg").read_text()
    assert "<svg" in svg and svg.rstrip().endswith("</svg>") and "proj_in" in svg
    handle.remove()
    with pytest.raises(sluice.InvalidArgument, match="already removed"):
        handle.trace(tmp_path / "again.json")
    untraced = offload(m, storage="bfloat16")
    with torch.no_grad():
        m(x)
    with pytest.raises(sluice.InvalidArgument, match="tracing is off"):
        untraced.timeline(tmp_path / "none.svg")
    untraced.remove()
