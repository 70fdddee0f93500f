#!/usr/bin/env python3
"""Side-by-side (issue 6 §4): sluice against diffusers' group offloading and an InvokeAI-style
partial load, on one device, the same random weights, the same inputs.

    # on a GPU machine (bench/gpu/device_all.sh builds sluice and the bindings, then runs this):
    python bench/gpu/compare.py --device cuda --preset anima-2b --resolutions 1024,512
    # the CPU smoke run (ctest "bench: compare.py CPU smoke"):
    python bench/gpu/compare.py --device cpu --preset anima-tiny --resolutions 64 --check-rel-l2 0.05

Contenders (each in its own child process, so host RSS and device peaks are its own):
  sluice-full            sluice, max_resident 1.0: the reference output and the compute time
  sluice-0.5, -0.25      sluice (Python bindings), max_resident 0.5 / 0.25, fp8 storage
  diffusers              CosmosTransformer3DModel (keys mapped, bench/gpu/anima_diffusers.py),
                         model.enable_layerwise_casting(float8_e4m3fn, bfloat16), then
                         apply_group_offloading(block_level, num_blocks_per_group=1,
                         use_stream=True, record_stream=True) (streams need CUDA: on the CPU
                         device use_stream/record_stream are off)
  invokeai-style@R       a RE-CREATION of InvokeAI 6.14's partial loading, not InvokeAI itself
                         (its package is not installed): InvokeAI's own Anima DiT
                         (.deps/reference, scripts/fetch_reference.sh); fp8 storage through
                         pre/post forward hooks that cast a layer's parameters where they lie
                         (so streamed layers are upcast on the host); CustomLinear's
                         `weight.to(device)` from pageable memory on the compute stream
                         (synchronous); greedy residency in state-dict order up to R bytes,
                         norms first (CachedModelWithPartialLoad.partial_load_to_vram). R is
                         sluice-0.5's / sluice-0.25's resident bytes.
  sluice@peak(X)         sluice under a VRAM budget equal to contender X's measured peak
                         device memory: the "same card" comparison (issue 6: diffusers cannot
                         use the room partial residency would use; sluice must).

Reported per contender and resolution: step time (median of --steps after --warmup),
peak device memory (torch.cuda.max_memory_allocated; on the CPU device: weights held on the
"device" by accounting), host RSS after the steps, bytes crossing PCIe per step (sluice:
its own counter; others: host<->device copies counted with a TorchDispatchMode on one extra
step; on the CPU device: what they would copy, by accounting), the ratio to sluice at equal
peak device memory, the relative L2 vs sluice-full, and the ratio to the floor
max(compute, streamed bytes / pinned H2D bandwidth) with compute = sluice-full's step time
and the bandwidth measured here. A markdown table goes to stdout, JSON to --json.

Time on one H200, as bench/gpu/device_all.sh runs it (--steps 3 --warmup 1; estimates, no GPU
run yet; the build of sluice and of the bindings is device_all.sh's):
  checkpoint generation (anima-2b, bf16, 4 GB)                  ~20 s
  4 child processes x (start + load 4 GB)                       ~60 s
  steps: (1 warm-up + 3 timed + 1 counted) x 9 contenders x 2 resolutions, at most ~1 s
  each for the slowest (InvokeAI-style streams bf16 through pageable memory)   ~60 s
  total                                                          ~2.5 min
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

import torch
from safetensors.torch import load_file, save_file
from torch.utils._python_dispatch import TorchDispatchMode

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)
FP8 = torch.float8_e4m3fn
BF16 = torch.bfloat16
GIB = 2**30
MIB = 2**20


# --------------------------------------------------------------------------------------------
# Measurement helpers (children)
# --------------------------------------------------------------------------------------------

def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def proc_status_bytes(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def timed_steps(step, device, warmup, steps):
    """Runs `step` warmup + steps times; returns (first timed output, step times in ms, peak
    device bytes over warm-up and timed steps or None on the CPU)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(warmup):
        step()
    times, out = [], None
    for i in range(steps):
        sync(device)
        t0 = time.perf_counter()
        o = step()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
        if i == 0:
            out = o.float().cpu()
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return out, times, peak


