"""Hessian factors of MSELoss, CrossEntropyLoss and BCEWithLogitsLoss.

For input ``x [N, C, *D]`` (``C`` classes or features, ``D`` any trailing axes) each
returns ``S [V, N, C, *D]`` with ``Σ_v S[v, n] S[v, n]ᵀ`` the Hessian of the loss, as
reduced, w.r.t. sample ``n``'s input (the loss is a sum over samples, so the Hessian
is block-diagonal over ``n``):

* exact: ``V = C·prod(D)``. BackPACK's factorisations: ``√2·I`` for MSE,
  ``diag(√p) - p √pᵀ`` per position for cross-entropy (``p`` the softmax), and
  ``√(σ(1-σ))`` per entry for BCE; the trailing positions are independent, so the
  factor is block-diagonal over them.
* sampled: ``V = M`` Monte-Carlo samples, ``∇ₓ loss(x, ỹ)/√M`` at targets ``ỹ``
  drawn from the model's predictive distribution (Gaussian with variance 1/2, the
  softmax categorical, the Bernoulli), whose outer products equal the Hessian in
  expectation.
* empirical: ``V = 1``, ``∇ₓ loss(x, y)`` at the true targets: the root of the
  empirical Fisher (the uncentred gradient covariance; curvlinops' ``"empirical"``).

``reduction="mean"`` divides the loss by the number of terms torch averages over,
so the factors carry its square root.
"""

from __future__ import annotations

from math import sqrt

import torch
from einops import rearrange
from torch import Tensor, nn

from jacmem.derivatives.jacobians import diagonal_factor
from jacmem.derivatives.registry import LossHessian, loss


def _reduction(module: nn.Module) -> dict:
    return {"reduction": module.reduction}


def _scale(S: Tensor, reduction: str, terms: float | Tensor) -> Tensor:
    """``S`` over ``√terms`` for the mean (``terms``: a tensor where it is counted on the
    device, with no host sync)."""
    if reduction != "mean":
        return S
    return S / (terms.sqrt() if isinstance(terms, Tensor) else sqrt(terms))


# -- MSELoss ------------------------------------------------------------------------


def _mse_check(module: nn.MSELoss) -> None:
    if module.reduction not in ("mean", "sum"):
        raise NotImplementedError(f"MSELoss(reduction={module.reduction!r}): use 'mean' or 'sum'")


def mse_sqrt_hessian(x: Tensor, y: Tensor, *, reduction: str) -> Tensor:
    """√2·I per sample: [N, *F] -> [prod(F), N, *F]"""
    return _scale(diagonal_factor(torch.full_like(x, sqrt(2))), reduction, x.numel())


def mse_sampled(x: Tensor, y: Tensor, mc_samples: int, *, reduction: str) -> Tensor:
    """2(ỹ - x) with ỹ ~ N(x, 1/2), i.e. √2·z: -> [M, N, *F]"""
    z = torch.randn((mc_samples, *x.shape), dtype=x.dtype, device=x.device)
    return _scale(sqrt(2) * z / sqrt(mc_samples), reduction, x.numel())


def mse_empirical(x: Tensor, y: Tensor, *, reduction: str) -> Tensor:
    """2 (x - y): [N, *F] -> [1, N, *F]"""
    return _scale(2 * (x - y), reduction, x.numel()).unsqueeze(0)


loss(nn.MSELoss, LossHessian(_mse_check, mse_sqrt_hessian, mse_sampled, _reduction, mse_empirical))


# -- CrossEntropyLoss ---------------------------------------------------------------


def _ce_check(module: nn.CrossEntropyLoss) -> None:
    if module.weight is not None:
        raise NotImplementedError(
            "CrossEntropyLoss(weight=...) is not supported by second-order extensions; use weight=None"
        )
    if module.reduction not in ("mean", "sum"):
        raise NotImplementedError(f"CrossEntropyLoss(reduction={module.reduction!r}): use 'mean' or 'sum'")


def _ce_hyperparams(module: nn.CrossEntropyLoss) -> dict:
    return {
        "reduction": module.reduction,
        "ignore_index": module.ignore_index,
        "label_smoothing": module.label_smoothing,
    }


def _ce_weights(x: Tensor, y: Tensor, ignore_index: int, label_smoothing: float):
    """(per-position weight [N, *D] of each term's Hessian, number of terms averaged).
    Class targets: 0 where ignored; probability targets: the sum over classes of the
    smoothed targets (:func:`_ce_targets`)."""
    if y.is_floating_point():
        return y.sum(1) * (1 - label_smoothing) + label_smoothing, x.numel() // x.shape[1]
    keep = (y != ignore_index).to(x.dtype)
    return keep, keep.sum().clamp(min=1)


def _ce_targets(x: Tensor, y: Tensor, ignore_index: int, label_smoothing: float) -> Tensor:
    """The targets the softmax is compared with, as torch smooths them, ``(1-ε) y + ε/C``
    (``y`` one-hot for class targets, 0 where ignored): [N, C, *D]"""
    c = x.shape[1]
    if y.is_floating_point():
        return y * (1 - label_smoothing) + label_smoothing / c
    keep = y != ignore_index
    onehot = torch.nn.functional.one_hot(torch.where(keep, y, 0), c).movedim(-1, 1).to(x.dtype)
    return (onehot * (1 - label_smoothing) + label_smoothing / c) * keep.unsqueeze(1).to(x.dtype)


