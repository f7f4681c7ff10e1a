"""Autograd functions that keep only what the gradients asked for need.

Each ``forward`` computes exactly what the stock layer computes (the same ATen
kernels), and saves, through ``ctx.save_for_backward`` (so that
:func:`jacmem.memory.report` sees it), only what the backward pass will read for the
inputs that require a gradient (``ctx.needs_input_grad``):

==============  ==========================================  ==========================
function        stock PyTorch keeps                         kept here
==============  ==========================================  ==========================
convolution     input and weight, whenever either           input only if the weight
(and transposed) requires a gradient                        needs a gradient; weight
                                                            only if the input does
batch norm      input, weight, running stats                input only if the weight
(eval)                                                      needs a gradient
ReLU            its float output                            a mask, 1 bit per element
dropout         its mask (CPU: in x's dtype; CUDA: bool)    a seed (a Python int)
max pooling     input and int64 indices                     the indices, as int32
==============  ==========================================  ==========================

None of them supports double backward (``once_differentiable``).
"""

from __future__ import annotations

import sys
from math import prod
from typing import Sequence

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.nn import functional as F

if sys.byteorder != "little":  # pack_bits reads 8 bools as one little-endian int64
    raise ImportError("jacmem.memory's bit-packed masks assume a little-endian machine")


def _stand_in(like: Tensor, shape: Sequence[int]) -> Tensor:
    """A zero-stride tensor of ``shape`` that owns one element: for kernels that
    read only the shape of an argument (as ``torch.nn.grad.conv2d_input`` does)."""
    return like.new_empty(1).expand(tuple(shape))


# -- convolution ---------------------------------------------------------------------


