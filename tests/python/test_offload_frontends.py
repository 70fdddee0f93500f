"""sluice.offload(module) under the code frontends attach to the models they run: InvokeAI's
ControlNet-LLLite adapter (AnimaControlNetLLLite, which swaps the instance `forward` of its
target Linears) and its regional-prompting patch (patch_anima_for_regional_prompting, which
swaps the cross-attentions' `forward`) on InvokeAI's own AnimaTransformer, accelerate's
add_hook_to_module, torch's forward pre/post hooks, a ControlNet-style patch undone with
`del layer.forward`, and a parent module that reads its layers' weights itself (a fused
QKV projection). InvokeAI's code is its own, taken from the pinned wheel by
scripts/fetch_reference.sh into .deps/reference/pkg (never committed; see that script for
the one stub module).

Why: a frontend binds such patches before or after it offloads a model, and undoes them
before or after remove(). sluice must run a streamed layer's whole call (hooks, the
frontend's instance forward, a subclass's forward) with its real weights, leave every
instance attribute it did not set as the frontend left it, and refuse to let code read a
streamed weight's values outside its layer's call (sluice.InvalidArgument naming the layer
and exclude=, which keeps a layer out of streaming) instead of giving it zeros.

Checks: with bf16 storage of a bf16 model (lossless), every patched or hooked model's
output equals the unoffloaded patched model's bit for bit, under max_resident=0.0 (every
layer streamed) and the default budget; after remove() the frontends' own unbinding works
and the model gives its plain output with every tensor back; a streamed weight's metadata
reads while its values raise. On the CPU device (plain, and strict with
SLUICE_STRICT_DEVICE=1) and on the torch test accelerator (SLUICE_TEST_DEVICE=testaccel).
"""
import contextlib
import functools
import re
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module

import sluice
from offload_helpers import DEVICE, assert_restored, backend, offload, on_device, snapshot

torch.set_num_threads(1)

# InvokeAI's package tree (scripts/fetch_reference.sh): importable as `invokeai`, as
# InvokeAI's own modules import each other.
INVOKEAI_PKG = Path(__file__).resolve().parents[2] / ".deps" / "reference" / "pkg"
if not (INVOKEAI_PKG / "invokeai" / "backend" / "anima" / "control_net_lllite.py").is_file():
    pytest.fail(f"InvokeAI's package tree is missing at {INVOKEAI_PKG}: run scripts/fetch_reference.sh",
                pytrace=False)
sys.path.insert(0, str(INVOKEAI_PKG))

from invokeai.backend.anima import anima_transformer, control_net_lllite  # noqa: E402
from invokeai.backend.anima.anima_transformer_patch import patch_anima_for_regional_prompting  # noqa: E402
from invokeai.backend.anima.conditioning_data import AnimaRegionalTextConditioning, AnimaTextConditioning  # noqa: E402
from invokeai.backend.anima.regional_prompting import AnimaRegionalPromptingExtension  # noqa: E402
from invokeai.backend.stable_diffusion.diffusion.conditioning_data import Range  # noqa: E402
from invokeai.backend.util.devices import TorchDevice  # noqa: E402

# What the error for a streamed weight read outside its layer's call must mention: the option
# that keeps the layer out of streaming (skip= keeps a layer's dtype; it still streams).
FIX_OPTION = "exclude="
BUDGETS = [pytest.param(0.0, id="all-streamed"), pytest.param(None, id="default-budget")]
ORDERS = ["before-offload", "after-offload"]


def move(t, device):
    return on_device(t) if device != "cpu" else t


def torch_device(name):
    """torch.device(name), the test accelerator's Python side registered first."""
    if name != "cpu":
        backend()
    return torch.device(name)


def instance_forwards(module):
    """Each submodule's instance `forward` (None where it has none, its class's runs)."""
    return {name: m.__dict__.get("forward") for name, m in module.named_modules()}


# --- InvokeAI's Anima transformer with its ControlNet-LLLite adapter -----------------------