def ce_sqrt_hessian(x: Tensor, y: Tensor, *, reduction: str, ignore_index: int, label_smoothing: float) -> Tensor:
    """``S[(c', d'), n, c, d] = δ_dd' (δ_cc' √p_c - p_c √p_c')``: [N, C, *D] -> [C·prod(D), N, C, *D]"""
    n, c, space = x.shape[0], x.shape[1], x.shape[2:]
    w, terms = _ce_weights(x, y, ignore_index, label_smoothing)
    p = torch.softmax(x, dim=1)
    p = rearrange(p, "n c ... -> n (...) c")  # [N, P, C]
    tau = p.sqrt()
    eye = torch.eye(c, dtype=x.dtype, device=x.device)
    S = torch.einsum("vc,npc->vnpc", eye, tau) - torch.einsum("npc,npv->vnpc", p, tau)  # [C, N, P, C]
    S = S * rearrange(w, "n ... -> n (...)").sqrt()[None, :, :, None]
    S = _scale(S, reduction, terms)
    P = S.shape[2]
    if P > 1:  # block-diagonal over positions: V = (c', p')
        S = torch.einsum("vnpc,pq->vqnpc", S, torch.eye(P, dtype=x.dtype, device=x.device)).flatten(0, 1)
    return rearrange(S, "v n p c -> v n c p").reshape(-1, n, c, *space)


def categorical(p: Tensor, m: int) -> Tensor:
    """``m`` draws from each row of ``p [R, C]`` (probabilities), by the inverse of its
    cumulative sum (``torch.multinomial`` takes three times as long at ``C`` = 32000):
    ``[m, R]``."""
    cdf = p.cumsum(1)
    u = torch.rand(p.shape[0], m, dtype=p.dtype, device=p.device) * cdf[:, -1:]
    return torch.searchsorted(cdf, u).clamp_(max=p.shape[1] - 1).T


def ce_sampled(
    x: Tensor, y: Tensor, mc_samples: int, *, reduction: str, ignore_index: int, label_smoothing: float
) -> Tensor:
    """p - onehot(ỹ) with ỹ ~ softmax(x), at each position: [N, C, *D] -> [M, N, C, *D]"""
    n = x.shape[0]
    w, terms = _ce_weights(x, y, ignore_index, label_smoothing)
    p = rearrange(torch.softmax(x, dim=1), "n c ... -> (n ...) c")
    draws = categorical(p, mc_samples)  # [M, (N P)]
    S = p.expand(mc_samples, *p.shape).scatter_add(
        2, draws.unsqueeze(2), -torch.ones_like(p[:, :1]).expand(mc_samples, -1, 1)
    )
    S = S * rearrange(w, "n ... -> (n ...)").sqrt()[None, :, None]
    S = rearrange(S, "m (n q) c -> m n c q", n=n).reshape(mc_samples, *x.shape)
    return _scale(S / sqrt(mc_samples), reduction, terms)


def ce_empirical(x: Tensor, y: Tensor, *, reduction: str, ignore_index: int, label_smoothing: float) -> Tensor:
    """``p Σ_c t_c - t`` at each position, ``t`` the smoothed targets (:func:`_ce_targets`;
    ``p - onehot(y)`` for class targets without smoothing, 0 where ignored):
    [N, C, *D] -> [1, N, C, *D]"""
    _, terms = _ce_weights(x, y, ignore_index, label_smoothing)
    t = _ce_targets(x, y, ignore_index, label_smoothing)
    S = torch.softmax(x, dim=1) * t.sum(1, keepdim=True) - t
    return _scale(S, reduction, terms).unsqueeze(0)


loss(nn.CrossEntropyLoss, LossHessian(_ce_check, ce_sqrt_hessian, ce_sampled, _ce_hyperparams, ce_empirical))


# -- BCEWithLogitsLoss --------------------------------------------------------------


def _bce_check(module: nn.BCEWithLogitsLoss) -> None:
    if module.weight is not None or module.pos_weight is not None:
        raise NotImplementedError(
            "BCEWithLogitsLoss(weight=..., pos_weight=...) is not supported by second-order "
            "extensions; use the defaults (None)"
        )
    if module.reduction not in ("mean", "sum"):
        raise NotImplementedError(f"BCEWithLogitsLoss(reduction={module.reduction!r}): use 'mean' or 'sum'")


def bce_sqrt_hessian(x: Tensor, y: Tensor, *, reduction: str) -> Tensor:
    """√(σ(1-σ)) per entry: [N, *F] -> [prod(F), N, *F]"""
    s = torch.sigmoid(x)
    return _scale(diagonal_factor((s * (1 - s)).sqrt()), reduction, x.numel())


def bce_sampled(x: Tensor, y: Tensor, mc_samples: int, *, reduction: str) -> Tensor:
    """σ - ỹ with ỹ ~ Bernoulli(σ): [N, *F] -> [M, N, *F]"""
    s = torch.sigmoid(x)
    draws = torch.bernoulli(s.unsqueeze(0).expand(mc_samples, *s.shape))
    return _scale((s - draws) / sqrt(mc_samples), reduction, x.numel())


def bce_empirical(x: Tensor, y: Tensor, *, reduction: str) -> Tensor:
    """σ - y: [N, *F] -> [1, N, *F]"""
    return _scale(torch.sigmoid(x) - y, reduction, x.numel()).unsqueeze(0)


loss(nn.BCEWithLogitsLoss, LossHessian(_bce_check, bce_sqrt_hessian, bce_sampled, _reduction, bce_empirical))
