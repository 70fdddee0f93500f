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

In place, as diffusers' apply_group_offloading does: every torch.nn.Linear, torch.nn.Embedding
and torch.nn.Conv1d/2d/3d of the module (those exact classes; the skip patterns' layers keep
their dtype) is stored by sluice in the storage dtype and leased to the device for its
forward only; the module's other parameters and buffers move to the device while it is
offloaded and come back on remove(). The module's own forward runs unchanged, delimited as
one sluice forward per call. For inference: the offloaded layers' outputs carry no autograd
history (as under torch.no_grad).

Each offloaded module is a model of a sluice ModelCache: the one given as `cache=` (its
budget shared with the cache's other models: a module's forward gets its share first,
taken from the models not running, as a lock does), or one of its own made from device=,
vram_budget=, working_memory=, pin_memory=, prefetch= and trace=.

Host memory (Note [freed originals]): while offloaded, the streamed layers' own
weight and bias tensors hold no memory; sluice's stored copy is the only one in RAM. A
layer stored in its own dtype (bf16 storage of a bf16 model, a skip-listed layer) gives its
tensors back from that copy at remove(); a layer stored lossily (bf16 weights as fp8) keeps
its original bits where `originals=` says, "disk" by default, so that remove() gives every
tensor back bit for bit.

A module already on the sluice device (`pipe.to("cuda")` first) is taken as it is: its
tensors come to the host, the device copies are freed, and remove() puts each back on the
device it came from. While offloaded, the streamed layers' placeholders are on the sluice
device, so the module's .device (its first parameter's, which diffusers reads to place a
pipeline's inputs) is where it runs, wherever it came from.

Not supported (each raises sluice.InvalidArgument naming it): tensors on another device than
the host or `device=` (another GPU, meta tensors), a module offloaded twice, removing twice,
state_dict()/load_state_dict() and .to()/.cuda()/.half() while offloaded. Subclasses of the
streamed classes (quantized or patched layers), transposed convolutions, an embedding with
max_norm (its lookup rewrites the table) and a layer whose weight another module shares
move with the other parameters instead of streaming.
"""
from __future__ import annotations

import ctypes
import json
import re
import tempfile
from typing import Dict, Iterable, List, Optional, Tuple

import torch

from . import _C
from ._C import InvalidArgument

_ATTR = "_sluice_offload"
_ORIGINALS = ("disk", "ram")

# Note [freed originals]
# ~~~~~~~~~~~~~~~~~~~~~~
# Host RAM while offloaded is sluice's stored model and nothing else (issue 31: at most
# 1.1x of it). Each streamed layer keeps its Parameter objects, but their .data becomes a
# placeholder: a zero-stride view (as_strided, every stride 0) of one zero element of the
# same dtype, on the sluice device (where the module now runs; see offload()). It keeps what
# code reads of a weight without its values (.shape, .dtype, .ndim, .numel(), a model's
# .dtype, and .device as the device it runs on), holds
# element_size() bytes (one per dtype and device, shared by every layer), reads as zeros, and
# refuses every in-place write ("more than one element of the written-to tensor refers to a
# single memory location"), so nothing can fill it silently. Not the alternatives: a meta
# tensor changes .device; freeing the original storage in place (storage().resize_(0), as
# FSDP does) would free sluice's own copy too, which for a layer already in its storage
# dtype IS the caller's memory (foreign_model.h, Note [foreign layers]).
#
# What remove() gives back, per tensor:
#   - stored in its own dtype: sluice's stored copy is exact (stored_layer(i));
#   - stored lossily (fp8 of bf16): the original bits, kept as `originals=` says: "disk"
#     writes their raw bytes (bf16 has no numpy dtype: the tensor's memory as it is) to one
#     unnamed temporary file (tempfile.TemporaryFile(dir=spill_dir), gone when closed or when
#     the process ends), read back at remove(); "ram" keeps the tensors as they are.
# Shapes, dtypes and strides are kept beside them, so a non-contiguous weight comes back
# with its own strides (in new memory).


def _skip_patterns(module: torch.nn.Module, skip: Iterable[str]) -> List[str]:
    # The ecosystem's conventions: diffusers' _skip_layerwise_casting_patterns and
    # _keep_in_fp32_modules where the model declares them, then the caller's patterns.
    patterns: List[str] = []
    for attr in ("_skip_layerwise_casting_patterns", "_keep_in_fp32_modules"):
        for p in getattr(module, attr, None) or ():
            patterns.append(p if re.search(r"[\\^$*+?()\[\]{}|]", p) else rf"\w*{re.escape(p)}\w*")
    patterns.extend(skip)
    return patterns


def _repoint(t: torch.Tensor, data: torch.Tensor) -> None:
    """Makes the tensor object `t` hold `data` (same object, new memory), as .data = does.

    .data = refuses a pair of a CPU tensor and an out-of-tree (PrivateUse1) backend's one
    (offload/repoint.h, Note [re-pointing across devices]); for such a pair the two objects
    swap their contents (torch.utils.swap_tensors), and `t` keeps its own attributes. The
    tensor must not require grad (offload() turns the flags off first)."""
    if torch._has_compatible_shallow_copy_type(t, data):
        t.data = data
        return
    other = torch.Tensor._make_subclass(type(t), data.detach(), False)
    torch.utils.swap_tensors(t, other)
    t.__dict__, other.__dict__ = other.__dict__, t.__dict__  # t's attributes stay t's


def _strided_like(src: torch.Tensor, shape, stride) -> torch.Tensor:
    """`src` (contiguous, host) with the given strides: itself when they already match."""
    if tuple(src.stride()) == tuple(stride):
        return src
    out = torch.empty_strided(shape, stride, dtype=src.dtype)
    out.copy_(src.view(shape))
    return out


_malloc_trim = None


def _return_freed_host_memory() -> None:
    """glibc's malloc_trim(0): gives the heap's free pages back to the system, so that the
    process's RSS shows the originals offload() freed (and remove() the stored copies);
    torch's CPU tensors below glibc's mmap threshold are freed into the heap, where they
    would otherwise stay counted. Nothing on a C library without it."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            _malloc_trim = ctypes.CDLL(None).malloc_trim
            _malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


