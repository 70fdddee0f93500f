#!/usr/bin/env python3
"""sluice.offload(module) against diffusers' group offloading, side by side, on the same
diffusers transformer (a random-weight CosmosTransformer3DModel, bf16) under the same
device-memory limit.

Modes, one row each, every one in a fresh subprocess (so that each row's peak host RSS,
resource.getrusage's ru_maxrss, is its own):
  baseline          the module on the device, no offloading: the floor
  diffusers group   apply_group_offloading(block_level, num_blocks_per_group=1), no stream
  diffusers stream  the same with use_stream=True (refused by diffusers on a CPU device)
  sluice bf16       sluice.offload(module, vram_budget=..., storage="bfloat16")
  sluice fp8        sluice.offload(module, vram_budget=..., storage="float8_e4m3fn")

Columns: the median step time (one transformer forward) over --steps after --warmup, its
ratio to the baseline measured in the same run, the bytes moved host->device per step,
the peak device memory, the peak host RSS (and its rise over the RSS right after the
imports, to read against the model's stored bytes), the host RAM each mode holds over the
model it stores, and the output against the baseline.

Host RAM over the stored model (issue 31's target for sluice: at most 1.1x): the RSS over
a base (the RSS once the model was built, less the model's bytes: what the process holds
besides the model), divided by the bytes the mode keeps of the model: sluice's
stored model (stats()["model"]["total_bytes"]: its streamed layers in the storage dtype, the
other tensors as they are) for the sluice rows, the bf16 model for the others. "setup" is
right after offload()/apply_group_offloading (sluice has freed the streamed layers' originals
by then: bf16 storage keeps the module's own memory, fp8 writes the bf16 originals to a
temporary file, originals="disk"), "peak" the whole run's peak (read after remove()), which
includes setup's moment with both the bf16 model the process built and the copy being
stored, the forwards' activations, and remove()'s moment with the stored copy and the
restored tensors. On the CPU device the
device is host memory too, so the sluice cells also give the host side alone: the RSS less
what sluice holds on the device (its ledger's current bytes after setup, its peak for the
peak).

Where the numbers come from:
  sluice: bytes/step is the median of stats()["forwards"][i]["bytes_streamed"] over the
    timed forwards; peak device memory is stats()["device"]["peak_bytes"] (sluice's ledger of
    the weights it put on the device: resident layers, ring, the module's other tensors; not
    activations), plus torch.cuda.max_memory_allocated on CUDA.
  diffusers: bytes/step counts what ModuleGroup._transfer_tensor_to_device really copies
    (a source tensor not already on the onload device); on the CPU device that is nothing
    (cpu->cpu .to() is a no-op), so the cell says n/a. Peak device memory is
    torch.cuda.max_memory_allocated on CUDA, n/a on the CPU device.
On the CPU device the "device" is host memory too: only sluice enforces the budget there, and
diffusers' hooks move nothing, so its row measures the hooks' overhead only.

    PYTHONPATH=build/pyinstall .venv/bin/python bench/offload_vs_diffusers.py
    ... --quick                       # fewer steps (the ctest entry)
    ... --device cuda --steps 50      # on a GPU machine (stream mode runs there)
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import subprocess
import sys
import tempfile
import time
import types

MODES = ["baseline", "diffusers-group", "diffusers-group-stream", "sluice-bf16", "sluice-fp8"]
LABELS = {
    "baseline": "baseline (no offloading)",
    "diffusers-group": "diffusers group offload (block_level, 1 block/group)",
    "diffusers-group-stream": "diffusers group offload + use_stream",
    "sluice-bf16": "sluice.offload storage=bfloat16",
    "sluice-fp8": "sluice.offload storage=float8_e4m3fn",
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--mlp-ratio", type=float, default=4.0)
    p.add_argument("--latent", type=int, default=32, help="latent height and width (16 channels, 1 frame)")
    p.add_argument("--frames", type=int, default=1)
    p.add_argument("--text-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=20, help="timed steps (transformer forwards) per mode")
    p.add_argument("--warmup", type=int, default=5,
                   help="untimed forwards first (sluice plans from its first measured forwards)")
    p.add_argument("--vram-budget", default="auto",
                   help="sluice's vram_budget (e.g. 48MiB; it includes the working memory); auto: "
                        "--working-memory + half the model's bytes with its Linear weights at the storage "
                        "dtype's width (skip lists not counted), so about half the layers stream")
    p.add_argument("--working-memory", default="64MiB", help="sluice's working_memory")
    p.add_argument("--max-resident", type=float, default=None, help="sluice's max_resident (default: none)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ",".join(MODES))
    p.add_argument("--quick", action="store_true", help="--steps 5 --warmup 4 (about 20 s on a 2-core CPU)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per mode's subprocess")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--ref", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.quick:
        a.steps, a.warmup = 5, 4
    a.modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    for m in a.modes:
        if m not in MODES:
            p.error(f"unknown mode {m!r}; one of {', '.join(MODES)}")
    return a


# --- helpers --------------------------------------------------------------------------------

UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9}


def parse_bytes(s: str) -> int:
    m = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", s)
    if not m or m.group(2).lower() not in UNITS:
        raise ValueError(f"not a byte size: {s!r}")
    return int(float(m.group(1)) * UNITS[m.group(2).lower()])


def mib(n) -> str:
    return "n/a" if n is None else f"{n / 2**20:.1f} MiB"


def rss_now_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        m = re.search(r"Model name:\s*(.+)", out)
        if m:
            return m.group(1).strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def torchvision_shim():
    # diffusers' Cosmos transformer resizes its padding mask with torchvision's nearest resize,
    # imported only when torchvision is installed (transformer_cosmos.py); F.interpolate(nearest)
    # is the same operation. scripts/setup.sh installs torchvision; this is for a GPU machine's
    # own Python, which may have diffusers without it.
    import importlib.util

    import torch

    if importlib.util.find_spec("torchvision") is not None:
        return
    import diffusers.models.transformers.transformer_cosmos as tc

    def resize(img, size, interpolation=None, **_):
        x = img if img.ndim == 4 else img[None]
        out = torch.nn.functional.interpolate(x, size=list(size), mode="nearest")
        return out if img.ndim == 4 else out[0]

    tc.transforms = types.SimpleNamespace(functional=types.SimpleNamespace(resize=resize),
                                          InterpolationMode=types.SimpleNamespace(NEAREST="nearest"))


def model_config(a) -> dict:
    hidden = a.heads * a.head_dim
    return dict(in_channels=16, out_channels=16, num_attention_heads=a.heads, attention_head_dim=a.head_dim,
                num_layers=a.layers, mlp_ratio=a.mlp_ratio, text_embed_dim=hidden, adaln_lora_dim=64,
                max_size=(max(8, a.frames), max(64, a.latent), max(64, a.latent)), patch_size=(1, 2, 2),
                rope_scale=(1.0, 4.0, 4.0), concat_padding_mask=True, extra_pos_embed_type=None)


def build_model(a):
    """The transformer, bf16, built in bf16 (no fp32 copy passes through host memory, so the
    peak RSS is the run's and not the construction's)."""
    import torch
    import diffusers

    diffusers.utils.logging.set_verbosity_error()
    torchvision_shim()
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = diffusers.CosmosTransformer3DModel(**model_config(a)).eval()
    finally:
        torch.set_default_dtype(old)
    return model.to(torch.bfloat16)


def model_bytes(model) -> int:
    return (sum(p.numel() * p.element_size() for p in model.parameters())
            + sum(b.numel() * b.element_size() for b in model.buffers()))


def inputs(a, device):
    import torch

    g = torch.Generator().manual_seed(1)
    hidden = a.heads * a.head_dim
    x = torch.randn(1, 16, a.frames, a.latent, a.latent, generator=g).to(torch.bfloat16)
    e = torch.randn(1, a.text_len, hidden, generator=g).to(torch.bfloat16)
    mask = torch.zeros(1, 1, a.latent * 2, a.latent * 2, dtype=torch.bfloat16)
    t = torch.tensor([0.5], dtype=torch.bfloat16)
    return dict(hidden_states=x.to(device), timestep=t.to(device), encoder_hidden_states=e.to(device),
                padding_mask=mask.to(device), return_dict=False)


def sluice_budget(a, model, storage: str) -> str:
    if a.vram_budget != "auto":
        return a.vram_budget
    import torch

    nbytes = 0
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            per = 1 if storage == "float8_e4m3fn" else m.weight.element_size()
            nbytes += m.weight.numel() * per + (0 if m.bias is None else m.bias.numel() * m.bias.element_size())
    others = model_bytes(model) - sum(p.numel() * p.element_size() for m in model.modules()
                                      if isinstance(m, torch.nn.Linear) for p in m.parameters(recurse=False))
    return str(parse_bytes(a.working_memory) + (nbytes + others) // 2)


# --- one mode, in its own process -----------------------------------------------------------

def child(a) -> dict:
    import torch

    torch.set_num_threads(a.threads)
    import diffusers  # noqa: F401  (imported before the RSS baseline)
    if a.child.startswith("sluice"):
        import sluice  # noqa: F401  (likewise: the extension's code is the process's, not the model's)

    rss_imports = rss_now_kib()
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    model = build_model(a)
    res = {"mode": a.child, "model_bytes": model_bytes(model), "rss_imports_kib": rss_imports,
           "rss_model_kib": rss_now_kib()}
    handle = None
    moved = {"bytes": 0}
    try:
        if a.child == "baseline":
            model.to(dev)
        elif a.child.startswith("diffusers-group"):
            from diffusers.hooks import apply_group_offloading
            from diffusers.hooks.group_offloading import ModuleGroup

            real = ModuleGroup._transfer_tensor_to_device

            def counted(self, tensor, source_tensor, default_stream):
                if source_tensor.device != torch.device(self.onload_device):
                    moved["bytes"] += source_tensor.numel() * source_tensor.element_size()
                return real(self, tensor, source_tensor, default_stream)

            ModuleGroup._transfer_tensor_to_device = counted
            use_stream = a.child.endswith("stream")
            try:
                apply_group_offloading(model, onload_device=dev, offload_device=torch.device("cpu"),
                                       offload_type="block_level", num_blocks_per_group=1, use_stream=use_stream)
            except ValueError as e:
                if use_stream and not cuda:
                    res["error"] = f"not supported on {dev.type}: {e}"
                    return res
                raise
        else:
            import sluice

            storage = "bfloat16" if a.child == "sluice-bf16" else "float8_e4m3fn"
            budget = sluice_budget(a, model, storage)
            res["vram_budget"] = budget
            handle = sluice.offload(model, device=a.device, vram_budget=budget, working_memory=a.working_memory,
                                    storage=storage, max_resident=a.max_resident)
        res["rss_setup_kib"] = rss_now_kib()
        if handle is not None:
            st = handle.stats()
            res["stored_bytes"] = st["model"]["total_bytes"]
            res["device_setup_bytes"] = st["device"]["current_bytes"]
        kw = inputs(a, dev)
        if cuda:
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        times = []
        out = None
        with torch.no_grad():
            for i in range(a.warmup + a.steps):
                if i == a.warmup:
                    moved["bytes"] = 0
                t0 = time.perf_counter()
                out = model(**kw)[0]
                if cuda:
                    torch.cuda.synchronize(dev)
                if i >= a.warmup:
                    times.append((time.perf_counter() - t0) * 1e3)
        times.sort()
        res["step_ms"] = times[len(times) // 2] if len(times) % 2 else (times[len(times) // 2 - 1] + times[len(times) // 2]) / 2
        res["min_ms"], res["max_ms"] = times[0], times[-1]
        res["torch_peak_bytes"] = torch.cuda.max_memory_allocated(dev) if cuda else None
        if handle is not None:
            st = handle.stats()
            timed = [f for f in st["forwards"] if f["index"] >= a.warmup]
            bs = sorted(f["bytes_streamed"] for f in timed)
            res["bytes_per_step"] = bs[len(bs) // 2] if bs else None
            res["bytes_per_step_range"] = [bs[0], bs[-1]] if bs else None
            res["sluice_wall_ms"] = sorted(f["wall_ms"] for f in timed)[len(timed) // 2] if timed else None
            res["stalls"] = sum(f.get("stalls", 0) for f in timed)
            res["demand_copies"] = sum(f.get("demand_copies", 0) for f in timed)
            res["forwards_recorded"] = len(st["forwards"])
            res["device_peak_bytes"] = st["device"]["peak_bytes"]
            res["device_by_kind_peak"] = {k: v["peak"] for k, v in st["device"]["by_kind"].items() if v["peak"]}
            res["model"] = st["model"]
            res["budget_bytes"] = st["budget"]["budget_bytes"]
            res["prefetch"] = st.get("prefetch")
            res["plan"] = {k: st["plan"].get(k) for k in ("policy", "predicted_step_ms", "floor_ms", "copy_gbps")} \
                if "plan" in st else None
        elif a.child == "baseline":
            res["bytes_per_step"] = 0
        else:
            res["bytes_per_step"] = moved["bytes"] if cuda else None
            res["bytes_counted"] = moved["bytes"]
        out = out.float().cpu()
        if a.child == "baseline":
            if a.ref:
                torch.save(out, a.ref)
        elif a.ref and os.path.exists(a.ref):
            ref = torch.load(a.ref)
            if torch.equal(out, ref):
                res["vs_baseline"] = "bit-identical"
            else:
                rel = ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()
                res["vs_baseline"] = f"rel L2 {rel:.2e}"
        if handle is not None:
            handle.remove()
    finally:
        res["peak_rss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return res


# --- the side by side -----------------------------------------------------------------------

def forwarded_args(a) -> list:
    out = ["--device", a.device, "--layers", str(a.layers), "--heads", str(a.heads), "--head-dim", str(a.head_dim),
           "--mlp-ratio", str(a.mlp_ratio), "--latent", str(a.latent), "--frames", str(a.frames),
           "--text-len", str(a.text_len), "--steps", str(a.steps), "--warmup", str(a.warmup),
           "--vram-budget", a.vram_budget, "--working-memory", a.working_memory, "--threads", str(a.threads)]
    if a.max_resident is not None:
        out += ["--max-resident", str(a.max_resident)]
    return out


def run_mode(a, mode: str, ref: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--ref", ref] + forwarded_args(a)
    env = dict(os.environ)
    env.setdefault("SLUICE_LOG_LEVEL", "warn")
    env.setdefault("OMP_NUM_THREADS", str(a.threads))
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=a.timeout)
    except subprocess.TimeoutExpired:
        return {"mode": mode, "error": f"timed out after {a.timeout:.0f} s"}
    lines = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
    if p.returncode != 0 or not lines:
        tail = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"mode": mode, "error": f"exit {p.returncode}: {tail}", "stderr": p.stderr}
    res = json.loads(lines[-1][len("RESULT "):])
    res["process_s"] = time.perf_counter() - t0
    return res


def hardware_line(a) -> str:
    import torch

    parts = [f"CPU: {cpu_name()} ({os.cpu_count()} logical cores visible, torch threads {a.threads})",
             f"torch {torch.__version__}"]
    try:
        import diffusers
        parts.append(f"diffusers {diffusers.__version__}")
    except ImportError:
        parts.append("diffusers not installed")
    dev = a.device
    if dev.startswith("cuda"):
        if torch.cuda.is_available():
            dev += f" ({torch.cuda.get_device_name(torch.device(dev))})"
        else:
            dev += " (not available)"
    parts.append(f"device {dev}")
    parts.append(f"python {platform.python_version()}")
    return "hardware: " + ", ".join(parts)


def ram_over_stored(r: dict, cuda: bool) -> str:
    """The table's host RAM cell: (RSS - the process without the model) / the model bytes the
    mode stores, after setup and at the peak."""
    stored = r.get("stored_bytes") or r["model_bytes"]
    # The process without the model: the RSS once the model was built, less its bytes (random
    # initialisation wrote every page of them); what building it loaded and touched besides
    # (torch's kernels, diffusers' modules) is the process's, not the model's.
    base = r["rss_model_kib"] * 1024 - r["model_bytes"]
    setup, peak = r["rss_setup_kib"] * 1024 - base, r["peak_rss_kib"] * 1024 - base
    cell = f"{setup / stored:.2f}x; {peak / stored:.2f}x of {mib(stored)}"
    if r["mode"].startswith("sluice") and not cuda and r.get("device_setup_bytes") is not None:
        cell += (f" (host side, the CPU device's memory left out: {(setup - r['device_setup_bytes']) / stored:.2f}x; "
                 f"{(peak - r['device_peak_bytes']) / stored:.2f}x)")
    return cell


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.child:
        res = child(a)
        print("RESULT " + json.dumps(res), flush=True)
        return 0

    import torch

    torch.set_num_threads(a.threads)
    print(hardware_line(a))
    cfg = model_config(a)
    print(f"model: diffusers CosmosTransformer3DModel(num_layers={cfg['num_layers']}, "
          f"num_attention_heads={cfg['num_attention_heads']}, attention_head_dim={cfg['attention_head_dim']} "
          f"(hidden {a.heads * a.head_dim}), mlp_ratio={cfg['mlp_ratio']}, text_embed_dim={cfg['text_embed_dim']}), "
          f"random weights, bf16; input latent 1x16x{a.frames}x{a.latent}x{a.latent}, text 1x{a.text_len}")
    print(f"steps: median of {a.steps} forwards after {a.warmup} warm-up forwards; each mode in a fresh process",
          flush=True)

    t0 = time.perf_counter()
    results = []
    with tempfile.TemporaryDirectory(prefix="offload_vs_diffusers_") as tmp:
        ref = os.path.join(tmp, "baseline_out.pt")
        modes = a.modes if "baseline" in a.modes else ["baseline"] + a.modes
        for mode in modes:
            results.append(run_mode(a, mode, ref))
    wall = time.perf_counter() - t0

    stored = next((r["model_bytes"] for r in results if "model_bytes" in r), None)
    base = next((r for r in results if r["mode"] == "baseline" and "step_ms" in r), None)
    print(f"model stored bytes (parameters + buffers, bf16): {stored} ({mib(stored)})" if stored is not None
          else "model stored bytes: unknown (every mode failed)")
    if base is not None:
        print(f"host RSS right after the imports (torch, diffusers): {mib(base['rss_imports_kib'] * 1024)}")
    print()
    cuda = a.device.startswith("cuda")
    hdr = ["mode", "step ms (median)", "x baseline", "H2D bytes/step", "peak device memory", "peak host RSS",
           "RSS over imports", "host RAM / stored model (setup; peak)", "output vs baseline"]
    print("| " + " | ".join(hdr) + " |")
    print("|" + "|".join("---" for _ in hdr) + "|")
    for r in results:
        label = LABELS[r["mode"]]
        if "error" in r and "step_ms" not in r:
            print(f"| {label} | {r['error']} |" + " |" * (len(hdr) - 2))
            continue
        ratio = f"{r['step_ms'] / base['step_ms']:.2f}" if base else "n/a"
        if r.get("bytes_per_step") is not None:
            h2d = f"{r['bytes_per_step']} ({mib(r['bytes_per_step'])})"
        elif r["mode"].startswith("diffusers"):
            h2d = f"n/a (cpu->cpu .to() copies nothing; counted {r.get('bytes_counted', 0)})"
        else:
            h2d = "n/a"
        if r["mode"].startswith("sluice"):
            dev = f"{mib(r['device_peak_bytes'])} (sluice ledger)"
            if r.get("torch_peak_bytes") is not None:
                dev += f"; torch max_allocated {mib(r['torch_peak_bytes'])}"
        elif r.get("torch_peak_bytes") is not None:
            dev = f"{mib(r['torch_peak_bytes'])} (torch max_allocated)"
        else:
            dev = f"n/a (on {a.device})"
        rss = r["peak_rss_kib"] * 1024
        over = rss - r["rss_imports_kib"] * 1024
        print(f"| {label} | {r['step_ms']:.2f} | {ratio} | {h2d} | {dev} | {mib(rss)} | {mib(over)} | "
              f"{ram_over_stored(r, cuda)} | {r.get('vs_baseline', 'reference' if r['mode'] == 'baseline' else 'n/a')} |")
    print()
    for r in results:
        if r["mode"].startswith("sluice") and "model" in r:
            m = r["model"]
            print(f"{LABELS[r['mode']]}: vram_budget {r['vram_budget']} bytes ({mib(r['budget_bytes'])}, working memory "
                  f"{a.working_memory} of it); residency '{m['residency']}': {m['resident_layers']} of {m['layers']} "
                  f"layers resident ({mib(m['resident_bytes'])} of {mib(m['total_bytes'])} stored), "
                  f"{m['streamed_layers']} streamed; device peak by kind {json.dumps({k: mib(v) for k, v in r['device_by_kind_peak'].items()})}; "
                  f"bytes_streamed over the timed forwards {r['bytes_per_step_range']}; engine wall_ms median "
                  f"{r['sluice_wall_ms']:.2f}; stalls {r['stalls']}, demand copies {r['demand_copies']}; "
                  f"plan {json.dumps(r['plan'])}")
    for r in results:
        if "step_ms" in r:
            print(f"{LABELS[r['mode']]}: step ms min {r['min_ms']:.2f} max {r['max_ms']:.2f}; host RSS after the "
                  f"model was built {mib(r['rss_model_kib'] * 1024)}, after the mode's setup "
                  f"{mib(r['rss_setup_kib'] * 1024)}; process {r['process_s']:.1f} s")
        elif r.get("stderr"):
            print(f"{LABELS[r['mode']]} failed; its stderr:\n{r['stderr']}")
    if not cuda:
        print("note: on the CPU device the device is host memory: only sluice enforces the budget (its ring copies "
              "are real memcpys), diffusers' cpu->cpu group offloading moves nothing, so its row is hook overhead.")
    print(f"total {wall:.1f} s")
    return 0 if base is not None else 1


if __name__ == "__main__":
    sys.exit(main())
