"""Autograd functions that keep only what the gradients asked for need.

Each ``forward`` computes exactly what the stock layer computes (the same ATen
kernels; dropout draws its own mask), and saves, through ``ctx.save_for_backward`` (so
that :func:`jacmem.memory.report` sees it), only what the backward pass will read:

================  ==========================================  ========================
function          stock PyTorch keeps                         kept here
================  ==========================================  ========================
convolution       input and weight, whenever anything         the weight (if the input
(and transposed), requires a gradient                         needs a gradient)
frozen weight
batch norm (eval) input, weight, running stats                running stats, weight
frozen weight
ReLU              its float output                            a mask, 1 bit per element
dropout           its mask (CPU: in x's dtype; CUDA: bool)    a seed (a Python int)
max pooling       input and int64 indices                     the argmax's offset in its
                                                              window (uint8 up to 256)
================  ==========================================  ========================

The conv and batch-norm Functions are for a frozen weight only: with a trainable one,
the stock op keeps nothing more than the weight's gradient needs, and
:mod:`jacmem.memory.lean` calls it. None of them supports double backward
(``once_differentiable``).
"""

from __future__ import annotations

import sys
from math import prod

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.nn import functional as F

from jacmem.memory import kernels

if sys.byteorder != "little":  # pack_bits reads 8 bools as one little-endian int64
    raise ImportError("jacmem.memory's bit-packed masks assume a little-endian machine")


# -- convolution ---------------------------------------------------------------------


