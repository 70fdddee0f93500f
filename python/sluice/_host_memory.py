"""Host memory the process freed, given back to the system."""
from __future__ import annotations

import ctypes

_malloc_trim = None


def return_freed_host_memory() -> None:
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
