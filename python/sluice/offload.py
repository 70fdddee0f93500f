"""sluice.offload(module): sluice's streaming engine behind a torch model you already have.

    import sluice
    handle = sluice.offload(pipe.transformer, device="cuda", vram_budget="6GiB",
                            storage="float8_e4m3fn")
    image = pipe(...)            # the module runs as before; its layers stream
    handle.stats()               # the engine's stats (the --stats-json model fields)
    handle.remove()              # the module as it was, bit for bit

    # Several modules of one frontend under one budget: one ModelCache holds them all.
    cache = sluice.ModelCache(device="cuda", vram_budget="6GiB", working_memory="512MiB")
    te = sluice.offload(pipe.text_encoder, cache=cache, storage="bfloat16")
    tr = sluice.offload(pipe.transformer, cache=cache)

    # PyTorch's conventions: torch dtypes and devices, sizes in bytes, a with block.
    with sluice.offload(pipe.transformer, device=torch.device("cuda", 0), vram_budget=6 << 30,
                        storage=torch.float8_e4m3fn) as handle:
        image = pipe(...)        # removed when the block ends, also when it raises

    # torch.compile after offload(): the streamed layers' calls are boundaries Dynamo does
    # not trace (Note [compiled callers] in _offload_hooks.py); the code between them compiles.
    handle = sluice.offload(pipe.transformer)
    pipe.transformer = torch.compile(pipe.transformer)

In place, as diffusers' apply_group_offloading does. Every torch.nn.Linear, Embedding and
Conv1d/2d/3d of the module, subclasses included, streams (Note [what streams] in
_offload_layers.py says which stay ordinary parameters, and why): sluice stores it in the
storage dtype and leases it to the device for its own call only, in which the layer runs
as it would without sluice (its forward, a forward a frontend patched in, its hooks: Note
[leased calls] in _offload_hooks.py). Each layer computes in the dtype it had (compute=
changes that for the layers not kept in their own dtype). The module's other parameters
and buffers move to the device while it is offloaded and come back on remove(). Each call
of the module is one sluice forward. For inference: the offloaded layers' outputs carry no
autograd history (as under torch.no_grad).

Each offloaded module is a model of a sluice ModelCache: the one given as `cache=` (its
budget shared with the cache's other models: a module's forward gets its share first,
taken from the models not running, as a lock does), or one of its own made from device=,
vram_budget=, working_memory=, pin_memory=, prefetch= and trace=.

Host memory: while offloaded, the streamed layers' own tensors hold no memory (Note
[placeholders] in _placeholders.py); sluice's stored copy is the only one in RAM. A layer
stored in its own dtype gives its tensors back from that copy at remove(); a layer stored
lossily (bf16 weights as fp8) keeps its original bits where `originals=` says, "disk" by
default, so that remove() gives every tensor back bit for bit. offload() and remove() go one
layer at a time (Note [handover] in _offload_layers.py), so host memory peaks near the
module's own bytes.

A module already on the sluice device (`pipe.to("cuda")` first) is taken as it is: its
tensors come to the host, the device copies are freed, and remove() puts each back on the
device it came from. While offloaded, the streamed layers' placeholders are on the sluice
device, so the module's .device (its first parameter's, which diffusers reads to place a
pipeline's inputs) is where it runs, wherever it came from.

Raises sluice.InvalidArgument (a ValueError too), naming what is at fault: a bad argument;
tensors on another device than the host or `device=` (another GPU, meta tensors); a
module offloaded twice, a module inside or around an offloaded one, torch.compile()'s
wrapper (offload the module, then compile it); removing twice; state_dict(),
load_state_dict() and .to()/.cuda()/.half() while offloaded; and reading a streamed weight's
values outside its layer's call (torch.cat of two weights, a fused QKV, a write in place),
which names the layer and the fix (exclude=[...] keeps it an ordinary parameter).
"""
from __future__ import annotations

import contextlib
import json
import logging
from typing import Iterable, List, Optional, Tuple

import torch

from . import _C
from . import _logging
from . import _offload_hooks as hooks
from ._C import InvalidArgument, ResourceError
from ._arguments import size_text
from ._offload_config import OffloadConfig
from ._offload_layers import Layer, Spill, choose, file_mappings, hand_over, own_mapped
from ._host_memory import return_freed_host_memory
from ._offload_removal import give_back
from ._placeholders import Placeholders, repoint

_ATTR = "_sluice_offload"
log = logging.getLogger("sluice")


