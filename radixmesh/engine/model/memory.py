"""Process-wide allocator settings for the worker."""

from __future__ import annotations

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc's ceiling for the mmap threshold on 64-bit.
_MMAP_THRESHOLD_MAX = 32 << 20


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


def release_free_memory() -> None:
    """Give the heap's free memory back to the OS (after loading, when the float32
    copies of the weights are gone)."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def keep_freed_memory() -> bool:
    """Keep freed blocks in the heap instead of returning them to the OS.

    Each decode step allocates and frees the same tens of MB of gathered K/V; with
    glibc's defaults those go back to the OS at every free and fault in again at the next
    step (measured: ~150k page faults and 2-3x slower steps after a large batch).
    Returns False where the C library is not glibc."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    mallopt = libc.mallopt
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)) and bool(
        mallopt(_M_TRIM_THRESHOLD, 1 << 30)
    )