class ConvFunction(torch.autograd.Function):
    """``torch.convolution`` (plain or transposed) with a frozen weight: x [N, C_in, *S_in],
    weight [C_out, C_in/G, *K] (transposed: [C_in, C_out/G, *K]), bias [C_out] ->
    [N, C_out, *S_out]. Keeps the weight (for x's gradient) and no x: x's gradient is
    stock's ``convolution_backward`` of the output's (bit for bit stock's), the bias's
    its sum.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
        if ctx.needs_input_grad[1]:
            raise RuntimeError("ConvFunction is for a frozen weight; call the stock convolution for a trainable one")
        ctx.conf = (stride, padding, dilation, transposed, output_padding, groups)
        ctx.x_layout = (x.shape, x.stride())
        ctx.save_for_backward(weight if ctx.needs_input_grad[0] else None)
        return torch.convolution(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        (weight,) = ctx.saved_tensors
        gx = None
        if ctx.needs_input_grad[0]:
            # stock's kernel, which reads x for its shape and layout only: on CPU an
            # uninitialised buffer of x's strides (its pages are never touched, so never
            # resident), elsewhere a zero-stride view
            shape, strides = ctx.x_layout
            if grad.device.type == "cpu":
                like = torch.empty_strided(shape, strides, dtype=grad.dtype)
            else:
                like = grad.new_empty(()).expand(shape)
            gx = torch.ops.aten.convolution_backward(grad, like, weight, None, *ctx.conf, [True, False, False])[0]
        gb = grad.sum([0, *range(2, grad.dim())]) if ctx.needs_input_grad[2] else None
        return gx, None, gb, None, None, None, None, None, None


# -- batch norm in eval mode ---------------------------------------------------------


def channel_view(t: Tensor, ndim: int) -> Tensor:
    """[C] -> [1, C, 1, ...] to broadcast against an [N, C, *S] tensor of ``ndim`` axes."""
    return t.view(1, -1, *([1] * (ndim - 2)))


def all_but_channels(ndim: int) -> list:
    return [0, *range(2, ndim)]


class BatchNormEvalFunction(torch.autograd.Function):
    """Batch norm with the running statistics and a frozen (or no) weight, x [N, C, *S] ->
    [N, C, *S]: ``y = (x - mean) / sqrt(var + eps) · weight + bias``. Keeps no x: the
    input's gradient is ``g · weight / sqrt(var + eps)``, the bias's the sum of g.
    """

    @staticmethod
    def forward(ctx, x, running_mean, running_var, weight, bias, eps):
        if ctx.needs_input_grad[3]:
            raise RuntimeError("BatchNormEvalFunction is for a frozen weight; call F.batch_norm for a trainable one")
        ctx.eps = eps
        ctx.save_for_backward(running_var, weight)
        return F.batch_norm(x, running_mean, running_var, weight, bias, False, 0.0, eps)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        var, weight = ctx.saved_tensors
        nd = grad.dim()
        gx = gb = None
        if ctx.needs_input_grad[0]:
            invstd = torch.rsqrt(var + ctx.eps)
            gx = grad * channel_view(invstd if weight is None else weight * invstd, nd)
        if ctx.needs_input_grad[4]:
            gb = grad.sum(all_but_channels(nd))
        return gx, None, None, None, gb, None


# -- ReLU: a 1-bit mask ------------------------------------------------------------

#: the k-th byte of an int64 lands on bit 56 + k of the product; see pack_bits
_GATHER = 0x0102040810204080
#: (device, dtype) -> [256, 8]: the bits of each byte value
_TABLES: dict = {}


def pack_bits(mask: Tensor, scratch: bool = False) -> Tensor:
    """A bool tensor of n elements -> uint8 [ceil(n / 8)], element ``8j + k`` in bit ``k``
    of byte ``j``. ``scratch=True``: the caller gives ``mask`` up, and it is packed in
    place (no fresh n-byte buffer).

    Eight bools, read as one little-endian int64 ``v = Σ_k b_k 2^(8k)``, times
    ``Σ_i 2^(56 - 7i)`` put ``b_k`` on bit ``56 + k``; every other product term falls on
    a distinct bit below 56 (no carries) or beyond 63 (wrapped away). The packed byte is
    then the product's top byte (byte 7, little-endian): one multiplication in place and
    one strided copy.
    """
    flat = mask.reshape(-1)
    if flat.numel() % 8:
        flat, scratch = torch.cat([flat, flat.new_zeros(8 - flat.numel() % 8)]), True
    words = flat.view(torch.int64) if scratch else flat.view(torch.int64).clone()
    return words.mul_(_GATHER).view(torch.uint8)[7::8].contiguous()


def unpack_bits(packed: Tensor, numel: int, dtype: torch.dtype = torch.bool) -> Tensor:
    """Inverse of :func:`pack_bits`: uint8 [ceil(n / 8)] -> [n] of 0 and 1 in ``dtype``,
    by a lookup in a [256, 8] table (one gather; faster than shifting bits)."""
    table = _TABLES.get((packed.device, dtype))
    if table is None:
        bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
        table = _TABLES[(packed.device, dtype)] = bits.to(device=packed.device, dtype=dtype)
    bits = torch.index_select(table, 0, packed.int()).view(-1)
    return bits if bits.numel() == numel else bits[:numel]


class ReLUFunction(torch.autograd.Function):
    """max(x, 0), any shape; keeps ``x > 0`` packed 8 elements to a byte.

    On CPU (float32/float64), :mod:`jacmem.memory.kernels` computes the output with its
    bits in one pass and applies the bits in another; elsewhere stock ops do, with the
    same output, bits and gradients."""

    @staticmethod
    def forward(ctx, x, inplace):
        ctx.shape = x.shape
        packed = None
        if ctx.needs_input_grad[0] and kernels.available(x):
            out = torch.empty_like(x)
            packed = kernels.relu_pack(x, out)
            if inplace:
                # the loop reading and writing one buffer is much slower than writing
                # into another (the stores wait on the loads of the same lines); copy back
                out = x.copy_(out)
        else:
            out = x.relu_() if inplace else torch.relu(x)
            if ctx.needs_input_grad[0]:
                # out != 0 is stock's "out > 0" (its backward passes the gradient where out is NaN, too)
                packed = pack_bits(out.bool(), scratch=True)
        if inplace:
            ctx.mark_dirty(x)
        ctx.save_for_backward(packed)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        (packed,) = ctx.saved_tensors
        if kernels.available(grad):
            return kernels.select(grad, packed), None
        mask = unpack_bits(packed, grad.numel(), grad.dtype).view(ctx.shape)
        # stock's kernel (0 where the mask is 0, even for an infinite gradient), into the mask's buffer
        return torch.ops.aten.threshold_backward.grad_input(grad, mask, 0, grad_input=mask), None


# -- dropout: a seed -----------------------------------------------------------------


def _draw_mask(buffer: Tensor, p: float, seed: int) -> Tensor:
    """``buffer`` (float, any strides) filled in place with the keep-mask, 1 with
    probability ``1 - p`` and 0 otherwise: uniform numbers u from a generator of its
    device seeded with ``seed``, kept where ``u < 1 - p``. The numbers are drawn in
    memory order, so the same seed, shape and strides give the same mask."""
    gen = torch.Generator(device=buffer.device)
    gen.manual_seed(seed)
    return buffer.uniform_(generator=gen).lt_(1 - p)


def _times_mask(t: Tensor, mask: Tensor, p: float, inplace: bool = False) -> Tensor:
    """``t · mask / (1 - p)``, computed as ``(t · mask) · (1 / (1 - p))`` alike in forward
    and backward; into the mask's buffer where the dtypes match (no other n-element
    buffer), into t if ``inplace``."""
    scale = 1 / (1 - p)
    if inplace:
        return t.mul_(mask).mul_(scale)
    if mask.dtype != t.dtype:
        return t * mask.to(t.dtype) * scale
    return mask.mul_(t).mul_(scale)


def _mask_dtype(t: Tensor) -> torch.dtype:
    """t's dtype if float32 or float64, else float32 (never half precision, whose grid
    of uniform numbers would distort p)."""
    return t.dtype if t.dtype in (torch.float32, torch.float64) else torch.float32


class DropoutFunction(torch.autograd.Function):
    """Inverted dropout ``x · mask / (1 - p)``, any shape, ``0 < p < 1`` (for p = 0 and
    p = 1 the stock op keeps nothing); keeps the seed of the mask's generator and draws
    the mask again in backward, in a buffer of the same shape and strides.

    The mask's buffer has x's layout (as the stock op's output), and becomes the
    output. The seed comes from the default CPU generator, so ``torch.manual_seed``
    makes runs reproducible; no host-device synchronisation.
    """

    @staticmethod
    def forward(ctx, x, p, inplace):
        ctx.p = p
        ctx.seed = int(torch.empty((), dtype=torch.int64).random_())
        mask = _draw_mask(torch.empty_like(x, dtype=_mask_dtype(x)), p, ctx.seed)
        ctx.layout = (mask.shape, mask.stride())
        out = _times_mask(x, mask, p, inplace)
        if inplace:
            ctx.mark_dirty(x)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        mask = torch.empty_strided(*ctx.layout, dtype=_mask_dtype(grad), device=grad.device)
        return _times_mask(grad, _draw_mask(mask, ctx.p, ctx.seed), ctx.p), None, None


# -- max pooling: the argmax's offset within its window ---------------------------------

_MAX_POOL = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
_MAX_POOL_BACKWARD = {
    1: torch.ops.aten.max_pool2d_with_indices_backward,  # 1d pooling runs as 2d with a unit axis
    2: torch.ops.aten.max_pool2d_with_indices_backward,
    3: torch.ops.aten.max_pool3d_with_indices_backward,
}


def _offset_dtype(window: int) -> torch.dtype:
    """The smallest integer type that holds offsets ``0 .. window - 1``."""
    if window <= 256:
        return torch.uint8
    return torch.int16 if window <= 2**15 else torch.int32


def _window_starts(out_shape, stride, padding, device) -> list[Tensor]:
    """Per pooled axis i of d: ``o_i · stride_i - padding_i`` for each output position o_i,
    shaped to broadcast against ``[*B, *S_out]``."""
    d = len(stride)
    return [
        (torch.arange(n, device=device) * s - p).view(n, *([1] * (d - 1 - i)))
        for i, (n, s, p) in enumerate(zip(out_shape, stride, padding))
    ]


def window_offsets(idx: Tensor, in_shape, kernel_size, stride, padding, dilation) -> Tensor:
    """Stock max pooling's flat indices ``idx`` [*B, *S_out] (into the d pooled axes of
    the input, ``in_shape`` = S_in) -> the argmax's position in its window,
    ``Σ_i k_i · Π_{j>i} K_j`` for the window index ``k_i`` (``0 <= k_i < K_i``) on axis i,
    in the smallest integer type (uint8 up to 256 window elements).

    On axis i, the argmax sits at ``p_i = start_i + k_i · dilation_i`` with
    ``start_i = o_i · stride_i - padding_i``; ``p_i`` is read off the flat index."""
    d = len(kernel_size)
    starts = _window_starts(idx.shape[-d:], stride, padding, idx.device)
    off = None
    rest = idx
    for i in reversed(range(d)):  # the last axis first: p_i = rest % S_i, rest //= S_i
        if i:
            q = torch.div(rest, in_shape[i], rounding_mode="floor")
            p = rest - q * in_shape[i]
            rest = q
        else:
            p = rest
        k = p.sub_(starts[i]) if p is not idx else p - starts[i]
        if dilation[i] != 1:
            k = k.div_(dilation[i], rounding_mode="floor")
        scale = prod(kernel_size[i + 1 :])
        off = k.mul_(scale) if off is None else off.add_(k, alpha=scale)
    return off.to(_offset_dtype(prod(kernel_size)))


def window_indices(off: Tensor, in_shape, kernel_size, stride, padding, dilation) -> Tensor:
    """Inverse of :func:`window_offsets`: offsets [*B, *S_out] -> int64 flat indices,
    ``Σ_i start_i · Π_{j>i} S_j`` (a [*S_out] table) plus, looked up by offset,
    ``Σ_i k_i · dilation_i · Π_{j>i} S_j`` (a table of one entry per window element)."""
    d = len(kernel_size)
    inner = [prod(in_shape[i + 1 :]) for i in range(d)]
    base = sum(s * n for s, n in zip(_window_starts(off.shape[-d:], stride, padding, off.device), inner))
    ks = torch.cartesian_prod(*[torch.arange(k, device=off.device) for k in kernel_size]).view(-1, d)
    table = ks @ torch.tensor([dl * n for dl, n in zip(dilation, inner)], device=off.device)
    return table[off.long()].add_(base)


class MaxPoolFunction(torch.autograd.Function):
    """Max pooling over the last d axes: x [*B, *S_in] -> (out, indices) [*B, *S_out].

    Keeps, for each output, where its argmax sits in its window (:func:`window_offsets`:
    one byte for windows of up to 256 elements, instead of the 8 of stock's int64
    index) and x's shape and strides. Backward turns the offsets back into stock's
    indices and calls stock's backward kernel with them, so the gradient is stock's bit
    for bit (ties and NaN: the argmax is stock's own)."""

    @staticmethod
    def forward(ctx, x, d, kernel_size, stride, padding, dilation, ceil_mode):
        out, idx = _MAX_POOL[d](x, kernel_size, stride, padding, dilation, ceil_mode, return_indices=True)
        ctx.mark_non_differentiable(idx)
        conf = tuple(_ntuple(v, d) for v in (kernel_size, stride if stride else kernel_size, padding, dilation))
        ctx.d, ctx.conf, ctx.ceil_mode = d, conf, ceil_mode
        ctx.layout = (x.shape, x.stride(), x.is_contiguous())
        off = window_offsets(idx, x.shape[-d:], *conf) if ctx.needs_input_grad[0] else None
        ctx.save_for_backward(off)
        return out, idx

    @staticmethod
    @once_differentiable
    def backward(ctx, grad, _grad_idx):
        (off,) = ctx.saved_tensors
        d, conf = ctx.d, ctx.conf
        shape, strides, contiguous = ctx.layout
        idx = window_indices(off, shape[-d:], *conf)
        # the kernel reads x only for its shape and memory format
        if contiguous:
            like = grad.new_empty(()).expand(shape)
        else:  # channels_last and the like: the gradient takes x's memory format, as stock's
            like = torch.empty_strided(shape, strides, dtype=grad.dtype, device=grad.device)
        if d == 1:
            kernel_size, stride, padding, dilation = ((unit, *v) for unit, v in zip((1, 1, 0, 1), conf))
            gx = _MAX_POOL_BACKWARD[1](
                grad.unsqueeze(-2),
                like.unsqueeze(-2),
                kernel_size,
                stride,
                padding,
                dilation,
                ctx.ceil_mode,
                idx.unsqueeze(-2),
            ).squeeze(-2)
        else:
            gx = _MAX_POOL_BACKWARD[d](grad, like, *conf, ctx.ceil_mode, idx)
        return gx, None, None, None, None, None, None


def _ntuple(v, d: int) -> tuple:
    return tuple(v) if isinstance(v, (tuple, list)) else (v,) * d
