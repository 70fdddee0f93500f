"""sluice.offload(module): sluice's streaming engine behind a torch model you already have.

    import sluice
    handle = sluice.offload(pipe.transformer, device="cuda", vram_budget="6GiB",
                            storage="float8_e4m3fn")
    image = pipe(...)            # the module runs as before; its Linear layers stream
    handle.stats()               # the engine's stats (the --stats-json model fields)
    handle.remove()              # the module as it was, bit for bit

In place, as diffusers' apply_group_offloading does: every torch.nn.Linear of the module
(except those the skip patterns name, which keep their dtype) is stored by sluice in the
storage dtype and leased to the device for its forward only; the module's other parameters
and buffers move to the device while it is offloaded and come back on remove(). The
module's own forward runs unchanged, delimited as one sluice forward per call. For
inference: the offloaded layers' outputs carry no autograd history (as under torch.no_grad).

Not supported yet (each raises sluice.InvalidArgument naming it): a module whose tensors
are not on the host, a module offloaded twice, and removing twice. Only torch.nn.Linear
layers (that exact class) are streamed: subclasses, embeddings and convolutions move with
the other parameters. Offloaded
modules do not share a ModelCache's budget yet: each has its own.
"""
from __future__ import annotations

import json
import re
import threading
from typing import Iterable, List, Optional

import torch

from . import _C
from ._C import InvalidArgument

_ATTR = "_sluice_offload"


def _skip_patterns(module: torch.nn.Module, skip: Iterable[str]) -> List[str]:
    # The ecosystem's conventions: diffusers' _skip_layerwise_casting_patterns and
    # _keep_in_fp32_modules where the model declares them, then the caller's patterns.
    patterns: List[str] = []
    for attr in ("_skip_layerwise_casting_patterns", "_keep_in_fp32_modules"):
        for p in getattr(module, attr, None) or ():
            patterns.append(p if re.search(r"[\\^$*+?()\[\]{}|]", p) else rf"\w*{re.escape(p)}\w*")
    patterns.extend(skip)
    return patterns


class Offloaded:
    """The handle sluice.offload() returns: stats(), set_vram_budget(), remove()."""

    def __init__(self, module: torch.nn.Module, model: "_C.OffloadedModel",
                 linears: List[torch.nn.Linear], grads: List[torch.Tensor]):
        self._module = module
        self._model = model
        self._linears = linears
        self._grads = grads  # parameters that required grad before offload()

    def stats(self) -> dict:
        """The engine's stats: the fields of `sluice run --stats-json`'s model section."""
        return json.loads(self._model.stats_json())

    def set_vram_budget(self, budget: str) -> None:
        """A new budget ("6GiB", "50%"); sluice.ResourceError when too small."""
        self._model.set_vram_budget(budget)

    @property
    def removed(self) -> bool:
        return self._model.removed()

    def remove(self) -> None:
        """Gives the module back as it was: its own forwards, its tensors on the host."""
        if self._model.removed():
            raise InvalidArgument("offload: the module was already removed")
        self._model.remove()
        for t in self._grads:
            t.requires_grad_(True)
        for lin in self._linears:
            lin.__dict__.pop("forward", None)
        self._module.__dict__.pop("forward", None)
        self._module.__dict__.pop(_ATTR, None)


def offload(module: torch.nn.Module, *, device: str = "cpu", vram_budget: str = "",
            working_memory: str = "256MiB", storage: str = "float8_e4m3fn",
            compute: Optional[str] = None, skip: Iterable[str] = (),
            max_resident: Optional[float] = None, pin_memory: str = "auto") -> Offloaded:
    """Streams `module`'s Linear layers through sluice, in place; returns the handle.

    vram_budget: what sluice may hold on the device for this module, working_memory (kept
    free for activations, 256MiB by default) included: for a budget smaller than that, lower
    working_memory too. "" = all device memory.
    compute: the dtype the Linear layers compute in; default: their weights' dtype."""
    if _ATTR in module.__dict__:
        raise InvalidArgument("offload: the module is already offloaded; remove() it first")
    # Exactly torch.nn.Linear: a subclass may compute more than x W^T + b in its forward
    # (quantized or patched layers); its tensors move with the other parameters instead.
    linears = [(name, m) for name, m in module.named_modules() if type(m) is torch.nn.Linear]
    if not linears:
        raise InvalidArgument("offload: the module has no torch.nn.Linear layer to stream")
    dtypes = {m.weight.dtype for _, m in linears}
    if compute is None:
        if len(dtypes) != 1:
            raise InvalidArgument("offload: the Linear layers have several dtypes "
                                  f"({sorted(str(d) for d in dtypes)}); give compute=")
        compute = str(next(iter(dtypes))).replace("torch.", "")
    owned = set()
    layers = []
    for name, m in linears:
        owned.add(id(m.weight))
        if m.bias is not None:
            owned.add(id(m.bias))
        layers.append((name, m.weight.detach(), None if m.bias is None else m.bias.detach()))
    # The module's own tensor objects: sluice re-points them in place (to the device and
    # back), so the module's norms and tables move with it.
    extras = [(n, t) for n, t in module.named_parameters() if id(t) not in owned]
    extras += [(n, t) for n, t in module.named_buffers() if t is not None]
    for name, t in [(n + ".weight", w) for n, w, _ in layers] + extras:
        if t.device.type != "cpu":
            raise InvalidArgument(f"offload: '{name}' is on {t.device}; offload a module whose tensors are on the host")
    # Inference only: the parameters stop requiring grad while offloaded (re-pointing one
    # that requires grad at an out-of-tree backend's memory is refused, Note [re-pointing
    # across devices]); remove() gives each its flag back.
    grads = [t for _, t in extras if t.requires_grad]
    for t in grads:
        t.requires_grad_(False)
    try:
        model = _C.OffloadedModel(layers, extras, device=device, vram_budget=vram_budget,
                                  working_memory=working_memory, storage=storage, compute=compute,
                                  skip=_skip_patterns(module, skip), max_resident=max_resident,
                                  pin_memory=pin_memory)
    except BaseException:
        for t in grads:
            t.requires_grad_(True)
        raise
    lin_modules = [m for _, m in linears]
    for i, m in enumerate(lin_modules):
        m.forward = (lambda i: lambda x: model.linear(i, x))(i)
    inner = module.forward
    # The engine runs one forward at a time: calls from several threads take turns (a
    # re-entrant lock, so a forward that calls the module again nests).
    turn = threading.RLock()

    def forward(*args, **kwargs):
        with turn:
            model.begin_forward(type(module).__name__)
            try:
                out = inner(*args, **kwargs)
            except BaseException:
                model.end_forward(True)
                raise
            model.end_forward(False)
            return out

    module.forward = forward
    handle = Offloaded(module, model, lin_modules, grads)
    module.__dict__[_ATTR] = handle
    return handle
