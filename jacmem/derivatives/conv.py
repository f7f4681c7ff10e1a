"""nn.Conv1d, nn.Conv2d and nn.Conv3d: every padding, padding_mode, stride, dilation
and group count.

Shapes: ``x [N, C_in, *S_in]``, ``g [N, C_out, *S_out]``, ``weight [C_out, C_in/G, *K]``,
``bias [C_out]``; ``G`` groups. The derivatives pad the input as the layer does (with
its ``padding_mode``); where that is symmetric zero padding, those that call a
convolution kernel let it pad instead (:func:`kernel_padding`), which copies nothing.

Three strategies give the per-sample weight gradients:

* ``unfold``: im2col as a strided view ``[N, C_in, *K, *S_out]``, then one contraction
  with ``g``. The contraction copies the view (the im2col buffer), so the extensions
  chunk it over the batch.
* ``save_memory`` (Rochette et al., 2019): the per-sample gradient is a correlation of
  each sample's input with its own output gradient. One grouped convolution computes
  it for the whole batch, with the input's channels as the batch and the samples as
  groups: no im2col buffer. BackPACK uses a convolution of one dimension higher and
  so has no 3d version; this form has the same dimension and works for 1d, 2d and 3d.

* ``grouped``: the per-sample gradients are the weight gradient of one convolution of
  the whole batch folded into channels, ``[1, N·C_in, *S_in]``, in ``N·G`` groups: one
  call of the backend's own weight-gradient kernel (torch.func's batching rule does the
  same). It is fastest where channels are many and outputs large; im2col's per-sample
  products are small matrices there.

``ghost`` gives the squared norms alone, ``⟨A Aᵀ, G Gᵀ⟩`` per sample and group, where
``A`` is the unfolded input; it pays off when ``S_out`` is small against the kernel.
``ghost_gram`` is the same norm with ``A Aᵀ`` summed from shifted views of the padded
input's Gram matrix over positions: no im2col, and ``prod(K)`` times fewer FLOPs where
kernels overlap.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from math import prod

import torch
from einops import rearrange
from opt_einsum import contract
from torch import Tensor, nn
from torch.nn import functional as F

from jacmem.derivatives.jacobians import vjp_generic
from jacmem.derivatives.projection import factors, kronecker, outer_sum
from jacmem.derivatives.registry import Cost, Kronecker, layer, passthrough, register

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONV_WEIGHT = {1: torch.nn.grad.conv1d_weight, 2: torch.nn.grad.conv2d_weight, 3: torch.nn.grad.conv3d_weight}


def conv_hyperparams(module: nn.modules.conv._ConvNd) -> dict:
    """The keyword arguments of every conv derivative, read off the module."""
    if isinstance(module.padding, str):
        if module.padding == "valid":
            padding = tuple((0, 0) for _ in module.kernel_size)
        else:  # "same": as torch does it, the odd pixel goes right
            totals = [d * (k - 1) for d, k in zip(module.dilation, module.kernel_size)]
            padding = tuple((t // 2, t - t // 2) for t in totals)
    else:
        padding = tuple((p, p) for p in module.padding)
    return dict(
        kernel_size=tuple(module.kernel_size),
        stride=tuple(module.stride),
        dilation=tuple(module.dilation),
        groups=module.groups,
        padding=padding,
        padding_mode=module.padding_mode,
    )


def pad(x: Tensor, padding: Sequence[tuple[int, int]], padding_mode: str) -> Tensor:
    """[N, C, *S] -> [N, C, *S_padded], as the layer pads before it convolves."""
    flat = [side for pair in reversed(padding) for side in pair]
    if not any(flat):
        return x
    return F.pad(x, flat, mode="constant" if padding_mode == "zeros" else padding_mode)


def kernel_padding(padding, padding_mode) -> list[int] | None:
    """The padding a convolution kernel applies itself (symmetric zeros) as one int per
    axis, or None where the input must be padded first."""
    if padding_mode == "zeros" and all(left == right for left, right in padding):
        return [left for left, _ in padding]
    return None


def for_kernel(x: Tensor, padding, padding_mode) -> tuple[Tensor, list[int]]:
    """``x`` and the padding to hand a convolution kernel: the kernel's own where it can
    pad (:func:`kernel_padding`), else ``x`` padded here and 0."""
    own = kernel_padding(padding, padding_mode)
    if own is None:
        return pad(x, padding, padding_mode), [0] * len(padding)
    return x, own


def unfold(x: Tensor, kernel_size, stride, dilation) -> Tensor:
    """im2col as a view, no copy: padded [N, C, *S] -> [N, C, *K, *S_out]."""
    n, c, *space = x.shape
    s_n, s_c, *s_space = x.stride()
    out = [(s - d * (k - 1) - 1) // st + 1 for s, k, st, d in zip(space, kernel_size, stride, dilation)]
    return x.as_strided(
        (n, c, *kernel_size, *out),
        (s_n, s_c, *[s * d for s, d in zip(s_space, dilation)], *[s * st for s, st in zip(s_space, stride)]),
        x.storage_offset(),
    )


def columns(x: Tensor, *, kernel_size, stride, dilation, groups, padding, padding_mode) -> Tensor:
    """The im2col columns of the padded input, per group, as a view where the padding
    allows: [N, C_in, *S_in] -> [N, G, C_in/G, *K, *S_out]. The one im2col of jacmem:
    the per-sample gradients, the ghost norm, the Kronecker input factor and the GGN
    diagonal all read it."""
    return unfold(pad(x, padding, padding_mode), kernel_size, stride, dilation).unflatten(1, (groups, -1))


def flat_columns(x: Tensor, **hp) -> Tensor:
    """:func:`columns` as matrices, one per sample and group (a copy): [N, C_in, *S_in]
    -> [N, G, C_in/G·K, T] (``K = prod(kernel_size)``, ``T = prod(S_out)``)."""
    return columns(x, **hp).flatten(2, 1 + len(hp["kernel_size"]) + 1).flatten(3)


def _unfolded(x, g, kernel_size, stride, dilation, groups, padding, padding_mode):
    """Padded, unfolded input [N, G, C_in/G, *K, *S_out] and g as [N, G, C_out/G, *S_out]."""
    hp = dict(kernel_size=kernel_size, stride=stride, dilation=dilation, groups=groups)
    return columns(x, padding=padding, padding_mode=padding_mode, **hp), g.unflatten(1, (groups, -1))


def _sizes(xs, gs, kernel_size, groups):
    """(N, C_in/G, C_out, prod(K), prod(S_out)) from the shapes of x and g."""
    return xs[0], xs[1] // groups, gs[1], prod(kernel_size), prod(gs[2:])


def unfold_cost(xs, gs, *, kernel_size, groups, **_):
    n, c, o, k, p = _sizes(xs, gs, kernel_size, groups)
    return Cost(flops=2 * n * o * c * k * p, workspace=n * c * groups * k * p)


def weight_batch_grad_unfold(x, g, *, kernel_size, stride, dilation, groups, padding, padding_mode, out=None):
    """Per-sample weight gradients by im2col: [N, C_in, *S_in], [N, C_out, *S_out]
    -> [N, C_out, C_in/G, *K], written into ``out`` where given"""
    cols, g = _unfolded(x, g, kernel_size, stride, dilation, groups, padding, padding_mode)
    n, c = cols.shape[0], cols.shape[2]
    # one batched matrix product over (N G): [O/G, P] @ [P, C/G·K]; the reshape of the
    # strided view is the im2col copy; bmm, since einsum's own plan is slower here
    a = cols.reshape(n * groups, c * prod(kernel_size), -1)  # [(N G), C/G·K, P]
    b = g.reshape(n * groups, g.shape[2], -1)  # [(N G), O/G, P]
    if out is None:
        return torch.bmm(b, a.transpose(1, 2)).view(n, -1, c, *kernel_size)
    torch.bmm(b, a.transpose(1, 2), out=out.view(n * groups, b.shape[1], a.shape[1]))
    return out


#: a convolution of N·G groups, one input channel each, against the FLOP rate of
#: im2col's batched matrix product on CPU (measured on the seed CNN's layers)
GROUPED_CONV_SLOWDOWN = 2.0


def save_memory_cost(xs, gs, *, kernel_size, groups, padding, **_):
    n, c, o, k, p = _sizes(xs, gs, kernel_size, groups)
    padded = prod(s + sum(lr) for s, lr in zip(xs[2:], padding))
    # workspace: the rearranged input, and the result in [C_in/G, N·C_out, *K] before
    # it is laid out as [N, C_out, C_in/G, *K]
    return Cost(flops=GROUPED_CONV_SLOWDOWN * 2 * n * o * c * k * p, workspace=n * c * groups * padded + n * o * c * k)


def weight_batch_grad_save_memory(x, g, *, kernel_size, stride, dilation, groups, padding, padding_mode):
    """Per-sample weight gradients by one grouped convolution (Rochette et al., 2019):
    [N, C_in, *S_in], [N, C_out, *S_out] -> [N, C_out, C_in/G, *K]

    With ``c`` the channel within a group, sample ``n`` and group ``q``:
    ``grad[n, (q o), c, k] = Σ_t x[n, (q c), k·dilation + t·stride] g[n, (q o), t]``,
    a convolution of ``x`` (batch ``c``, channels ``(n q)``) with ``g`` as the kernel,
    in ``N·G`` groups, where stride and dilation trade places.
    """
    n = x.shape[0]
    d = len(kernel_size)
    x = rearrange(pad(x, padding, padding_mode), "n (q c) ... -> c (n q) ...", q=groups)
    kernel = rearrange(g, "n (q o) ... -> (n q o) 1 ...", q=groups)
    out = _CONV[d](x, kernel, stride=dilation, dilation=stride, groups=n * groups)
    out = out[(..., *[slice(0, k) for k in kernel_size])]
    return rearrange(out, "c (n o) ... -> n o c ...", n=n)


#: the grouped strategy's FLOP rate against im2col's, where each group has at least
#: GROUPED_MIN_CHANNELS input and output channels and GROUPED_MIN_OUTPUT output
#: positions, or one of each (depthwise: the backend's depthwise kernel); otherwise the
#: kernel vectorises poorly (few channels, small outputs, several output channels per
#: input channel) and it is charged GROUPED_SLOW. Measured on CPU against im2col.
GROUPED_FAST, GROUPED_SLOW = 0.35, 3.0
GROUPED_MIN_CHANNELS, GROUPED_MIN_OUTPUT = 16, 256


def _grouped_cost(xs, gs, *, kernel_size, groups, **_):
    n, c, o, k, p = _sizes(xs, gs, kernel_size, groups)
    depthwise = c == 1 and o == groups
    fast = depthwise or (min(c, o // groups) >= GROUPED_MIN_CHANNELS and p >= GROUPED_MIN_OUTPUT)
    # workspace: the backend lays input, output gradient and result out in its own blocked
    # format and back (twice their sizes above the result; its depthwise kernel, once)
    copies = (1 if depthwise else 2) * n * (c * groups * prod(xs[2:]) + o * p + o * c * k)
    return Cost(flops=(GROUPED_FAST if fast else GROUPED_SLOW) * 2 * n * o * c * k * p, workspace=copies)


def weight_batch_grad_grouped(x, g, *, kernel_size, stride, dilation, groups, padding, padding_mode):
    """Per-sample weight gradients as the weight gradient of one grouped convolution:
    [N, C_in, *S_in], [N, C_out, *S_out] -> [N, C_out, C_in/G, *K]

    Sample ``n`` and group ``q`` become group ``(n q)`` of a batch of one, so the
    weight gradient ``[(N C_out), C_in/G, *K]`` holds each sample's apart.
    """
    n, c, o = x.shape[0], x.shape[1], g.shape[1]
    x, own = for_kernel(x, padding, padding_mode)
    shape = (n * o, c // groups, *kernel_size)
    weight = x.new_empty(()).expand(shape)  # only its shape is read
    grad = torch.ops.aten.convolution_backward(
        g.reshape(1, n * o, *g.shape[2:]),
        x.reshape(1, n * c, *x.shape[2:]),
        weight,
        None,
        stride,
        own,
        dilation,
        False,
        [0] * len(kernel_size),
        n * groups,
        [False, True, False],
    )[1]
    return grad.view(n, o, *shape[1:])


def grad_cost(xs, gs, *, kernel_size, groups, **_):
    n, c, o, k, p = _sizes(xs, gs, kernel_size, groups)
    return Cost(flops=2 * n * o * c * k * p, workspace=0)


def weight_grad(x, g, *, kernel_size, stride, dilation, groups, padding, padding_mode):
    """The summed weight gradient, as autograd computes it: -> [C_out, C_in/G, *K]"""
    x, own = for_kernel(x, padding, padding_mode)
    shape = (g.shape[1], x.shape[1] // groups, *kernel_size)
    return _CONV_WEIGHT[len(kernel_size)](x, shape, g, stride=stride, padding=own, dilation=dilation, groups=groups)


def ghost_cost(xs, gs, *, kernel_size, groups, **_):
    n, c, o, k, p = _sizes(xs, gs, kernel_size, groups)
    return Cost(flops=2 * n * groups * p * p * (c * k + o // groups), workspace=n * groups * (c * k * p + 2 * p * p))


def _pair(aa: Tensor, g: Tensor) -> Tensor:
    """Σ_q ⟨A_q A_qᵀ, G_q G_qᵀ⟩ per sample: aa [N, G, P, P], g [N, G, C_out/G, *S_out] -> [N]"""
    g = g.flatten(3)  # [N, G, C_out/G, P]
    gg = torch.einsum("nqop,nqor->nqpr", g, g)
    return torch.einsum("nqpr,nqpr->n", aa, gg)


def weight_batch_l2_ghost(x, g, *, kernel_size, stride, dilation, groups, padding, padding_mode):
    """Squared norms of the per-sample weight gradients, Σ_q ⟨A_q A_qᵀ, G_q G_qᵀ⟩, without
    forming them: [N, C_in, *S_in], [N, C_out, *S_out] -> [N]"""
    hp = dict(kernel_size=kernel_size, stride=stride, dilation=dilation, groups=groups)
    cols = flat_columns(x, padding=padding, padding_mode=padding_mode, **hp)  # [N, G, C_in/G·K, P]
    return _pair(torch.einsum("nqcp,nqcr->nqpr", cols, cols), g.unflatten(1, (groups, -1)))


def ghost_gram_cost(xs, gs, *, kernel_size, groups, padding, **_):
    n, c, o, k, p = _sizes(xs, gs, kernel_size, groups)
    padded = prod(s + sum(lr) for s, lr in zip(xs[2:], padding))
    # workspace: the padded input, its Gram matrix, K shifted reads of it, A Aᵀ and G Gᵀ
    return Cost(
        flops=2 * n * groups * (c * padded * padded + o // groups * p * p),
        workspace=n * groups * (c * padded + padded * padded + (k + 2) * p * p),
    )


def weight_batch_l2_ghost_gram(x, g, *, kernel_size, stride, dilation, groups, padding, padding_mode):
    """The ghost norm of :func:`weight_batch_l2_ghost`, with ``A Aᵀ`` from the Gram matrix
    of the padded input's positions instead of the unfolded input: [N, C_in, *S_in],
    [N, C_out, *S_out] -> [N]

    A row of ``A`` is the input at positions ``t·stride + k·dilation`` over kernel
    offsets ``k``, so ``A Aᵀ[t, u] = Σ_k M[t·stride + k·dilation, u·stride + k·dilation]``
    with ``M = X Xᵀ`` over the channels of the padded input ``X [P_padded, C_in/G]``: a
    sum of ``prod(K)`` strided views of ``M``. It costs ``P_padded²`` per channel where
    unfolding costs ``prod(K)·P²``, and copies no im2col buffer: cheaper for overlapping
    kernels (stride below kernel size), dearer for patch-like ones.
    """
    x = pad(x, padding, padding_mode)
    n, c, *space = x.shape
    d = len(space)
    x = x.reshape(n * groups, c // groups, -1)  # [(N G), C_in/G, P_padded]
    gram = torch.bmm(x.transpose(1, 2), x).view(n * groups, *space, *space)
    step, first, second = gram.stride(0), gram.stride()[1 : 1 + d], gram.stride()[1 + d :]
    shape = (n * groups, *g.shape[2:], *g.shape[2:])
    strides = (step, *[s * st for s, st in zip(first, stride)], *[s * st for s, st in zip(second, stride)])
    aa = gram.new_zeros(shape)
    for k in itertools.product(*map(range, kernel_size)):
        shift = sum(i * dil * (a + b) for i, dil, a, b in zip(k, dilation, first, second))
        aa += gram.as_strided(shape, strides, gram.storage_offset() + shift)
    return _pair(aa.view(n, groups, *aa.shape[1:]).flatten(2, 1 + d).flatten(3), g.unflatten(1, (groups, -1)))


def bias_batch_grad(x, g: Tensor, **_) -> Tensor:
    """Per-sample bias gradients: [N, C_out, *S_out] -> [N, C_out]"""
    return g.flatten(2).sum(2)


def grad_proj_cost(xs, gs, *, dim, kind, kernel_size, groups, **_):
    """im2col, then both factors projected per position (``None`` for the dense kind: from
    per-sample gradients)"""
    if kind != "kronecker":
        return None
    n, c, o, k, p = _sizes(xs, gs, kernel_size, groups)
    k_rows, k_cols = factors(dim)
    flops = 2 * n * p * (groups * c * k * k_cols + o * k_rows + groups * dim)
    return Cost(flops=flops, workspace=n * p * groups * (c * k + k_rows + k_cols))


def weight_grad_proj(x, g, *, dim, kind, seed, name, **hp) -> Tensor:
    """The kronecker projection of ``weight [C_out, C_in/G, *K]`` as ``[C_out, C_in/G·K]``
    (its columns the unfolded patch): ``Σ_t (P_rows g_t)(P_cols a_t)ᵀ``, each group's output
    channels with their own patches: [N, C_in, *S_in], [N, C_out, *S_out] -> [N, dim]"""
    groups = hp["groups"]
    cols = flat_columns(x, **hp)  # [N, G, C_in/G·K, T]
    p_rows, p_cols = kronecker(seed, name, dim, g.shape[1], cols.shape[2], dtype=g.dtype, device=g.device)
    u = torch.einsum("li,ngit->ngtl", p_cols, cols)  # [N, G, T, k_cols]
    v = torch.einsum("kgo,ngot->ngtk", p_rows.unflatten(1, (groups, -1)), g.flatten(2).unflatten(1, (groups, -1)))
    return outer_sum(v.flatten(1, 2), u.flatten(1, 2))


# -- Curvature: Kronecker factors and the GGN diagonal ----------------------------------


def group_gram(cols: Tensor, approx: str | None = None) -> Tensor:
    """KFAC's input factor from im2col columns ``[N, G, M, T]`` per group, ``[M, M]``
    for one group, ``[G, M, M]`` for several: ``Σ_{n,t} a aᵀ / N`` (BackPACK's, the
    default), ``/ (N·T)`` with ``approx="expand"``, or ``Σ_n ā āᵀ / N`` of the means
    over positions ``ā = 1/T Σ_t a_t`` with ``approx="reduce"``."""
    n, t = cols.shape[0], cols.shape[-1]
    if approx == "reduce":
        cols, t = cols.mean(-1, keepdim=True), 1
    scale = n * t if approx == "expand" else n
    if cols.shape[1] == 1:
        return contract("nit,njt->ij", cols[:, 0], cols[:, 0]) / scale
    return contract("ngit,ngjt->gij", cols, cols) / scale


def kronecker_input(x: Tensor, out_shape, dtype, approx=None, **hp) -> Tensor:
    """``A`` of :func:`group_gram` over the im2col columns ``a_t [C_in·K]``: ``[C_in·K,
    C_in·K]``, or ``[G, C_in/G·K, C_in/G·K]`` with ``G > 1`` groups"""
    return group_gram(flat_columns(x, **hp), approx)


def kronecker_input_with_bias(x: Tensor, out_shape, dtype, approx=None, **hp) -> Tensor:
    """``A`` of :func:`group_gram` over the columns ``[a_t; 1]``, a one appended to each
    patch (the bias as a column of ones, one per output position): ``[C_in·K + 1,
    C_in·K + 1]``, or ``[G, C_in/G·K + 1, C_in/G·K + 1]`` with ``G > 1`` groups"""
    cols = flat_columns(x, **hp)  # [N, G, C_in/G·K, T]
    ones = cols.new_ones(*cols.shape[:2], 1, cols.shape[3])
    return group_gram(torch.cat([cols, ones], dim=2), approx)


def squared_vjps(x: Tensor, S: Tensor, params, batch: bool, budget: float, **hp) -> dict[str, Tensor]:
    """``Σ_v (J_θᵀ S[v])²`` with one im2col of the input shared by all ``V`` (BackPACK's
    contraction, in chunks of ``V`` under ``budget`` bytes): ``(J_Wᵀ S[v])[n] = Σ_t
    S[v, n, :, t] a[n, :, t]ᵀ`` per group: ``[V, N, C_out, *S_out]`` -> ``[(N,) *p.shape]``"""
    g = hp["groups"]
    v, n = S.shape[:2]
    out: dict[str, Tensor] = {}
    if "bias" in params:
        b = S.flatten(3).sum(3).square().sum(0)  # [N, C_out]
        out["bias"] = b if batch else b.sum(0)
    if "weight" not in params:
        return out
    cols = flat_columns(x, **hp)  # [N, G, C/G·K, T]
    S = S.flatten(3).unflatten(2, (g, -1))  # [V, N, G, O/G, T]
    per_v = n * S.shape[3] * cols.shape[2] * g * S.element_size()
    step = max(1, int(budget // max(per_v, 1)))
    acc = None
    for start in range(0, v, step):
        js = contract("ngit,vngot->vngoi", cols, S[start : start + step]).square_()
        part = js.sum(0) if batch else js.sum((0, 1))  # [(N,) G, O/G, C/G·K]
        acc = part if acc is None else acc.add_(part)
    shape = params["weight"]
    out["weight"] = acc.reshape(n, *shape) if batch else acc.reshape(shape)
    return out


for _module in (nn.Conv1d, nn.Conv2d, nn.Conv3d):
    layer(
        _module,
        hyperparams=conv_hyperparams,
        input_free=("bias",),
        compute_once=True,
        own_layout=True,
        kronecker=Kronecker(kronecker_input, with_bias=kronecker_input_with_bias),
        squared_vjps=squared_vjps,
    )
    register(_module, "weight", "batch_grad", "unfold", cost=unfold_cost, writes_out=True)(weight_batch_grad_unfold)
    register(_module, "weight", "batch_grad", "save_memory", cost=save_memory_cost)(weight_batch_grad_save_memory)
    register(_module, "weight", "batch_grad", "grouped", cost=_grouped_cost)(weight_batch_grad_grouped)
    register(_module, "weight", "batch_l2", "ghost", cost=ghost_cost)(weight_batch_l2_ghost)
    register(_module, "weight", "batch_l2", "ghost_gram", cost=ghost_gram_cost)(weight_batch_l2_ghost_gram)
    register(_module, "weight", "grad", "direct", cost=grad_cost)(weight_grad)
    register(_module, "bias", "batch_grad", "sum")(bias_batch_grad)
    register(_module, "weight", "grad_proj", "kronecker", cost=grad_proj_cost)(weight_grad_proj)


# -- Input Jacobian, for second-order extensions ---------------------------------------

_CONV_INPUT = {1: torch.nn.grad.conv1d_input, 2: torch.nn.grad.conv2d_input, 3: torch.nn.grad.conv3d_input}


def jac_t(xs, out, S: Tensor, *, weight, kernel_size, stride, dilation, groups, padding, padding_mode):
    """Jᵀ S per vector, one transposed convolution for all ``V·N``: [V, N, C_out, *S_out]
    -> ([V, N, C_in, *S_in],). Symmetric zero padding is the transposed convolution's
    own (a contiguous result of x's size); other padding is convolved over, then its
    adjoint applied."""
    x = xs[0]
    v, n = S.shape[:2]
    conv_input = _CONV_INPUT[len(kernel_size)]
    hyper = dict(stride=stride, dilation=dilation, groups=groups)
    own = kernel_padding(padding, padding_mode)
    if own is not None:
        g = conv_input((v * n, *x.shape[1:]), weight, S.flatten(0, 1), padding=own, **hyper)
        return (g.unflatten(0, (v, n)),)
    padded = pad(x[:1], padding, padding_mode).shape[1:]
    g = conv_input((v * n, *padded), weight, S.flatten(0, 1), padding=0, **hyper).unflatten(0, (v, n))
    if padding_mode == "zeros":
        crop = tuple(slice(left, left + size) for (left, _), size in zip(padding, x.shape[2:]))
        return (g[(..., *crop)],)
    return vjp_generic(lambda t: pad(t, padding, padding_mode), (x,), g)


def _jac_hyperparams(module) -> dict:
    return {**conv_hyperparams(module), "weight": module.weight.detach()}


passthrough(nn.Conv1d, nn.Conv2d, nn.Conv3d, jac_t=jac_t, sample_independent=True, hyperparams=_jac_hyperparams)
