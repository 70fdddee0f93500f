"""Regional prompting parity: sluice's forward with a cross-attention mask against InvokeAI's
own patch (patch_anima_for_regional_prompting with an AnimaRegionalPromptingExtension holding
the mask) on InvokeAI's AnimaTransformer, both from the pinned wheel's code laid out by
scripts/fetch_reference.sh in .deps/reference/pkg, on one checkpoint from `sluice
make-checkpoint` (fp32, anima-small: 8 blocks).

The mask is random with at least one True in every row: InvokeAI's additive -inf mask gives
NaN for a row with none, which sluice defines as no cross-attention (tested in
tests/models/anima/test_regional_prompting.cpp). fp32 relative L2 <= 1e-5, fully resident
and at 0.5 residency, on InvokeAI's default blocks (the even ones) and on every block (its
extension's block choice replaced). The masked output must differ from the plain one by far
more than the tolerance, so the comparison is not vacuous. Needs SLUICE_CLI and the
installed bindings (ctest's "parity: regional prompting ..." entry sets both).
"""
import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch

import sluice

HERE = Path(__file__).resolve().parent
INVOKEAI_PKG = HERE.parents[1] / ".deps" / "reference" / "pkg"
if not (INVOKEAI_PKG / "invokeai" / "backend" / "anima" / "anima_transformer_patch.py").is_file():
    pytest.fail(f"InvokeAI's package tree is missing at {INVOKEAI_PKG}: run scripts/fetch_reference.sh",
                pytrace=False)
sys.path.insert(0, str(INVOKEAI_PKG))
sys.path.insert(0, str(HERE))

from invokeai.backend.anima import anima_transformer  # noqa: E402
from invokeai.backend.anima.anima_transformer_patch import patch_anima_for_regional_prompting  # noqa: E402
from invokeai.backend.anima.regional_prompting import AnimaRegionalPromptingExtension  # noqa: E402
from reference_anima import invokeai_transformer, make_checkpoint, rel_l2  # noqa: E402

CLI = os.environ["SLUICE_CLI"]
PRESET = "anima-small"
TOL = 1e-5
B, T, H, W, S = 1, 1, 14, 10, 12   # L = 1 * 7 * 5 = 35 image tokens


@pytest.fixture(scope="module")
def setup():
    with tempfile.TemporaryDirectory(dir=os.environ.get("SLUICE_TEST_TMP")) as d:
        ckpt = os.path.join(d, "ckpt.safetensors")
        cfg = make_checkpoint(CLI, PRESET, 40, ckpt)
        yield ckpt, cfg, invokeai_transformer(anima_transformer, ckpt, cfg)


def inputs(cfg):
    g = torch.Generator().manual_seed(41)
    x = torch.randn(B, cfg["in_channels"], T, H, W, generator=g)
    t = torch.rand(B, generator=g)
    ctx = torch.randn(B, S, cfg["crossattn_emb_channels"], generator=g)
    L = T * ((H + 1) // 2) * ((W + 1) // 2)
    mask = torch.rand(L, S, generator=g) > 0.6
    mask[torch.arange(L), torch.randint(0, S, (L,), generator=g)] = True   # every row attends somewhere
    return x, t, ctx, mask


def invokeai_forward(tr, x, t, ctx, mask, every_block=False):
    ext = AnimaRegionalPromptingExtension(None, cross_attn_mask=mask)
    if every_block:
        ext.get_cross_attn_mask = lambda block_index: mask
    with torch.no_grad(), patch_anima_for_regional_prompting(tr, ext):
        return tr(x=x, timesteps=t, context=ctx)


@pytest.mark.parametrize("max_resident", [None, 0.5], ids=["resident", "half-resident"])
@pytest.mark.parametrize("blocks", ["even", "all"])
def test_regional_prompting_matches_invokeai_patch(setup, max_resident, blocks):
    ckpt, cfg, tr = setup
    x, t, ctx, mask = inputs(cfg)
    want = invokeai_forward(tr, x, t, ctx, mask, every_block=blocks == "all")
    with torch.no_grad():
        plain = tr(x=x, timesteps=t, context=ctx)
    cache = sluice.ModelCache(device="cpu")
    model = cache.load(ckpt, storage="float32", compute="float32", max_resident=max_resident)
    with model.lock() as m:
        if max_resident is not None:
            assert model.stats()["model"]["streamed_bytes_by_forward"]["dit"] > 0
        got = m(x, t, ctx, cross_attn_mask=mask, mask_blocks=None if blocks == "even" else "all")
        unmasked = m(x, t, ctx)
    e, e_plain = rel_l2(got, want), rel_l2(unmasked, plain)
    moved = rel_l2(want, plain)
    print(f"regional prompting ({blocks} blocks, max_resident {max_resident}): rel-L2 {e:.3e} (tol {TOL:.0e}); "
          f"unmasked {e_plain:.3e}; the mask moves InvokeAI's output by {moved:.3e}")
    assert torch.isfinite(got).all()
    assert moved > 100 * TOL, "the mask barely changes the output: the comparison would be vacuous"
    assert e <= TOL and e_plain <= TOL


def test_python_binding_takes_the_mask_and_block_names_and_refuses_bad_input(setup):
    """The binding's keywords: mask_blocks as indices or "even"/"odd"/"all", the progress
    callback beside the mask, locate_nonfinite with it, and the one-line refusals
    (sluice.InvalidArgument, a ValueError)."""
    ckpt, cfg, _ = setup
    x, t, ctx, mask = inputs(cfg)
    cache = sluice.ModelCache(device="cpu")
    model = cache.load(ckpt, storage="float32", compute="float32")
    with model.lock() as m:
        even = m.forward(x, t, ctx, cross_attn_mask=mask)
        assert torch.equal(even, m(x, t, ctx, cross_attn_mask=mask, mask_blocks="even"))
        assert torch.equal(even, m(x, t, ctx, cross_attn_mask=mask, mask_blocks=[0, 2, 4, 6]))
        every = m(x, t, ctx, cross_attn_mask=mask, mask_blocks="all")
        assert torch.equal(every, m(x, t, ctx, cross_attn_mask=mask, mask_blocks=range(8)))
        assert not torch.equal(every, even)
        assert not torch.equal(m(x, t, ctx, cross_attn_mask=mask, mask_blocks="odd"), even)
        assert torch.equal(m(x, t, ctx, cross_attn_mask=torch.ones_like(mask), mask_blocks="all"), m(x, t, ctx))
        calls = []
        assert torch.equal(m.forward(x, t, ctx, progress=lambda done, expected: calls.append(done),
                                     cross_attn_mask=mask), even)
        assert calls
        assert m.locate_nonfinite(x, t, ctx, cross_attn_mask=mask, mask_blocks="all") is None
        with pytest.raises(sluice.InvalidArgument, match=r"^cross_attn_mask has dtype Float, expected Bool"):
            m(x, t, ctx, cross_attn_mask=mask.float())
        with pytest.raises(ValueError, match=r"^cross_attn_mask has shape \[34, 12\], expected \[L, S\] = \[35, 12\]"):
            m(x, t, ctx, cross_attn_mask=mask[:-1])
        with pytest.raises(sluice.InvalidArgument, match=r"^mask_blocks has block 8, the model has 8 blocks \(0\.\.7\)$"):
            m(x, t, ctx, cross_attn_mask=mask, mask_blocks=[8])
        with pytest.raises(sluice.InvalidArgument, match="mask_blocks 'middle' is not one of"):
            m(x, t, ctx, cross_attn_mask=mask, mask_blocks="middle")