LATENT_HW = 8      # latent 8x8 -> a 4x4 token grid (patch 2), the LLLite trunk's 64x64 cond image
TOKENS = (LATENT_HW // 2) ** 2
DIM = 32           # model_channels = crossattn_emb_channels = the LLM adapter's width


def anima():
    """InvokeAI's AnimaTransformer, 2 blocks at width 32, bf16, random weights (the same
    ones at every call). AnimaTransformer.__init__ builds its LLMAdapter at the full size
    (32128-token vocabulary, 6 blocks of width 1024): built tiny here, through the name the
    module looks up."""
    full = anima_transformer.LLMAdapter
    anima_transformer.LLMAdapter = functools.partial(full, vocab_size=64, dim=DIM, num_layers=1, num_heads=2)
    try:
        torch.manual_seed(0)
        tr = anima_transformer.AnimaTransformer(
            max_img_h=32, max_img_w=32, in_channels=4, out_channels=4, model_channels=DIM, num_blocks=2,
            num_heads=2, mlp_ratio=2.0, crossattn_emb_channels=DIM, use_adaln_lora=True, adaln_lora_dim=8)
    finally:
        anima_transformer.LLMAdapter = full
    return tr.eval().requires_grad_(False).to(torch.bfloat16)


def lllite(device="cpu"):
    """InvokeAI's AnimaControlNetLLLite from a random v2 state dict (the on-disk key format:
    lllite_conditioning1.* and lllite_dit_blocks_{i}_{target}.*, hyperparameters in the
    lllite.* metadata), targeting all five Linears of both blocks. The layers a fresh
    adapter zero-initialises (up, cond_to_film, depth_embed: an exact passthrough) are
    random too, so the adapter moves the output. Its LLLite modules run on `device`, its
    conditioning trunk (convolutions) on the host."""
    names = [f"lllite_dit_blocks_{i}_{suffix}" for i in range(2) for suffix in control_net_lllite._SUFFIX_TO_ATTR_PATH]
    meta = {"lllite.cond_emb_dim": "16", "lllite.mlp_dim": "8", "lllite.cond_dim": "16", "lllite.cond_resblocks": "1",
            "lllite.use_aspp": "false", "lllite.cond_in_channels": "3"}
    torch.manual_seed(1)
    template = control_net_lllite.AnimaControlNetLLLite(
        [(n, DIM) for n in names], cond_emb_dim=16, mlp_dim=8, cond_dim=16, cond_resblocks=1).state_dict()
    g = torch.Generator().manual_seed(2)
    state_dict = {}
    for key, t in template.items():
        if key.startswith("conditioning1."):
            saved = "lllite_" + key
        else:
            _, index, tail = key.split(".", 2)   # lllite_modules.{i}.{tail}
            saved = f"{names[int(index)]}.{tail}"
        if re.search(r"\.(up|cond_to_film)\.|\.depth_embed$", key):
            t = torch.randn(t.shape, generator=g) * 0.3
        state_dict[saved] = t
    adapter = control_net_lllite.AnimaControlNetLLLite.from_state_dict(state_dict, meta).to(torch.bfloat16)
    assert len(adapter.lllite_modules) == 10
    adapter.lllite_modules.to(torch_device(device))
    return adapter


def cond_image():
    """A random RGB image through InvokeAI's own preparation (resized to the trunk's size)."""
    g = torch.Generator().manual_seed(3)
    return control_net_lllite.prepare_cond_image(torch.rand(1, 3, 40, 48, generator=g), LATENT_HW, LATENT_HW)


def prompt(seed, length):
    g = torch.Generator().manual_seed(seed)
    return AnimaTextConditioning(qwen3_embeds=torch.randn(length, DIM, generator=g).to(torch.bfloat16),
                                 t5xxl_ids=torch.randint(0, 64, (length,), generator=g),
                                 t5xxl_weights=(1 + 0.1 * torch.randn(length, generator=g)).to(torch.bfloat16))


def text_context(tr, tc, device):
    """The LLM adapter's context for one prompt, as AnimaDenoiseInvocation computes it:
    transformer.preprocess_text_embeds, outside the transformer's forward."""
    return tr.preprocess_text_embeds(move(tc.qwen3_embeds.unsqueeze(0), device), move(tc.t5xxl_ids.unsqueeze(0), device),
                                     t5xxl_weights=move(tc.t5xxl_weights.view(1, -1, 1), device))


def contexts(tr, *, regional, device, mask_device=None):
    """AnimaDenoiseInvocation's conditioning (one positive, one negative prompt); with
    `regional`, two positive prompts, the first masked to the image's left half, the second
    global: each through the LLM adapter on its own (_run_llm_adapter_for_regions), and
    InvokeAI's cross-attention mask, built where TorchDevice chooses (`mask_device`).
    Returns (positive context, negative context, the regional extension or None)."""
    mask_device = torch_device(mask_device or device)
    with torch.no_grad():
        neg = text_context(tr, prompt(11, 5), device)
        if not regional:
            return text_context(tr, prompt(10, 6), device), neg, None
        left = torch.zeros(1, 8 * LATENT_HW, 8 * LATENT_HW, dtype=torch.bool)
        left[..., : 4 * LATENT_HW] = True
        token_hw = LATENT_HW // 2
        regions = [prompt(12, 6), prompt(13, 4)]
        regions[0].mask = AnimaRegionalPromptingExtension.preprocess_regional_prompt_mask(
            left, token_hw, token_hw, torch.bfloat16, mask_device)
        embeds, ranges, start = [], [], 0
        for tc in regions:
            ctx = text_context(tr, tc, device).squeeze(0)
            embeds.append(ctx)
            ranges.append(Range(start=start, end=start + ctx.shape[0]))
            start += ctx.shape[0]
        cond = AnimaRegionalTextConditioning(context_embeds=torch.cat(embeds), image_masks=[tc.mask for tc in regions],
                                             context_ranges=ranges)
        TorchDevice.set_session_device(mask_device)
        try:
            ext = AnimaRegionalPromptingExtension.from_regional_conditioning(cond, TOKENS)
        finally:
            TorchDevice.clear_session_device()
        assert ext.cross_attn_mask is not None and ext.cross_attn_mask.shape == (TOKENS, start)
        return cond.context_embeds.unsqueeze(0), neg, ext


@contextlib.contextmanager
def invokeai_patches(tr, adapter, ext):
    """What AnimaDenoiseInvocation wraps its denoise loop in: the regional patch (a no-op
    without an extension), then the LLLite adapter bound with its cond image; undone in
    reverse (adapter.restore(), then the patch's own restore)."""
    with patch_anima_for_regional_prompting(tr, ext):
        adapter.apply_to(tr)
        adapter.set_cond_image(cond_image())
        try:
            yield
        finally:
            adapter.restore()
            adapter.clear_cond_image()


def euler_step(tr, pos, neg, device):
    """One Euler step with classifier-free guidance as AnimaDenoiseInvocation's loop makes it
    (t5xxl_ids=None: the contexts are computed already)."""
    g = torch.Generator().manual_seed(4)
    latents = move(torch.randn(1, 4, 1, LATENT_HW, LATENT_HW, generator=g).to(torch.bfloat16), device)
    t = move(torch.tensor([0.75], dtype=torch.bfloat16), device)
    with torch.no_grad():
        cond = tr(x=latents, timesteps=t, context=pos).float()
        uncond = tr(x=latents, timesteps=t, context=neg).float()
    return (latents.float() + (0.5 - 0.75) * (uncond + 4.0 * (cond - uncond))).cpu()


def invokeai_reference(*, adapter, regional, patch=True):
    """InvokeAI's output on the unoffloaded model, and its modules' instance forwards after
    InvokeAI undid its patches. patch=False: the regional contexts without the regional
    patch (the masked cross-attention)."""
    tr = anima()
    pos, neg, ext = contexts(tr, regional=regional, device="cpu")
    if not patch:
        ext = None
    if adapter:
        with invokeai_patches(tr, lllite(), ext):
            out = euler_step(tr, pos, neg, "cpu")
    else:
        with patch_anima_for_regional_prompting(tr, ext):
            out = euler_step(tr, pos, neg, "cpu")
    return out, instance_forwards(tr)


def assert_equal(got, want, what, without=None):
    """torch.equal, failing with one line: how far off, and whether `got` is `without` (the
    output without the patch or hook: it was bypassed)."""
    if torch.equal(got, want):
        return
    diff = (got.float() - want.float()).abs().max().item() if got.shape == want.shape else float("nan")
    bypassed = without is not None and torch.equal(got, without)
    raise AssertionError(f"{what}: not the expected output bit for bit (max |difference| {diff:.4g})"
                         + ("; it is the output WITHOUT the patch or hook: bypassed" if bypassed else ""))


def test_the_lllite_adapter_changes_invokeais_output():
    """The premise of the adapter tests: bound, the adapter really moves the output."""
    plain, _ = invokeai_reference(adapter=False, regional=False)
    want, forwards = invokeai_reference(adapter=True, regional=False)
    rel = ((want - plain).norm() / plain.norm()).item()
    assert rel > 0.02, f"the adapter moved the output by {rel:.4f} (relative L2)"
    assert all(f is None for f in forwards.values())  # restore() deletes the forwards it set


@pytest.mark.parametrize("max_resident", BUDGETS)
def test_lllite_bound_before_offload(max_resident):
    """InvokeAI binds its adapter, then the model is offloaded: sluice must keep the
    adapter's forward; after remove() the adapter's restore() (which deletes the instance
    forward it set) must find it."""
    plain, _ = invokeai_reference(adapter=False, regional=False)
    want, _ = invokeai_reference(adapter=True, regional=False)
    tr = anima()
    pos, neg, _ = contexts(tr, regional=False, device="cpu")
    snap = snapshot(tr)
    adapter = lllite(DEVICE)
    adapter.apply_to(tr)
    adapter.set_cond_image(cond_image())
    q = tr.blocks[0].self_attn.q_proj
    assert q.__dict__["forward"] == adapter.lllite_modules[0].forward
    handle = offload(tr, storage="bfloat16", max_resident=max_resident)
    assert_equal(euler_step(tr, move(pos, DEVICE), move(neg, DEVICE), DEVICE), want, "LLLite bound before", plain)
    assert q.__dict__.get("forward") == adapter.lllite_modules[0].forward  # still the adapter's
    handle.remove()
    assert q.__dict__.get("forward") == adapter.lllite_modules[0].forward, "remove() dropped the adapter's forward"
    adapter.restore()  # KeyError: 'forward' where remove() deleted it
    adapter.clear_cond_image()
    assert_restored(tr, snap)  # no instance forward left anywhere
    assert_equal(euler_step(tr, pos, neg, "cpu"), plain, "removed, adapter restored")


@pytest.mark.parametrize("unbind", ["restore-then-remove", "remove-then-restore"])
@pytest.mark.parametrize("max_resident", BUDGETS)
def test_lllite_bound_after_offload(max_resident, unbind):
    """The model is offloaded, then InvokeAI binds its adapter (it saves the forward it finds,
    the Linear's own, and whether it was an instance attribute). Undone before remove(), or
    after it: remove() must not take the adapter's forward away, and restore() must then
    leave no instance forward behind."""
    plain, _ = invokeai_reference(adapter=False, regional=False)
    want, _ = invokeai_reference(adapter=True, regional=False)
    tr = anima()
    snap = snapshot(tr)
    handle = offload(tr, storage="bfloat16", max_resident=max_resident)
    pos, neg, _ = contexts(tr, regional=False, device=DEVICE)  # the LLM adapter, offloaded
    adapter = lllite(DEVICE)
    adapter.apply_to(tr)
    adapter.set_cond_image(cond_image())
    assert_equal(euler_step(tr, pos, neg, DEVICE), want, "LLLite bound after", plain)
    targets = [adapter._resolve_target(tr, lm.lllite_name) for lm in adapter.lllite_modules]
    if unbind == "restore-then-remove":
        adapter.restore()
        # It found no instance forward on its targets when it bound, so it deletes its own.
        left = [lm.lllite_name for lm, t in zip(adapter.lllite_modules, targets) if "forward" in t.__dict__]
        assert not left, f"restore() left an instance forward (the one it found when it bound) on {left}"
        assert_equal(euler_step(tr, pos, neg, DEVICE), plain, "LLLite restored while offloaded", want)
        handle.remove()
    else:
        handle.remove()
        # Still bound: the adapter's forward, around the layer's own, on the restored weights.
        assert tr.blocks[0].self_attn.q_proj.__dict__.get("forward") == adapter.lllite_modules[0].forward, (
            "remove() dropped the adapter's forward")
        adapter.lllite_modules.to("cpu")
        assert_equal(euler_step(tr, pos.cpu(), neg.cpu(), "cpu"), want, "removed, adapter still bound", plain)
        adapter.restore()
    adapter.clear_cond_image()
    assert_restored(tr, snap)
    assert_equal(euler_step(tr, pos.cpu(), neg.cpu(), "cpu"), plain, "removed, adapter restored")


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("max_resident", BUDGETS)
def test_regional_prompting_patch_with_the_lllite_adapter(max_resident, order):
    """InvokeAI's regional prompting (a masked cross-attention patched into block 0's
    cross_attn.forward, which calls the streamed q/k/v/output projections itself) together
    with the LLLite adapter (which wraps cross_attn.q_proj among others), bound before the
    model is offloaded or after it; InvokeAI's own undoing (reverse order) in both."""
    want, forwards_after = invokeai_reference(adapter=True, regional=True)
    regional_only, _ = invokeai_reference(adapter=False, regional=True)   # the adapter bypassed
    unpatched, _ = invokeai_reference(adapter=False, regional=True, patch=False)
    assert not torch.equal(want, regional_only) and not torch.equal(regional_only, unpatched)  # both patches matter
    tr = anima()
    snap = snapshot(tr)
    adapter = lllite(DEVICE)
    if order == "before-offload":
        pos, neg, ext = contexts(tr, regional=True, device="cpu", mask_device=DEVICE)
        pos, neg = move(pos, DEVICE), move(neg, DEVICE)
        with invokeai_patches(tr, adapter, ext):
            handle = offload(tr, storage="bfloat16", max_resident=max_resident)
            assert_equal(euler_step(tr, pos, neg, DEVICE), want, "regional + LLLite bound before", regional_only)
            handle.remove()
    else:
        handle = offload(tr, storage="bfloat16", max_resident=max_resident)
        pos, neg, ext = contexts(tr, regional=True, device=DEVICE)
        with invokeai_patches(tr, adapter, ext):
            assert_equal(euler_step(tr, pos, neg, DEVICE), want, "regional + LLLite bound after", regional_only)
        handle.remove()
    # InvokeAI's patch restores by assignment: each cross_attn keeps its own bound forward
    # in its instance dict, as in the unoffloaded run; nothing else has one.
    now = instance_forwards(tr)
    assert {k for k, f in now.items() if f is not None} == {k for k, f in forwards_after.items() if f is not None}
    for name in (k for k, f in now.items() if f is not None):
        m = tr.get_submodule(name)
        assert now[name].__func__ is type(m).forward and now[name].__self__ is m, name
        del m.__dict__["forward"]  # InvokeAI's leftover, for assert_restored
    assert_restored(tr, snap)
    assert_equal(euler_step(tr, pos.cpu(), neg.cpu(), "cpu"), unpatched, "removed, patches undone")


# --- toy models: accelerate's hooks, torch's hooks, ControlNet-style patches ----------------

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj_in = torch.nn.Linear(16, 32)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(32, 32) for _ in range(2)])
        self.norm = torch.nn.LayerNorm(32)
        self.proj_out = torch.nn.Linear(32, 8)

    def forward(self, x):
        x = self.proj_in(x)
        for b in self.blocks:
            x = F.gelu(b(x))
        return self.proj_out(self.norm(x))


