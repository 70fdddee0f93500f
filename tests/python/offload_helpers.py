"""What tests/python/test_offload.py and test_offload_pipeline.py share: the device sluice
streams to (SLUICE_TEST_DEVICE), moving a tensor there, the snapshot a module is checked
against after remove(), and diffusers' tiny Cosmos transformer with the skip list of
diffusers' enable_layerwise_casting."""
import os
import types

import torch

import sluice

# The device sluice streams to: the CPU device, or the torch test accelerator when ctest's
# accel entry sets SLUICE_TEST_DEVICE=testaccel (and SLUICE_DEVICE_LIBRARY to its library).
DEVICE = os.environ.get("SLUICE_TEST_DEVICE", "cpu")


def backend():
    """Makes DEVICE usable from torch's Python side: an out-of-tree (PrivateUse1) backend
    exists once sluice loaded its library (a sluice device made on it), and torch wants a
    module for it before .to() or a factory takes it."""
    if DEVICE != "cpu" and not hasattr(torch, DEVICE):
        sluice.ModelCache(device=DEVICE)  # loads SLUICE_DEVICE_LIBRARY, which names the backend
        mod = types.ModuleType(DEVICE)
        mod.is_available = lambda: True  # what torch.accelerator and torch.random ask of it
        mod.device_count = lambda: 1
        mod.current_device = lambda: 0
        mod._is_in_bad_fork = lambda: False
        mod.manual_seed_all = lambda seed: None
        torch._register_device_module(DEVICE, mod)


def on_device(t):
    backend()
    return t.to(DEVICE)


def offload(module, **kwargs):
    backend()
    return sluice.offload(module, device=DEVICE, **kwargs)


class Kept(types.SimpleNamespace):
    """One tensor of a module as it was: the object itself, its bytes (on the host), where."""


def status_bytes(field):
    """A byte count of /proc/self/status ("VmRSS", "VmHWM"); the test is skipped where there is none."""
    import pytest

    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    pytest.skip(f"no {field} in /proc/self/status here")


def bits(t):
    """A tensor's bytes, on the host: equal bits, not equal values (-0.0 is not 0.0)."""
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)


def snapshot(module):
    return {k: Kept(obj=v, bits=bits(v).clone(), ptr=v.data_ptr(), grad=v.requires_grad, dtype=v.dtype,
                    device=v.device, shape=tuple(v.shape), stride=v.stride())
            for k, v in module.state_dict(keep_vars=True).items()}


def assert_restored(module, snap, same_memory=False):
    """What remove() promises (issue 31): the same tensor objects, bit for bit, in the same
    dtype, on the same device, with the same requires_grad flag and strides. A freed Linear
    weight comes back in new memory: its data_ptr is checked only with same_memory."""
    now = module.state_dict(keep_vars=True)
    assert set(now) == set(snap)
    for k, was in snap.items():
        t = now[k]
        assert t is was.obj, k
        assert t.dtype == was.dtype and t.device == was.device, k
        assert tuple(t.shape) == was.shape and t.stride() == was.stride, k
        assert torch.equal(bits(t), was.bits), k
        assert t.requires_grad == was.grad, k
        if same_memory:
            assert t.data_ptr() == was.ptr, k
    assert "forward" not in module.__dict__
    assert all("forward" not in m.__dict__ and "_apply" not in m.__dict__ for m in module.modules())


# The transformer of diffusers' tests/pipelines/anima/test_anima.py (AnimaPipeline's fast tests).
COSMOS_CONFIG = dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=2,
                     mlp_ratio=2, text_embed_dim=16, adaln_lora_dim=4, max_size=(4, 32, 32), patch_size=(1, 2, 2),
                     rope_scale=(1.0, 4.0, 4.0), concat_padding_mask=True, extra_pos_embed_type=None)
# What enable_layerwise_casting adds to the model's own patterns (diffusers
# hooks/layerwise_casting.py DEFAULT_SKIP_MODULES_PATTERN), written for sluice's skip list
# (a plain word matches a whole dotted component: `\w*norm\w*` is diffusers' search for "norm").
DIFFUSERS_DEFAULT_SKIPS = [r"\w*pos_embed\w*", r"\w*patch_embed\w*", r"\w*norm\w*", "^proj_in$", "^proj_out$"]
