"""First-order extensions: BatchGrad, BatchL2Grad, SumGradSquared, Variance.

Names, shapes and scaling follow BackPACK 1.7.1: per-sample gradients are those of the
loss as reduced, so with ``reduction="mean"`` they carry its ``1/N`` and
``grad_batch.sum(0) == grad``.

Each extension names the *quantities* (:mod:`jacmem.derivatives.quantities`: registered
objects, or the names of ones without parameters) it needs; the first-order engine
computes the union once per parameter, with the strategies that :mod:`jacmem.engine.planner`
chooses, and hands ``finalize`` a dict keyed by them.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from jacmem.derivatives.quantities import BATCH_GRAD, BATCH_L2, GRAD, SUM_GRAD_SQUARED, Quantity


class FirstOrderExtension:
    """Base class: ``savefield`` is the parameter attribute the result goes to.
    ``overwrites``: quantities whose tensors ``finalize`` may reuse for its result (the
    engine hands it a copy of one that another extension of the block reads too).
    ``as_is``: the quantity that ``finalize`` returns as it is, if it does (the engine then
    takes it without the call); a subclass that defines ``finalize`` and not ``as_is``
    has None."""

    savefield: str = ""
    quantities: tuple[Quantity, ...] = ()
    overwrites: tuple[Quantity, ...] = ()
    as_is: Quantity | None = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "finalize" in cls.__dict__ and "as_is" not in cls.__dict__:
            cls.as_is = None  # its own finalize: the engine calls it

    def finalize(self, q: dict[Quantity, Tensor], batch_size: int) -> Tensor:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def checked_subsampling(subsampling: Iterable[int] | None, ext: str) -> list[int] | None:
    """BackPACK's ``subsampling=``: ``None`` (every sample) or a non-empty list of sample
    indices (repeats allowed), checked against the batch by :func:`subsample`."""
    if subsampling is None:
        return None
    index = list(subsampling)
    if not index or not all(isinstance(i, int) and not isinstance(i, bool) for i in index):
        raise ValueError(f"{ext}: subsampling must be a non-empty list of sample indices (ints), got {subsampling!r}")
    return index


def subsample(t: Tensor, subsampling: list[int], dim: int = 0, indices: dict | None = None) -> Tensor:
    """The samples of ``t`` (batch axis ``dim``) at ``subsampling``; an index outside the
    batch raises ``IndexError`` saying the valid range. ``indices``: the index tensors
    made so far, by (device, batch size), to reuse (a new one is a copy from the host,
    which waits for an accelerator's queue)."""
    n = t.shape[dim]
    bad = [i for i in subsampling if not -n <= i < n]
    if bad:
        raise IndexError(
            f"subsampling index {bad[0]} is out of range for the batch of {n} samples; pass indices in [0, {n})"
        )
    indices = {} if indices is None else indices
    index = indices.get((t.device, n))
    if index is None:
        index = indices[(t.device, n)] = torch.tensor([i % n for i in subsampling], device=t.device)
    return t.index_select(dim, index)


class BatchGrad(FirstOrderExtension):
    """Per-sample gradients, ``param.grad_batch``: ``[N, *param.shape]``; with BackPACK's
    ``subsampling`` (a list of sample indices), those samples' only,
    ``[len(subsampling), *param.shape]``."""

    savefield, quantities, as_is = "grad_batch", (BATCH_GRAD,), BATCH_GRAD

    def __init__(self, subsampling: Iterable[int] | None = None):
        # (no subsampling, most blocks: nothing to check, and no call; one is made at every step)
        self.subsampling = None if subsampling is None else checked_subsampling(subsampling, "BatchGrad")
        if self.subsampling is not None:
            self.as_is = None  # its samples' rows, by finalize
        #: (device, batch size) -> the subsampling's index tensor, made on the first pass
        self._indices: dict[tuple[torch.device, int], Tensor] = {}

    def finalize(self, q, batch_size):
        if self.subsampling is None:
            return q[BATCH_GRAD]
        return subsample(q[BATCH_GRAD], self.subsampling, indices=self._indices)

    def __repr__(self) -> str:
        return "BatchGrad()" if self.subsampling is None else f"BatchGrad(subsampling={self.subsampling})"


class BatchL2Grad(FirstOrderExtension):
    """Squared norms of the per-sample gradients, ``param.batch_l2``: ``[N]``."""

    savefield, quantities, as_is = "batch_l2", (BATCH_L2,), BATCH_L2

    def finalize(self, q, batch_size):
        return q[BATCH_L2]


class SumGradSquared(FirstOrderExtension):
    """Sum of the squared per-sample gradients, ``param.sum_grad_squared``: ``param.shape``."""

    savefield, quantities, as_is = "sum_grad_squared", (SUM_GRAD_SQUARED,), SUM_GRAD_SQUARED

    def finalize(self, q, batch_size):
        return q[SUM_GRAD_SQUARED]


class Variance(FirstOrderExtension):
    """Gradient variance as BackPACK defines it, ``param.variance``: ``param.shape``.

    ``sum_grad_squared / N - (grad / N)²``, with ``grad`` the summed gradient.
    """

    savefield, quantities, overwrites = "variance", (SUM_GRAD_SQUARED, GRAD), (SUM_GRAD_SQUARED,)

    def finalize(self, q, batch_size):
        # (N Σg² - (Σg)²) / N², in the tensor of Σg²: nothing of p.shape is allocated (a
        # tied 50k-token embedding's is 154 MB in float32); an empty batch gives NaN (0/0)
        sgs, grad = q[SUM_GRAD_SQUARED], q[GRAD]
        return sgs.mul_(batch_size).addcmul_(grad, grad, value=-1).div_(batch_size * batch_size)