class Offloaded:
    """The handle sluice.offload() returns: stats(), trace(), timeline(), set_vram_budget(),
    remove(). A context manager too: `with sluice.offload(m, ...) as handle:` gives the
    handle and removes the offload when the block ends, also when the block raises (the
    block's exception is the one that propagates; a remove() that fails then is logged and
    noted on it). A handle removed inside the block is left as it is."""

    def __init__(self, module: torch.nn.Module, model: "_C.OffloadedModel", layers: List[Layer],
                 grads: List[torch.Tensor], moved: List[Tuple[torch.Tensor, torch.device]], spill: Optional[Spill],
                 attached: hooks.Attached, not_streamed: List[Tuple[str, str]], skip: List[str]):
        self._module = module
        self._model = model
        self._layers = layers
        self._grads = grads    # parameters that required grad before offload()
        self._moved = moved    # the other tensors that came from the device, and that device
        self._spill = spill
        self._attached = attached
        self._not_streamed = not_streamed
        self._skip = skip
        self._final_stats: Optional[str] = None

    def stats(self) -> dict:
        """The engine's stats: the fields of `sluice run --stats-json`'s model section (after
        remove(), those of the moment it was removed), with "not_streamed": the layers that
        stay ordinary parameters and why, and "skip": the skip list that applied."""
        out = json.loads(self._final_stats if self._model is None else self._model.stats_json())
        out["not_streamed"] = [{"layer": n, "reason": r} for n, r in self._not_streamed]
        out["skip"] = list(self._skip)
        return out

    def trace(self, path: str) -> None:
        """Writes the per-layer trace (Chrome trace JSON: copies, waits, upcasts, computes)
        to `path`; needs trace=True (or a cache made with trace=True)."""
        self._attached_model().write_trace(str(path))

    def timeline(self, path: str) -> None:
        """Writes the SVG timeline of one steady-state forward to `path` (as `sluice run
        --timeline`); needs trace=True and a forward that ran to its end."""
        self._attached_model().write_timeline_svg(str(path))

    def set_vram_budget(self, budget) -> None:
        """A new budget (bytes as an int, or "6GiB", "50%") for a module with a cache of its
        own; sluice.ResourceError when too small. In a shared cache: the cache's set_vram_budget."""
        self._attached_model().set_vram_budget(size_text(budget, "budget", "set_vram_budget"))

    def _attached_model(self) -> "_C.OffloadedModel":
        if self._model is None:
            raise InvalidArgument("offload: the module was already removed")
        return self._model

    @property
    def removed(self) -> bool:
        return self._model is None or self._model.removed()

    def __enter__(self) -> "Offloaded":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.removed:
            return
        if exc is None:
            self.remove()
            return
        # The block raised: its exception propagates, whatever remove() does.
        try:
            self.remove()
        except Exception as e:  # noqa: BLE001  (never masks the block's exception)
            log.warning("offload: remove() at the end of a with block that raised failed too: %s: %s",
                        type(e).__name__, e)
            if hasattr(exc, "add_note"):  # Python 3.11
                exc.add_note(f"sluice: remove() on leaving the with block failed too: {type(e).__name__}: {e}")

    def remove(self) -> None:
        """Gives the module back as it was: every attribute offload() set put back as it was,
        every tensor bit for bit on the device it came from, the same tensor objects (in new
        memory where they were freed)."""
        if self.removed:
            raise InvalidArgument("offload: the module was already removed")
        model = self._model
        model.remove()  # the other tensors back on the host, the device memory freed
        self._attached.undo()
        self._module.__dict__.pop(_ATTR, None)
        try:
            give_back(model, self._layers, self._spill)
        finally:
            if self._spill is not None:
                self._spill.close()
                self._spill = None
            try:
                self._final_stats = model.stats_json()
            except Exception:  # noqa: BLE001  (stats are not worth a failed remove())
                self._final_stats = "{}"
            # The C++ model lets go of the module's tensors (a tensor that one more owner
            # holds cannot be swapped back to an out-of-tree device: _placeholders.repoint).
            self._model = None
            del model
        for t, home in self._moved:
            repoint(t, t.detach().to(home))
        self._moved = []
        for t in self._grads:
            t.requires_grad_(True)
        return_freed_host_memory()


def _device_of(device: str) -> torch.device:
    """The torch device `device` names, with its index ("cuda": the current one)."""
    dev = torch.device(device)
    if dev.type != "cpu" and dev.index is None:
        try:
            dev = torch.device(dev.type, getattr(torch, dev.type).current_device())
        except Exception:  # noqa: BLE001  (a backend without a device module: its device 0)
            dev = torch.device(dev.type, 0)
    return dev


