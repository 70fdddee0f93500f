"""Anima-3.8B v1.1's semantic connector through the Python bindings: locked.encode_text's
qwen35_hidden / qwen35_mask / timesteps keywords, the same bits as `sluice forward`, the
context following the timestep, the refusals as sluice.InvalidArgument, and a connector layer
that overflows named by locate_nonfinite_text, `sluice forward` and `sluice run`. A small
random model with a connector, made by `sluice make-checkpoint` from a JSON config."""
import json
import os
import subprocess
import tempfile

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import sluice

CLI = os.environ["SLUICE_CLI"]
CONFIG = {"preset": "anima-tiny", "name": "tiny-connector",
          "connector": {"enabled": True, "num_queries": 8, "resampler_blocks": 2, "resampler_dim": 32,
                        "resampler_heads": 4, "mlp_hidden_dim": 48, "source_dim": 24}}


@pytest.fixture(scope="module")
def workdir():
    with tempfile.TemporaryDirectory(dir=os.environ.get("SLUICE_TEST_TMP")) as d:
        yield d


@pytest.fixture(scope="module")
def checkpoint(workdir):
    config = os.path.join(workdir, "connector.json")
    with open(config, "w") as f:
        json.dump(CONFIG, f)
    path = os.path.join(workdir, "connector.safetensors")
    subprocess.run([CLI, "make-checkpoint", "--config", config, "--seed", "4", "--dtype", "float32", "--out", path],
                   check=True)
    return path


def text_inputs(seed=0, batch=2):
    g = torch.Generator().manual_seed(seed)
    qwen = torch.randn(batch, 7, 32, generator=g)
    ids = torch.randint(0, 128, (batch, 5), generator=g)
    hidden = torch.randn(4, batch, 6, 24, generator=g)
    mask = torch.ones(batch, 6, dtype=torch.bool)
    mask[1, 4:] = False
    return qwen, ids, hidden, mask


def test_encode_text_takes_the_connector_inputs_as_keywords(checkpoint, workdir):
    cache = sluice.ModelCache(device="cpu")
    model = cache.load(checkpoint, storage="float32", compute="float32", max_resident=0.5)
    qwen, ids, hidden, mask = text_inputs()
    t = torch.tensor([0.8, 0.8])
    with model.lock() as locked:
        assert locked.info["connector"]["enabled"]
        ctx = locked.encode_text(qwen, ids, qwen35_hidden=hidden, qwen35_mask=mask, timesteps=t)
        assert ctx.shape == (2, 24, 32)
        # A list of the four layers is the same input as the stacked tensor.
        assert torch.equal(locked.encode_text(qwen, ids, qwen35_hidden=list(hidden), qwen35_mask=mask, timesteps=t),
                           ctx)
        # The context follows the timestep: recomputed per step.
        later = locked.encode_text(qwen, ids, qwen35_hidden=hidden, qwen35_mask=mask, timesteps=torch.tensor([0.2, 0.2]))
        assert not torch.allclose(later, ctx, atol=1e-4, rtol=1e-4)
        native = locked.encode_text(qwen, ids)
        assert not torch.allclose(native, ctx, atol=1e-4, rtol=1e-4)

    # The same bits as the CLI's `sluice forward` (which takes the timestep from its inputs).
    inputs = os.path.join(workdir, "inputs.safetensors")
    out = os.path.join(workdir, "out.safetensors")
    g = torch.Generator().manual_seed(1)
    save_file({"x": torch.randn(2, 16, 1, 8, 8, generator=g), "timesteps": t, "qwen_hidden": qwen,
               "t5_ids": ids, "qwen35_hidden": hidden, "qwen35_mask": mask}, inputs)
    subprocess.run([CLI, "forward", "--checkpoint", checkpoint, "--inputs", inputs, "--output", out,
                    "--storage", "float32", "--compute", "float32"], check=True)
    assert torch.equal(load_file(out)["context"], ctx)


