"""What offload() attaches to a module and its layers, and how each is taken off again.

Note [leased calls]
~~~~~~~~~~~~~~~~~~~
A streamed layer keeps its own forward. offload() sets one instance attribute on it,
`_call_impl` (what nn.Module.__call__ runs: the forward pre-hooks, self.forward, the forward
hooks), to a wrapper that runs the layer's own _call_impl with its weights leased for the
call: the engine hands out the layer's weights on the device in its compute dtype
(OffloadedModel.lease), Parameters holding them stand in for the placeholders (Note
[placeholders]) in the module's own parameter table, the call runs, and the placeholders
are back, also when the call raised. (Not the placeholder objects re-pointed at the leased
memory: an autograd graph from before offload() that still holds a Parameter makes torch
refuse to re-point it across devices.) So whatever a frontend
attached runs as it would without sluice, whenever it attached it:
  - an instance `forward` patched before or after offload() (InvokeAI's ControlNet-LLLite,
    accelerate's add_hook_to_module, a regional-prompt patch);
  - torch's forward pre- and post-hooks, which also see the real weights;
  - a subclass's forward (comfy.ops' Linear casting its weight to the input's dtype).
Two shortcuts for the plain classes with nothing attached: an nn.Linear runs in the engine
(OffloadedModel.linear: the same x W^T + b, without the round trip through Python, about
14 us a layer on a CPU), and an nn.Embedding looks its rows up there, which upcasts only
those rows of an fp8 table (Note [embedding rows] in offload/layer/layer.h).

The module's own forward is wrapped (functools.wraps: its signature stays what
inspect.signature reads, as transformers' generate() does to pass logits_to_keep) so that
each call is one sluice forward: the engine records the order the layers ran in and copies
the next ones ahead.

Every attribute offload() sets is recorded with what was there before (a value, or
nothing) and put back by remove(), unless the frontend has replaced it since (then its own
value stays). Nothing the frontend set is deleted.

Note [compiled callers]
~~~~~~~~~~~~~~~~~~~~~~~
torch.compile(module) after offload() compiles the module's own code between its streamed
layers, and each streamed layer's call is a boundary Dynamo does not trace:
  - a layer's leased call (the `_call_impl` above, with its Linear/Embedding shortcuts) is
    torch.compiler.disable'd: Dynamo graph-breaks at the layer's call and runs it as
    Python, with compilation off inside it (recursive), so the layer's own forward, its
    hooks and a patched forward run eagerly, exactly as without torch.compile, on the
    weights the engine leases. Dynamo inlines a module call as type(m).__call__, which
    reads the instance's _call_impl (torch 2.11, 2.15); torch 2.7's Dynamo inlines
    type(m)._call_impl instead, skipping the instance's, unless the instance's __call__
    is not nn.Module's own. So offload() also sets an instance `__call__` on each streamed
    layer: a method that calls the class's __call__ (what m.__call__(x) runs anyway; m(x)
    never reads it), which sends every Dynamo to the instance's _call_impl;
  - the module's wrapped forward is disabled non-recursively: its own frame (begin_forward,
    end_forward, the log level and lines: calls into the engine Dynamo cannot trace) runs
    as Python, and the module's real forward it calls is compiled as usual, in pieces
    between the layers' calls.
So a compiled offloaded module computes what the eager one does, its layers bit for bit;
only the code between them is inductor's (which may round differently from eager, as it
does for any module). The boundaries hold nothing Dynamo guards on that changes from call
to call (the leased Parameters are swapped in and out inside the disabled call), so it
compiles once. torch.compile's wrapper itself (OptimizedModule) is refused by offload():
offload the module, then compile it.
"""
from __future__ import annotations

import functools
import types
from typing import Callable, List

import torch

from . import _logging
from ._C import InvalidArgument

_ABSENT = object()
MARK = "_sluice_offloaded_in"  # on every module of an offloaded module: the offloaded module's name