class CopyCounter(TorchDispatchMode):
    """Counts bytes of host<->device copies (aten._to_copy and aten.copy_ across devices)."""

    def __init__(self):
        super().__init__()
        self.h2d = 0
        self.d2h = 0

    def _add(self, src, dst, nbytes):
        if src.type == "cpu" and dst.type != "cpu":
            self.h2d += nbytes
        elif src.type != "cpu" and dst.type == "cpu":
            self.d2h += nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.ops.aten._to_copy.default and isinstance(out, torch.Tensor):
            if args[0].device != out.device:
                self._add(args[0].device, out.device, out.nbytes)
        elif func is torch.ops.aten.copy_.default:
            dst, src = args[0], args[1]
            if isinstance(src, torch.Tensor) and src.device != dst.device:
                self._add(src.device, dst.device, src.nbytes)
        return out


def counted_step(step, device):
    """Host->device bytes of one step, counted (CUDA) or None (the CPU device has no bus)."""
    if device.type == "cpu":
        return None
    with CopyCounter() as c:
        step()
    sync(device)
    return c.h2d


def load_inputs(path, res, device):
    t = load_file(path)
    return (t[f"x_{res}"].to(device, BF16), t[f"t_{res}"].to(device), t[f"ctx_{res}"].to(device, BF16))


def result_row(name, res, out_path, out, times, peak, pcie, extra=None):
    save_file({"velocity": out.contiguous()}, out_path)
    row = dict(name=name, resolution=res, output=out_path, step_ms=statistics.median(times), step_ms_all=times,
               peak_device_bytes=peak, host_rss_bytes=proc_status_bytes("VmRSS"),
               host_peak_rss_bytes=proc_status_bytes("VmHWM"), pcie_bytes_per_step=pcie)
    row.update(extra or {})
    return row


# --------------------------------------------------------------------------------------------
# Children
# --------------------------------------------------------------------------------------------

def child_sluice(spec):
    """sluice through its Python bindings. spec["configs"]: {name, max_resident} or
    {name, budget: {res: bytes}}."""
    import sluice

    device = torch.device(spec["device"])
    rows = []
    for res in spec["resolutions"]:
        x, t, ctx = load_inputs(spec["inputs"], res, device)
        for c in spec["configs"]:
            budget = c.get("budget", {}).get(str(res))
            if "budget" in c and budget is None:
                continue
            # A cache per run: the budget and the working memory sized for `res` are cache
            # options, and a fresh cache starts with fresh peaks.
            cache = sluice.ModelCache(device=spec["device"], vram_budget=str(budget) if budget else "",
                                      resolution=res)
            row_extra = {}
            try:
                model = cache.load(spec["checkpoint"], storage="float8_e4m3fn", compute="bfloat16",
                                   max_resident=c.get("max_resident"))
                with model.lock() as m:
                    out, times, peak = timed_steps(lambda: m(x, t, ctx), device, spec["warmup"], spec["steps"])
                st = model.stats()
                last = st["forwards"][-1]
                row_extra = dict(resident_bytes=st["model"]["resident_bytes"], total_bytes=st["model"]["total_bytes"],
                                 residency=model.residency_map(), sluice_device_peak_bytes=st["device"]["peak_bytes"],
                                 budget_bytes=budget, h2d_gbps=last.get("h2d_gbps"), stall_ms=last.get("stall_ms"))
                if peak is None:  # CPU device: the weights sluice holds "on the device", by accounting
                    peak = st["device"]["peak_bytes"]
                rows.append(result_row(c["name"], res, os.path.join(spec["workdir"], f"out_{c['name']}_{res}.safetensors"),
                                       out, times, peak, last["bytes_streamed"], row_extra))
                del model
            except sluice.Error as e:
                rows.append(dict(name=c["name"], resolution=res, error=str(e), budget_bytes=budget))
            del cache
            gc.collect()
    return rows


