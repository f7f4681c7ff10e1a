"""Modules that make sums and branches visible to second-order extensions.

Curvature flows backward along a chain of modules; the common functional ops (``x + y``,
``x * 2``, ``F.relu(x)``) stand for these modules (:mod:`jacmem.derivatives.functional`).
They match BackPACK's ``custom_module`` ones, for models written with them::

    block = jacmem.nn.Residual(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))   # x + f(x)
    both = jacmem.nn.Parallel(nn.Linear(8, 4), nn.Sequential(...))           # f(x) + g(x)
    half = jacmem.nn.Scale(0.5)                                              # 0.5 * x
"""

from __future__ import annotations

from torch import Tensor, nn

from jacmem.derivatives.functional import Scale, Sum

__all__ = ["Parallel", "Residual", "Scale", "Sum"]


class Parallel(nn.Module):
    """``Parallel(f, g, ...)(x) = merge(f(x), g(x), ...)``, ``merge`` a :class:`Sum` by
    default (BackPACK's ``branching.Parallel``). ``nn.Identity()`` as a branch is the
    skip connection."""

    def __init__(self, *branches: nn.Module, merge: nn.Module | None = None):
        super().__init__()
        self.branches = nn.ModuleList(branches)
        self.merge = Sum() if merge is None else merge

    def forward(self, x: Tensor) -> Tensor:
        return self.merge(*[branch(x) for branch in self.branches])


class Residual(Parallel):
    """``Residual(*layers)(x) = x + layers(x)``, the layers run in sequence."""

    def __init__(self, *layers: nn.Module):
        super().__init__(nn.Identity(), nn.Sequential(*layers))
