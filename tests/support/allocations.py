"""A watch on the sizes of the tensors that ops produce: a test that memory stays below
a size (no ``[N, V, D]`` per-sample gradients of a large embedding) checks what was
allocated, not what a strategy's name promises."""

from __future__ import annotations

from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode


class Allocations(TorchDispatchMode):
    """The shapes of the op outputs with at least ``limit`` entries, while active, but
    those in an input's storage (views such as ``expand``, in-place writes): they allocate nothing."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit, self.large = limit, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in [*args, *(kwargs or {}).values()] if isinstance(a, Tensor)}
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, Tensor) and t.numel() >= self.limit and t.untyped_storage().data_ptr() not in inputs:
                self.large.append((str(func), tuple(t.shape)))
        return out
