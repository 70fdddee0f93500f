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


def on_device(t):
    if DEVICE != "cpu" and not hasattr(torch, DEVICE):
        # torch's Python side wants a module for a PrivateUse1 backend before .to() takes
        # it; the backend itself exists once sluice loaded its library (the first offload).
        mod = types.ModuleType(DEVICE)
        mod.is_available = lambda: True  # what torch.accelerator and torch.random ask of it
        mod.device_count = lambda: 1
        mod.current_device = lambda: 0
        mod._is_in_bad_fork = lambda: False
        mod.manual_seed_all = lambda seed: None
        torch._register_device_module(DEVICE, mod)
    return t.to(DEVICE)


def offload(module, **kwargs):
    return sluice.offload(module, device=DEVICE, **kwargs)


def snapshot(module):
    return {k: (v.detach().clone(), v.data_ptr(), v.requires_grad)
            for k, v in module.state_dict(keep_vars=True).items()}


def assert_restored(module, snap):
    now = module.state_dict(keep_vars=True)
    assert set(now) == set(snap)
    for k, (values, ptr, grad) in snap.items():
        assert now[k].data_ptr() == ptr, k
        assert torch.equal(now[k], values), k
        assert now[k].requires_grad == grad, k
    assert "forward" not in module.__dict__
    assert all("forward" not in m.__dict__ for m in module.modules())


# The transformer of diffusers' tests/pipelines/anima/test_anima.py (AnimaPipeline's fast tests).
COSMOS_CONFIG = dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=2,
                     mlp_ratio=2, text_embed_dim=16, adaln_lora_dim=4, max_size=(4, 32, 32), patch_size=(1, 2, 2),
                     rope_scale=(1.0, 4.0, 4.0), concat_padding_mask=True, extra_pos_embed_type=None)
# What enable_layerwise_casting adds to the model's own patterns (diffusers
# hooks/layerwise_casting.py DEFAULT_SKIP_MODULES_PATTERN), written for sluice's skip list
# (a plain word matches a whole dotted component: `\w*norm\w*` is diffusers' search for "norm").
DIFFUSERS_DEFAULT_SKIPS = [r"\w*pos_embed\w*", r"\w*patch_embed\w*", r"\w*norm\w*", "^proj_in$", "^proj_out$"]