class Attached:
    """The instance attributes offload() set, to be put back as they were."""

    def __init__(self):
        self._set: List[tuple] = []  # (module, attribute, value set, value before or _ABSENT)
        self._hooks: list = []

    def set(self, m: torch.nn.Module, attr: str, value) -> None:
        self._set.append((m, attr, value, m.__dict__.get(attr, _ABSENT)))
        m.__dict__[attr] = value

    def hook(self, handle) -> None:
        self._hooks.append(handle)

    def undo(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for m, attr, value, before in reversed(self._set):
            if m.__dict__.get(attr, _ABSENT) is not value:
                continue  # replaced by someone else since: theirs stays
            if before is _ABSENT:
                del m.__dict__[attr]
            else:
                m.__dict__[attr] = before
        self._set = []


def not_traced(fn: Callable, recursive: bool = True) -> Callable:
    """`fn` as a boundary Dynamo does not trace (Note [compiled callers]):
    torch.compiler.disable (torch._dynamo.disable on a torch without it). With
    recursive=False only `fn`'s own frame runs uncompiled; the frames it calls compile."""
    disable = getattr(getattr(torch, "compiler", None), "disable", None)
    if disable is None:
        from torch import _dynamo

        disable = _dynamo.disable
    out = disable(fn, recursive=recursive)
    if out is not fn:
        functools.update_wrapper(out, fn)  # a wrapper (2.11's non-recursive disable too): fn's name, signature
    return out


def _nothing_attached(m: torch.nn.Module, cls: type) -> bool:
    """`m` is exactly `cls` with nothing attached (no instance forward, no hooks): the engine
    can run its call itself (OffloadedModel.linear/embedding), as the class would."""
    mod = torch.nn.modules.module
    return (type(m) is cls and "forward" not in m.__dict__ and not m._forward_hooks and not m._forward_pre_hooks
            and not mod._global_forward_hooks and not mod._global_forward_pre_hooks)


def attach_layer(attached: Attached, model, layer) -> None:
    """Layer `layer` (_offload_layers.Layer) runs its own call with its weights leased."""
    m = layer.module
    index = layer.index
    has_bias = len(layer.kept) > 1
    own = m.__dict__.get("_call_impl", _ABSENT)
    embedding = layer.kind == "embedding"
    params = m._parameters

    linear = layer.kind == "linear"

    def call_impl(*args, **kwargs):
        if len(args) == 1 and not kwargs:
            # Shortcuts for the plain classes: the same math in the engine, without the
            # Python round trip (x W^T + b is at::linear either way).
            if linear and _nothing_attached(m, torch.nn.Linear):
                return model.linear(index, args[0])
            if embedding and _nothing_attached(m, torch.nn.Embedding):
                return model.embedding(index, args[0])
        inner = own if own is not _ABSENT else functools.partial(type(m)._call_impl, m)

        def run(w, b):
            # The leased weights stand in for the placeholders in the module's own
            # parameter table for the call, and the placeholders go back after it.
            saved_w, saved_b = params["weight"], params.get("bias")
            params["weight"] = torch.nn.Parameter(w, requires_grad=False)
            if has_bias:
                params["bias"] = torch.nn.Parameter(b, requires_grad=False)
            try:
                return inner(*args, **kwargs)
            finally:
                params["weight"] = saved_w
                if has_bias:
                    params["bias"] = saved_b

        return model.lease(index, run)

    attached.set(m, "_call_impl", not_traced(call_impl))
    if "__call__" not in m.__dict__:
        # Note [compiled callers]: an older Dynamo (torch 2.7) reaches the instance's
        # _call_impl only when the instance's __call__ is not nn.Module's own.
        attached.set(m, "__call__", types.MethodType(_class_call(type(m)), m))


def _class_call(cls: type) -> Callable:
    """`cls.__call__` as a function of the instance: what `m.__call__(x)` runs anyway."""
    call = cls.__call__

    def __call__(self, *args, **kwargs):
        return call(self, *args, **kwargs)

    return __call__


def _begin_forward(model, kind: str) -> None:
    _logging.sync_level()  # the `sluice` logger's level now (sluice/_logging.py)
    model.begin_forward(kind)


def _end_forward(model, aborted: bool) -> None:
    model.end_forward(aborted)
    _logging.flush()


_engine_calls = None  # (begin, end) as not_traced boundaries, made at the first offload()


def wrap_forward(attached: Attached, module: torch.nn.Module, model, kind: str) -> None:
    """Each call of the module's forward is one sluice forward."""
    global _engine_calls
    if _engine_calls is None:  # not at import: torch.compiler.disable imports torch._dynamo
        _engine_calls = (not_traced(_begin_forward), not_traced(_end_forward))
    begin_forward, end_forward = _engine_calls
    inner = module.forward  # the instance's own forward if it had one, else its class's

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        begin_forward(model, kind)
        try:
            out = inner(*args, **kwargs)
        except BaseException:
            end_forward(model, True)
            raise
        end_forward(model, False)
        return out

    # Note [compiled callers]: this frame runs as Python, `inner` compiles.
    attached.set(module, "forward", not_traced(forward, recursive=False))


def guard(attached: Attached, module: torch.nn.Module, layers: List[torch.nn.Module], name: str) -> None:
    """While offloaded: no state_dict() of the placeholders, no load_state_dict() into them,
    no .to()/.cuda()/.half() moving them (nn.Module._apply, shadowed in each module's own
    dict), and a mark on every module, so that no part of it is offloaded a second time."""

    def no_state_dict(*_):
        raise InvalidArgument("offload: state_dict() of an offloaded module; remove() it first")

    def no_load_state_dict(*_):
        raise InvalidArgument("offload: load_state_dict() into an offloaded module; remove() it first")

    def no_apply(*_, **__):
        raise InvalidArgument("offload: .to()/.cuda()/.half()/... of an offloaded module would move its "
                              "placeholders; remove() it first")

    attached.hook(module.register_load_state_dict_pre_hook(no_load_state_dict))
    for m in [module] + layers:
        attached.hook(m.register_state_dict_pre_hook(no_state_dict))
    for m in module.modules():
        attached.set(m, "_apply", no_apply)
        attached.set(m, MARK, name)


def refuse_nested(module: torch.nn.Module) -> None:
    """One InvalidArgument when the module, a module inside it, or a module it is part of is
    already offloaded: sluice streams a layer for one offloaded module only."""
    for n, m in module.named_modules():
        if MARK in m.__dict__:
            where = "the module" if not n else f"its submodule '{n}'"
            raise InvalidArgument(f"offload: {where} is already offloaded (in '{m.__dict__[MARK]}'); remove() that "
                                  "first: a module inside an offloaded one, or around one, is not offloaded again")


def refuse_compiled(module: torch.nn.Module) -> None:
    if type(module).__name__ == "OptimizedModule" and hasattr(module, "_orig_mod"):
        raise InvalidArgument("offload: the module is torch.compile()'s wrapper (OptimizedModule); offload the "
                              "module itself (its _orig_mod), then compile")
