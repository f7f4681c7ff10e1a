"""One use of a tensor broadcast over the batch: a parameter read directly in a forward
(a class token, a position embedding, a learnable scale), expanded to the batch where
it met batched tensors (:mod:`jacmem.engine.broadcast`).

Shapes: the gradient that arrives at the expansion is ``g [N, *padded[1:]]``, where
``padded`` is the parameter's shape with leading ones (``[D]`` met ``[N, T, D]`` as
``[1, 1, D]``); it holds ``N · prod(shape)`` entries, and sample ``n``'s gradient
w.r.t. the parameter is its row ``n`` reshaped to ``shape``. Nothing of the input is
kept.
"""

from __future__ import annotations

from functools import cache
from math import prod

from torch import Tensor

from jacmem.derivatives.registry import Cost, LayerDerivatives, Strategy


def _free(xs, gs, **hp) -> Cost:
    return Cost(flops=0, workspace=0)


def _squares_cost(xs, gs, **hp) -> Cost:
    return Cost(flops=2 * prod(gs), workspace=0)


def batch_grad(x, g: Tensor, *, shape: tuple[int, ...]) -> Tensor:
    """[N, *padded[1:]] -> [N, *shape]: a view, no copy"""
    return g.reshape(g.shape[0], *shape)


def batch_l2(x, g: Tensor, *, shape: tuple[int, ...]) -> Tensor:
    """[N, *padded[1:]] -> [N]"""
    return g.flatten(1).square().sum(1)


def sum_grad_squared(x, g: Tensor, *, shape: tuple[int, ...]) -> Tensor:
    """[N, *padded[1:]] -> shape"""
    return g.square().sum(0).reshape(shape)


def grad(x, g: Tensor, *, shape: tuple[int, ...]) -> Tensor:
    """[N, *padded[1:]] -> shape"""
    return g.sum(0).reshape(shape)


@cache
def use_entry(param: str, shape: tuple[int, ...]) -> LayerDerivatives:
    """The derivatives of one use of the parameter named ``param`` of ``shape``."""
    return LayerDerivatives(
        hyperparams=lambda module: {"shape": shape},
        keep=lambda args, kwargs: None,
        input_free={param},
        strategies={
            (param, "batch_grad"): {"expand": Strategy(batch_grad, _free)},
            (param, "batch_l2"): {"expand": Strategy(batch_l2, _squares_cost)},
            (param, "sum_grad_squared"): {"expand": Strategy(sum_grad_squared, _squares_cost)},
            (param, "grad"): {"expand": Strategy(grad, _squares_cost)},
        },
    )
