"""Giving an offloaded module's tensors back, one layer at a time (Note [handover] in
_offload_layers.py, in reverse): each streamed tensor gets its class and its values back,
on the device it came from, bit for bit, and sluice's stored copy of that layer is freed
before the next layer is given back, so host memory peaks one layer above the module.

Where each tensor's values come from (Note [placeholders] for what it is meanwhile):
  - stored in its own dtype: sluice's stored copy is exact (OffloadedModel.stored_layer);
  - stored lossily (fp8 of bf16): the original bits, kept as `originals=` said: read back
    from the temporary file ("disk"), or the tensor kept as it was ("ram").
Shapes, dtypes and strides were kept beside them, so a non-contiguous weight comes back
with its own strides (in new memory).
"""
from __future__ import annotations

from typing import List, Optional

import torch

from . import _placeholders as ph
from ._offload_layers import Layer, Spill


def _strided_like(src: torch.Tensor, shape, stride) -> torch.Tensor:
    """`src` (contiguous, host) with the given strides: itself when they already match."""
    if tuple(src.stride()) == tuple(stride):
        return src
    out = torch.empty_strided(shape, stride, dtype=src.dtype)
    out.copy_(src.view(shape))
    return out


def give_back(model, layers: List[Layer], spill: Optional[Spill]) -> None:
    """Every handed-over layer's tensors back (the C++ model already removed from its
    cache), freeing sluice's copy of each layer once it is given back."""
    for layer in layers:
        if not layer.kept:
            continue  # never handed over (a failing offload)
        stored = None
        for k in layer.kept:
            if k.how == "stored":
                if stored is None:
                    stored = model.stored_layer(layer.index)
                src = stored[1 if k.is_bias else 0]
            elif k.how == "disk":
                src = spill.read(k.value, k.dtype, k.shape)
            else:
                src = k.value
            src = _strided_like(src, k.shape, k.stride)
            ph.restore(k.param, src if k.home.type == "cpu" else src.to(k.home))
            k.value = None
        stored = None
        model.release_layer(layer.index)  # sluice's copy of the layer, back to the system before the next
        layer.kept = []
