"""What a streamed layer's weight is while its module is offloaded (Note [placeholders]), and
re-pointing a tensor object at other memory.

Note [placeholders]
~~~~~~~~~~~~~~~~~~~
While a module is offloaded, each streamed layer keeps its Parameter objects, but their
.data is a placeholder: a zero-stride view (every stride 0) of one element of the same
dtype, on the sluice device, holding element_size() bytes shared by every layer. The
object's class becomes a subclass of its own (OffloadedParameter) whose __torch_function__
lets through what code reads of a weight without its values (.shape, .dtype, .device,
.requires_grad, .ndim, .size(), .numel(), .is_floating_point(), .data_ptr(), ...: what a
model's .dtype and .device and a pipeline's placement read) and refuses everything else
(arithmetic, torch.cat, F.linear, .data, .to(), copy_, repr of the values) with one
sluice.InvalidArgument naming the layer and the fix. Never a silent zero: a fused-QKV
forward that concatenates q.weight and k.weight, or a patch that calls nn.Linear.forward
outside the layer's own call, gets that error instead of computing with zeros.

During the layer's own call (Note [leased calls] in _offload_hooks.py) Parameters holding
the leased weights stand in for the placeholders in the layer's parameter table; afterwards
the placeholders are back. remove() gives each its class and its values back.

Not the alternatives: a meta tensor changes .device (a pipeline would place its inputs on
"meta"); freeing the storage in place (storage().resize_(0), as FSDP does) makes every read
fail with a message that names no layer; a tensor subclass built around a new object would
change the identity of the module's parameters, which frontends hold.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from ._C import InvalidArgument

_LAYER = "_sluice_layer"  # the placeholder's layer name, in the Parameter's own __dict__

# What reads a tensor's metadata, not its values: getters (Tensor.<name>.__get__) and methods.
_GETTERS = frozenset({
    "shape", "dtype", "device", "requires_grad", "ndim", "is_leaf", "grad", "grad_fn", "layout", "nbytes",
    "itemsize", "is_cuda", "is_cpu", "is_meta", "is_mps", "is_xpu", "is_sparse", "is_quantized", "is_nested",
    "is_mkldnn", "names", "output_nr", "_version", "_cdata",
})
_METHODS = frozenset({
    "dim", "size", "numel", "nelement", "element_size", "is_floating_point", "is_complex", "is_signed", "stride",
    "is_contiguous", "storage_offset", "requires_grad_", "data_ptr", "get_device", "__len__", "_is_view",
    "__hash__", "ndimension", "has_names", "is_inference",
    "untyped_storage",  # where its memory is and how much (one element): accounting, not values
})


def _op_name(func) -> Tuple[str, bool]:
    """(name, is_getter) of what __torch_function__ was called for."""
    name = getattr(func, "__name__", "") or str(func)
    if name == "__get__":
        owner = getattr(func, "__self__", None)
        return getattr(owner, "__name__", "attribute"), True
    return name, False


def _layer_of(args, kwargs) -> str:
    def walk(x):
        if isinstance(x, torch.Tensor) and _LAYER in x.__dict__:
            return x.__dict__[_LAYER]
        if isinstance(x, (list, tuple)):
            for y in x:
                found = walk(y)
                if found:
                    return found
        return None

    return walk(list(args) + list((kwargs or {}).values())) or "?"


def refusal(layer: str, what: str) -> InvalidArgument:
    return InvalidArgument(
        f"offload: '{layer}' is streamed by sluice.offload: its values exist only during that layer's own call, and "
        f"{what} reads them outside it. Keep the layer out of streaming with offload(..., exclude=['{layer.rsplit('.', 1)[0]}']), "
        f"or remove() the offload first")


class _Offloaded:
    """Mixed into a placeholder's class (see placeholder_class)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name, getter = _op_name(func)
        if name in (_GETTERS if getter else _METHODS):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        what = f"'.{name}'" if getter else f"'{name}'"
        raise refusal(_layer_of(args, kwargs), what)

    def __repr__(self):
        layer = self.__dict__.get(_LAYER, "?")
        with torch._C.DisableTorchFunctionSubclass():
            return (f"OffloadedParameter('{layer}', shape={tuple(self.shape)}, dtype={self.dtype}, "
                    f"device={self.device}: streamed by sluice.offload)")


_classes: Dict[type, type] = {}


def placeholder_class(cls: type) -> type:
    """The placeholder class of a Parameter class (one per class, made once)."""
    if cls not in _classes:
        _classes[cls] = type(f"Offloaded{cls.__name__}", (_Offloaded, cls), {})
    return _classes[cls]


def repoint(t: torch.Tensor, data: torch.Tensor) -> None:
    """Makes the tensor object `t` hold `data` (same object, new memory), as .data = does.

    .data = refuses a pair of a CPU tensor and an out-of-tree (PrivateUse1) backend's one
    (offload/layer/repoint.h, Note [re-pointing across devices]); for such a pair the two objects
    swap their contents (torch.utils.swap_tensors), and `t` keeps its own attributes and
    class. `t` must not require grad (offload() turns the flags off first) and must not be a
    placeholder (its class is its own again first)."""
    if torch._has_compatible_shallow_copy_type(t, data):
        t.data = data
        return
    other = torch.Tensor._make_subclass(type(t), data.detach(), False)
    torch.utils.swap_tensors(t, other)
    t.__dict__, other.__dict__ = other.__dict__, t.__dict__  # t's attributes stay t's


class Placeholders:
    """The zero-stride placeholders of one offload(): one element per dtype and device."""

    def __init__(self, runs_on: Optional[torch.device]):
        self._runs_on = runs_on
        self._bases: Dict[Tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def _base(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if (dtype, device) not in self._bases:
            self._bases[(dtype, device)] = torch.zeros(1, dtype=dtype, device=device)
        return self._bases[(dtype, device)]

    def view(self, dtype: torch.dtype, shape, device: torch.device) -> torch.Tensor:
        return self._base(dtype, device).as_strided(shape, (0,) * len(shape))

    def make(self, p: torch.Tensor, layer: str, home: torch.device) -> None:
        """Turns the Parameter `p` (its class its own, not requiring grad) into its placeholder,
        on the sluice device, where the module now runs (a model's .device, which diffusers
        reads to place a pipeline's inputs, is where its forward computes); where that cannot
        be (a backend torch's Python side cannot allocate on, or a tensor an autograd graph
        from before still holds, which an out-of-tree backend's swap refuses), on the device
        it came from."""
        shape, dtype = tuple(p.shape), p.dtype
        data = None
        if self._runs_on is not None:
            try:
                data = self.view(dtype, shape, self._runs_on)
                repoint(p, data)
            except Exception:  # noqa: BLE001  (see above: the tensor's own device then)
                data = None
        if data is None:
            data = self.view(dtype, shape, home)
            repoint(p, data)
        p.__dict__[_LAYER] = layer
        p.__class__ = placeholder_class(type(p))


def own_class(p: torch.Tensor) -> type:
    """The class a placeholder had before it was one (its own class if it is none)."""
    cls = type(p)
    return cls.__mro__[2] if issubclass(cls, _Offloaded) else cls


def restore(p: torch.Tensor, value: torch.Tensor) -> None:
    """`p` is no placeholder any more: its own class, holding `value`, its layer name gone."""
    p.__class__ = own_class(p)
    p.__dict__.pop(_LAYER, None)
    repoint(p, value)
