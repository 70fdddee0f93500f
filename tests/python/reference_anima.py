#!/usr/bin/env python3
"""Runs the independent reference Anima (InvokeAI's anima_transformer.py, fetched by
scripts/fetch_reference.sh, never committed) on a sluice-format checkpoint.

    reference_anima.py --module .deps/reference/invokeai_anima/anima_transformer.py \
        --checkpoint ckpt.safetensors --config config.json \
        --inputs in.safetensors --output out.safetensors [--dtype float32|bfloat16]

config.json is sluice's AnimaConfig as JSON (the "config" object of `sluice inspect
--json`). The checkpoint's keys (after stripping "net.") must match the reference's
parameters exactly: the load is strict, so a missing, extra or mis-shaped tensor fails.

Inputs (as in `sluice forward`): x, timesteps, context -> velocity; or qwen_hidden, t5_ids
[, t5_weights] -> context (adapter output, padded to output_tokens), then velocity when x
and timesteps are present too.
"""
import argparse
import importlib.util
import json
import sys
import time

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PREFIX = "net."


def load_reference_module(path):
    spec = importlib.util.spec_from_file_location("reference_anima_transformer", path)
    if spec is None:
        raise SystemExit(f"reference_anima: cannot import {path}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def check_supported(cfg):
    """The reference hard-codes a few values that sluice makes configurable."""
    problems = []
    if cfg["rope_theta"] != 10000.0:
        problems.append("rope_theta != 10000")
    if cfg["norm_eps"] != 1e-6:
        problems.append("norm_eps != 1e-6")
    a = cfg["adapter"]
    if a["enabled"]:
        if a["source_dim"] != a["model_dim"]:
            problems.append("adapter.source_dim != adapter.model_dim")
        if a["mlp_ratio"] != 4:
            problems.append("adapter.mlp_ratio != 4")
        if a["rope_theta"] != 10000.0:
            problems.append("adapter.rope_theta != 10000")
    if problems:
        raise SystemExit("reference_anima: config not expressible in the reference: " + ", ".join(problems))


class _NoInit:
    """Skips the reference's random parameter init (every parameter is then assigned from
    the checkpoint): torch.empty pages are never touched, so even anima-2b costs nothing
    here. (A meta-device build would be the usual tool, but the reference computes its
    RoPE buffers in __init__, which on meta pulls in torch's slow decomposition imports.)"""

    CLASSES = (torch.nn.Linear, torch.nn.Embedding, torch.nn.LayerNorm, torch.nn.RMSNorm)

    def __enter__(self):
        self.saved = [(c, c.reset_parameters) for c in self.CLASSES]
        for c in self.CLASSES:
            c.reset_parameters = lambda self: None
        return self

    def __exit__(self, *exc):
        for c, f in self.saved:
            c.reset_parameters = f


def dit_kwargs(cfg):
    """The reference DiT's constructor arguments for sluice's AnimaConfig `cfg`: the same for
    MiniTrainDIT and InvokeAI's AnimaTransformer, which extends it."""
    return dict(
        in_channels=cfg["in_channels"],
        out_channels=cfg["out_channels"],
        patch_spatial=cfg["patch_spatial"],
        patch_temporal=cfg["patch_temporal"],
        concat_padding_mask=cfg["concat_padding_mask"],
        model_channels=cfg["model_channels"],
        num_blocks=cfg["num_blocks"],
        num_heads=cfg["num_heads"],
        mlp_ratio=float(cfg["mlp_ratio"]),
        crossattn_emb_channels=cfg["crossattn_emb_channels"],
        pos_emb_cls="rope3d",
        use_adaln_lora=cfg["use_adaln_lora"],
        adaln_lora_dim=cfg["adaln_lora_dim"],
        rope_h_extrapolation_ratio=cfg["rope_h_extrapolation_ratio"],
        rope_w_extrapolation_ratio=cfg["rope_w_extrapolation_ratio"],
        rope_t_extrapolation_ratio=cfg["rope_t_extrapolation_ratio"],
        extra_per_block_abs_pos_emb=False,
    )


def make_checkpoint(cli, preset, seed, path):
    """`sluice make-checkpoint` of `preset` in fp32 at `path`; returns the preset's AnimaConfig
    (the "config" object of `sluice inspect --json`)."""
    import subprocess
    info = json.loads(subprocess.run([cli, "inspect", "--config", preset, "--json"], check=True,
                                     capture_output=True, text=True).stdout)
    subprocess.run([cli, "make-checkpoint", "--config", preset, "--seed", str(seed), "--out", path, "--dtype",
                    "float32"], check=True, capture_output=True)
    return info["config"]


def invokeai_transformer(anima_transformer, checkpoint, cfg):
    """InvokeAI's AnimaTransformer (the wheel's `anima_transformer` module) at the checkpoint's
    shapes, loaded strictly from it in fp32. AnimaTransformer.__init__ builds its LLMAdapter at
    the full size: it is built at the config's size here, through the name the module looks up."""
    import functools
    a = cfg["adapter"]
    full = anima_transformer.LLMAdapter
    anima_transformer.LLMAdapter = functools.partial(full, vocab_size=a["vocab_size"], dim=a["model_dim"],
                                                     num_layers=a["num_blocks"], num_heads=a["num_heads"])
    try:
        with _NoInit():
            tr = anima_transformer.AnimaTransformer(**dit_kwargs(cfg))
    finally:
        anima_transformer.LLMAdapter = full
    with safe_open(checkpoint, framework="pt", device="cpu") as f:
        sd = {k[len(PREFIX):] if k.startswith(PREFIX) else k: f.get_tensor(k).float() for k in f.keys()}
    tr.load_state_dict(sd, strict=True, assign=True)
    return tr.eval().requires_grad_(False)


def rel_l2(a, b):
    """Relative L2 error of `a` against the reference `b`, in float64."""
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def build_models(ref, cfg):
    """Builds the DiT and adapter with uninitialized parameters (see _NoInit)."""
    with _NoInit():
        dit = ref.MiniTrainDIT(**dit_kwargs(cfg))
        adapter = None
        a = cfg["adapter"]
        if a["enabled"]:
            adapter = ref.LLMAdapter(
                vocab_size=a["vocab_size"], dim=a["model_dim"], num_layers=a["num_blocks"], num_heads=a["num_heads"]
            )
    return dit, adapter


def load_weights(dit, adapter, checkpoint, dtype):
    """Strict load, converted to `dtype` one tensor at a time (peak RAM ~ one model in
    `dtype`); assign=True replaces the never-touched uninitialized parameters."""
    dit_sd, adapter_sd = {}, {}
    with safe_open(checkpoint, framework="pt", device="cpu") as f:
        for key in f.keys():
            name = key[len(PREFIX):] if key.startswith(PREFIX) else key
            t = f.get_tensor(key).to(dtype)
            if name.startswith("llm_adapter."):
                adapter_sd[name[len("llm_adapter."):]] = t
            else:
                dit_sd[name] = t
    dit.load_state_dict(dit_sd, strict=True, assign=True)
    if adapter is not None:
        adapter.load_state_dict(adapter_sd, strict=True, assign=True)
    elif adapter_sd:
        raise SystemExit("reference_anima: checkpoint has llm_adapter.* keys but the config disables the adapter")
    for m in (dit, adapter):
        if m is None:
            continue
        for p in m.parameters():
            p.requires_grad_(False)
        m.eval()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--module", required=True, help="path of the reference anima_transformer.py")
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--config", required=True, help="sluice AnimaConfig JSON")
    ap.add_argument("--inputs", required=True)
    ap.add_argument("--output", required=True)
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    ref = load_reference_module(args.module)
    with open(args.config) as f:
        cfg = json.load(f)
    check_supported(cfg)
    dtype = DTYPES[args.dtype]

    t0 = time.perf_counter()
    dit, adapter = build_models(ref, cfg)
    load_weights(dit, adapter, args.checkpoint, dtype)
    t_load = time.perf_counter() - t0

    inputs = load_file(args.inputs)
    out = {}
    t0 = time.perf_counter()
    with torch.inference_mode():
        context = inputs.get("context")
        if "qwen_hidden" in inputs:
            if adapter is None:
                raise SystemExit("reference_anima: adapter inputs given but the model has no adapter")
            ctx = adapter(inputs["qwen_hidden"].to(dtype), inputs["t5_ids"].long())
            if "t5_weights" in inputs:
                ctx = ctx * inputs["t5_weights"].to(dtype).unsqueeze(-1)
            pad = cfg["adapter"]["output_tokens"] - ctx.shape[1]
            if pad > 0:
                ctx = torch.nn.functional.pad(ctx, (0, 0, 0, pad))
            out["context"] = ctx
            context = ctx
        if "x" in inputs:
            out["velocity"] = dit(inputs["x"].to(dtype), inputs["timesteps"], context.to(dtype))
    t_fwd = time.perf_counter() - t0
    save_file({k: v.contiguous() for k, v in out.items()}, args.output)
    print(f"reference: load {t_load:.2f}s, forward {t_fwd:.2f}s", file=sys.stderr)


if __name__ == "__main__":
    main()
