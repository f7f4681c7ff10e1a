"""First-order extensions: BatchGrad, BatchL2Grad, SumGradSquared, Variance.

Names, shapes and scaling follow BackPACK 1.7.1: per-sample gradients are those of the
loss as reduced, so with ``reduction="mean"`` they carry its ``1/N`` and
``grad_batch.sum(0) == grad``.

Each extension names the *quantities* (see :mod:`jacmem.derivatives`) it needs; the
first-order engine computes the union once per parameter, with the strategies that
:mod:`jacmem.engine.planner` chooses. The quantity math that turns per-sample gradients into
the others (:func:`derive`) is here.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

#: quantities that add up over the calls of a module (weight tying, loops)
LINEAR_QUANTITIES = ("batch_grad", "grad")
PER_SAMPLE = ("batch_grad", "batch_l2")


class FirstOrderExtension:
    """Base class: ``savefield`` is the parameter attribute the result goes to."""

    savefield: str = ""
    quantities: tuple[str, ...] = ()

    def finalize(self, q: dict[str, Tensor], batch_size: int) -> Tensor:
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

    savefield, quantities = "grad_batch", ("batch_grad",)

    def __init__(self, subsampling: Iterable[int] | None = None):
        self.subsampling = checked_subsampling(subsampling, "BatchGrad")
        #: (device, batch size) -> the subsampling's index tensor, made on the first pass
        self._indices: dict[tuple[torch.device, int], Tensor] = {}

    def finalize(self, q, batch_size):
        if self.subsampling is None:
            return q["batch_grad"]
        return subsample(q["batch_grad"], self.subsampling, indices=self._indices)

    def __repr__(self) -> str:
        return "BatchGrad()" if self.subsampling is None else f"BatchGrad(subsampling={self.subsampling})"


class BatchL2Grad(FirstOrderExtension):
    """Squared norms of the per-sample gradients, ``param.batch_l2``: ``[N]``."""

    savefield, quantities = "batch_l2", ("batch_l2",)

    def finalize(self, q, batch_size):
        return q["batch_l2"]


class SumGradSquared(FirstOrderExtension):
    """Sum of the squared per-sample gradients, ``param.sum_grad_squared``: ``param.shape``."""

    savefield, quantities = "sum_grad_squared", ("sum_grad_squared",)

    def finalize(self, q, batch_size):
        return q["sum_grad_squared"]


class Variance(FirstOrderExtension):
    """Gradient variance as BackPACK defines it, ``param.variance``: ``param.shape``.

    ``sum_grad_squared / N - (grad / N)²``, with ``grad`` the summed gradient.
    """

    savefield, quantities = "variance", ("sum_grad_squared", "grad")

    def finalize(self, q, batch_size):
        # in place on the two temporaries: fewer fresh allocations, the same values
        return (q["sum_grad_squared"] / batch_size).sub_((q["grad"] / batch_size).square_())


def squared_norms(batch_grad: Tensor) -> Tensor:
    """‖g_n‖² per sample, one fused reduction without a squared copy: [n, *shape] -> [n]"""
    return torch.linalg.vector_norm(batch_grad.flatten(1), dim=1).square_()


#: bytes of samples squared at once by :func:`sum_of_squares`
_SQUARE_BLOCK_BYTES = 4 * 2**20
#: per-sample size from which sum_of_squares takes one fused call per sample
_SAMPLE_LOOP_BYTES = 64 * 2**10


def sum_of_squares(batch_grad: Tensor, with_sum: bool = False) -> tuple[Tensor, Tensor | None]:
    """Σ_n g_n ⊙ g_n, and Σ_n g_n where ``with_sum`` (else None): [n, *shape] -> shape, shape.

    A sample of :data:`_SAMPLE_LOOP_BYTES` or more: one fused multiply-add per sample
    into the result (``addcmul_``: each gradient read once, no squared copy). Smaller
    ones: as many samples at a time as fill :data:`_SQUARE_BLOCK_BYTES`, squared and
    summed (a call per sample would cost more than its work). A norm over axis 0
    (``vector_norm(dim=0)``) would need no copy, but its strided reduction is slow on
    CPU. The sum is taken sample by sample (or block by block) too, while that is in
    cache, rather than in a second pass over the whole chunk.
    """
    out = batch_grad.new_zeros(batch_grad.shape[1:])
    total = batch_grad.new_zeros(out.shape) if with_sum else None
    per_sample = max(out.numel() * out.element_size(), 1)
    if per_sample >= _SAMPLE_LOOP_BYTES:
        for g in batch_grad:
            out.addcmul_(g, g)
            if total is not None:
                total.add_(g)
        return out, total
    for block in batch_grad.split(max(1, _SQUARE_BLOCK_BYTES // per_sample)):
        out += block.square().sum(0)
        if total is not None:
            total += block.sum(0)
    return out, total


def derive(batch_grad: Tensor, quantities: Iterable[str]) -> dict[str, Tensor]:
    """Every quantity from (a chunk of) per-sample gradients ``[n, *shape]``."""
    wanted = set(quantities)
    out = {}
    if "sum_grad_squared" in wanted:
        out["sum_grad_squared"], total = sum_of_squares(batch_grad, with_sum="grad" in wanted)
        if total is not None:
            out["grad"] = total
    if "batch_grad" in wanted:
        out["batch_grad"] = batch_grad
    if "batch_l2" in wanted:
        out["batch_l2"] = squared_norms(batch_grad)
    if "grad" in wanted and "grad" not in out:
        out["grad"] = batch_grad.sum(0)
    return out