def _target(dev: Optional[torch.device], device: str, name: str, t: torch.Tensor) -> None:
    """Refuses a tensor that is neither on the host nor on the sluice device `device` (`dev`,
    as _device_of resolves it; None when torch knows no such device)."""
    where = t.device
    if where.type == "cpu":
        return
    if dev is None or where.type == "meta" or dev.type != where.type or dev.index != (where.index or 0):
        raise InvalidArgument(f"offload: '{name}' is on {where}; offload(device={device!r}) takes a module whose "
                              f"tensors are on the host or on {device}")


@contextlib.contextmanager
def _naming_working_memory(cfg: OffloadConfig):
    """A budget too small for the module's own cache says which argument to lower."""
    try:
        yield
    except ResourceError as e:
        if cfg.cache is not None:
            raise
        part = "256MiB by default" if cfg.working_memory is None else f"{cfg.working_memory} here"
        raise ResourceError(f"offload: {e}; vram_budget= is what sluice may hold for the module, working_memory= "
                            f"({part}) the part of it kept for activations: raise the one or lower the other") \
            from None


def _model_dtype(layers: List[Layer]) -> str:
    """The dtype most of the streamed weights have: the model's compute dtype in its stats."""
    count = {}
    for layer in layers:
        d = layer.module._parameters["weight"].dtype
        count[d] = count.get(d, 0) + layer.module._parameters["weight"].numel()
    return str(max(count, key=count.get)).replace("torch.", "")


