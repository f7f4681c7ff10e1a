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

from jacmem.derivatives import passthrough


class Sum(nn.Module):
    """``Sum()(x_1, ..., x_k) = x_1 + ... + x_k``, inputs of one shape (BackPACK's
    ``SumModule``)."""

    def forward(self, *xs: Tensor) -> Tensor:
        if not xs or any(x.shape != xs[0].shape for x in xs):
            raise ValueError(f"jacmem.nn.Sum needs inputs of one shape, got {[tuple(x.shape) for x in xs]}")
        out = xs[0]
        for x in xs[1:]:
            out = out + x
        return out if len(xs) > 1 else out.clone()


class Scale(nn.Module):
    """``Scale(w)(x) = w * x`` for a constant ``w`` (BackPACK's ``ScaleModule``)."""

    def __init__(self, weight: float = 1.0):
        super().__init__()
        self.weight = weight

    def forward(self, x: Tensor) -> Tensor:
        return x * self.weight

    def extra_repr(self) -> str:
        return f"weight={self.weight}"


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


def _sum_jac_t(xs, out, S: Tensor):
    """Every input gets the output's factor: [V, N, *] -> one [V, N, *] per input."""
    return tuple(S for _ in xs)


def _scale_df(x: Tensor, out: Tensor, *, weight: float) -> Tensor:
    return x.new_full((), weight).expand_as(x)


passthrough(Sum, jac_t=_sum_jac_t, sample_independent=True)
passthrough(Scale, df=_scale_df, hyperparams=lambda m: {"weight": m.weight})
