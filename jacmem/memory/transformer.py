"""Autograd functions for transformer layers that keep less than the stock ones.

================  ============================================  =========================
function          stock PyTorch keeps                           kept here
================  ============================================  =========================
LayerNorm /       LayerNorm: input, mean, rstd; RMSNorm (CPU,   the output and the per-row
RMSNorm           composite): input and the normalised input    rstd, where the next layer
                                                                keeps that output anyway
                                                                (``keep="output"``); else
                                                                the input and rstd
Linear after      the activation's input (GELU/SiLU) and its    the activation's input
GELU / SiLU       output (the Linear, for its weight's          only: the Linear's weight
                  gradient)                                     gradient recomputes the
                                                                activation from it
attention         the backend's choice; with dropout on CPU,    q, k, v, the row
(SDPA)            the math path: q, k, v, the softmax, the      log-sum-exp and the
                  dropout mask and the dropped softmax          dropout seed
================  ============================================  =========================

Norms with ``keep="output"`` rebuild the normalised input from the output,
``x̂ = (y - b) / w``: the callers use it only where no weight entry is 0, and its
rounding error is that of one subtraction and one division (relative ``ε (1 + |b/(w
x̂)|)``). None of these supports double backward (``once_differentiable``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.nn import functional as F

# -- LayerNorm and RMSNorm ------------------------------------------------------------


def _norm_forward(x: Tensor, d: int, weight, bias, eps: float, rms: bool):
    """(y, x̂, rstd) of LayerNorm (``rms=False``) or RMSNorm over the last d axes;
    rstd [*B, 1 × d]."""
    dims = tuple(range(-d, 0))
    if rms:  # ATen's composite rms_norm, op for op
        rstd = torch.rsqrt(x.pow(2).mean(dims, keepdim=True).add_(eps))
        xhat = x.mul(rstd)
        y = xhat * weight if weight is not None else xhat
        return y, xhat, rstd
    shape = x.shape[-d:]
    y, _, rstd = torch.native_layer_norm(x, shape, weight, bias, eps)
    return y, None, rstd.view(*x.shape[:-d], *([1] * d))


class NormFunction(torch.autograd.Function):
    """LayerNorm or RMSNorm over the last d axes: x [*B, *D] -> y [*B, *D],
    ``y = x̂ · w + b`` with ``x̂ = (x - mean) · rstd`` (RMSNorm: ``x̂ = x · rstd``, no
    mean, no bias).

    Gradients, with sums over the batch axes for the parameters and means over the
    normalised ones for x: ``∂b = Σ g``, ``∂w = Σ g · x̂``, ``h = g · w``, and
    ``∂x = rstd · (h - mean(h) - x̂ · mean(h · x̂))`` (RMSNorm: without ``mean(h)``).

    ``keep="output"``: keeps y and rstd (x̂ is rebuilt as ``(y - b) / w``; every weight
    entry must be nonzero); ``keep="input"``: keeps x and rstd.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, d, eps, rms, keep):
        y, xhat, rstd = _norm_forward(x, d, weight, bias, eps, rms)
        ctx.d, ctx.rms, ctx.keep = d, rms, keep
        ctx.save_for_backward(y if keep == "output" else x, rstd, weight, bias)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        kept, rstd, weight, bias = ctx.saved_tensors
        d = ctx.d
        dims = tuple(range(-d, 0))
        if ctx.keep == "output":
            xhat = kept if bias is None else kept - bias
            xhat = xhat if weight is None else xhat / weight
        elif ctx.rms:
            xhat = kept * rstd
        else:
            xhat = (kept - kept.mean(dims, keepdim=True)) * rstd
        batch = tuple(range(g.dim() - d))
        gw = (g * xhat).sum(batch) if ctx.needs_input_grad[1] else None
        gb = g.sum(batch) if bias is not None and ctx.needs_input_grad[2] else None
        gx = None
        if ctx.needs_input_grad[0]:
            h = g * weight if weight is not None else g
            proj = (h * xhat).mean(dims, keepdim=True)
            gx = h - xhat * proj if ctx.rms else h - h.mean(dims, keepdim=True) - xhat * proj
            gx = gx.mul_(rstd)
        return gx, gw, gb, None, None, None, None


# -- a Linear whose input is an activation's output ------------------------------------


