"""Fresh tensors for large results, cheaper to fill on CPU.

A per-sample result is written once into freshly allocated memory, and on CPU every
4 KiB page of it faults on first touch, a cost of the order of the arithmetic that
fills it. Where the kernel lets a process ask for transparent huge pages (Linux,
``madvise`` mode), 2 MiB pages fault 512 times less often. PyTorch does the same for all of its CPU allocations when the
environment sets ``THP_MEM_ALLOC_ENABLE=1``; this asks for it for jacmem's large
results alone. Elsewhere it is ``torch.empty``.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Sequence

import torch
from torch import Tensor

#: results below this size are left to the allocator as they are
HUGE_PAGE_MIN_BYTES = 8 * 2**20
_HUGE_PAGE = 2 * 2**20
_MADV_HUGEPAGE = 14


def _madvise():
    """libc's ``madvise``, or None where there is none to call."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int
    return fn


_MADVISE = _madvise()


def empty(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> Tensor:
    """``torch.empty(shape)``; on CPU, a large one backed by huge pages where the kernel
    grants them (a hint: nothing changes where it does not)."""
    out = torch.empty(shape, dtype=dtype, device=device)
    nbytes = out.numel() * out.element_size()
    if _MADVISE is None or out.device.type != "cpu" or nbytes < HUGE_PAGE_MIN_BYTES:
        return out
    start = -(-out.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE  # the aligned 2 MiB pages inside
    end = (out.data_ptr() + nbytes) // _HUGE_PAGE * _HUGE_PAGE
    if end > start:
        _MADVISE(start, end - start, _MADV_HUGEPAGE)
    return out