class _Spill:
    """The lossy layers' original tensors as raw bytes in one unnamed temporary file."""

    def __init__(self, spill_dir: Optional[str]):
        try:
            self._file = tempfile.TemporaryFile(dir=spill_dir)
        except OSError as e:
            raise InvalidArgument(f"offload: cannot make the originals' temporary file in spill_dir "
                                  f"{spill_dir or tempfile.gettempdir()!r}: {e}") from e
        self._end = 0
        self.used = False  # anything written (an empty tensor too)

    @staticmethod
    def _bytes(t: torch.Tensor) -> memoryview:
        """The bytes of a contiguous host tensor, without a copy (and without numpy, which
        torch does not require). `t` must outlive the view."""
        n = t.numel() * t.element_size()
        return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B") if n else memoryview(b"")

    def write(self, t: torch.Tensor) -> int:
        """Appends t's bytes (in its dtype, row-major); returns their offset."""
        data = t.detach().contiguous()
        buf = self._bytes(data)
        offset = self._end
        self._file.seek(offset)
        self._file.write(buf)
        self._end += len(buf)
        self.used = True
        return offset

    def read(self, offset: int, dtype: torch.dtype, shape) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype)
        buf = self._bytes(out)
        self._file.seek(offset)
        got = 0
        while got < len(buf):
            n = self._file.readinto(buf[got:])
            if not n:
                raise InvalidArgument(f"offload: the originals' temporary file ended at byte {offset + got}, "
                                      f"{len(buf) - got} bytes early")
            got += n
        return out

    def close(self) -> None:
        self._file.close()


