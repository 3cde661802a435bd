"""The worker's memory: the C allocator's settings, tensors committed only where written,
and how much memory a device has."""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

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


def lazy_zeros(shape: Sequence[int], dtype: torch.dtype,
               device: torch.device | str = "cpu") -> torch.Tensor:
    """A zero-filled tensor for a large buffer that fills up as it is used: on the CPU its
    memory is committed page by page as it is first written (private anonymous memory,
    which reads as the kernel's zero page until then); on a GPU, torch.zeros.

    On the CPU torch.zeros writes (and so commits) every page at once; torch.empty is not
    zeroed, and not lazy for sure either: glibc serves blocks under its mmap threshold, which
    keep_freed_memory raises to 32 MiB, from heap memory that may have been written."""
    nbytes = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or not nbytes:
        return torch.zeros(shape, dtype=dtype, device=device)
    # fileno -1: anonymous memory.
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).view(*shape)


@dataclass(frozen=True)
class Memory:
    """A device's memory in bytes: all of it, and how much is free now."""

    total: int
    available: int


def device_memory(device: torch.device) -> Memory:
    """A GPU's memory as CUDA reports it, else this host's (within its cgroup's limit)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return Memory(total, free)
    return host_memory()


# The memory controller's limit and usage: cgroup v2's, then v1's.
_CGROUP_FILES = (
    ("memory.max", "memory.current"),
    ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"),
)


def host_memory(meminfo: Path = Path("/proc/meminfo"),
                cgroup: Path = Path("/sys/fs/cgroup")) -> Memory:
    """This host's MemTotal and MemAvailable, lowered to a cgroup's memory limit (a
    container's) where one is set."""
    try:
        fields = dict(line.split(":", 1) for line in meminfo.read_text().splitlines())
        total, available = (int(fields[k].split()[0]) * 1024 for k in ("MemTotal", "MemAvailable"))
    except (OSError, KeyError, ValueError):
        page = os.sysconf("SC_PAGE_SIZE")
        total, available = (os.sysconf(k) * page for k in ("SC_PHYS_PAGES", "SC_AVPHYS_PAGES"))
    for limit_file, usage_file in _CGROUP_FILES:
        try:
            limit = int((cgroup / limit_file).read_text())  # "max": no limit (ValueError)
            usage = int((cgroup / usage_file).read_text())
        except (OSError, ValueError):
            continue
        total, available = min(total, limit), min(available, max(limit - usage, 0))
    return Memory(total, available)
