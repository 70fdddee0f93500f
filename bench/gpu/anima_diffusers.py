"""sluice's Anima DiT as diffusers' `CosmosTransformer3DModel`: config and key mapping.

Anima's DiT is the Cosmos-Predict2 "MiniTrainDIT", which diffusers ships as
`CosmosTransformer3DModel` under renamed keys. This module is shared by the parity test
(tests/python/test_diffusers_parity.py) and the GPU side-by-side (bench/gpu/compare.py).

    cfg = json.load(...)                    # the "config" object of `sluice inspect --json`
    model = build_model(cfg, sd, dtype)     # sd: a sluice-format state dict ("net." optional)
    v = forward(model, x, timesteps, context)

Note [diffusers Cosmos differences]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
  The mapping is exact up to three things that diffusers does differently, each handled
  here so that an fp32 forward matches sluice to rounding:
  - q/k RMSNorm eps: diffusers' `Attention(qk_norm="rms_norm")` builds its RMSNorms with
    eps 1e-5; Cosmos/Anima use 1e-6 (`norm_eps`). `build_model` sets them to `norm_eps`.
  - Padding mask: with `concat_padding_mask=True` diffusers resizes a caller-given
    `padding_mask` with torchvision and concatenates it. Anima's mask is all zeros, so we
    build the model with `concat_padding_mask=False` and `in_channels + 1` input channels
    and concatenate the zero channel in `forward`: the same computation, without a
    torchvision dependency. `out_channels` stays 16, so `proj_out` has the same shape.
  - RoPE ratios: diffusers' `rope_scale` is (t, h, w); sluice's ratios map one to one.
  The DiT's adapter (`llm_adapter.*`) has no diffusers counterpart; its keys are ignored.
"""
from __future__ import annotations

import re
from typing import Dict

import torch

PREFIX = "net."

# sluice (Cosmos) module names -> diffusers module names. Applied to the dotted name with the
# trailing ".weight"/".bias" removed; block-level entries use the block-relative name.
_TOP = {
    "x_embedder.proj.1": "patch_embed.proj",
    "t_embedder.1.linear_1": "time_embed.t_embedder.linear_1",
    "t_embedder.1.linear_2": "time_embed.t_embedder.linear_2",
    "t_embedding_norm": "time_embed.norm",
    "final_layer.linear": "proj_out",
    "final_layer.adaln_modulation.1": "norm_out.linear_1",
    "final_layer.adaln_modulation.2": "norm_out.linear_2",
}
_BLOCK = {
    "self_attn.q_proj": "attn1.to_q",
    "self_attn.k_proj": "attn1.to_k",
    "self_attn.v_proj": "attn1.to_v",
    "self_attn.output_proj": "attn1.to_out.0",
    "self_attn.q_norm": "attn1.norm_q",
    "self_attn.k_norm": "attn1.norm_k",
    "cross_attn.q_proj": "attn2.to_q",
    "cross_attn.k_proj": "attn2.to_k",
    "cross_attn.v_proj": "attn2.to_v",
    "cross_attn.output_proj": "attn2.to_out.0",
    "cross_attn.q_norm": "attn2.norm_q",
    "cross_attn.k_norm": "attn2.norm_k",
    "mlp.layer1": "ff.net.0.proj",
    "mlp.layer2": "ff.net.2",
    "adaln_modulation_self_attn.1": "norm1.linear_1",
    "adaln_modulation_self_attn.2": "norm1.linear_2",
    "adaln_modulation_cross_attn.1": "norm2.linear_1",
    "adaln_modulation_cross_attn.2": "norm2.linear_2",
    "adaln_modulation_mlp.1": "norm3.linear_1",
    "adaln_modulation_mlp.2": "norm3.linear_2",
}
_BLOCK_RE = re.compile(r"^blocks\.(\d+)\.(.+)$")

# sluice's fp8 skip set on Anima (default patterns + the model's t_embedder, x_embedder,
# final_layer) over diffusers' module names, for `diffusers.hooks.apply_layerwise_casting`.
# `model.enable_layerwise_casting()` always adds the class's own patterns ("norm" searched
# anywhere), which also keeps every block's norm1/norm2/norm3 Linears (the adaLN
# modulations, 168 MiB on anima-2b) in bf16; with these patterns the fp8 set is sluice's.
SLUICE_SKIP_PATTERNS = (r"^patch_embed(\.|$)", r"^time_embed(\.|$)", r"^norm_out(\.|$)", r"^proj_out$")