def net():
    torch.manual_seed(0)
    return Net().to(torch.bfloat16)


def toy_input():
    return torch.randn(3, 16, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)


class HalveInDoubleOut(ModelHook):
    """An accelerate hook that changes its layer's input and output."""

    def pre_forward(self, module, x):
        return (x * 0.5,), {}

    def post_forward(self, module, output):
        return output * 2 + 1


@pytest.mark.parametrize("order", ORDERS)
def test_accelerate_hook(order):
    """accelerate's add_hook_to_module (module.forward = a partial around the layer's own
    forward, kept as _old_forward; _hf_hook the hook) on a streamed Linear, before or after
    offload(): the hooked output; after remove() the hook is still attached, and
    remove_hook_from_module gives the plain layer back."""
    x = toy_input()
    plain = net()(x)
    ref = net()
    add_hook_to_module(ref.blocks[0], HalveInDoubleOut())
    want = ref(x)
    assert not torch.equal(want, plain)
    m = net()
    lin = m.blocks[0]
    snap = snapshot(m)
    hook = HalveInDoubleOut()
    if order == "before-offload":
        add_hook_to_module(lin, hook)
    handle = offload(m, storage="bfloat16", max_resident=0.0)
    if order == "after-offload":
        add_hook_to_module(lin, hook)
    with torch.no_grad():
        assert_equal(m(on_device(x)).cpu(), want, f"accelerate hook {order}", plain)
    # accelerate wrapped the layer's own forward, not a stand-in of sluice's.
    assert lin._hf_hook is hook
    assert getattr(lin._old_forward, "__func__", None) is torch.nn.Linear.forward and lin._old_forward.__self__ is lin, (
        f"accelerate wrapped {lin._old_forward!r}, not the layer's own forward")
    handle.remove()
    assert isinstance(lin.__dict__.get("forward"), functools.partial), "remove() dropped accelerate's forward"
    assert lin._hf_hook is hook
    assert_equal(m(x), want, "removed, hook still attached", plain)
    remove_hook_from_module(lin)
    assert "_hf_hook" not in lin.__dict__ and "_old_forward" not in lin.__dict__
    # accelerate restores by assignment: the layer's own bound forward, pinned.
    assert lin.forward.__func__ is torch.nn.Linear.forward and lin.forward.__self__ is lin
    assert_equal(m(x), plain, "hook removed after remove()")
    del lin.__dict__["forward"]  # accelerate's leftover, for assert_restored
    assert_restored(m, snap)


