"""Which layers of a module sluice streams, why the others stay ordinary parameters, and
handing the streamed ones over one at a time (Note [handover]).

Note [what streams]
~~~~~~~~~~~~~~~~~~~
Every torch.nn.Linear, torch.nn.Embedding and torch.nn.Conv1d/2d/3d of the module streams,
subclasses included (ComfyUI builds its models from comfy.ops Linear subclasses; a layer
runs its own forward with its weights leased, Note [leased calls] in _offload_hooks.py).
A layer stays an ordinary parameter of the module (moved to the device with the norms and
buffers, and named, with the reason, in handle.stats()["not_streamed"] and one INFO line of
the `sluice` logger) when its weight cannot be leased:
  - its weight or bias is also another module's (tied weights: freeing it would leave that
    module a placeholder);
  - an embedding with max_norm (its lookup renormalises rows of the table in place);
  - a weight that is not a floating nn.Parameter (int8 or packed quantized weights, tensor
    subclasses such as GGUF's or torchao's: sluice would not know what its values mean);
  - the caller's exclude= patterns name it.

Note [handover]
~~~~~~~~~~~~~~~
offload() hands the layers over one at a time: layer k's original comes to the host (from
the device, if it was there), sluice stores its copy (add_layer: cast to the storage dtype,
in sluice's own memory), the original bits of a lossy layer go where `originals=` says, and
the original becomes a placeholder, freeing its memory, before layer k+1 is taken. Host
memory then peaks at the module's own bytes plus one layer's stored copy, not at the module
plus the whole stored copy (issue 37: at most 1.1x the original bytes plus one layer).
remove() goes the same way in reverse (_offload_removal.py).

Note [mapped checkpoints]
~~~~~~~~~~~~~~~~~~~~~~~~~
A model loaded with from_pretrained from safetensors holds views of the checkpoint file's
mapping: every tensor keeps the whole mapping alive, and its pages count in the process's
RSS while it is (file-backed, reclaimable, but counted). sluice keeps the module's other
tensors (norms, buffers) as they are while offloaded, so one of them alone would keep the
whole file resident. offload() therefore copies those of them that live in a mapped file
into memory of their own first (they are small), and the mapping goes with the last
streamed layer's original. Each streamed layer's pages of the file are handed back to the
kernel as the layer is handed over (madvise(MADV_PAGEOUT), Linux 5.4: a clean file page is
dropped from the process and read again from the file if anyone still reads it; a page
written in place is kept or swapped, never lost; MADV_DONTNEED would lose such a write), so
that the file does not stay resident beside the stored copy until the last layer.
"""
from __future__ import annotations

import ctypes
import re
import tempfile
from typing import Dict, List, Optional, Tuple

import torch

from ._C import InvalidArgument
from ._host_memory import return_freed_host_memory

_CONVS = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)
_REGEX = re.compile(r"[\\^$*+?()\[\]{}|]")


def kind_of(m: torch.nn.Module) -> Optional[str]:
    """The C++ model's kind of a module sluice may stream, None for any other module."""
    if isinstance(m, torch.nn.Linear):
        return "linear"
    if isinstance(m, torch.nn.Embedding):
        return "embedding"
    if isinstance(m, _CONVS):
        return "other"
    return None


def matches(pattern: str, name: str) -> bool:
    """sluice's skip-pattern meaning (Note [skip pattern matching]): a plain pattern is one
    whole dotted component or run of components; any other is a regex searched in the name."""
    if _REGEX.search(pattern):
        return re.search(pattern, name) is not None
    return re.search(rf"(^|\.){re.escape(pattern)}(\.|$)", name) is not None


class Layer:
    """A layer that streams: its module, its index in the C++ model, its tensors."""

    __slots__ = ("name", "module", "kind", "index", "kept")

    def __init__(self, name: str, module: torch.nn.Module, kind: str):
        self.name = name
        self.module = module
        self.kind = kind
        self.index = -1
        self.kept: List["Kept"] = []  # weight first, then bias


def choose(module: torch.nn.Module, exclude: List[str]) -> Tuple[List[Layer], List[Tuple[str, str]]]:
    """(the layers that stream, [(name, why not)] of the ones that stay resident)."""
    holders: Dict[int, int] = {}
    for m in module.modules():
        for p in m._parameters.values():
            if p is not None:
                holders[id(p)] = holders.get(id(p), 0) + 1
    streamed: List[Layer] = []
    resident: List[Tuple[str, str]] = []
    for name, m in module.named_modules():
        kind = kind_of(m)
        if kind is None:
            continue
        w = m._parameters.get("weight")
        b = m._parameters.get("bias")
        why = None
        if w is None:
            why = "it has no weight parameter"
        elif any(p is not None and holders[id(p)] > 1 for p in (w, b)):
            why = "its weight is shared with another module (tied weights)"
        elif kind == "embedding" and m.max_norm is not None:
            why = "its lookup renormalises the table in place (max_norm)"
        elif any(p is not None and type(p) is not torch.nn.Parameter for p in (w, b)):
            bad = w if type(w) is not torch.nn.Parameter else b
            why = f"its weight is a {type(bad).__name__}, not a plain torch.nn.Parameter"
        elif any(p is not None and not p.is_floating_point() for p in (w, b)):
            why = f"its weight is {w.dtype}, not floating (quantized)"
        elif w.dim() < 1 or (kind != "other" and w.dim() != 2):
            why = f"its weight has {w.dim()} dims"
        elif any(matches(p, name) for p in exclude):
            why = "exclude= names it"
        # The module itself may be the layer (offload(a_linear)): it is named by its class.
        if why:
            resident.append((name or type(m).__name__, why))
        else:
            streamed.append(Layer(name or type(m).__name__, m, kind))
    return streamed, resident


