#!/usr/bin/env python3
"""sluice.offload(module) against diffusers' group offloading, side by side, on the same
diffusers transformer (a random-weight CosmosTransformer3DModel, bf16) under the same
device-memory limit.

Modes, one row each, every one in a fresh subprocess (so that each row's peak host RSS,
resource.getrusage's ru_maxrss, is its own):
  baseline          the module on the device, no offloading: the floor
  diffusers group   apply_group_offloading(block_level, num_blocks_per_group=1), no stream
  diffusers stream  the same with use_stream=True (refused by diffusers on a CPU device: its
                    process asks with a one-layer module first and builds no transformer)
  sluice bf16       sluice.offload(module, vram_budget=..., storage="bfloat16")
  sluice fp8        sluice.offload(module, vram_budget=..., storage="float8_e4m3fn")
  sluice fp8 mixed  the same transformer loaded with mixed dtypes, as frontends load it, then
                    sluice.offload(module, vram_budget=..., storage="float8_e4m3fn") with no
                    compute= and no skip= (each layer computes in its own dtype; the model's own
                    and diffusers' default skip lists apply). Before issue 37 offload() refused
                    such a model ("give compute="); its row shows that it runs.
With --compiled, a row more for each of sluice bf16 and sluice fp8 among --modes (issue 38;
not in the default run: inductor compiles for 20 to 40 s a row on a 2-core CPU):
  sluice bf16 compiled  sluice bf16, then torch.compile(module) (inductor, the default
  sluice fp8 compiled   backend); likewise for fp8. The first call (compilation) is
                        timed apart and not among the steps; the timed steps must not
                        compile again (torch._dynamo's error_on_recompile). Each streamed
                        layer's call is a boundary Dynamo does not trace (Note [compiled
                        callers] in python/sluice/_offload_hooks.py): inductor compiles the
                        code between the layers. The line "compiled vs eager offloaded"
                        below the table gives each compiled row's step time over its eager
                        row's, measured in the same run, and its output against the eager
                        offloaded output of the same process (the module called without the
                        compiled wrapper once the timed steps are done).

The mixed model: the bf16 transformer built as above, saved with save_pretrained to a
temporary folder (kept until the process ends) and loaded back with
from_pretrained(folder, torch_dtype=torch.bfloat16) into a subclass whose
_keep_in_fp32_modules is CosmosTransformer3DModel's own list (["learnable_pos_embed"], in
diffusers 0.42.1: a module this configuration does not have, extra_pos_embed_type=None)
plus "time_embed": so diffusers' loader keeps the time embedding in fp32 (its two Linear
layers time_embed.t_embedder.linear_1/linear_2 and its RMSNorm's weight time_embed.norm),
everything else bf16; the preamble prints the dtypes it loaded with. The built bf16 model is
freed (and the heap trimmed) before the load. from_pretrained as frontends call it maps the
safetensors file and leaves the tensors that need no conversion (every bf16 one) in that
mapping; the bench reads every tensor once right after loading (a sha1 of each), so that
all the model's pages are resident when the base is read, as a built model's are. Cosmos's
own code runs time_embed in the latent's dtype (timesteps_proj.type_as(hidden_states)), so
the model as loaded cannot run (a bf16 input to an fp32 Linear); the bench does what Wan's
time embedder does in diffusers itself: a forward pre-hook on time_embed casts its input to
fp32 and a forward hook casts its two outputs back to bf16 (the model's own hooks, the same
offloaded or not). sluice reads the subclass's _keep_in_fp32_modules too, so the time
embedding is stored and computed in fp32 (the detail line gives handle.stats()["skip"]).
Its reference ("output vs baseline", "... vs the mixed model without offloading") is the
same mixed model's output without offloading, in the same process, after remove(): one
forward, once the sha1 of every tensor matched those taken at load (remove() gave it back
bit for bit; otherwise the cell says n/a). Computed after remove() so that the offload()
stage below runs in a process that ran no forward yet, as in the other sluice rows. Its
"x baseline" is against the baseline row, as every row's (the fp32 time embedding is two
Linear layers on one timestep).

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
    activations), plus torch.cuda.max_memory_allocated on CUDA. Each sluice row's detail line
    below the table also gives stats()["pinned_bytes"], stats()["model"]["compute"] and
    stats()["skip"] (the skip list that applied).
  diffusers: bytes/step counts what ModuleGroup._transfer_tensor_to_device really copies
    (a source tensor not already on the onload device); on the CPU device that is nothing
    (cpu->cpu .to() is a no-op), so the cell says n/a. Peak device memory is
    torch.cuda.max_memory_allocated on CUDA, n/a on the CPU device.
On the CPU device the "device" is host memory too: only sluice enforces the budget there, and
diffusers' hooks move nothing, so its row measures the hooks' overhead only.

Host RSS of offload() and remove() (issue 37's target: the peak RSS during offload(), and
separately during remove(), at most 1.1x the module's original bytes plus the stored copy of
one layer), a block per sluice row. Its first line:
  "<row>: offload() peak X.XXx, remove() peak Y.YYx of the original bytes; target ≤ Z.ZZx
   (...): offload() meets it | misses it by D.DDx (M MiB), remove() ..."
Each stage's peak: just before the call the heap's free pages go back to the system
(malloc_trim(0), as sluice does after each layer) and the process's peak RSS is reset (5
written to /proc/self/clear_refs); right after the call VmHWM is read from
/proc/self/status. The peak less the base of the host RAM column (the RSS once the model
was built, less the model's bytes), over the original bytes (the module's parameters and
buffers before offload(): "model stored bytes" above, the mixed model's own in its row), is
X (offload()) and Y (remove()). Z = 1.1 + the stored bytes of the largest layer sluice took
over (weight and bias in the dtype it stores that layer in: the storage dtype, or the
layer's own for one of the skip list; read from the handle, OffloadedModel.stored_dtype of
each layer, which no public stat gives per layer) / the original bytes. "meets it" is
X ≤ Z (Y ≤ Z); a miss gives X - Z, and that times the original bytes. Where the peak cannot
be reset (no /proc/self/clear_refs, or not writable) the stage's cells say n/a. Resetting
the peak also resets what getrusage's ru_maxrss reports, so each row's "peak host RSS" is
the largest of VmHWM read just before each reset and ru_maxrss at the end: still the whole
run's peak. The indented lines below it say what is in those peaks:
  - remove() against the base read again after it: remove() runs after the forwards, which
    leave the process larger than when the base was read (the code pages and caches their
    kernels touched: the baseline row grows as much, its detail line's "at the end"). So
    the same base is read again once the module is back: the RSS after remove() (the heap
    trimmed) less the original bytes; Y against it. Memory remove() left behind would be in
    that base too: the detail line's "at the end" shows it against the baseline row's.
  - host side (CPU device only): sluice's device memory (resident layers, ring, scratch;
    stats()["device"]["current_bytes"]) is host memory there and counts in both stages; X
    less what sluice held there after offload(), and remove() (against the base read again)
    less what it held when remove() began (it frees that first), at least 1.00x (where
    remove() ends). "=" where the peak came while sluice held that memory (offload(): the
    RSS right after it within 1 MiB of its peak; remove(): the RSS right before it within
    1 MiB of its peak), so the figure is the host side's peak; "≥" otherwise, a lower bound.
    The figures a GPU machine's host would see.
  - file-backed RSS: RssFile of /proc/self/status after each stage less before it (code
    pages, mapped files; part of the peaks), and, where the model came from from_pretrained,
    the resident KiB of the *.safetensors mappings (/proc/self/smaps) once loaded, after
    offload() and after remove().

pin_memory: the sluice rows call offload() with pin_memory=None (sluice's default, "auto":
on for CUDA and ROCm, off on the CPU device) unless --pin-memory on|off|auto says otherwise.
On the CPU device pin_memory="on" makes sluice keep the streamed layers in its own pinned
arena, which is host memory too: run with --pin-memory on to measure that case (the detail
line gives the pinned bytes).

    PYTHONPATH=build/pyinstall .venv/bin/python bench/offload_vs_diffusers.py
    ... --quick                       # fewer steps (the ctest entry)
    ... --device cuda --steps 50      # on a GPU machine (stream mode runs there)
    ... --quick --pin-memory on       # the sluice rows with their streamed layers pinned
"""
from __future__ import annotations