@pytest.mark.parametrize("order", ORDERS)
def test_torch_hooks_read_the_layers_weight(order):
    """torch's forward pre-hook (changes the input) and forward hook (adds the sum of the
    layer's own weight to its output, as code that inspects weights in a hook does) on a
    streamed Linear, registered before or after offload(): they run inside the layer's
    call, so the weight they read is the real one."""
    x = toy_input()

    def pre(module, args):
        return (args[0] * 2,)

    def post(module, args, out):
        return out + module.weight.sum()

    plain = net()(x)
    ref = net()
    ref.blocks[1].register_forward_pre_hook(pre)
    ref.blocks[1].register_forward_hook(post)
    want = ref(x)
    assert abs(ref.blocks[1].weight.sum().item()) > 0.1  # a zero weight would show
    m = net()
    snap = snapshot(m)
    hooks = []
    if order == "before-offload":
        hooks = [m.blocks[1].register_forward_pre_hook(pre), m.blocks[1].register_forward_hook(post)]
    handle = offload(m, storage="bfloat16", max_resident=0.0)
    if order == "after-offload":
        hooks = [m.blocks[1].register_forward_pre_hook(pre), m.blocks[1].register_forward_hook(post)]
    with torch.no_grad():
        for _ in range(2):
            assert_equal(m(on_device(x)).cpu(), want, f"torch hooks {order}", plain)
    handle.remove()
    assert_equal(m(x), want, "removed, the hooks still registered", plain)
    for h in hooks:
        h.remove()
    assert_restored(m, snap)
    assert_equal(m(x), plain, "removed")