def offload(module: torch.nn.Module, *, cache=None, name: str = "", storage="float8_e4m3fn", compute=None,
            skip: Optional[Iterable[str]] = None, exclude: Iterable[str] = (), max_resident: Optional[float] = None,
            originals: str = "disk", spill_dir: Optional[str] = None, device=None, vram_budget=None,
            working_memory=None, pin_memory: Optional[str] = None, prefetch=None,
            trace: Optional[bool] = None) -> Offloaded:
    """Streams `module`'s layers through sluice, in place; returns the handle.

    The module's tensors may be on the host or on the sluice device already (a pipeline
    moved there with .to("cuda")); remove() puts each back where it was.

    cache: a sluice.ModelCache to hold the module beside its other models, under its one
    budget (its device, budget, working memory, pinning, prefetch and tracing are the
    cache's: giving any of those here too is an InvalidArgument). None: a cache of the
    module's own, made from:
      device: a torch.device, a name ("cuda", "cuda:1", "cpu": the CPU plays the device) or
        an int index of the current accelerator. Default: sluice.default_device(), the
        current accelerator (torch.accelerator; CUDA or ROCm on an older torch), "cpu" only
        when there is none (Note [default device] in _devices.py).
      vram_budget: what sluice may hold on the device for this module, working_memory (kept
        free for activations, 256MiB by default) included: for a budget smaller than that,
        lower working_memory too. Sizes are an int (bytes) or a string ("6GiB", "50%"; a
        bool, a float or a negative int is an InvalidArgument). "" (default) = all device
        memory.
      pin_memory: "auto" (default: on for CUDA and ROCm) | "on" | "off".
      prefetch: most streamed layers copied ahead, "auto" (default) or a number.
      trace: record per-layer spans for handle.trace() and handle.timeline().
    name: the module's name in logs and stats; default: its class name.
    storage: the streamed layers' storage dtype (a torch.dtype or its name).
    compute: the dtype the streamed layers not kept in their own dtype compute in (a
      torch.dtype or its name); default: each its own weight's dtype (a mixed model needs none).
    skip: patterns of layers kept in their own dtype (stored unconverted). Default: the
      model's own patterns, and under fp8 storage diffusers' default list too, so that
      offload(m, storage="float8_e4m3fn") computes what m.enable_layerwise_casting() does
      (Note [default skip list] in _offload_config.py); handle.stats()["skip"] shows it.
    exclude: patterns of layers not streamed at all: they stay ordinary parameters, on the
      device while offloaded (for code that reads their weights outside their own call).
    originals: where the original weights of layers stored lossily (bf16 weights stored as
    fp8) wait for remove(), which gives them back bit for bit. "disk" (default): as raw bytes
    in one unnamed temporary file in spill_dir (default: the system's temporary folder),
    deleted when the handle is removed or the process ends: out of the process's RSS (the
    kernel's page cache may hold them for a while, as reclaimable memory), read back at
    remove(). "ram": kept in memory as they are (host RAM: the model plus the stored copy;
    the fastest remove()). Layers stored in their own dtype keep no second copy either way."""
    _logging.sync_level()
    hooks.refuse_compiled(module)
    if _ATTR in module.__dict__:
        raise InvalidArgument("offload: the module is already offloaded; remove() it first")
    hooks.refuse_nested(module)
    cfg = OffloadConfig.of(module, cache=cache, name=name, storage=storage, compute=compute, skip=skip,
                           exclude=exclude, max_resident=max_resident, originals=originals, spill_dir=spill_dir,
                           device=device, vram_budget=vram_budget, working_memory=working_memory,
                           pin_memory=pin_memory, prefetch=prefetch, trace=trace)
    try:
        runs_on: Optional[torch.device] = _device_of(cfg.where)  # once: "cuda" asks torch for its current device
    except (RuntimeError, ValueError):
        runs_on = None  # a device torch does not know: the module's tensors must be on the host
    layers, not_streamed = choose(module, cfg.exclude)
    if not layers:
        why = "; ".join(f"'{n}': {r}" for n, r in not_streamed[:3])
        raise InvalidArgument("offload: the module has no layer to stream (torch.nn.Linear, Embedding, Conv1d/2d/3d)"
                              + (f"; {why}" if why else ""))
    owned = {id(p) for layer in layers for p in layer.module._parameters.values() if p is not None}
    # The module's own tensor objects: sluice re-points them in place (to the device and
    # back), so the module's norms and tables move with it.
    extras = [(n, t) for n, t in module.named_parameters() if id(t) not in owned]
    extras += [(n, t) for n, t in module.named_buffers() if t is not None]
    lin_tensors = [(f"{layer.name}.{k}", p) for layer in layers for k, p in layer.module._parameters.items()
                   if p is not None]
    for tname, t in lin_tensors + extras:
        _target(runs_on, cfg.where, tname, t)
    # Inference only: the parameters stop requiring grad while offloaded (re-pointing one
    # that requires grad at an out-of-tree backend's memory is refused, Note [re-pointing
    # across devices]); remove() gives each its flag back.
    grads = [t for _, t in lin_tensors + extras if t.requires_grad]
    spill = None
    moved: List[Tuple[torch.Tensor, torch.device]] = []  # other tensors brought from the device to the host
    model = None
    placeholders = Placeholders(runs_on)
    try:
        for t in grads:
            t.requires_grad_(False)
        # The other tensors that live in a mapped checkpoint file get memory of their own
        # (Note [mapped checkpoints]), so that the mapping goes with the streamed originals.
        own_mapped([t for _, t in extras], repoint)
        if cfg.originals == "disk":
            spill = Spill(cfg.spill_dir)
        with _naming_working_memory(cfg):
            model = _C.OffloadedModel(cache=None if cfg.cache is None else cfg.cache._cache, name=cfg.name,
                                      storage=cfg.storage, compute=cfg.compute or _model_dtype(layers),
                                      skip=cfg.skip, max_resident=cfg.max_resident, device=cfg.device,
                                      vram_budget=cfg.vram_budget, working_memory=cfg.working_memory,
                                      pin_memory=cfg.pin_memory, prefetch=cfg.prefetch, trace=cfg.trace)
        mapped = file_mappings()
        for layer in layers:  # one at a time (Note [handover])
            hand_over(model, layer, cfg.compute, cfg.originals, spill, placeholders, mapped)
        # The other tensors of a module on the device come to the host (the C++ model takes
        # host tensors), and their device copies are freed before sluice claims device memory.
        for _, t in extras:
            if t.device.type != "cpu":
                home = t.device
                repoint(t, t.detach().to("cpu"))
                moved.append((t, home))
        if torch.device(cfg.where).type == "cuda" and any(k.home.type == "cuda" for layer in layers for k in layer.kept):
            torch.cuda.empty_cache()  # torch's cached blocks back to the device, for sluice's budget
        with _naming_working_memory(cfg):
            model.finish(extras)
        if spill is not None and not spill.used:
            spill.close()  # no layer was stored lossily
            spill = None
    except BaseException:
        # The module as it was: every layer handed over comes back, every tensor moved goes back.
        if model is not None:
            model.remove()
            give_back(model, layers, spill)
            del model
        if spill is not None:
            spill.close()
        for t, home in reversed(moved):
            repoint(t, t.detach().to(home))
        for t in grads:
            t.requires_grad_(True)
        raise
    return_freed_host_memory()

    attached = hooks.Attached()
    for layer in layers:
        hooks.attach_layer(attached, model, layer)
    hooks.wrap_forward(attached, module, model, type(module).__name__)
    hooks.guard(attached, module, [layer.module for layer in layers], cfg.name)
    handle = Offloaded(module, model, layers, grads, moved, spill, attached, not_streamed, cfg.skip)
    module.__dict__[_ATTR] = handle
    _logging.flush()
    if not_streamed:
        log.info("offload %s: %d layers stay ordinary parameters: %s", cfg.name, len(not_streamed),
                 "; ".join(f"{n} ({r})" for n, r in not_streamed))
    return handle
