"""sluice.offload()'s arguments, checked once (OffloadConfig), and the skip list it applies.

Note [default skip list]
~~~~~~~~~~~~~~~~~~~~~~~~
The layers kept in their own dtype (stored unconverted, computing in that dtype) follow
diffusers' enable_layerwise_casting, so that offload(m, storage="float8_e4m3fn") computes
what m.enable_layerwise_casting(float8_e4m3fn, <m's dtype>) computes with no arguments:
  - always the model's own patterns: diffusers' _skip_layerwise_casting_patterns, and
    _keep_in_fp32_modules (diffusers' and transformers' attribute);
  - with `skip` not given and fp8 storage, diffusers' DEFAULT_SKIP_MODULES_PATTERN too
    (pos_embed, patch_embed, norm, ^proj_in$, ^proj_out$);
  - with `skip` given, the caller's patterns instead of those defaults (as diffusers does
    with skip_modules_pattern).
diffusers searches every pattern as a regex in the module's dotted name; a plain word is
written for sluice's skip list (whose plain words match whole components, Note [skip
pattern matching]) as the regex \\w*word\\w*, which matches the same names. The caller's own
patterns keep sluice's meaning.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable, List, Optional

import torch

from ._C import InvalidArgument
from ._arguments import dtype_name, size_text
from ._devices import device_name

ORIGINALS = ("disk", "ram")
# diffusers hooks/layerwise_casting.py DEFAULT_SKIP_MODULES_PATTERN.
DIFFUSERS_DEFAULT_SKIP = ("pos_embed", "patch_embed", "norm", "^proj_in$", "^proj_out$")
_REGEX = re.compile(r"[\\^$*+?()\[\]{}|]")


def _searched(p: str) -> str:
    """A diffusers pattern (re.search) for sluice's skip list."""
    return p if _REGEX.search(p) else rf"\w*{re.escape(p)}\w*"


def skip_patterns(module: torch.nn.Module, skip: Optional[Iterable[str]], storage: str) -> List[str]:
    """The skip list of Note [default skip list]."""
    patterns: List[str] = []
    for attr in ("_skip_layerwise_casting_patterns", "_keep_in_fp32_modules"):
        for p in getattr(module, attr, None) or ():
            patterns.append(_searched(p))
    if skip is None:
        if storage.startswith("float8"):
            patterns.extend(_searched(p) for p in DIFFUSERS_DEFAULT_SKIP)
    else:
        if isinstance(skip, str):
            raise InvalidArgument(f"offload: skip= takes a list of patterns, got the string {skip!r}")
        patterns.extend(skip)
    return patterns


@dataclass
class OffloadConfig:
    """offload()'s arguments, checked: each bad one is one InvalidArgument naming it."""

    name: str
    storage: str
    compute: Optional[str]
    skip: List[str]
    exclude: List[str]
    max_resident: Optional[float]
    originals: str
    spill_dir: Optional[str]
    cache: object
    device: Optional[str]
    vram_budget: Optional[str]
    working_memory: Optional[str]
    pin_memory: Optional[str]
    prefetch: object
    trace: Optional[bool]
    where: str = field(default="cpu")  # the sluice device, as a name

    @classmethod
    def of(cls, module: torch.nn.Module, *, cache, name, storage, compute, skip, exclude, max_resident, originals,
           spill_dir, device, vram_budget, working_memory, pin_memory, prefetch, trace) -> "OffloadConfig":
        if originals not in ORIGINALS:
            raise InvalidArgument(f"offload: originals={originals!r}; one of {', '.join(map(repr, ORIGINALS))}")
        if cache is not None and not (hasattr(cache, "_cache") and hasattr(cache, "_device")):
            raise InvalidArgument(f"offload: cache= takes a sluice.ModelCache, got {type(cache).__name__}")
        own = (("device", device), ("vram_budget", vram_budget), ("working_memory", working_memory),
               ("pin_memory", pin_memory), ("prefetch", prefetch), ("trace", trace))
        if cache is not None:
            given = [k for k, v in own if v is not None]
            if given:
                raise InvalidArgument(f"offload: {', '.join(given)} belong to the ModelCache given as cache=; "
                                      "set them there")
        if isinstance(exclude, str):
            raise InvalidArgument(f"offload: exclude= takes a list of patterns, got the string {exclude!r}")
        storage = dtype_name(storage, "storage")
        if storage is None:
            raise InvalidArgument("offload: storage= takes a torch.dtype or its name, got None")
        # Note [default device] in _devices.py: no cache and no device= is the current accelerator.
        where = cache._device if cache is not None else device_name(device, "offload")
        return cls(name=name or type(module).__name__, storage=storage, compute=dtype_name(compute, "compute"),
                   skip=skip_patterns(module, skip, storage), exclude=list(exclude or ()), max_resident=max_resident,
                   originals=originals, spill_dir=spill_dir, cache=cache,
                   device=None if cache is not None else where,
                   vram_budget=size_text(vram_budget, "vram_budget", "offload"),
                   working_memory=size_text(working_memory, "working_memory", "offload"), pin_memory=pin_memory,
                   prefetch=prefetch, trace=trace, where=where)