class EmbeddingOrConv(torch.nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.layer = torch.nn.Embedding(50, 8) if kind == "embedding" else torch.nn.Conv1d(8, 8, 3, padding=1)
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x):
        h = self.layer(x) if self.kind == "embedding" else self.layer(x.transpose(1, 2)).transpose(1, 2)
        return self.head(h)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("kind", ["embedding", "conv1d"])
def test_a_torch_hook_on_an_embedding_or_a_convolution_reads_its_weight(kind, order):
    """The same for the other streamed kinds: a forward hook on an nn.Embedding or an
    nn.Conv1d that reads the layer's weight."""

    def post(module, args, out):
        return out * module.weight.abs().mean()

    def make():
        torch.manual_seed(0)
        return EmbeddingOrConv(kind).to(torch.bfloat16)

    g = torch.Generator().manual_seed(7)
    x = torch.randint(0, 50, (2, 6), generator=g) if kind == "embedding" else torch.randn(2, 6, 8, generator=g).to(
        torch.bfloat16)
    plain = make()(x)
    ref = make()
    ref.layer.register_forward_hook(post)
    want = ref(x)
    m = make()
    snap = snapshot(m)
    hooks = [m.layer.register_forward_hook(post)] if order == "before-offload" else []
    handle = offload(m, storage="bfloat16", max_resident=0.0)
    if order == "after-offload":
        hooks = [m.layer.register_forward_hook(post)]
    with torch.no_grad():
        assert_equal(m(on_device(x)).cpu(), want, f"a torch hook on the {kind} {order}", plain)
    handle.remove()
    for h in hooks:
        h.remove()
    assert_restored(m, snap)
    assert_equal(m(x), plain, "removed")


