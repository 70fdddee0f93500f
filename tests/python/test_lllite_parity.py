"""ControlNet-LLLite parity: sluice's LLLite (locked.lllite, models/anima/lllite.h) against
InvokeAI's own AnimaControlNetLLLite.from_state_dict(...).apply_to(AnimaTransformer) with
set_cond_image(prepare_cond_image(...)), both from the pinned wheel's code laid out by
scripts/fetch_reference.sh in .deps/reference/pkg, on one checkpoint from `sluice
make-checkpoint` (fp32, anima-tiny) and one LLLite file with random weights (up, FiLM and
depth_embed too, so that it moves the output) written here.

Cases: an RGB adapter with ASPP and an inpaint adapter (4 channels, masked input, with a
mask), each fully resident and at 0.5 residency; an odd latent (13 x 10, padded to 14 x 10
like the DiT pads it) and a batch of 2 (the embedding broadcast). fp32 relative L2 <= 1e-5;
the adapter must move InvokeAI's output by far more than that, so the comparison is not
vacuous. Needs SLUICE_CLI and the installed bindings (ctest's "parity: LLLite ..." entry).
"""
import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import sluice

HERE = Path(__file__).resolve().parent
INVOKEAI_PKG = HERE.parents[1] / ".deps" / "reference" / "pkg"
if not (INVOKEAI_PKG / "invokeai" / "backend" / "anima" / "control_net_lllite.py").is_file():
    pytest.fail(f"InvokeAI's package tree is missing at {INVOKEAI_PKG}: run scripts/fetch_reference.sh",
                pytrace=False)
sys.path.insert(0, str(INVOKEAI_PKG))
sys.path.insert(0, str(HERE))

from invokeai.backend.anima import anima_transformer, control_net_lllite  # noqa: E402
from reference_anima import invokeai_transformer, make_checkpoint, rel_l2  # noqa: E402

CLI = os.environ["SLUICE_CLI"]
PRESET = "anima-tiny"
TOL = 1e-5
B, T, H, W, S = 2, 1, 13, 10, 6


@pytest.fixture(scope="module")
def setup():
    with tempfile.TemporaryDirectory(dir=os.environ.get("SLUICE_TEST_TMP")) as d:
        ckpt = os.path.join(d, "ckpt.safetensors")
        cfg = make_checkpoint(CLI, PRESET, 50, ckpt)
        files = {kind: write_lllite(os.path.join(d, f"{kind}.safetensors"), cfg, kind) for kind in ("rgb", "inpaint")}
        yield ckpt, cfg, invokeai_transformer(anima_transformer, ckpt, cfg), files


def write_lllite(path, cfg, kind):
    """A random v2 LLLite file on every target of every block: InvokeAI's own module layout
    (its state_dict) saved under the on-disk names, hyperparameters in the lllite.* metadata."""
    dim = cfg["model_channels"]
    names = [f"lllite_dit_blocks_{i}_{suffix}" for i in range(cfg["num_blocks"])
             for suffix in control_net_lllite._SUFFIX_TO_ATTR_PATH]
    inpaint = kind == "inpaint"
    hp = dict(cond_emb_dim=24, mlp_dim=16, cond_dim=16, cond_resblocks=1 if inpaint else 2, use_aspp=not inpaint,
              cond_in_channels=4 if inpaint else 3)
    torch.manual_seed(60 + inpaint)
    template = control_net_lllite.AnimaControlNetLLLite([(n, dim) for n in names], **hp).state_dict()
    g = torch.Generator().manual_seed(61 + inpaint)
    sd = {}
    for key, t in template.items():
        if key.startswith("conditioning1."):
            saved = "lllite_" + key
        else:
            _, index, tail = key.split(".", 2)   # lllite_modules.{i}.{tail}
            saved = f"{names[int(index)]}.{tail}"
        if ".up." in key or ".cond_to_film." in key or key.endswith(".depth_embed"):
            t = torch.randn(t.shape, generator=g) * 0.3
        sd[saved] = t.contiguous()
    meta = {f"lllite.{k}": (str(v).lower() if isinstance(v, bool) else str(v)) for k, v in hp.items()}
    if inpaint:
        meta["lllite.inpaint_masked_input"] = "true"
    else:
        meta = {k: v for k, v in meta.items() if k != "lllite.cond_resblocks"}   # read off the shapes
    save_file(sd, path, metadata=meta)
    return path