class _Kept:
    """One streamed layer's tensor: how remove() gives it back."""

    __slots__ = ("param", "layer", "is_bias", "dtype", "shape", "stride", "home", "how", "value")

    def __init__(self, param, layer, is_bias, home):
        self.param = param
        self.layer = layer        # its index in the C++ model
        self.is_bias = is_bias
        self.dtype = param.dtype
        self.shape = tuple(param.shape)
        self.stride = tuple(param.stride())
        self.home = home          # the device it came from
        self.how = "stored"       # "stored" | "disk" | "ram"
        self.value = None         # the file offset ("disk") or the host tensor ("ram")


class Offloaded:
    """The handle sluice.offload() returns: stats(), trace(), timeline(), set_vram_budget(),
    remove()."""

    def __init__(self, module: torch.nn.Module, model: "_C.OffloadedModel", linears: List[torch.nn.Module],
                 grads: List[torch.Tensor], kept: List[_Kept], moved: List[Tuple[torch.Tensor, torch.device]],
                 spill: Optional[_Spill], hooks: list, guarded: List[torch.nn.Module]):
        self._module = module
        self._model = model
        self._linears = linears
        self._grads = grads    # parameters that required grad before offload()
        self._kept = kept      # the streamed layers' tensors (Note [freed originals])
        self._moved = moved    # the other tensors that came from the device, and that device
        self._spill = spill
        self._hooks = hooks
        self._guarded = guarded
        self._final_stats: Optional[str] = None

    def stats(self) -> dict:
        """The engine's stats: the fields of `sluice run --stats-json`'s model section (after
        remove(), those of the moment it was removed)."""
        return json.loads(self._final_stats if self._model is None else self._model.stats_json())

    def trace(self, path: str) -> None:
        """Writes the per-layer trace (Chrome trace JSON: copies, waits, upcasts, computes)
        to `path`; needs trace=True (or a cache made with trace=True)."""
        self._attached().write_trace(str(path))

    def timeline(self, path: str) -> None:
        """Writes the SVG timeline of one steady-state forward to `path` (as `sluice run
        --timeline`); needs trace=True and a forward that ran to its end."""
        self._attached().write_timeline_svg(str(path))

    def set_vram_budget(self, budget: str) -> None:
        """A new budget ("6GiB", "50%") for a module with a cache of its own;
        sluice.ResourceError when too small. In a shared cache: the cache's set_vram_budget."""
        self._attached().set_vram_budget(str(budget))

    def _attached(self) -> "_C.OffloadedModel":
        if self._model is None:
            raise InvalidArgument("offload: the module was already removed")
        return self._model

    @property
    def removed(self) -> bool:
        return self._model is None or self._model.removed()

    def remove(self) -> None:
        """Gives the module back as it was: its own forwards, every tensor bit for bit on the
        device it came from, the same tensor objects (in new memory where they were freed)."""
        if self.removed:
            raise InvalidArgument("offload: the module was already removed")
        model = self._model
        model.remove()  # the other tensors back on the host, the device memory freed
        for h in self._hooks:
            h.remove()
        for m in self._guarded:
            m.__dict__.pop("_apply", None)
        for lin in self._linears:
            lin.__dict__.pop("forward", None)
        self._module.__dict__.pop("forward", None)
        self._module.__dict__.pop(_ATTR, None)
        try:
            layer, stored = -1, None  # one layer's copies of sluice's stored tensors at a time
            for k in self._kept:
                if k.how == "stored":
                    if layer != k.layer:
                        layer, stored = k.layer, model.stored_layer(k.layer)
                    src = stored[1 if k.is_bias else 0]
                elif k.how == "disk":
                    src = self._spill.read(k.value, k.dtype, k.shape)
                else:
                    src = k.value
                src = _strided_like(src, k.shape, k.stride)
                _repoint(k.param, src if k.home.type == "cpu" else src.to(k.home))
                k.value = None
            stored = None
        finally:
            if self._spill is not None:
                self._spill.close()
                self._spill = None
            try:
                self._final_stats = model.stats_json()
            except Exception:  # noqa: BLE001  (stats are not worth a failed remove())
                self._final_stats = "{}"
            # The C++ model lets go of its stored layers and of the module's tensors (a
            # tensor that one more owner holds cannot be swapped back to an out-of-tree
            # device: _repoint).
            self._model = None
            del model
        for t, home in self._moved:
            _repoint(t, t.detach().to(home))
        self._moved = []
        for t in self._grads:
            t.requires_grad_(True)
        _return_freed_host_memory()