class ConvFunction(torch.autograd.Function):
    """``torch.convolution`` (plain or transposed): x [N, C_in, *S_in], weight
    [C_out, C_in/G, *K] (transposed: [C_in, C_out/G, *K]), bias [C_out] -> [N, C_out, *S_out].

    Keeps x only for the weight's gradient and the weight only for x's.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
        ctx.conf = (stride, padding, dilation, transposed, output_padding, groups)
        ctx.shapes = (x.shape, weight.shape, None if bias is None else bias.shape)
        x_grad, w_grad = ctx.needs_input_grad[:2]
        ctx.save_for_backward(x if w_grad else None, weight if x_grad else None)
        return torch.convolution(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        x_shape, w_shape, b_shape = ctx.shapes
        stride, padding, dilation, transposed, output_padding, groups = ctx.conf
        mask = [bool(m) for m in ctx.needs_input_grad[:3]]
        if x is None:  # no weight gradient: the input's is the adjoint convolution, which needs no x
            gx = _conv_adjoint(grad, weight, x_shape, *ctx.conf) if mask[0] else None
            gb = grad.sum([0, *range(2, grad.dim())]) if mask[2] else None
            return gx, None, gb, None, None, None, None, None, None
        gx, gw, gb = torch.ops.aten.convolution_backward(
            grad,
            x,
            weight if weight is not None else _stand_in(grad, w_shape),
            b_shape,
            *ctx.conf,
            mask,
        )
        return gx, gw, gb, None, None, None, None, None, None


def _conv_adjoint(grad, weight, x_shape, stride, padding, dilation, transposed, output_padding, groups):
    """The input gradient of a (transposed) convolution: grad [N, C_out, *S_out] -> [N, C_in, *S_in],
    by the transposed (plain) convolution with the same weight."""
    if transposed:
        return torch.convolution(grad, weight, None, stride, padding, dilation, False, [0] * len(stride), groups)
    # the transposed convolution's output size, less the rows that stride skipped
    extra = [
        x - ((g - 1) * s - 2 * p + d * (k - 1) + 1)
        for x, g, s, p, d, k in zip(x_shape[2:], grad.shape[2:], stride, padding, dilation, weight.shape[2:])
    ]
    return torch.convolution(grad, weight, None, stride, padding, dilation, True, extra, groups)


# -- batch norm in eval mode ---------------------------------------------------------


def _channel_view(t: Tensor, ndim: int) -> Tensor:
    """[C] -> [1, C, 1, ...] to broadcast against an [N, C, *S] tensor of ``ndim`` axes."""
    return t.view(1, -1, *([1] * (ndim - 2)))


def _all_but_channels(ndim: int) -> list:
    return [0, *range(2, ndim)]


class BatchNormEvalFunction(torch.autograd.Function):
    """Batch norm with the running statistics, x [N, C, *S] -> [N, C, *S]:
    ``y = (x - mean) / sqrt(var + eps) · weight + bias``. Keeps x only for the weight's
    gradient; the input's gradient, ``g · weight / sqrt(var + eps)``, needs no x.
    """

    @staticmethod
    def forward(ctx, x, running_mean, running_var, weight, bias, eps):
        ctx.eps = eps
        keep_x = weight is not None and ctx.needs_input_grad[3]
        ctx.save_for_backward(x if keep_x else None, running_mean, running_var, weight)
        return F.batch_norm(x, running_mean, running_var, weight, bias, False, 0.0, eps)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, mean, var, weight = ctx.saved_tensors
        mask = [ctx.needs_input_grad[i] for i in (0, 3, 4)]
        if x is not None:  # stock's kernel, on what stock keeps
            gx, gw, gb = torch.ops.aten.native_batch_norm_backward(
                grad, x, weight, mean, var, None, None, False, ctx.eps, mask
            )
            return gx, None, None, gw, gb, None
        nd = grad.dim()
        invstd = torch.rsqrt(var + ctx.eps)
        gx = grad * _channel_view(invstd if weight is None else weight * invstd, nd) if mask[0] else None
        gb = grad.sum(_all_but_channels(nd)) if mask[2] else None
        return gx, None, None, None, gb, None


# -- ReLU: a 1-bit mask ------------------------------------------------------------

#: the k-th byte of an int64 lands on bit 56 + k of the product; see pack_bits
_GATHER = 0x0102040810204080
#: (device, dtype) -> [256, 8]: the bits of each byte value
_TABLES: dict = {}


def pack_bits(mask: Tensor, scratch: bool = False) -> Tensor:
    """A bool tensor of n elements -> uint8 [ceil(n / 8)], element ``8j + k`` in bit ``k``
    of byte ``j``. ``scratch=True``: the caller gives ``mask`` up, and it is packed in
    place (no fresh n-byte buffers).

    Eight bools, read as one little-endian int64 ``v = Σ_k b_k 2^(8k)``, times
    ``Σ_i 2^(56 - 7i)`` put ``b_k`` on bit ``56 + k``; every other product term falls on
    a distinct bit below 56 (no carries) or beyond 63 (wrapped away).
    """
    flat = mask.reshape(-1)
    if flat.numel() % 8:
        flat, scratch = torch.cat([flat, flat.new_zeros(8 - flat.numel() % 8)]), True
    words = flat.view(torch.int64) if scratch else flat.view(torch.int64).clone()
    return words.mul_(_GATHER).bitwise_right_shift_(56).to(torch.uint8)


def unpack_bits(packed: Tensor, numel: int, dtype: torch.dtype = torch.bool) -> Tensor:
    """Inverse of :func:`pack_bits`: uint8 [ceil(n / 8)] -> [n] of 0 and 1 in ``dtype``,
    by a lookup in a [256, 8] table (one gather; faster than shifting bits)."""
    table = _TABLES.get((packed.device, dtype))
    if table is None:
        bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
        table = _TABLES[(packed.device, dtype)] = bits.to(device=packed.device, dtype=dtype)
    return torch.index_select(table, 0, packed.int()).view(-1)[:numel]


class ReLUFunction(torch.autograd.Function):
    """max(x, 0), any shape; keeps ``x > 0`` packed 8 elements to a byte."""

    @staticmethod
    def forward(ctx, x, inplace):
        if inplace:
            out = x.relu_()
            ctx.mark_dirty(x)
        else:
            out = torch.relu(x)
        ctx.shape = x.shape
        # out != 0 is stock's "out > 0" (its backward passes the gradient where out is NaN, too)
        ctx.save_for_backward(pack_bits(out.bool(), scratch=True) if ctx.needs_input_grad[0] else None)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        (packed,) = ctx.saved_tensors
        mask = unpack_bits(packed, grad.numel(), grad.dtype).view(ctx.shape)
        # stock's kernel (0 where the mask is 0, even for an infinite gradient), into the mask's buffer
        return torch.ops.aten.threshold_backward.grad_input(grad, mask, 0, grad_input=mask), None


# -- dropout: a seed -----------------------------------------------------------------


def _dropout_mask(like: Tensor, p: float, seed: int) -> Tensor:
    """The scaled keep-mask, ``1 / (1 - p)`` with probability ``1 - p`` and 0 otherwise,
    in ``like``'s dtype and on its device: uniform numbers from a generator of that
    device seeded with ``seed`` (so the same seed gives the same mask), drawn in float32
    or float64 (never in half precision, whose grid would distort ``p``)."""
    gen = torch.Generator(device=like.device)
    gen.manual_seed(seed)
    dtype = like.dtype if like.dtype in (torch.float32, torch.float64) else torch.float32
    uniform = torch.rand(like.shape, generator=gen, device=like.device, dtype=dtype)
    return uniform.lt_(1 - p).mul_(1 / (1 - p)).to(like.dtype)


class DropoutFunction(torch.autograd.Function):
    """Inverted dropout ``x · mask / (1 - p)``, any shape, 0 <= p <= 1; keeps the seed
    of the mask's generator and draws the mask again in backward.

    The seed comes from the default CPU generator, so ``torch.manual_seed`` makes runs
    reproducible; no host-device synchronisation.
    """

    @staticmethod
    def forward(ctx, x, p, inplace):
        ctx.p = p
        if p == 1:
            out = x.zero_() if inplace else torch.zeros_like(x)
        elif p == 0:
            out = x if inplace else x.clone()
        else:
            ctx.seed = int(torch.empty((), dtype=torch.int64).random_())
            mask = _dropout_mask(x, p, ctx.seed)
            out = x.mul_(mask) if inplace else x * mask
        if inplace:
            ctx.mark_dirty(x)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        p = ctx.p
        if p == 1:
            return torch.zeros_like(grad), None, None
        if p == 0:
            return grad, None, None
        return grad * _dropout_mask(grad, p, ctx.seed), None, None


# -- max pooling: indices only -------------------------------------------------------

_MAX_POOL = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}


class MaxPoolFunction(torch.autograd.Function):
    """Max pooling over the last d axes: x [*B, *S_in] -> (out, indices) [*B, *S_out].
    Keeps only the indices, as int32 where they fit (and x's shape); backward scatters the gradient back
    to the argmax positions (adding where windows overlap)."""

    @staticmethod
    def forward(ctx, x, d, kernel_size, stride, padding, dilation, ceil_mode):
        out, idx = _MAX_POOL[d](x, kernel_size, stride, padding, dilation, ceil_mode, return_indices=True)
        ctx.mark_non_differentiable(idx)
        ctx.d, ctx.shape = d, x.shape
        small = prod(x.shape[-d:]) < 2**31
        ctx.save_for_backward((idx.to(torch.int32) if small else idx) if ctx.needs_input_grad[0] else None)
        return out, idx

    @staticmethod
    @once_differentiable
    def backward(ctx, grad, _grad_idx):
        (idx,) = ctx.saved_tensors
        d, shape = ctx.d, ctx.shape
        flat = grad.new_zeros((*shape[:-d], prod(shape[-d:])))
        flat.scatter_add_(-1, idx.flatten(-d).long(), grad.flatten(-d))
        return flat.view(shape), None, None, None, None, None, None

