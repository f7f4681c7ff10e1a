"""Measured peak memory of one call, above what was in use when it started.

* CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``: the
  caching allocator's view, exact to the byte.
* CPU (Linux): the process's peak resident set (``VmHWM`` in ``/proc/self/status``,
  reset by writing ``5`` to ``/proc/self/clear_refs``) minus the resident set before
  the call. glibc is told once to serve every allocation of a page or more with its
  own ``mmap`` (``mallopt``), so that freed tensors leave the resident set at once and
  the figure is what the call needed, not what the allocator happened to keep (this
  makes large allocations slower for the rest of the process); ``malloc_trim`` before
  the call returns the free heap pages, so that reusing them counts too.
  Pages of earlier allocations that the call touches first also count, so measure
  a warmed-up call.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import sys
from collections.abc import Callable

import torch

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_LIBC = None


def _libc():
    """glibc, told once to mmap every allocation of a page or more."""
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(ctypes.util.find_library("c"))
        _LIBC.mallopt(_M_MMAP_THRESHOLD, 4096)
        _LIBC.mallopt(_M_TRIM_THRESHOLD, 4096)
    return _LIBC


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _cpu_peak(fn: Callable[[], object]) -> int:
    if not sys.platform.startswith("linux"):
        raise RuntimeError("jacmem.memory.peak_memory measures CPU memory on Linux only; pass device='cuda' for a GPU")
    libc = _libc()
    gc.collect()
    libc.malloc_trim(0)  # free heap pages leave the resident set: reusing them counts again
    base = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    fn()
    return max(_status_kib("VmHWM") - base, 0) * 1024


def _cuda_peak(fn: Callable[[], object], device: torch.device) -> int:
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def peak_memory(fn: Callable[[], object], device: torch.device | None = None) -> int:
    """Bytes of peak memory that ``fn()`` used on ``device`` (default CPU) beyond what
    was in use before it; ``fn``'s return value is dropped."""
    device = torch.device("cpu" if device is None else device)
    if device.type == "cuda":
        return _cuda_peak(fn, device)
    if device.type != "cpu":
        raise ValueError(f"peak_memory measures 'cpu' or 'cuda', not {device.type!r}")
    return _cpu_peak(fn)