def read_checkpoint(path, dtype):
    sd = {}
    from safetensors import safe_open
    with safe_open(path, framework="pt", device="cpu") as f:
        for k in f.keys():
            sd[k] = f.get_tensor(k).to(dtype)
    return sd


def child_diffusers(spec):
    import anima_diffusers as ad
    from diffusers.hooks import apply_group_offloading, apply_layerwise_casting

    device = torch.device(spec["device"])
    cfg = spec["config"]
    sd = read_checkpoint(spec["checkpoint"], BF16)
    model = ad.build_model(cfg, sd, BF16, "cpu")
    linear_keys = {ad.map_key(k) for k, v in sd.items() if ad.is_dit_key(k) and v.dim() == 2}
    del sd
    if spec["diffusers_fp8_set"] == "model":
        model.enable_layerwise_casting(storage_dtype=FP8, compute_dtype=BF16)
    else:
        apply_layerwise_casting(model, storage_dtype=FP8, compute_dtype=BF16,
                                skip_modules_pattern=ad.SLUICE_SKIP_PATTERNS)
    sd_after = model.state_dict()
    fp8_keys = {k for k, v in sd_after.items() if v.dtype == FP8}
    expected = {k for k in linear_keys if not any(re.search(p, k.rpartition(".")[0]) for p in INVOKEAI_SKIPS_MAPPED)}
    total_bytes = sum(v.nbytes for v in sd_after.values())
    use_stream = device.type == "cuda"
    apply_group_offloading(model, onload_device=device, offload_device=torch.device("cpu"),
                           offload_type="block_level", num_blocks_per_group=1, use_stream=use_stream,
                           record_stream=use_stream)
    block_bytes = [sum(p.nbytes for p in b.parameters()) for b in model.transformer_blocks]
    rows = []
    for res in spec["resolutions"]:
        x, t, ctx = load_inputs(spec["inputs"], res, device)
        pad = cfg["concat_padding_mask"]
        with torch.inference_mode():
            step = lambda: ad.forward(model, x, t, ctx, pad)  # noqa: E731
            out, times, peak = timed_steps(step, device, spec["warmup"], spec["steps"])
            pcie = counted_step(step, device)
        extra = dict(fp8_bytes=sum(sd_after[k].nbytes for k in fp8_keys), total_bytes=total_bytes,
                     fp8_set_equals_sluice=fp8_keys == expected, pcie_accounted=True if pcie is None else False,
                     use_stream=use_stream)
        if pcie is None:  # every group is onloaded each forward: all of the model crosses
            pcie = total_bytes
        if peak is None:  # non-block groups + the running block + the prefetched one
            peak = (total_bytes - sum(block_bytes)) + 2 * max(block_bytes)
            extra["peak_accounted"] = True
        rows.append(result_row("diffusers", res, os.path.join(spec["workdir"], f"out_diffusers_{res}.safetensors"),
                               out, times, peak, pcie, extra))
    return rows


# InvokeAI's fp8 skip patterns (load_default.py _FP8_DEFAULT_SKIP_PATTERNS + AnimaTransformer's
# declared ones), searched over the module's dotted name, and the same set over diffusers' names.
INVOKEAI_SKIPS = ("pos_embed", "patch_embed", "norm", r"^proj_in$", r"^proj_out$", "t_embedder", "x_embedder",
                  "final_layer")
INVOKEAI_SKIPS_MAPPED = (r"^patch_embed(\.|$)", r"^time_embed(\.|$)", r"^norm_out(\.|$)", r"^proj_out$")