@pytest.mark.parametrize("order", ORDERS)
def test_controlnet_style_patch_undone_with_del_forward(order):
    """A ControlNet-style patch (layer.forward = a closure around the forward it found)
    undone with `del layer.forward` while offloaded: the layer is then its plain self on
    its real weights, not a Linear of zeros."""
    x = toy_input()
    plain = net()(x)

    def patch(lin):
        inner = lin.forward
        lin.forward = lambda h: inner(h) + 1.0

    ref = net()
    patch(ref.blocks[0])
    patched = ref(x)
    m = net()
    snap = snapshot(m)
    if order == "before-offload":
        patch(m.blocks[0])
    handle = offload(m, storage="bfloat16", max_resident=0.0)
    if order == "after-offload":
        patch(m.blocks[0])
    with torch.no_grad():
        assert_equal(m(on_device(x)).cpu(), patched, f"patch {order}", plain)
        del m.blocks[0].forward
        assert_equal(m(on_device(x)).cpu(), plain, "patch undone with `del layer.forward` while offloaded")
    handle.remove()
    assert_restored(m, snap)
    assert_equal(m(x), plain, "removed")


# --- reading a streamed weight outside its layer's call ------------------------------------

class Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = torch.nn.Linear(32, 32)
        self.k_proj = torch.nn.Linear(32, 32)
        self.v_proj = torch.nn.Linear(32, 32)

    def forward(self, x, fused=False):
        if fused:  # one matmul for q, k, v: the parent reads its layers' weights itself
            w = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])
            b = torch.cat([self.q_proj.bias, self.k_proj.bias, self.v_proj.bias])
            return F.linear(x, w, b)
        return torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = Attention()
        self.out = torch.nn.Linear(96, 32)

    def forward(self, x, fused=False):
        return self.out(self.self_attn(x, fused))


class AttnNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block()])

    def forward(self, x, fused=False):
        return self.blocks[0](x, fused)


def attn_net():
    torch.manual_seed(0)
    return AttnNet().to(torch.bfloat16).requires_grad_(False)


def test_a_fused_qkv_forward_gets_one_clear_error():
    """A parent module's forward that concatenates its streamed layers' weights: sluice
    cannot lease them there, so it raises sluice.InvalidArgument naming the layer and
    exclude= (today it computes with zeros); the module stays usable."""
    x = torch.randn(2, 32, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    m = attn_net()
    want = m(x)
    snap = snapshot(m)
    handle = offload(m, storage="bfloat16", max_resident=0.0)
    with torch.no_grad():
        with pytest.raises(sluice.InvalidArgument, match=r"blocks\.0\.self_attn\.[qkv]_proj") as err:
            m(on_device(x), fused=True)
        assert FIX_OPTION in str(err.value)
        assert_equal(m(on_device(x)).cpu(), want, "after the error")
    handle.remove()
    assert_restored(m, snap)


def placeholder_reads():
    return {
        "weight + 1": lambda lin, x: lin.weight + 1,
        "weight.sum()": lambda lin, x: lin.weight.sum(),
        "weight.data": lambda lin, x: lin.weight.data,
        "torch.cat([weight])": lambda lin, x: torch.cat([lin.weight]),
        "F.linear(x, weight)": lambda lin, x: F.linear(x, lin.weight),
        "bias * 2": lambda lin, x: lin.bias * 2,
    }


@pytest.mark.parametrize("read", list(placeholder_reads()))
def test_a_streamed_weight_outside_its_call_is_metadata_only(read):
    """Outside its layer's call a streamed weight keeps what code reads without its values
    (.shape, .dtype, .device: the sluice device, .requires_grad); reading its values raises
    sluice.InvalidArgument naming the layer and exclude=. remove() gives the values back."""
    m = attn_net()
    lin = m.blocks[0].self_attn.k_proj
    x = on_device(torch.randn(2, 32, dtype=torch.bfloat16))
    snap = snapshot(m)
    handle = offload(m, storage="bfloat16", max_resident=0.0)
    w = lin.weight
    assert tuple(w.shape) == (32, 32) and w.dtype == torch.bfloat16 and w.ndim == 2 and w.numel() == 32 * 32
    assert w.device.type == DEVICE and w.requires_grad is False
    with pytest.raises(sluice.InvalidArgument, match=re.escape("blocks.0.self_attn.k_proj")) as err:
        placeholder_reads()[read](lin, x)
    assert FIX_OPTION in str(err.value)
    handle.remove()
    assert_restored(m, snap)
    placeholder_reads()[read](lin, x.cpu())  # its values again
