"""jacmem.engine.alloc.empty: a plain empty tensor, with a huge-page hint for large CPU ones."""

import torch

from jacmem.engine import alloc


def test_large_cpu_results_ask_for_huge_pages_inside_their_own_memory(monkeypatch):
    calls = []
    monkeypatch.setattr(alloc, "_MADVISE", lambda start, length, advice: calls.append((start, length, advice)))
    t = alloc.empty((5, 2**20 + 7), torch.float32, torch.device("cpu"))  # ~20 MiB
    assert t.shape == (5, 2**20 + 7) and t.dtype == torch.float32
    ((start, length, advice),) = calls
    first, last = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    assert start % alloc._HUGE_PAGE == 0 and length % alloc._HUGE_PAGE == 0 and length > 0
    assert first <= start and start + length <= last  # never advises memory it does not own
    assert advice == alloc._MADV_HUGEPAGE
    t.fill_(1.0)
    assert t.sum().item() == t.numel()


def test_small_results_and_other_dtypes_are_plain(monkeypatch):
    calls = []
    monkeypatch.setattr(alloc, "_MADVISE", lambda *args: calls.append(args))
    t = alloc.empty((3, 4), torch.float64, torch.device("cpu"))
    assert t.shape == (3, 4) and t.dtype == torch.float64 and not calls