class _InvokeLinear(torch.nn.Linear):
    """InvokeAI's CustomLinear with device autocasting on (a partially loaded model):
    cast_to_device() is a plain `.to(device)` of the CPU weight, i.e. a synchronous copy from
    pageable memory on the current (compute) stream, then a dtype cast if needed."""

    def forward(self, input):
        w, b = self.weight, self.bias
        if w.device.type != input.device.type:
            w = w.to(input.device)
        if w.dtype != input.dtype:
            w = w.to(input.dtype)
        if b is not None:
            if b.device.type != input.device.type:
                b = b.to(input.device)
            if b.dtype != input.dtype:
                b = b.to(input.dtype)
        return torch.nn.functional.linear(input, w, b)


# ModelLoader._wrap_forward_with_fp8_cast: cast a layer's parameters where they lie (on the
# host for a streamed layer) on entry, and back to fp8 on exit (even when forward raises).
def _fp8_pre_hook(mod, _args):
    for p in mod.parameters(recurse=False):
        p.data = p.data.to(BF16)


def _fp8_post_hook(mod, _args, _output):
    for p in mod.parameters(recurse=False):
        p.data = p.data.to(FP8)


def invokeai_style(dit, device, resident_bytes):
    """Applies the re-created InvokeAI fp8 storage + partial load to `dit` (bf16, on the CPU).
    Returns (resident bytes loaded, bytes a step copies host->device by accounting)."""
    cast_modules = set()
    for name, mod in dit.named_modules():
        if not isinstance(mod, (torch.nn.Linear, torch.nn.Embedding)):
            continue
        if any(re.search(p, name) for p in INVOKEAI_SKIPS):
            continue
        params = list(mod.parameters(recurse=False))
        if not params:
            continue
        for p in params:
            p.data = p.data.to(FP8)
        mod.register_forward_pre_hook(_fp8_pre_hook)
        mod.register_forward_hook(_fp8_post_hook, always_call=True)
        cast_modules.add(name)
    autocast = set()
    for name, mod in dit.named_modules():
        if type(mod) is torch.nn.Linear:
            mod.__class__ = _InvokeLinear  # apply_custom_layers_to_model
            autocast.add(name)
    sd = dit.state_dict()
    nbytes = {k: v.nbytes for k, v in sd.items()}
    must = [k for k in sd if k.rpartition(".")[0] not in autocast]  # norms: no autocast -> on device
    load = set(must)
    loaded = sum(nbytes[k] for k in must)
    for k in sd:  # greedy in state-dict order, skipping what does not fit (`continue`, not `break`)
        if k in load:
            continue
        if loaded + nbytes[k] > resident_bytes:
            continue
        load.add(k)
        loaded += nbytes[k]
    params = dict(dit.named_parameters())
    with torch.no_grad():
        for k in load:
            if k in params:
                params[k].data = params[k].data.to(device)
        for mod in dit.modules():  # _move_non_persistent_buffers_to_device
            for bname, buf in list(mod._buffers.items()):
                if buf is not None:
                    mod._buffers[bname] = buf.to(device)
    streamed = 0
    for k in sd:
        if k not in load:
            streamed += sd[k].nelement() * 2 if k.rpartition(".")[0] in cast_modules else nbytes[k]
    return loaded, streamed