def inputs(cfg):
    g = torch.Generator().manual_seed(51)
    x = torch.randn(B, cfg["in_channels"], T, H, W, generator=g)
    t = torch.rand(B, generator=g)
    ctx = torch.randn(B, S, cfg["crossattn_emb_channels"], generator=g)
    image = torch.rand(3, 57, 43, generator=g)         # any size: resized to the padded latent x 8
    mask = (torch.rand(30, 22, generator=g) > 0.5).float()
    return x, t, ctx, image, mask


def invokeai_forward(tr, path, x, t, ctx, image, mask):
    with safe_open(path, framework="pt", device="cpu") as f:
        sd = {k: f.get_tensor(k) for k in f.keys()}
        meta = f.metadata()
    adapter = control_net_lllite.AnimaControlNetLLLite.from_state_dict(sd, meta)
    cond = control_net_lllite.prepare_cond_image(image[None], H, W)
    if adapter.cond_in_channels == 4:
        m = control_net_lllite.prepare_mask(mask[None], H, W)
        cond = control_net_lllite.build_inpaint_cond_image(cond, m, adapter.inpaint_masked_input)
    adapter.set_cond_image(cond)
    adapter.apply_to(tr)
    try:
        with torch.no_grad():
            return tr(x=x, timesteps=t, context=ctx)
    finally:
        adapter.restore()


@pytest.mark.parametrize("max_resident", [None, 0.5], ids=["resident", "half-resident"])
@pytest.mark.parametrize("kind", ["rgb", "inpaint"])
def test_lllite_matches_invokeai(setup, kind, max_resident):
    ckpt, cfg, tr, files = setup
    x, t, ctx, image, mask = inputs(cfg)
    want = invokeai_forward(tr, files[kind], x, t, ctx, image, mask)
    with torch.no_grad():
        plain = tr(x=x, timesteps=t, context=ctx)
    cache = sluice.ModelCache(device="cpu")
    model = cache.load(ckpt, storage="float32", compute="float32", max_resident=max_resident)
    with model.lock() as m:
        if max_resident is not None:
            assert model.stats()["model"]["streamed_bytes_by_forward"]["dit"] > 0
        with m.lllite(files[kind], image, mask=mask if kind == "inpaint" else None) as ll:
            assert ll.bound_layers == 5 * cfg["num_blocks"]
            got = m(x, t, ctx)
        unbound = m(x, t, ctx)
    e, e_plain = rel_l2(got, want), rel_l2(unbound, plain)
    moved = rel_l2(want, plain)
    print(f"LLLite {kind} (max_resident {max_resident}): rel-L2 {e:.3e} (tol {TOL:.0e}); unbound {e_plain:.3e}; "
          f"the adapter moves InvokeAI's output by {moved:.3e}")
    assert torch.isfinite(got).all()
    assert moved > 100 * TOL, "the adapter barely changes the output: the comparison would be vacuous"
    assert e <= TOL and e_plain <= TOL


def test_lllite_step_range_and_errors(setup):
    """InvokeAI's step gate (floor(begin * steps) <= i <= ceil(end * steps)), weight 0 an exact
    passthrough, and the errors a user gets, each one line."""
    ckpt, cfg, tr, files = setup
    x, t, ctx, image, mask = inputs(cfg)
    cache = sluice.ModelCache(device="cpu")
    model = cache.load(ckpt, storage="float32", compute="float32")
    with model.lock() as m:
        plain = m(x, t, ctx)
        with m.lllite(files["rgb"], image, weight=0.8, begin=0.25, end=0.5) as ll:
            gate = [ll.step(i, 8) for i in range(8)]
            assert gate == [0.0, 0.0, 0.8, 0.8, 0.8, 0.0, 0.0, 0.0]
            ll.step(0, 8)
            assert torch.equal(m(x, t, ctx), plain)
            ll.step(2, 8)
            assert not torch.equal(m(x, t, ctx), plain)
            assert model.stats()["lllite"][0]["layers_bound"] == 5 * cfg["num_blocks"]
        assert torch.equal(m(x, t, ctx), plain)
        with pytest.raises(sluice.InvalidArgument, match="it needs a mask"):
            m.lllite(files["inpaint"], image)
        with pytest.raises(sluice.InvalidArgument, match="takes no mask"):
            m.lllite(files["rgb"], image, mask=mask)
        with pytest.raises(sluice.InvalidArgument, match="outside -10..10"):
            m.lllite(files["rgb"], image, weight=11)
        with pytest.raises(sluice.InvalidArgument, match="0 <= begin <= end <= 1"):
            m.lllite(files["rgb"], image, begin=0.6, end=0.5)
        with pytest.raises(sluice.FileError):
            m.lllite(files["rgb"] + ".missing", image)
        assert model.stats()["lllite"] == []
