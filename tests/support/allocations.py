"""A watch on the sizes of the tensors that ops produce: a test that memory stays below
a size (no ``[N, V, D]`` per-sample gradients of a large embedding) checks what was
allocated, not what a strategy's name promises."""

from __future__ import annotations

from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode


class Allocations(TorchDispatchMode):
    """The shapes of the op outputs with at least ``limit`` entries, while active."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit, self.large = limit, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, Tensor) and t.numel() >= self.limit:
                self.large.append((str(func), tuple(t.shape)))
        return out