class Kept:
    """One streamed tensor of a layer: how remove() gives it back."""

    __slots__ = ("param", "layer", "is_bias", "dtype", "shape", "stride", "home", "how", "value")

    def __init__(self, param: torch.Tensor, layer: int, is_bias: bool, home: torch.device):
        self.param = param
        self.layer = layer        # its index in the C++ model
        self.is_bias = is_bias
        self.dtype = param.dtype
        self.shape = tuple(param.shape)
        self.stride = tuple(param.stride())
        self.home = home          # the device it came from
        self.how = "stored"       # "stored" (sluice's copy is exact) | "disk" | "ram"
        self.value = None         # the file offset ("disk") or the host tensor ("ram")


class Spill:
    """The lossy layers' original tensors as raw bytes in one unnamed temporary file
    (tempfile.TemporaryFile(dir=spill_dir): gone when closed or when the process ends). bf16
    has no numpy dtype: a tensor's memory is written as it is, without numpy."""

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
        """The bytes of a contiguous host tensor, without a copy. `t` must outlive the view."""
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


def file_mappings() -> List[Tuple[int, int]]:
    """The process's mappings of files ([start, end) addresses), from /proc/self/maps; none
    where there is no such file."""
    out: List[Tuple[int, int]] = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6 and parts[5].startswith("/"):
                    start, end = (int(x, 16) for x in parts[0].split("-"))
                    out.append((start, end))
    except OSError:
        pass
    return out


def own_mapped(tensors, repoint) -> int:
    """Note [mapped checkpoints]: each host tensor whose memory is in a mapped file is copied
    into memory of its own (the same object, re-pointed); returns how many were."""
    maps = file_mappings()
    copied = 0
    for t in tensors:
        p = t.data_ptr()
        if t.device.type == "cpu" and t.numel() and any(a <= p < b for a, b in maps):
            repoint(t, t.detach().clone())
            copied += 1
    return copied


_madvise = None
_MADV_PAGEOUT = 21
_PAGE = 4096


def page_out(ptr: int, nbytes: int) -> None:
    """madvise(MADV_PAGEOUT) on the whole pages of [ptr, ptr + nbytes) (Note [mapped
    checkpoints]); nothing where the C library or the kernel does not have it."""
    global _madvise
    if _madvise is None:
        try:
            _madvise = ctypes.CDLL(None, use_errno=True).madvise
            _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        except (OSError, AttributeError):
            _madvise = False
    start = (ptr + _PAGE - 1) // _PAGE * _PAGE
    end = (ptr + nbytes) // _PAGE * _PAGE
    if _madvise and end > start:
        _madvise(start, end - start, _MADV_PAGEOUT)  # a hint: EINVAL on an older kernel is fine


def hand_over(model, layer: Layer, compute: Optional[str], originals: str, spill: Optional[Spill],
              placeholders, mapped: List[Tuple[int, int]]) -> None:
    """Layer `layer` into the C++ model `model` (Note [handover]): its stored copy made, its
    lossy originals kept as `originals` says, its tensors turned into placeholders."""
    m = layer.module
    params = [(False, m._parameters["weight"])]
    if m._parameters.get("bias") is not None:
        params.append((True, m._parameters["bias"]))
    host = {}
    in_file = []  # (address, bytes) of originals in a mapped checkpoint (Note [mapped checkpoints])
    for is_bias, p in params:
        host[is_bias] = p.detach() if p.device.type == "cpu" else p.detach().to("cpu")
        if p.device.type == "cpu" and any(a <= p.data_ptr() < b for a, b in mapped):
            in_file.append((p.data_ptr(), p.numel() * p.element_size()))
    own_dtype = params[0][1].dtype
    layer.index = model.add_layer(layer.name, host[False], host.get(True), layer.kind,
                                  compute or str(own_dtype).replace("torch.", ""))
    stored = model.stored_dtype(layer.index)
    kept = []
    for is_bias, p in params:
        k = Kept(p, layer.index, is_bias, p.device)
        if p.dtype != stored:  # lossy: the original bits are kept
            k.how = originals
            # "ram": the host tensor itself (the original's memory, or its copy from the device).
            k.value = spill.write(host[is_bias]) if originals == "disk" else host[is_bias]
        kept.append(k)
    del host
    for k in kept:
        placeholders.make(k.param, layer.name + (".bias" if k.is_bias else ".weight"), k.home)
    layer.kept = kept
    return_freed_host_memory()  # the original's pages back to the system before the next layer
    for ptr, nbytes in in_file:
        page_out(ptr, nbytes)