def test_bad_connector_inputs_are_one_line_errors(checkpoint):
    cache = sluice.ModelCache(device="cpu")
    model = cache.load(checkpoint, storage="float32", compute="float32")
    qwen, ids, hidden, mask = text_inputs()
    t = torch.tensor([0.5, 0.5])
    with model.lock() as locked:
        with pytest.raises(sluice.InvalidArgument, match="got 3 Qwen3.5 hidden-state layers, the connector reads 4"):
            locked.encode_text(qwen, ids, qwen35_hidden=hidden[:3], timesteps=t)
        with pytest.raises(sluice.InvalidArgument, match="has width 25, the connector reads 24"):
            locked.encode_text(qwen, ids, qwen35_hidden=torch.randn(4, 2, 6, 25), timesteps=t)
        with pytest.raises(sluice.InvalidArgument, match=r"qwen35_mask has shape \[2, 5\]"):
            locked.encode_text(qwen, ids, qwen35_hidden=hidden, qwen35_mask=mask[:, :5], timesteps=t)
        with pytest.raises(sluice.InvalidArgument, match="the timestep is missing"):
            locked.encode_text(qwen, ids, qwen35_hidden=hidden)
    tiny = cache.load("anima-tiny")
    with tiny.lock() as locked:
        with pytest.raises(sluice.InvalidArgument, match="has no semantic connector"):
            locked.encode_text(qwen, ids, qwen35_hidden=hidden, timesteps=t)


def test_a_connector_layer_that_overflows_is_named_by_locate_nonfinite_text_forward_and_run(checkpoint, workdir):
    # One connector Linear made to overflow fp32 (weights of 3e38 over a 32-wide input): the
    # context is non-finite only through the connector, so only a re-run with its inputs can
    # name the layer (Note [non-finite values]).
    layer = "anima_v2_connector.semantic_resampler.output_projection"
    with safe_open(checkpoint, "pt") as f:
        metadata = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    key = next(k for k in tensors if k.endswith(layer + ".weight"))
    tensors[key] = torch.full_like(tensors[key], 3e38)
    bad = os.path.join(workdir, "overflow.safetensors")
    save_file(tensors, bad, metadata=metadata)

    cache = sluice.ModelCache(device="cpu")
    model = cache.load(bad, storage="float32", compute="float32")
    qwen, ids, hidden, mask = text_inputs()
    t = torch.tensor([0.8, 0.8])
    with model.lock() as locked:
        ctx = locked.encode_text(qwen, ids, qwen35_hidden=hidden, qwen35_mask=mask, timesteps=t)
        assert not torch.isfinite(ctx).all()
        # The native adapter alone is finite: without the connector's inputs nothing is found.
        assert torch.isfinite(locked.encode_text(qwen, ids)).all()
        assert locked.locate_nonfinite_text(qwen, ids) is None
        r = locked.locate_nonfinite_text(qwen, ids, qwen35_hidden=list(hidden), qwen35_mask=mask, timesteps=t)
        assert r is not None
        assert r["kind"] == "adapter"
        assert r["module"] == layer
        assert 0 < r["nonfinite_values"] <= r["values"]
        assert r["output_nonfinite_values"] == int((~torch.isfinite(ctx)).sum())
        assert model.stats()["nonfinite"]["last"]["module"] == layer

    # `sluice forward` and `sluice run` end with one line naming the layer.
    inputs = os.path.join(workdir, "overflow_inputs.safetensors")
    g = torch.Generator().manual_seed(1)
    save_file({"x": torch.randn(2, 16, 1, 8, 8, generator=g), "timesteps": t, "qwen_hidden": qwen,
               "t5_ids": ids, "qwen35_hidden": hidden, "qwen35_mask": mask}, inputs)
    fwd = subprocess.run([CLI, "forward", "--checkpoint", bad, "--inputs", inputs, "--output",
                          os.path.join(workdir, "overflow_out.safetensors"), "--storage", "float32", "--compute", "float32"],
                         capture_output=True, text=True)
    assert fwd.returncode == 1, fwd.stderr
    assert "the adapter forward's context is non-finite" in fwd.stderr
    assert "first non-finite output: " + layer in fwd.stderr
    run_inputs = os.path.join(workdir, "overflow_run_inputs.safetensors")
    save_file({"qwen_hidden": qwen[:1], "t5_ids": ids[:1], "qwen35_hidden": hidden[:, :1].contiguous(),
               "qwen35_mask": mask[:1]}, run_inputs)
    run = subprocess.run([CLI, "run", "--device", "cpu", "--checkpoint", bad, "--steps", "2", "--resolution", "64",
                          "--storage", "float32", "--compute", "float32", "--connector-inputs", run_inputs,
                          "--output", os.path.join(workdir, "overflow_latent.safetensors")],
                         capture_output=True, text=True)
    assert run.returncode == 1, run.stderr
    assert "step 1/2: the adapter forward's context is non-finite" in run.stderr
    assert "first non-finite output: " + layer in run.stderr
