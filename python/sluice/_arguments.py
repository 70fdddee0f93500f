"""sluice's arguments as a PyTorch user gives them, checked once: sizes (an int of bytes or a
size string) and dtypes (a torch.dtype or its name). Devices are _devices.py's.

A bad one is one sluice.InvalidArgument (also a ValueError) naming the call and the
argument. Size strings are read by the C++ options (Note [size suffixes] in
runtime/size_parse.h: "8GiB", "512MiB", "8G", "50%"), which name the argument too.
"""
from __future__ import annotations

import numbers
from typing import Optional

import torch

from . import _C
from ._C import InvalidArgument


def size_text(value, name: str, where: str) -> Optional[str]:
    """A size argument as the text the C++ options read: an int (bytes, 0 or more) or a size
    string ("8GiB", "50%"); None stays None. A bool, a float, a negative int or anything else
    is one InvalidArgument naming `name`."""
    if value is None:
        return None
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        if value < 0:
            raise InvalidArgument(f"{where}: {name}={int(value)} is negative; a size is a number of bytes, 0 or more")
        return str(int(value))
    if isinstance(value, str):
        return value
    raise InvalidArgument(f"{where}: {name}= takes an int (bytes) or a size string such as '8GiB' or '50%', got "
                          f"{type(value).__name__} {value!r}")


def size_bytes(value, name: str, where: str) -> int:
    """A size argument the C++ side takes as a number of bytes: an int, or a size string
    without a percentage ("8GiB", read as the C++ options read sizes)."""
    text = size_text(value, name, where)
    if text is None:
        raise InvalidArgument(f"{where}: {name}= takes an int (bytes) or a size string such as '8GiB', got None")
    if not isinstance(value, str):
        return int(text)
    return int(_C._parse_size(text, f"{where}: {name}"))


def dtype_name(d, name: str, where: str = "offload") -> Optional[str]:
    """A dtype argument (a torch.dtype or its name, "bfloat16", "float8_e4m3fn") as sluice's
    name of it; None stays None."""
    if d is None:
        return None
    if isinstance(d, torch.dtype):
        return str(d).replace("torch.", "")
    if isinstance(d, str):
        return d[len("torch."):] if d.startswith("torch.") else d  # str(torch.bfloat16) too
    raise InvalidArgument(f"{where}: {name}= takes a torch.dtype or its name, got {type(d).__name__} {d!r}")