def child_invokeai(spec):
    sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
    import reference_anima

    device = torch.device(spec["device"])
    ref = reference_anima.load_reference_module(spec["reference"])
    cfg = spec["config"]
    rows = []
    for c in spec["configs"]:
        dit, _ = reference_anima.build_models(ref, dict(cfg, adapter=dict(cfg["adapter"], enabled=False)))
        sd = {k[len("net."):] if k.startswith("net.") else k: v
              for k, v in read_checkpoint(spec["checkpoint"], BF16).items()}
        sd = {k: v for k, v in sd.items() if not k.startswith("llm_adapter.")}
        dit.load_state_dict(sd, strict=True, assign=True)
        del sd
        dit.requires_grad_(False).eval()
        loaded, streamed = invokeai_style(dit, device, c["resident_bytes"])
        for res in spec["resolutions"]:
            x, t, ctx = load_inputs(spec["inputs"], res, device)
            with torch.inference_mode():
                step = lambda: dit(x, t, ctx)  # noqa: E731
                out, times, peak = timed_steps(step, device, spec["warmup"], spec["steps"])
                pcie = counted_step(step, device)
            extra = dict(resident_bytes=loaded, target_resident_bytes=c["resident_bytes"],
                         pcie_accounted=pcie is None)
            if pcie is None:
                pcie = streamed
            if peak is None:  # resident bytes + the largest layer's bf16 copy in flight
                peak = loaded + max(p.nelement() * 2 for p in dit.parameters())
                extra["peak_accounted"] = True
            rows.append(result_row(c["name"], res, os.path.join(spec["workdir"], f"out_{c['name']}_{res}.safetensors"),
                                   out, times, peak, pcie, extra))
        del dit
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


CHILDREN = {"sluice": child_sluice, "diffusers": child_diffusers, "invokeai": child_invokeai}


# --------------------------------------------------------------------------------------------
# Parent
# --------------------------------------------------------------------------------------------

def measure_h2d_gbps(device):
    """Pinned host->device bandwidth in GB/s (1e9 B/s): 256 MiB, best of 5. On the CPU device,
    a host memcpy of the same size (what the CPU device's copies cost)."""
    n = 256 * MIB
    if device.type == "cuda":
        src = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        dst = torch.empty(n, dtype=torch.uint8, device=device)
        best = float("inf")
        for _ in range(6):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            dst.copy_(src, non_blocking=True)
            e.record()
            e.synchronize()
            best = min(best, s.elapsed_time(e) / 1e3)
        return n / best / 1e9
    src = torch.ones(n, dtype=torch.uint8)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return n / best / 1e9


