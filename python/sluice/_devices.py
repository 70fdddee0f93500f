"""The device sluice runs on: the default (Note [default device]) and a device= argument as
sluice's name of it.

Note [default device]
~~~~~~~~~~~~~~~~~~~~~
sluice.offload() without cache= or device=, and sluice.ModelCache() without device=, run on
default_device(): the current accelerator, as PyTorch names it,
  - torch.accelerator.current_accelerator(check_available=True) where torch has it (a torch
    whose current_accelerator() takes no check_available is asked
    torch.accelerator.is_available() instead): "cuda" for CUDA and ROCm builds with a
    device, "xpu", "mps", or an out-of-tree (PrivateUse1) backend once its library is
    loaded (the test accelerator's "testaccel" in the accel test entries);
  - before torch.accelerator: "cuda" where torch.cuda.is_available() (ROCm builds say cuda);
  - "cpu" (the CPU plays the device) only when there is none.
The name has no index: sluice then runs on that backend's current device, as torch does.
An int device= is an index of that same accelerator (device=1 is "cuda:1" on a CUDA
machine); with no accelerator an int is an InvalidArgument naming device=.
"""
from __future__ import annotations

from typing import Optional

import torch

from ._C import InvalidArgument


def _current_accelerator() -> Optional[torch.device]:
    """The available accelerator torch reports (Note [default device]); None when there is none."""
    accelerator = getattr(torch, "accelerator", None)
    current = getattr(accelerator, "current_accelerator", None)
    if current is None:
        return torch.device("cuda") if torch.cuda.is_available() else None
    try:
        return current(check_available=True)
    except TypeError:  # a current_accelerator() without check_available: ask is_available() ourselves
        dev = current()
        if dev is None:
            return None
        available = getattr(accelerator, "is_available", None)
        if available is not None:
            return dev if available() else None
        module = getattr(torch, dev.type, None)
        return dev if module is not None and module.is_available() else None


def default_device() -> str:
    """The device sluice runs on when none is given (Note [default device]): the current
    accelerator's type ("cuda" on a CUDA or ROCm machine, "xpu", "mps", a PrivateUse1
    backend's name), or "cpu" when torch finds none available."""
    dev = _current_accelerator()
    return "cpu" if dev is None else dev.type


def device_name(device, where: str) -> str:
    """A device= argument (a torch.device, a name such as "cuda", "cuda:1", "cpu", or an int
    index of the current accelerator; None: default_device()) as sluice's name of it.
    `where` names the call in the error ("offload", "ModelCache")."""
    if device is None:
        return default_device()
    if isinstance(device, torch.device):
        return str(device)
    if isinstance(device, str):
        if not device.strip():
            raise InvalidArgument(f"{where}: device= is empty; give a device such as 'cuda', 'cuda:1' or 'cpu'")
        return device.strip()
    if isinstance(device, int) and not isinstance(device, bool):
        if device < 0:
            raise InvalidArgument(f"{where}: device={device} is a negative index")
        acc = _current_accelerator()
        if acc is None:
            raise InvalidArgument(f"{where}: device={device} is an index of the current accelerator, and torch finds "
                                  "none available (torch.accelerator); give the device by name, e.g. device='cpu'")
        return str(torch.device(acc.type, device))
    raise InvalidArgument(f"{where}: device= takes a torch.device, a name ('cuda', 'cuda:1', 'cpu') or an index, got "
                          f"{type(device).__name__} {device!r}")
