"""nn.ConvTranspose1d, nn.ConvTranspose2d and nn.ConvTranspose3d: every stride, padding,
output_padding, dilation and group count.

Shapes: ``x [N, C_in, *S_in]``, ``g [N, C_out, *S_out]``, ``weight [C_in, C_out/G, *K]``,
``bias [C_out]``; ``G`` groups.

A transposed convolution is the adjoint of the convolution with the same weight and
hyper-parameters, ``conv_W: [C_out, *S_out] -> [C_in, *S_in]`` (weight layout
``[C_in, C_out/G, *K]``, i.e. conv's ``[C_out', C_in'/G, *K]``). So
``⟨g, convT_W(x)⟩ = ⟨conv_W(g), x⟩``, and the weight gradient of the transposed conv
with input ``x`` and output gradient ``g`` is the weight gradient of that conv with
input ``g`` and output gradient ``x``, in the transposed conv's own weight layout. Every
strategy of :mod:`jacmem.derivatives.conv` (``unfold``, ``save_memory``, ``ghost``,
``ghost_gram``, the summed ``direct``) therefore serves the transposed conv too, with the roles of ``x`` and
``g`` swapped.

``output_padding`` adds ``op`` positions at the end of ``S_out`` that no input position
reaches through the conv: the conv reads ``g`` padded by ``padding`` on both sides, and
the last ``op`` positions of it only feed conv outputs beyond ``S_in``. So ``g`` is
padded by ``(p, p - op)`` per axis (a negative pad crops). ``op`` is read off the shapes,
``S_out - ((S_in - 1)·stride - 2p + dilation·(K - 1) + 1)``, so that ``forward(x,
output_size=...)``, which picks it per call, needs nothing more.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from math import prod

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from jacmem.derivatives import conv
from jacmem.derivatives.registry import Kronecker, layer, passthrough, register


def conv_transpose_hyperparams(module: nn.modules.conv._ConvTransposeNd) -> dict:
    """The keyword arguments of every transposed-conv derivative, read off the module."""
    return dict(
        kernel_size=tuple(module.kernel_size),
        stride=tuple(module.stride),
        dilation=tuple(module.dilation),
        groups=module.groups,
        padding=tuple(module.padding),
    )


def as_conv(xs: Sequence[int], gs: Sequence[int], *, kernel_size, stride, dilation, groups, padding) -> dict:
    """The hyper-parameters of the conv whose weight gradient (input ``g``, output
    gradient ``x``) is this transposed conv's: shapes ``[N, C_in, *S_in]``,
    ``[N, C_out, *S_out]`` -> conv keyword arguments."""
    output_padding = [
        so - ((si - 1) * s - 2 * p + d * (k - 1) + 1)
        for si, so, k, s, d, p in zip(xs[2:], gs[2:], kernel_size, stride, dilation, padding)
    ]
    return dict(
        kernel_size=kernel_size,
        stride=stride,
        dilation=dilation,
        groups=groups,
        padding=tuple((p, p - op) for p, op in zip(padding, output_padding)),
        padding_mode="zeros",
    )


def transposed(conv_fn: Callable) -> Callable:
    """A conv derivative ``conv_fn(x, g, **conv_hp)`` -> the same derivative of the
    transposed conv, ``fn(x, g, **hp)``: ``[N, C_in, *S_in]``, ``[N, C_out, *S_out]``
    -> conv_fn's result in the layout ``weight [C_in, C_out/G, *K]``."""

    def fn(x, g, **hp):
        return conv_fn(g, x, **as_conv(x.shape, g.shape, **hp))

    fn.__name__ = fn.__qualname__ = conv_fn.__name__
    fn.__doc__ = f"Transposed conv, roles of x and g swapped: {conv_fn.__doc__}"
    return fn


def transposed_cost(conv_cost: Callable) -> Callable:
    """A conv cost ``conv_cost(xs, gs, **conv_hp)`` -> the transposed conv's, on the
    shapes of ``x`` and ``g``."""

    def cost(xs, gs, **hp):
        return conv_cost(gs, xs, **as_conv(xs, gs, **hp))

    return cost


def columns(x: Tensor, out_shape, *, kernel_size, stride, dilation, groups, padding) -> Tensor:
    """The transposed conv's input unfolded: ``[N, C_in, *S_in] -> [N, C_in·K, T]``
    (channel-major, ``(c k)``; ``T = prod(S_out)``), by a transposed convolution with
    one-hot kernels; groups stay contiguous in the channel axis. ``out_shape``: the
    output's, which fixes ``output_padding``."""
    k, g, c = prod(kernel_size), groups, x.shape[1]
    d = len(kernel_size)
    sizes = [
        (si - 1) * s - 2 * p + dl * (kk - 1) + 1
        for si, kk, s, dl, p in zip(x.shape[2:], kernel_size, stride, dilation, padding)
    ]
    output_padding = [so - s for so, s in zip(out_shape[2:], sizes)]
    # kernel [C_in, C_in/g·K, *K]: input channel c' of a group writes its k-th kernel entry to column c'·K + k
    eye = torch.eye(c // g * k, dtype=x.dtype, device=x.device)
    kernel = rearrange(eye, "m (c k) -> c m k", k=k).repeat(g, 1, 1).reshape(c, c // g * k, *kernel_size)
    conv_t = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[d - 1]
    cols = conv_t(x, kernel, stride=stride, padding=padding, output_padding=output_padding, groups=g, dilation=dilation)
    return cols.flatten(2)


def kronecker_input(x: Tensor, out_shape, dtype, approx=None, **hp) -> Tensor:
    """``A`` as for a conv (:func:`conv.group_gram`), over the columns of :func:`columns`:
    ``[C_in·K, C_in·K]``, or ``[G, C_in/G·K, C_in/G·K]`` with ``G > 1`` groups (the block of
    ``weight.transpose(0, 1)``)"""
    return conv.group_gram(columns(x, out_shape, **hp).unflatten(1, (hp["groups"], -1)), approx)


_STRATEGIES = [
    ("weight", "batch_grad", "unfold", conv.weight_batch_grad_unfold, conv.unfold_cost),
    ("weight", "batch_grad", "save_memory", conv.weight_batch_grad_save_memory, conv.save_memory_cost),
    ("weight", "batch_l2", "ghost", conv.weight_batch_l2_ghost, conv.ghost_cost),
    ("weight", "batch_l2", "ghost_gram", conv.weight_batch_l2_ghost_gram, conv.ghost_gram_cost),
    ("weight", "grad", "direct", conv.weight_grad, conv.grad_cost),
]

for _module in (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d):
    layer(
        _module,
        hyperparams=conv_transpose_hyperparams,
        input_free=("bias",),
        own_layout=True,
        # its factors are of weight.transpose(0, 1), [C_out, C_in·K] (kronecker_input)
        kronecker=Kronecker(kronecker_input, transposed=True),
    )
    for _param, _quantity, _name, _fn, _cost in _STRATEGIES:
        register(_module, _param, _quantity, _name, cost=transposed_cost(_cost))(transposed(_fn))
    # the bias gradient sums g over S_out, as for a conv
    register(_module, "bias", "batch_grad", "sum")(conv.bias_batch_grad)

# Input Jacobian, for second-order extensions: the vjp of their own forward
passthrough(nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d, sample_independent=True)