_CONVS = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)


def _kind(m: torch.nn.Module) -> Optional[str]:
    """How a module's forward reaches sluice (the C++ model's layer kinds), or None for a
    module sluice does not stream: exactly nn.Linear, nn.Embedding without max_norm (whose
    lookup renormalises rows of the table in place), nn.Conv1d/2d/3d."""
    t = type(m)
    if t is torch.nn.Linear:
        return "linear"
    if t is torch.nn.Embedding and m.max_norm is None:
        return "embedding"
    if t in _CONVS:
        return "other"
    return None


def _layer_forward(model: "_C.OffloadedModel", i: int, m: torch.nn.Module):
    """Layer i's forward through sluice: its weights leased for the call."""
    kind = _kind(m)
    if kind == "linear":
        return lambda x: model.linear(i, x)
    if kind == "embedding":
        # padding_idx, scale_grad_by_freq and sparse shape gradients only: a lookup is rows.
        return lambda ids: model.embedding(i, ids)
    # A convolution: the module's own _conv_forward (its stride, padding, padding_mode,
    # dilation and groups) with the leased weights.
    return lambda x: model.call(i, lambda w, b: m._conv_forward(x, w, b))


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


def offload(module: torch.nn.Module, *, cache=None, name: str = "", storage: str = "float8_e4m3fn",
            compute: Optional[str] = None, skip: Iterable[str] = (), max_resident: Optional[float] = None,
            originals: str = "disk", spill_dir: Optional[str] = None, device: Optional[str] = None,
            vram_budget: Optional[str] = None, working_memory: Optional[str] = None,
            pin_memory: Optional[str] = None, prefetch=None, trace: Optional[bool] = None) -> Offloaded:
    """Streams `module`'s layers through sluice, in place; returns the handle.

    The module's tensors may be on the host or on the sluice device already (a pipeline
    moved there with .to("cuda")); remove() puts each back where it was.

    cache: a sluice.ModelCache to hold the module beside its other models, under its one
    budget (its device, budget, working memory, pinning, prefetch and tracing are the
    cache's: giving any of those here too is an InvalidArgument). None: a cache of the
    module's own, made from:
      device: "cpu" (default; the CPU plays the device), "cuda", "cuda:1", ...
      vram_budget: what sluice may hold on the device for this module, working_memory (kept
        free for activations, 256MiB by default) included: for a budget smaller than that,
        lower working_memory too. "" (default) = all device memory.
      pin_memory: "auto" (default: on for CUDA and ROCm) | "on" | "off".
      prefetch: most streamed layers copied ahead, "auto" (default) or a number.
      trace: record per-layer spans for handle.trace() and handle.timeline().
    name: the module's name in logs and stats; default: its class name.
    compute: the dtype the streamed layers compute in; default: their weights' dtype.
    originals: where the original weights of layers stored lossily (bf16 weights stored as
    fp8) wait for remove(), which gives them back bit for bit. "disk" (default): as raw bytes
    in one unnamed temporary file in spill_dir (default: the system's temporary folder),
    deleted when the handle is removed or the process ends: out of the process's RSS (the
    kernel's page cache may hold them for a while, as reclaimable memory), read back at
    remove(). "ram": kept in memory as they are (host RAM: the model plus the stored copy;
    the fastest remove()). Layers stored in their own dtype keep no second copy either way.
    While offloaded, the streamed layers' weights are placeholders of the same shape and
    dtype, on the sluice device, that hold no memory: state_dict(), load_state_dict() and .to() raise
    sluice.InvalidArgument until remove()."""
    if _ATTR in module.__dict__:
        raise InvalidArgument("offload: the module is already offloaded; remove() it first")
    if originals not in _ORIGINALS:
        raise InvalidArgument(f"offload: originals={originals!r}; one of {', '.join(map(repr, _ORIGINALS))}")
    if cache is not None and not (hasattr(cache, "_cache") and hasattr(cache, "_device")):
        raise InvalidArgument(f"offload: cache= takes a sluice.ModelCache, got {type(cache).__name__}")
    if cache is not None:
        given = [k for k, v in (("device", device), ("vram_budget", vram_budget), ("working_memory", working_memory),
                                ("pin_memory", pin_memory), ("prefetch", prefetch), ("trace", trace)) if v is not None]
        if given:
            raise InvalidArgument(f"offload: {', '.join(given)} belong to the ModelCache given as cache=; set them there")
    where = cache._device if cache is not None else device or "cpu"  # the sluice device
    try:
        runs_on: Optional[torch.device] = _device_of(where)  # once: "cuda" asks torch for its current device
    except (RuntimeError, ValueError):
        runs_on = None  # a device torch does not know: the module's tensors must be on the host
    # Exactly the streamed classes: a subclass may compute more than its class does in its
    # forward (quantized or patched layers); its tensors move with the other parameters.
    # Nor a layer whose weight or bias another module also holds (tied weights): freeing it
    # would leave that module a placeholder.
    holders: Dict[int, int] = {}
    for m in module.modules():
        for p in m._parameters.values():
            if p is not None:
                holders[id(p)] = holders.get(id(p), 0) + 1
    linears = [(n, m) for n, m in module.named_modules()
               if _kind(m) is not None and all(holders[id(p)] == 1 for p in m._parameters.values() if p is not None)]
    if not linears:
        raise InvalidArgument("offload: the module has no layer to stream (torch.nn.Linear, Embedding, Conv1d/2d/3d)")
    dtypes = {m.weight.dtype for _, m in linears}
    if compute is None:
        if len(dtypes) != 1:
            raise InvalidArgument("offload: the streamed layers have several dtypes "
                                  f"({sorted(str(d) for d in dtypes)}); give compute=")
        compute = str(next(iter(dtypes))).replace("torch.", "")
    owned = {id(p) for _, m in linears for p in m._parameters.values() if p is not None}
    # The module's own tensor objects: sluice re-points them in place (to the device and
    # back), so the module's norms and tables move with it.
    extras = [(n, t) for n, t in module.named_parameters() if id(t) not in owned]
    extras += [(n, t) for n, t in module.named_buffers() if t is not None]
    lin_tensors = [(f"{n}.{k}", p) for n, m in linears for k, p in m._parameters.items() if p is not None]
    for tname, t in lin_tensors + extras:
        _target(runs_on, where, tname, t)
    # Inference only: the parameters stop requiring grad while offloaded (re-pointing one
    # that requires grad at an out-of-tree backend's memory is refused, Note [re-pointing
    # across devices]); remove() gives each its flag back.
    grads = [t for _, t in lin_tensors + extras if t.requires_grad]
    spill = None
    moved: List[Tuple[torch.Tensor, torch.device]] = []  # tensors brought from the device to the host
    model = None
    try:
        for t in grads:
            t.requires_grad_(False)
        # A module on the device: every tensor comes to the host (the C++ model takes host
        # tensors) and its device copy is freed before sluice claims device memory.
        for _, t in lin_tensors + extras:
            if t.device.type != "cpu":
                home = t.device
                _repoint(t, t.detach().to("cpu"))
                moved.append((t, home))
        if moved and torch.device(where).type == "cuda":
            torch.cuda.empty_cache()  # torch's cached blocks back to the device, for sluice's budget
        if originals == "disk":
            spill = _Spill(spill_dir)
        layers = [(lname, m.weight.detach(), None if getattr(m, "bias", None) is None else m.bias.detach(), _kind(m))
                  for lname, m in linears]
        model = _C.OffloadedModel(layers, extras, cache=None if cache is None else cache._cache,
                                  name=name or type(module).__name__, storage=storage, compute=compute,
                                  skip=_skip_patterns(module, skip), max_resident=max_resident, device=device,
                                  vram_budget=vram_budget, working_memory=working_memory, pin_memory=pin_memory,
                                  prefetch=prefetch, trace=trace)
        del layers
        homes = {id(t): h for t, h in moved}
        kept: List[_Kept] = []
        for i, (_, m) in enumerate(linears):
            stored = model.stored_dtype(i)
            for is_bias, p in ((False, m.weight), (True, getattr(m, "bias", None))):
                if p is None:
                    continue
                k = _Kept(p, i, is_bias, homes.get(id(p), p.device))
                if p.dtype != stored:  # lossy: the original bits are kept
                    k.how = originals
                    k.value = spill.write(p) if originals == "disk" else p.detach()
                kept.append(k)
        if spill is not None and not spill.used:
            spill.close()  # no layer was stored lossily
            spill = None
    except BaseException:
        # The module as it was: nothing is freed before this point.
        if model is not None:
            model.remove()
            del model
        if spill is not None:
            spill.close()
        for t, home in reversed(moved):
            _repoint(t, t.detach().to(home))
        for t in grads:
            t.requires_grad_(True)
        raise
    # Frees the originals (Note [freed originals]): from here on nothing fails.
    lin_moved = {id(k.param) for k in kept}
    moved = [(t, h) for t, h in moved if id(t) not in lin_moved]
    # The placeholders live on the sluice device, where the module now runs, whichever
    # device its tensors came from: a model's .device (its first parameter's, as diffusers
    # reads it to place a pipeline's inputs) is where its forward computes, as diffusers'
    # group offloading reports its onload device.
    # Where that cannot be (a backend torch's Python side cannot allocate on, or a tensor
    # that an autograd graph from before still holds, which an out-of-tree backend's swap
    # refuses: _repoint), the placeholder stays on the device the tensor came from.
    bases: Dict[Tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def base(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if (dtype, device) not in bases:
            bases[(dtype, device)] = torch.zeros(1, dtype=dtype, device=device)
        return bases[(dtype, device)]

    for k in kept:
        zeros = (0,) * len(k.shape)
        try:
            _repoint(k.param, base(k.dtype, k.home if runs_on is None else runs_on).as_strided(k.shape, zeros))
        except Exception:  # noqa: BLE001  (see above: the tensor's own device then)
            _repoint(k.param, base(k.dtype, k.home).as_strided(k.shape, zeros))
    _return_freed_host_memory()

    lin_modules = [m for _, m in linears]
    for i, m in enumerate(lin_modules):
        m.forward = _layer_forward(model, i, m)
    inner = module.forward
    # The engine runs one forward at a time: a call from another thread waits in
    # begin_forward (without the GIL) for the running one to end, and a forward that calls
    # the module again nests (OffloadedModel's turn, include/sluice/offload.hpp).

    def forward(*args, **kwargs):
        model.begin_forward(type(module).__name__)
        try:
            out = inner(*args, **kwargs)
        except BaseException:
            model.end_forward(True)
            raise
        model.end_forward(False)
        return out

    module.forward = forward

    # While offloaded the streamed weights are placeholders: no state_dict() of them, no
    # load_state_dict() into them, no .to()/.cuda()/.half() moving them (nn.Module._apply,
    # shadowed in each module's own dict; remove() drops it).
    def no_state_dict(*_):
        raise InvalidArgument("offload: state_dict() of an offloaded module; remove() it first")

    def no_load_state_dict(*_):
        raise InvalidArgument("offload: load_state_dict() into an offloaded module; remove() it first")

    def no_apply(*_, **__):
        raise InvalidArgument("offload: .to()/.cuda()/.half()/... of an offloaded module would move its "
                              "placeholders; remove() it first")

    hooks = [module.register_load_state_dict_pre_hook(no_load_state_dict)]
    for m in [module] + lin_modules:
        hooks.append(m.register_state_dict_pre_hook(no_state_dict))
    guarded = list(module.modules())
    for m in guarded:
        m.__dict__["_apply"] = no_apply
    handle = Offloaded(module, model, lin_modules, grads, kept, moved, spill, hooks, guarded)
    module.__dict__[_ATTR] = handle
    return handle