def run_child(kind, spec, args):
    path = os.path.join(args.workdir, f"spec_{kind}_{len(os.listdir(args.workdir))}.json")
    with open(path, "w") as f:
        json.dump(spec, f)
    out = path.replace("spec_", "result_")
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", kind, "--spec", path, "--result", out])
    print(f"[compare] {kind}: {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    if p.returncode != 0:
        raise SystemExit(f"compare.py: the {kind} child failed (exit {p.returncode}); see its output above")
    with open(out) as f:
        return json.load(f)


def find_cli(args):
    for c in (args.sluice_cli, os.environ.get("SLUICE_CLI"), shutil.which("sluice"),
              os.path.join(ROOT, "build", "cli", "sluice")):
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    raise SystemExit("compare.py: no sluice CLI (pass --sluice-cli, set SLUICE_CLI, or build build/cli/sluice)")


def rel_l2(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def fmt_bytes(n):
    return "—" if n is None else (f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / MIB:.1f} MiB")


def main():
    ap = argparse.ArgumentParser(description="sluice vs diffusers vs InvokeAI-style partial loading (issue 6 §4)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--preset", default="anima-2b", help="generated model (sluice make-checkpoint --config)")
    ap.add_argument("--checkpoint", help="use this Anima checkpoint instead of generating one")
    ap.add_argument("--seed", type=int, default=2026)
    ap.add_argument("--resolutions", default="1024,512", help="image sides in pixels (latent = /8)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--max-resident", default="0.5,0.25")
    ap.add_argument("--steps", type=int, default=5, help="timed steps (median reported)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--contenders", default="sluice,diffusers,invokeai,equal-peak")
    ap.add_argument("--diffusers-fp8-set", choices=("model", "sluice"), default="model",
                    help="model: enable_layerwise_casting's own skips (adaLN modulations stay bf16); "
                         "sluice: the same fp8 set as sluice (apply_layerwise_casting with mapped patterns)")
    ap.add_argument("--reference", default=os.path.join(ROOT, ".deps", "reference", "invokeai_anima",
                                                         "anima_transformer.py"),
                    help="InvokeAI's anima_transformer.py (scripts/fetch_reference.sh)")
    ap.add_argument("--sluice-cli")
    ap.add_argument("--workdir", default=os.path.join(ROOT, "build", "compare"))
    ap.add_argument("--json", help="write the results here (default: WORKDIR/compare.json)")
    ap.add_argument("--check-rel-l2", type=float, help="exit 1 unless every contender's rel-L2 vs sluice-full "
                                                       "is below this (and every contender ran)")
    ap.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.child:
        with open(args.spec) as f:
            spec = json.load(f)
        torch.manual_seed(0)
        rows = CHILDREN[args.child](spec)
        with open(args.result, "w") as f:
            json.dump(rows, f)
        return 0

    t_start = time.perf_counter()
    device = torch.device(args.device)
    resolutions = [int(r) for r in args.resolutions.split(",") if r]
    fractions = [float(f) for f in args.max_resident.split(",") if f]
    contenders = set(args.contenders.split(","))
    os.makedirs(args.workdir, exist_ok=True)
    cli = find_cli(args)
    ckpt = args.checkpoint
    if ckpt is None:
        ckpt = os.path.join(args.workdir, f"{args.preset}-seed{args.seed}.safetensors")
        if not os.path.exists(ckpt):
            subprocess.run([cli, "make-checkpoint", "--config", args.preset, "--seed", str(args.seed), "--out",
                            ckpt, "--dtype", "bfloat16"], check=True, stdout=subprocess.DEVNULL)
    info = json.loads(subprocess.run([cli, "inspect", ckpt, "--json"], check=True, stdout=subprocess.PIPE,
                                     text=True).stdout)
    cfg = info["config"]
    cfg["name"] = args.preset if args.checkpoint is None else os.path.basename(ckpt)
    g = torch.Generator().manual_seed(args.seed)
    tokens = cfg["adapter"]["output_tokens"] if cfg["adapter"]["enabled"] else 512
    inputs = {}
    for r in resolutions:
        inputs[f"x_{r}"] = torch.randn(args.batch, cfg["in_channels"], 1, r // 8, r // 8, generator=g)
        inputs[f"t_{r}"] = torch.full((args.batch,), 0.7)
        inputs[f"ctx_{r}"] = torch.randn(args.batch, tokens, cfg["crossattn_emb_channels"], generator=g)
    inputs_path = os.path.join(args.workdir, "inputs.safetensors")
    save_file(inputs, inputs_path)
    h2d = measure_h2d_gbps(device)
    print(f"[compare] {cfg['name']} on {args.device}: pinned H2D {h2d:.1f} GB/s", file=sys.stderr)

    base = dict(device=args.device, checkpoint=ckpt, inputs=inputs_path, resolutions=resolutions,
                warmup=args.warmup, steps=args.steps, workdir=args.workdir, config=cfg)
    rows = []
    sluice_cfgs = [dict(name="sluice-full", max_resident=1.0)]
    if "sluice" in contenders:
        sluice_cfgs += [dict(name=f"sluice-{f:g}", max_resident=f) for f in fractions]
    rows += run_child("sluice", dict(base, configs=sluice_cfgs), args)
    if "diffusers" in contenders:
        rows += run_child("diffusers", dict(base, diffusers_fp8_set=args.diffusers_fp8_set), args)
    if "invokeai" in contenders and "sluice" in contenders:
        if not os.path.isfile(args.reference):
            raise SystemExit(f"compare.py: InvokeAI's anima_transformer.py not found at {args.reference} "
                             "(scripts/fetch_reference.sh, or --reference, or leave out --contenders invokeai)")
        res0 = resolutions[0]
        cfgs = []
        for f in fractions:
            r = next(x for x in rows if x["name"] == f"sluice-{f:g}" and x["resolution"] == res0)
            cfgs.append(dict(name=f"invokeai-style@sluice-{f:g}", resident_bytes=r["resident_bytes"]))
        rows += run_child("invokeai", dict(base, reference=args.reference, configs=cfgs), args)
    if "equal-peak" in contenders:
        cfgs = []
        for name in sorted({x["name"] for x in rows if not x["name"].startswith("sluice") and "error" not in x}):
            budget = {}
            for x in rows:
                if x["name"] == name and "error" not in x:
                    b = x["peak_device_bytes"]
                    if device.type == "cpu":  # accounted weights: add the working memory sluice keeps
                        b += max(256 * MIB, int(GIB * (x["resolution"] / 1024) ** 2))
                    budget[str(x["resolution"])] = b
            cfgs.append(dict(name=f"sluice@peak({name})", budget=budget, peer=name))
        if cfgs:
            rows += run_child("sluice", dict(base, configs=cfgs), args)

    # Relative L2 vs sluice-full, floors, ratios at equal peak.
    failures = []
    for r in resolutions:
        ref_row = next(x for x in rows if x["name"] == "sluice-full" and x["resolution"] == r and "error" not in x)
        ref = load_file(ref_row["output"])["velocity"]
        compute_ms = ref_row["step_ms"]
        for x in rows:
            if x["resolution"] != r or "error" in x:
                continue
            x["rel_l2_vs_full"] = rel_l2(load_file(x["output"])["velocity"], ref)
            streamed_ms = x["pcie_bytes_per_step"] / (h2d * 1e9) * 1e3
            x["floor_ms"] = max(compute_ms, streamed_ms)
            x["ratio_to_floor"] = x["step_ms"] / x["floor_ms"]
            peer = next((y for y in rows if y["resolution"] == r and y["name"] == f"sluice@peak({x['name']})"
                         and "error" not in y), None)
            if peer is not None:
                x["ratio_to_sluice_at_equal_peak"] = x["step_ms"] / peer["step_ms"]
    table = render_table(rows, resolutions, cfg, args, h2d)
    print(table)
    goals = evaluate_goals(rows, resolutions, fractions, cpu=device.type == "cpu")
    for line in goals:
        print(line)
    out_json = args.json or os.path.join(args.workdir, "compare.json")
    with open(out_json, "w") as f:
        json.dump(dict(model=cfg["name"], device=args.device, torch=torch.__version__,
                       gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                       pinned_h2d_gbps=h2d, resolutions=resolutions, batch=args.batch, steps=args.steps,
                       warmup=args.warmup, diffusers_fp8_set=args.diffusers_fp8_set, rows=rows, goals=goals,
                       date=time.strftime("%Y-%m-%d"), seconds=time.perf_counter() - t_start), f, indent=1)
    print(f"[compare] JSON: {out_json}; {time.perf_counter() - t_start:.0f}s in all", file=sys.stderr)

    if args.check_rel_l2 is not None:
        for x in rows:
            if "error" in x:
                failures.append(f"{x['name']} @ {x['resolution']}: {x['error']}")
            elif not x["rel_l2_vs_full"] < args.check_rel_l2:
                failures.append(f"{x['name']} @ {x['resolution']}: rel-L2 {x['rel_l2_vs_full']:.3e} "
                                f">= {args.check_rel_l2:g}")
        expected = len(resolutions) * (1 + ("sluice" in contenders) * len(fractions) + ("diffusers" in contenders)
                                       + ("invokeai" in contenders and "sluice" in contenders) * len(fractions))
        ran = len([x for x in rows if not x["name"].startswith("sluice@")])
        if ran != expected:
            failures.append(f"{ran} contender runs, expected {expected}")
        for f_ in failures:
            print(f"compare.py: CHECK FAILED: {f_}", file=sys.stderr)
        if not failures:
            print(f"compare.py: check ok: every contender's rel-L2 vs sluice-full < {args.check_rel_l2:g}")
        return 1 if failures else 0
    return 0


def render_table(rows, resolutions, cfg, args, h2d):
    cpu = args.device == "cpu"
    lines = [f"## Side-by-side: {cfg['name']} on {args.device}, batch {args.batch}, median of {args.steps} steps "
             f"after {args.warmup} warm-up, pinned H2D {h2d:.1f} GB/s" +
             (" (CPU device: a memcpy; NOT meaningful for the GPU goals)" if cpu else ""), ""]
    lines.append("| res | contender | step ms | peak device | host RSS | PCIe / step | ÷ sluice @ equal peak "
                 "| rel-L2 vs full | ÷ floor |")
    lines.append("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in resolutions:
        for x in rows:
            if x["resolution"] != r:
                continue
            if "error" in x:
                lines.append(f"| {r} | {x['name']} | error: {x['error'][:80]} | | | | | | |")
                continue
            peak = fmt_bytes(x["peak_device_bytes"]) + ("*" if x.get("peak_accounted") or (
                cpu and x["name"].startswith("sluice")) else "")
            pcie = fmt_bytes(x["pcie_bytes_per_step"]) + ("*" if x.get("pcie_accounted") else "")
            eq = x.get("ratio_to_sluice_at_equal_peak")
            lines.append(f"| {r} | {x['name']} | {x['step_ms']:.1f} | {peak} | {fmt_bytes(x['host_rss_bytes'])} "
                         f"| {pcie} | {'—' if eq is None else f'{eq:.2f}'} | {x['rel_l2_vs_full']:.2e} "
                         f"| {x['ratio_to_floor']:.2f} |")
    lines.append("")
    lines.append("`*` by accounting (weights held on the device / bytes a step would copy), not measured. "
                 "Floor = max(sluice-full step, PCIe bytes ÷ pinned H2D).")
    return "\n".join(lines)


def evaluate_goals(rows, resolutions, fractions, cpu=False):
    """The issue's goals, each met/missed per resolution (meaningful on a GPU only)."""
    def get(name, r):
        return next((x for x in rows if x["name"] == name and x["resolution"] == r and "error" not in x), None)

    out = ["", "Goals (issue 6 §4)" + (" — CPU device: NOT meaningful, printed to exercise the code:" if cpu else ":")]
    for r in resolutions:
        d = get("diffusers", r)
        sl = [x for x in rows if x["resolution"] == r and x["name"].startswith("sluice") and
              x["name"] != "sluice-full" and "error" not in x]
        if d:
            worst = max(sl, key=lambda x: x["step_ms"], default=None)
            if worst:
                out.append(f"- {r}: never slower than diffusers: slowest sluice point {worst['name']} "
                           f"{worst['step_ms']:.1f} ms vs diffusers {d['step_ms']:.1f} ms -> "
                           f"{'met' if worst['step_ms'] <= d['step_ms'] else 'MISSED'}")
            half = get("sluice-0.5", r)
            if half:
                want = 1.3 if r >= 1024 else 1.8
                sp = d["step_ms"] / half["step_ms"]
                out.append(f"- {r}: sluice-0.5 vs diffusers {sp:.2f}x (goal >= {want}x) -> "
                           f"{'met' if sp >= want else 'MISSED'}")
        for f in fractions:
            s, i = get(f"sluice-{f:g}", r), get(f"invokeai-style@sluice-{f:g}", r)
            if s and i:
                sp = i["step_ms"] / s["step_ms"]
                out.append(f"- {r}: sluice-{f:g} vs InvokeAI-style at the same resident bytes {sp:.2f}x "
                           f"(goal >= 3x) -> {'met' if sp >= 3 else 'MISSED'}")
        for x in sl:
            out.append(f"- {r}: {x['name']} within {x['ratio_to_floor']:.2f}x of the floor (goal <= 1.15) -> "
                       f"{'met' if x['ratio_to_floor'] <= 1.15 else 'MISSED'}")
    return out


if __name__ == "__main__":
    sys.exit(main())