def is_dit_key(name: str) -> bool:
    """True for DiT parameters (adapter keys and filtered buffers are not mapped)."""
    if name.startswith(PREFIX):
        name = name[len(PREFIX):]
    return not (name.startswith("llm_adapter.") or name.startswith("pos_embedder.") or name.endswith(".inv_freq"))


def map_key(name: str) -> str:
    """One sluice checkpoint key ("net." optional) -> its diffusers state-dict key."""
    if name.startswith(PREFIX):
        name = name[len(PREFIX):]
    module, _, leaf = name.rpartition(".")
    if leaf not in ("weight", "bias"):
        raise KeyError(f"anima_diffusers: '{name}' is not a weight or bias")
    if module in _TOP:
        return f"{_TOP[module]}.{leaf}"
    m = _BLOCK_RE.match(module)
    if m and m.group(2) in _BLOCK:
        return f"transformer_blocks.{m.group(1)}.{_BLOCK[m.group(2)]}.{leaf}"
    raise KeyError(f"anima_diffusers: no diffusers name for sluice key '{name}'")


def convert_state_dict(sd: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """A sluice-format DiT state dict -> diffusers' key names (adapter keys dropped)."""
    out = {}
    for k, v in sd.items():
        if is_dit_key(k):
            out[map_key(k)] = v
    return out


def diffusers_config(cfg: dict) -> dict:
    """sluice's AnimaConfig (JSON) -> CosmosTransformer3DModel keyword arguments."""
    problems = []
    if not cfg.get("use_adaln_lora", True):
        problems.append("use_adaln_lora false (diffusers' Cosmos always has the adaLN-LoRA)")
    if cfg.get("rope_theta", 10000.0) != 10000.0:
        problems.append("rope_theta != 10000 (hard-coded in diffusers)")
    if cfg["model_channels"] % cfg["num_heads"]:
        problems.append("model_channels not a multiple of num_heads")
    if problems:
        raise ValueError("anima_diffusers: config not expressible in diffusers: " + ", ".join(problems))
    pt, ps = cfg["patch_temporal"], cfg["patch_spatial"]
    return dict(
        in_channels=cfg["in_channels"] + (1 if cfg["concat_padding_mask"] else 0),
        out_channels=cfg["out_channels"],
        num_attention_heads=cfg["num_heads"],
        attention_head_dim=cfg["model_channels"] // cfg["num_heads"],
        num_layers=cfg["num_blocks"],
        mlp_ratio=float(cfg["mlp_ratio"]),
        text_embed_dim=cfg["crossattn_emb_channels"],
        adaln_lora_dim=cfg["adaln_lora_dim"],
        # RoPE positions index up to max_size // patch; 240 px latents (1920 px images) is
        # Anima's documented maximum, with room to spare.
        max_size=(128 * pt, 240 * ps, 240 * ps),
        patch_size=(pt, ps, ps),
        rope_scale=(cfg["rope_t_extrapolation_ratio"], cfg["rope_h_extrapolation_ratio"],
                    cfg["rope_w_extrapolation_ratio"]),
        concat_padding_mask=False,  # see Note [diffusers Cosmos differences]
        extra_pos_embed_type=None,
    )


def build_model(cfg: dict, sd: Dict[str, torch.Tensor], dtype: torch.dtype = torch.float32,
                device: str = "cpu"):
    """CosmosTransformer3DModel with the weights of a sluice-format state dict (strict load:
    a missing, extra or mis-shaped tensor raises). Built on the meta device, so no memory is
    spent on an initialization that is overwritten anyway."""
    from diffusers import CosmosTransformer3DModel

    with torch.device("meta"):
        model = CosmosTransformer3DModel(**diffusers_config(cfg))
    mapped = {k: v.to(device=device, dtype=dtype) for k, v in convert_state_dict(sd).items()}
    model.load_state_dict(mapped, strict=True, assign=True)
    eps = float(cfg.get("norm_eps", 1e-6))
    for block in model.transformer_blocks:
        for attn in (block.attn1, block.attn2):
            attn.norm_q.eps = eps
            attn.norm_k.eps = eps
    model.requires_grad_(False)
    model.eval()
    return model


def forward(model, x: torch.Tensor, timesteps: torch.Tensor, context: torch.Tensor,
            concat_padding_mask: bool = True) -> torch.Tensor:
    """The DiT velocity for x [B,C,T,H,W], timesteps [B] (sigma) and context [B,S,D]. H and W
    must be multiples of the patch size (sluice pads and crops; diffusers does not)."""
    if concat_padding_mask:
        B, _, T, H, W = x.shape
        x = torch.cat([x, x.new_zeros(B, 1, T, H, W)], dim=1)
    return model(x, timesteps, context, return_dict=False)[0]

