"""The vocabulary of quantities: what the first-order extensions ask of one parameter ``p``.

====================  ==========================================  =================
quantity              meaning                                     shape
====================  ==========================================  =================
``batch_grad``        per-sample gradients g_n                    ``[N, *p.shape]``
``batch_l2``          their squared norms ‖g_n‖²                  ``[N]``
``sum_grad_squared``  Σ_n g_n ⊙ g_n                               ``p.shape``
``grad``              Σ_n g_n (what autograd puts in ``.grad``)   ``p.shape``
====================  ==========================================  =================

Only ``batch_grad`` is required of a layer. :func:`derive` gives the other three from
it, chunk by chunk over the batch, unless a strategy computes them directly (the ghost
norm, say). A chunk's per-sample quantities (:data:`PER_SAMPLE`) are concatenated over
the chunks, the others summed.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

QUANTITIES = ("batch_grad", "batch_l2", "sum_grad_squared", "grad")
#: one row per sample, ``[N, ...]``: chunks are concatenated
PER_SAMPLE = ("batch_grad", "batch_l2")
#: quantities that add up over the calls of a module (weight tying, loops)
LINEAR_QUANTITIES = ("batch_grad", "grad")


def squared_norms(batch_grad: Tensor) -> Tensor:
    """‖g_n‖² per sample, one fused reduction without a squared copy: [n, *shape] -> [n]
    (``shape`` may be ``()``: a 0-dim parameter's per-sample gradients are ``[n]``)"""
    return torch.linalg.vector_norm(batch_grad.unsqueeze(-1).flatten(1), dim=1).square_()


#: bytes of samples squared at once by :func:`sum_of_squares`
_SQUARE_BLOCK_BYTES = 4 * 2**20
#: per-sample size from which sum_of_squares takes one fused call per sample
_SAMPLE_LOOP_BYTES = 64 * 2**10


def sum_of_squares(batch_grad: Tensor, with_sum: bool = False) -> tuple[Tensor, Tensor | None]:
    """Σ_n g_n ⊙ g_n, and Σ_n g_n where ``with_sum`` (else None): [n, *shape] -> shape,
    shape (:func:`add_moments` into zeros)."""
    out = batch_grad.new_zeros(batch_grad.shape[1:])
    total = batch_grad.new_zeros(out.shape) if with_sum else None
    add_moments(batch_grad, out, total)
    return out, total


def add_moments(batch_grad: Tensor, squares: Tensor | None, total: Tensor | None) -> None:
    """``squares += Σ_n g_n ⊙ g_n`` and ``total += Σ_n g_n`` in place (either may be
    None): [n, *shape] into shape.

    A sample of :data:`_SAMPLE_LOOP_BYTES` or more: one fused multiply-add per sample
    into the result (``addcmul_``: each gradient read once, no squared copy), 2.5-3.5×
    faster than squaring and summing on the seed CNN's convs. Smaller ones: as many
    samples at a time as fill :data:`_SQUARE_BLOCK_BYTES`, squared and summed (a call per
    sample would cost more than its work). A norm over axis 0 (``vector_norm(dim=0)``)
    would need no copy but runs some 50× slower on CPU. The sum is taken sample by sample
    (or block by block) too, while that is in cache: on the seed CNN's two large convs,
    6-10% less time than a second pass over the whole chunk (2 threads).
    """
    per_sample = max(batch_grad[0].numel() * batch_grad.element_size(), 1) if len(batch_grad) else 1
    if per_sample >= _SAMPLE_LOOP_BYTES:
        for g in batch_grad:
            if squares is not None:
                squares.addcmul_(g, g)
            if total is not None:
                total.add_(g)
        return
    for block in batch_grad.split(max(1, _SQUARE_BLOCK_BYTES // per_sample)):
        if squares is not None:
            squares += block.square().sum(0)
        if total is not None:
            total += block.sum(0)


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