import argparse
import contextlib
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

MODES = ["baseline", "diffusers-group", "diffusers-group-stream", "sluice-bf16", "sluice-fp8", "sluice-fp8-mixed"]
COMPILED_MODES = ["sluice-bf16-compiled", "sluice-fp8-compiled"]  # --compiled
LABELS = {
    "baseline": "baseline (no offloading)",
    "diffusers-group": "diffusers group offload (block_level, 1 block/group)",
    "diffusers-group-stream": "diffusers group offload + use_stream",
    "sluice-bf16": "sluice.offload storage=bfloat16",
    "sluice-fp8": "sluice.offload storage=float8_e4m3fn",
    "sluice-fp8-mixed": "sluice.offload storage=float8_e4m3fn, mixed bf16/fp32 model (no compute=, no skip=)",
    "sluice-bf16-compiled": "sluice.offload storage=bfloat16 + torch.compile",
    "sluice-fp8-compiled": "sluice.offload storage=float8_e4m3fn + torch.compile",
}
# The modules the mixed model keeps in fp32, besides CosmosTransformer3DModel's own
# _keep_in_fp32_modules (module docstring: "The mixed model").
KEEP_FP32 = ["time_embed"]


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
    p.add_argument("--pin-memory", choices=("on", "off", "auto"), default=None,
                   help="sluice's pin_memory for the sluice rows (default: not given, sluice's default auto: off on "
                        "the CPU device); on the CPU device 'on' keeps the streamed layers in a pinned arena")
    p.add_argument("--modes", default=",".join(MODES),
                   help="comma-separated subset of " + ",".join(MODES + COMPILED_MODES))
    p.add_argument("--compiled", action="store_true",
                   help="also a torch.compile row for each of sluice-bf16 and sluice-fp8 among --modes (" +
                        ", ".join(COMPILED_MODES) + ") and its ratio to that eager row (inductor: 20 to 40 s of "
                        "compilation per row on a 2-core CPU)")
    p.add_argument("--quick", action="store_true", help="--steps 5 --warmup 4 (about 20 s on a 2-core CPU)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per mode's subprocess")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--ref", default=None, help=argparse.SUPPRESS)
    p.add_argument("--scratch", default=None, help=argparse.SUPPRESS)  # the run's temporary folder
    a = p.parse_args(argv)
    if a.quick:
        a.steps, a.warmup = 5, 4
    a.modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    if a.compiled:  # the compiled twin of each eager sluice row asked for
        a.modes += [m + "-compiled" for m in ("sluice-bf16", "sluice-fp8")
                    if m in a.modes and m + "-compiled" not in a.modes]
    for m in a.modes:
        if m not in MODES + COMPILED_MODES:
            p.error(f"unknown mode {m!r}; one of {', '.join(MODES + COMPILED_MODES)}")
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