class LinearOfActFunction(torch.autograd.Function):
    """``linear(a, W, b)`` for ``a = act(pre)`` (a is the activation's output, pre its input),
    x [*B, in] -> [*B, out]: keeps ``pre`` (which the activation keeps anyway) and the
    weight, not a; the weight's gradient ``gᵀ act(pre)`` recomputes a. ``a`` is the
    differentiable input; ``pre`` is read, not differentiated."""

    @staticmethod
    def forward(ctx, a, pre, act, weight, bias):
        ctx.act = act
        ctx.save_for_backward(pre if ctx.needs_input_grad[3] else None, weight if ctx.needs_input_grad[0] else None)
        return F.linear(a, weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        pre, weight = ctx.saved_tensors
        g2 = g.reshape(-1, g.shape[-1])
        ga = g.matmul(weight) if ctx.needs_input_grad[0] else None
        gw = g2.t().mm(ctx.act(pre).reshape(-1, pre.shape[-1])) if ctx.needs_input_grad[3] else None
        gb = g2.sum(0) if ctx.needs_input_grad[4] else None
        return ga, None, None, gw, gb


# -- attention -------------------------------------------------------------------------


def _keep_mask(shape, p: float, seed: int, like: Tensor) -> Tensor:
    gen = torch.Generator(device=like.device)
    gen.manual_seed(seed)
    return torch.empty(shape, dtype=like.dtype, device=like.device).uniform_(generator=gen).lt_(1 - p)


def _scores(q, k, mask, scale, causal):
    s = torch.matmul(q, k.transpose(-2, -1)).mul_(scale)
    if causal:
        t_q, t_k = s.shape[-2:]
        # top-left aligned, as SDPA: query i attends keys 0..i
        s.masked_fill_(torch.ones(t_q, t_k, dtype=torch.bool, device=s.device).triu_(1), -math.inf)
    if mask is not None:
        s = s.masked_fill_(~mask, -math.inf) if mask.dtype == torch.bool else s.add_(mask)
    return s


class AttentionFunction(torch.autograd.Function):
    """``softmax(q kᵀ · scale + mask) @ v`` with dropout on the attention weights, q [*B, H, T_q, E],
    k [*B, H, T_k, E], v [*B, H, T_k, E_v] -> [*B, H, T_q, E_v]; ``mask`` broadcasts to
    [*B, H, T_q, T_k] (bool: True attends; float: added).

    Keeps q, k, v, the row log-sum-exp ``m`` [*B, H, T_q, 1] and the dropout seed; backward
    rebuilds ``P = exp(S - m)`` and the dropout mask D (``P̃ = P · D / (1 - p)``):
    ``∂v = P̃ᵀ g``, ``∂P̃ = g vᵀ``, ``∂P = ∂P̃ · D / (1 - p)``,
    ``∂S = P · (∂P - rowsum(P · ∂P))``, ``∂q = ∂S k · scale``, ``∂k = ∂Sᵀ q · scale``.
    A row with every key masked gives 0, as stock SDPA's math path does."""

    @staticmethod
    def forward(ctx, q, k, v, mask, p, scale, causal):
        s = _scores(q, k, mask, scale, causal)
        m = torch.logsumexp(s, -1, keepdim=True)
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # fully masked rows: P = 0
        probs = s.sub_(m).exp_()
        ctx.seed = None
        if p > 0:
            ctx.seed = int(torch.empty((), dtype=torch.int64).random_())
            probs = probs.mul_(_keep_mask(probs.shape, p, ctx.seed, probs)).mul_(1 / (1 - p))
        ctx.conf = (p, scale, causal)
        ctx.save_for_backward(q, k, v, m, mask)
        return torch.matmul(probs, v)

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        q, k, v, m, mask = ctx.saved_tensors
        p, scale, causal = ctx.conf
        probs = _scores(q, k, mask, scale, causal).sub_(m).exp_()
        dprobs = torch.matmul(g, v.transpose(-2, -1))
        dropped = probs
        if ctx.seed is not None:
            keep = _keep_mask(probs.shape, p, ctx.seed, probs).mul_(1 / (1 - p))
            dropped = probs * keep
            dprobs.mul_(keep)
        gv = torch.matmul(dropped.transpose(-2, -1), g) if ctx.needs_input_grad[2] else None
        del dropped
        ds = dprobs.sub_((probs * dprobs).sum(-1, keepdim=True)).mul_(probs)
        gq = torch.matmul(ds, k).mul_(scale) if ctx.needs_input_grad[0] else None
        gk = torch.matmul(ds.transpose(-2, -1), q).mul_(scale) if ctx.needs_input_grad[1] else None
        gv = _sum_to(gv, v.shape)
        return _sum_to(gq, q.shape), _sum_to(gk, k.shape), gv, None, None, None, None


def _sum_to(t, shape):
    return t if t is None or t.shape == shape else t.sum_to_size(shape)


def attention(q, k, v, mask=None, dropout_p: float = 0.0, scale: float | None = None, is_causal: bool = False):
    """``F.scaled_dot_product_attention(q, k, v, mask, dropout_p, is_causal, scale)`` that keeps
    q, k, v, the row log-sum-exp and a dropout seed (see :class:`AttentionFunction`).
    Without dropout, or with a mask that needs a gradient, the stock op runs (its
    backend keeps what it needs, no more)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    learned_mask = mask is not None and mask.requires_grad  # a position bias: its gradient is stock's business
    if dropout_p == 0 or not needs_grad or learned_mask or torch.compiler.is_compiling():
        return F.scaled_dot_product_attention(q, k, v, mask, dropout_p, is_causal, scale=scale)
    return AttentionFunction.apply(q, k, v, mask, dropout_p, scale, is_causal)


def hf_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None, **_):
    """transformers' attention interface (``ALL_ATTENTION_FUNCTIONS``): query/key/value
    [B, H, T, E] -> ([B, T, H, E], None), as its ``sdpa`` entry, through :func:`attention`."""
    if key.shape[1] != query.shape[1]:  # grouped-query attention: repeat the key/value heads
        reps = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(reps, 1), value.repeat_interleave(reps, 1)
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))  # as HF's sdpa
    causal = causal and attention_mask is None and query.shape[2] > 1
    if attention_mask is not None and attention_mask.dim() == 4:
        attention_mask = attention_mask[:, :, :, : key.shape[-2]]
    out = attention(query, key, value, attention_mask, dropout, scaling, causal)
    return out.transpose(1, 2).contiguous(), None