def status_kib(field: str):
    """A /proc/self/status field in KiB (VmRSS, VmHWM); None where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def rss_now_kib() -> int:
    return status_kib("VmRSS") or 0


def mapped_checkpoint_kib():
    """Resident KiB of the process's mappings of *.safetensors files (from_pretrained maps the
    checkpoint and keeps the tensors that need no conversion in the mapping); None where
    /proc/self/smaps cannot be read."""
    total, mapped = 0, False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                parts = line.split()
                if parts and not parts[0].endswith(":"):
                    mapped = len(parts) > 5 and parts[5].endswith(".safetensors")
                elif mapped and parts and parts[0] == "Rss:":
                    total += int(parts[1])
    except OSError:
        return None
    return total


_malloc_trim = None


def trim_heap() -> None:
    """glibc's malloc_trim(0): the heap's free pages back to the system (nothing elsewhere)."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            import ctypes

            _malloc_trim = ctypes.CDLL(None).malloc_trim
            _malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


class StagePeaks:
    """Peak RSS of one stage at a time (module docstring: "Host RSS of offload() and
    remove()"): reset() before the stage, peak_kib() after it. The run's own peak survives
    the resets (run_peak_kib)."""

    def __init__(self):
        self._run_peak = 0
        self._reset_ok = False

    def reset(self) -> bool:
        trim_heap()
        self._run_peak = max(self._run_peak, status_kib("VmHWM") or 0)
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self._reset_ok = status_kib("VmHWM") is not None
        except OSError:
            self._reset_ok = False
        return self._reset_ok

    def peak_kib(self):
        """VmHWM since the last reset(); None where it could not be reset."""
        return status_kib("VmHWM") if self._reset_ok else None

    def run_peak_kib(self) -> int:
        return max(self._run_peak, status_kib("VmHWM") or 0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


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


def build_mixed_model(a, folder: str):
    """The mixed model (module docstring: "The mixed model"): build_model's transformer saved
    to `folder` and loaded back as diffusers loads a model with _keep_in_fp32_modules, with
    the casts at the fp32 time embedding's edges. The built model is freed (and the heap
    trimmed) before the loaded one is returned, so the RSS after this is the loaded model's."""
    import gc

    import torch
    import diffusers

    built = build_model(a)
    built.save_pretrained(folder)
    del built
    gc.collect()
    trim_heap()
    base = diffusers.CosmosTransformer3DModel
    own_keep = list(base._keep_in_fp32_modules or [])
    keep = own_keep + [m for m in KEEP_FP32 if m not in own_keep]
    mixed_cls = type("CosmosTransformer3DModelMixed", (base,), {"_keep_in_fp32_modules": keep})
    model = mixed_cls.from_pretrained(folder, torch_dtype=torch.bfloat16).eval()
    te = model.time_embed
    own = te.t_embedder.linear_1.weight.dtype  # fp32 as loaded (read now: offload() makes it a placeholder)

    def to_own(mod, args):  # Wan's time embedder casts its input to its own weights' dtype the same way
        return (args[0].to(own),) + tuple(args[1:])

    def back(mod, args, out):
        return tuple(o.to(torch.bfloat16) for o in out)

    te.register_forward_pre_hook(to_own)
    te.register_forward_hook(back)
    trim_heap()
    return model


def checksums(model) -> dict:
    """{name: sha1 of its bytes} of every parameter and buffer (host tensors). Reading them
    also faults in every page of a model whose tensors lie in a mapped file (from_pretrained
    maps the safetensors file and keeps the tensors that need no conversion there)."""
    import hashlib

    import torch

    out = {}
    for n, t in list(model.named_parameters()) + list(model.named_buffers()):
        b = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        out[n] = (str(t.dtype), tuple(t.shape), hashlib.sha1(b).hexdigest())
    return out


def dtype_census(model) -> dict:
    """{dtype: [names of the parameters and buffers in it]}, for the preamble's dtype line."""
    out = {}
    for n, t in list(model.named_parameters()) + list(model.named_buffers()):
        out.setdefault(str(t.dtype).replace("torch.", ""), []).append(n)
    return out


def largest_stored_layer(handle):
    """(bytes, name) of the largest layer sluice took over, as it stores it: weight and bias in
    the dtype it stores that layer in (OffloadedModel.stored_dtype: the storage dtype, or the
    layer's own for one of the skip list). Read from the handle's private fields, which no
    public stat gives per layer."""
    import math

    import torch

    best = (0, "")
    for layer in handle._layers:
        width = torch.empty((), dtype=handle._model.stored_dtype(layer.index)).element_size()
        n = sum(math.prod(k.shape) for k in layer.kept) * width
        best = max(best, (n, layer.name))
    return best


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
    mixed = a.child.endswith("-mixed")
    if a.child == "diffusers-group-stream" and not cuda:
        # diffusers refuses streams before it looks at the module: asked with a one-layer
        # module, the row gets its own words without building the transformer (--quick's time).
        from diffusers.hooks import apply_group_offloading

        try:
            apply_group_offloading(torch.nn.Sequential(torch.nn.Linear(1, 1)), onload_device=dev,
                                   offload_device=torch.device("cpu"), offload_type="block_level",
                                   num_blocks_per_group=1, use_stream=True)
        except ValueError as e:
            return {"mode": a.child, "error": f"not supported on {dev.type}: {e}"}
    peaks = StagePeaks()
    sums = folder = None
    if mixed:
        folder = tempfile.mkdtemp(prefix="mixed_model_", dir=a.scratch)  # kept while the model maps its file
        model = build_mixed_model(a, folder)
        # Every page of the model resident before the base is read, as for a built model
        # (module docstring: "The mixed model"), and the bits remove() must give back.
        sums = checksums(model)
    else:
        model = build_model(a)
    res = {"mode": a.child, "model_bytes": model_bytes(model), "rss_imports_kib": rss_imports,
           "rss_model_kib": rss_now_kib(), "mapped_model_kib": mapped_checkpoint_kib() if mixed else None}
    if mixed:
        res["dtypes"] = dtype_census(model)
        res["keep_fp32"] = list(type(model)._keep_in_fp32_modules)
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

            storage = "bfloat16" if a.child.startswith("sluice-bf16") else "float8_e4m3fn"
            budget = sluice_budget(a, model, storage)
            res["vram_budget"] = budget
            # No compute= and no skip= for any row: each layer computes in its own dtype, the
            # default skip lists apply.
            peaks.reset()
            file_before = status_kib("RssFile")
            handle = sluice.offload(model, device=a.device, vram_budget=budget, working_memory=a.working_memory,
                                    storage=storage, max_resident=a.max_resident, pin_memory=a.pin_memory)
            res["offload_peak_kib"] = peaks.peak_kib()
            res["offload_file_kib"] = None if file_before is None else status_kib("RssFile") - file_before
            res["mapped_offload_kib"] = mapped_checkpoint_kib() if res["mapped_model_kib"] else None
        res["rss_setup_kib"] = rss_now_kib()
        if handle is not None:
            st = handle.stats()
            res["stored_bytes"] = st["model"]["total_bytes"]
            res["device_setup_bytes"] = st["device"]["current_bytes"]
            res["largest_layer_bytes"], res["largest_layer"] = largest_stored_layer(handle)
            res["skip"] = st["skip"]
            res["compute"] = st["model"].get("compute")
            res["sluice_hardware"] = st.get("hardware")
        kw = inputs(a, dev)
        compiled = a.child.endswith("-compiled")
        run = model
        first_timed = a.warmup  # the index of the first timed sluice forward
        if compiled:
            # torch.compile after offload() (module docstring: --compiled); the first call
            # compiles and is timed apart.
            from torch._dynamo.utils import counters

            run = torch.compile(model)
            t0 = time.perf_counter()
            with torch.no_grad():
                run(**kw)
            if cuda:
                torch.cuda.synchronize(dev)
            res["compile_s"] = time.perf_counter() - t0
            res["graphs_compiled"] = counters["stats"]["unique_graphs"]
            first_timed += 1
        if cuda:
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        times = []
        out = None
        no_recompile = torch._dynamo.config.patch(error_on_recompile=True) if compiled else contextlib.nullcontext()
        with torch.no_grad(), no_recompile:
            for i in range(a.warmup + a.steps):
                if i == a.warmup:
                    moved["bytes"] = 0
                t0 = time.perf_counter()
                out = run(**kw)[0]
                if cuda:
                    torch.cuda.synchronize(dev)
                if i >= a.warmup:
                    times.append((time.perf_counter() - t0) * 1e3)
        if compiled:
            res["graphs_after_steps"] = counters["stats"]["unique_graphs"]
        times.sort()
        res["step_ms"] = times[len(times) // 2] if len(times) % 2 else (times[len(times) // 2 - 1] + times[len(times) // 2]) / 2
        res["min_ms"], res["max_ms"] = times[0], times[-1]
        res["torch_peak_bytes"] = torch.cuda.max_memory_allocated(dev) if cuda else None
        if handle is not None:
            st = handle.stats()
            timed = [f for f in st["forwards"] if f["index"] >= first_timed]
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
            res["pinned_bytes"] = st.get("pinned_bytes")
            res["device_before_remove_bytes"] = st["device"]["current_bytes"]
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
        elif mixed:
            pass  # compared after remove() below
        elif a.ref and os.path.exists(a.ref):
            ref = torch.load(a.ref)
            if torch.equal(out, ref):
                res["vs_baseline"] = "bit-identical"
            else:
                rel = ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()
                res["vs_baseline"] = f"rel L2 {rel:.2e}"
        if compiled:
            # The same offloaded module called without the compiled wrapper: the eager output.
            with torch.no_grad():
                eager = model(**kw)[0].float().cpu()
            rel = ((out - eager).norm() / eager.norm().clamp_min(1e-30)).item()
            res["vs_eager_offloaded"] = "bit-identical" if torch.equal(out, eager) else f"rel L2 {rel:.2e}"
        if handle is not None:
            del kw
            peaks.reset()
            res["rss_before_remove_kib"] = rss_now_kib()
            file_before = status_kib("RssFile")
            handle.remove()
            res["remove_peak_kib"] = peaks.peak_kib()
            res["remove_file_kib"] = None if file_before is None else status_kib("RssFile") - file_before
            res["mapped_remove_kib"] = mapped_checkpoint_kib() if res["mapped_model_kib"] else None
        trim_heap()
        res["rss_end_kib"] = rss_now_kib()
        if mixed:
            # The reference: the same mixed model without offloading, in this process, once
            # remove() has given it back (checked bit for bit against the sums taken at load).
            same = checksums(model) == sums
            res["removed_bit_identical"] = same
            if not same:
                res["vs_baseline"] = "n/a: remove() did not give the model back bit for bit"
            else:
                with torch.no_grad():
                    ref = model.to(dev)(**inputs(a, dev))[0].float().cpu()
                rel = ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()
                res["vs_baseline"] = ("bit-identical" if torch.equal(out, ref) else f"rel L2 {rel:.2e}") + \
                    " vs the mixed model without offloading"
    finally:
        res["peak_rss_kib"] = peaks.run_peak_kib()
        if folder is not None:
            import shutil

            shutil.rmtree(folder, ignore_errors=True)
    return res


# --- the side by side -----------------------------------------------------------------------

def forwarded_args(a) -> list:
    out = ["--device", a.device, "--layers", str(a.layers), "--heads", str(a.heads), "--head-dim", str(a.head_dim),
           "--mlp-ratio", str(a.mlp_ratio), "--latent", str(a.latent), "--frames", str(a.frames),
           "--text-len", str(a.text_len), "--steps", str(a.steps), "--warmup", str(a.warmup),
           "--vram-budget", a.vram_budget, "--working-memory", a.working_memory, "--threads", str(a.threads)]
    if a.max_resident is not None:
        out += ["--max-resident", str(a.max_resident)]
    if a.pin_memory is not None:
        out += ["--pin-memory", a.pin_memory]
    return out


def run_mode(a, mode: str, ref: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--ref", ref,
           "--scratch", os.path.dirname(ref)] + forwarded_args(a)
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


def stage_peaks_lines(r: dict, cuda: bool) -> list:
    """offload()'s and remove()'s peak RSS against issue 37's target (module docstring: "Host
    RSS of offload() and remove()"): the line the target is read on, then what is in it."""
    orig = r["model_bytes"]
    base = r["rss_model_kib"] * 1024 - orig
    target = 1.1 + r["largest_layer_bytes"] / orig

    def ratio(kib, over=base):
        return None if kib is None else (kib * 1024 - over) / orig

    def verdict(x):
        if x is None:
            return "n/a"
        return "meets it" if x <= target else f"misses it by {x - target:.2f}x ({(x - target) * orig / 2**20:.2f} MiB)"

    def cell(x):
        return "n/a" if x is None else f"{x:.2f}x"

    off, rem = ratio(r.get("offload_peak_kib")), ratio(r.get("remove_peak_kib"))
    out = [f"{LABELS[r['mode']]}: offload() peak {cell(off)}, remove() peak {cell(rem)} of the original bytes; "
           f"target ≤ {target:.2f}x (1.1 + the largest layer's stored copy, '{r['largest_layer']}' "
           f"{mib(r['largest_layer_bytes'])}, over the original {mib(orig)}): offload() {verdict(off)}, "
           f"remove() {verdict(rem)}"]
    if rem is None:
        return out
    # remove() runs after the forwards, which leave the process larger than it was when the
    # base was read (the code pages and caches their kernels touched): the same base read
    # again once the module is back, the RSS after remove() less the original bytes.
    base2 = r["rss_end_kib"] * 1024 - orig
    rem2 = ratio(r["remove_peak_kib"], base2)
    out.append(f"    remove() against the base read again after it (the RSS after remove() less the original bytes, "
               f"{mib(base2 - base)} above the first base: what the forwards left in the process, any memory "
               f"remove() left behind included): {rem2:.2f}x, {verdict(rem2)}")
    if not cuda:
        d_off, d_rem = r["device_setup_bytes"], r["device_before_remove_bytes"]
        # The peak less the device memory: the host side exactly where the peak came while
        # sluice held it (offload(): at its end, the RSS then within 1 MiB of the peak;
        # remove(): at its start), a lower bound otherwise; remove()'s is at least where it
        # ended (the module back: 1.00x of the base read again).
        h_off, h_rem = off - d_off / orig, max(1.0, rem2 - d_rem / orig)
        at_end = r["offload_peak_kib"] - r["rss_setup_kib"] < 1024
        at_start = r["remove_peak_kib"] - r["rss_before_remove_kib"] < 1024
        out.append(f"    host side, less sluice's memory on the CPU device (host memory there: {mib(d_off)} after "
                   f"offload(), {mib(d_rem)} when remove() began, which frees it first): offload() "
                   f"{'=' if at_end else '≥'} {h_off:.2f}x, {verdict(h_off)}; remove() (against the base read again) "
                   f"{'=' if at_start else '≥'} {h_rem:.2f}x, {verdict(h_rem)}")
    if r.get("offload_file_kib") is not None:
        line = (f"    file-backed RSS (mapped files, code pages; in the peaks above): "
                f"{r['offload_file_kib'] / 1024:+.1f} MiB over offload(), {r['remove_file_kib'] / 1024:+.1f} MiB "
                f"over remove()")
        if r.get("mapped_model_kib"):
            line += (f"; the checkpoint file from_pretrained mapped (*.safetensors) resident: "
                     f"{mib(r['mapped_model_kib'] * 1024)} once loaded, {mib(r['mapped_offload_kib'] * 1024)} after "
                     f"offload(), {mib(r['mapped_remove_kib'] * 1024)} after remove()")
        out.append(line)
    return out


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
    print("sluice rows: " + (f"pin_memory={a.pin_memory!r}" if a.pin_memory is not None else
                             "pin_memory not given (sluice's default, auto: " +
                             ("on for CUDA)" if a.device.startswith("cuda") else "off on the CPU device)")),
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
    for r in results:
        if "dtypes" in r:
            census = "; ".join(f"{d}: {len(names)} tensors" + (f" ({', '.join(names)})" if len(names) <= 8 else "")
                               for d, names in sorted(r["dtypes"].items(), key=lambda kv: len(kv[1])))
            print(f"mixed model ({LABELS[r['mode']]}), as from_pretrained(torch_dtype=bfloat16) loaded it with "
                  f"_keep_in_fp32_modules={r['keep_fp32']}: {census}; {r['model_bytes']} bytes "
                  f"({mib(r['model_bytes'])})")
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
    by_mode = {r["mode"]: r for r in results}
    hw = next((r["sluice_hardware"] for r in results if r.get("sluice_hardware")), None)
    if hw or any(r["mode"].endswith("-compiled") for r in results):
        print()
    if hw:
        print(f"sluice's hardware line (an offload handle's stats()['hardware']): {hw}")
    for r in results:
        if r["mode"].endswith("-compiled") and "step_ms" in r:
            e = by_mode.get(r["mode"][: -len("-compiled")])
            ratio = f"{r['step_ms'] / e['step_ms']:.2f}x" if e and "step_ms" in e else "n/a (its eager row did not run)"
            eager_ms = f"{e['step_ms']:.2f} ms" if e and "step_ms" in e else "n/a"
            print(f"compiled vs eager offloaded: {LABELS[r['mode']]} {r['step_ms']:.2f} ms vs {eager_ms} "
                  f"({LABELS[r['mode'][: -len('-compiled')]]}, same run): {ratio}; first call (compiling) "
                  f"{r['compile_s']:.1f} s, {r['graphs_compiled']} graphs, {r['graphs_after_steps']} after the timed "
                  f"steps (no recompilation); output vs the eager offloaded module: {r['vs_eager_offloaded']}")
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
                  f"plan {json.dumps(r['plan'])}; pinned {mib(r.get('pinned_bytes'))}; compute "
                  f"{json.dumps(r.get('compute'))}; skip {json.dumps(r.get('skip'))}"
                  + ("" if "removed_bit_identical" not in r else
                     f"; remove() gave every tensor back bit for bit (sha1 at load and after remove()): "
                     f"{'yes' if r['removed_bit_identical'] else 'NO'}"))
    print()
    print("host RSS of offload() and remove(), issue 37's target: each stage's peak RSS (reset just before it), less "
          "the base of the host RAM column, ≤ 1.1x the module's original bytes + its largest layer's stored copy")
    for r in results:
        if r["mode"].startswith("sluice") and "largest_layer_bytes" in r:
            print("\n".join(stage_peaks_lines(r, cuda)))
    print()
    for r in results:
        if "step_ms" in r:
            print(f"{LABELS[r['mode']]}: step ms min {r['min_ms']:.2f} max {r['max_ms']:.2f}; host RSS after the "
                  f"model was built {mib(r['rss_model_kib'] * 1024)}, after the mode's setup "
                  f"{mib(r['rss_setup_kib'] * 1024)}, at the end (after remove() for sluice) "
                  f"{mib(r.get('rss_end_kib', 0) * 1024)} "
                  f"({(r.get('rss_end_kib', 0) - r['rss_model_kib']) / 1024:+.1f} MiB over the model built); "
                  f"process {r['process_s']:.1f} s")
        elif r.get("stderr"):
            print(f"{LABELS[r['mode']]} failed; its stderr:\n{r['stderr']}")
    if not cuda:
        print("note: on the CPU device the device is host memory: only sluice enforces the budget (its ring copies "
              "are real memcpys), diffusers' cpu->cpu group offloading moves nothing, so its row is hook overhead.")
    print(f"total {wall:.1f} s")
    return 0 if base is not None else 1


if __name__ == "__main__":
    sys.exit(main())
