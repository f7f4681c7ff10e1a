"""The second-order registry: how curvature flows backward through a module.

Second-order extensions backpropagate *factors*: tensors ``S`` of shape
``[V, N, *out]`` (a leading axis of ``V`` vectors per sample, BackPACK's convention)
whose outer products sum to a curvature matrix w.r.t. a module's output. Each module
maps them to its inputs, ``S_in[v] = J_nᵀ S[v]`` per sample ``n``.

Two kinds of entries:

* :class:`Passthrough`, for every module the chain may pass through (with or without
  parameters). ``jac_t(xs, out, S, **hp) -> tuple of S_in``, one per input; by
  default the vector-Jacobian product of the module's own ``forward``, vmapped over
  ``V``, so any deterministic module works. Elementwise functions give ``df`` (and
  ``d2f`` where the second derivative is not zero) instead.
* :class:`LossHessian`, for losses: a symmetric factorisation of the Hessian of the
  loss w.r.t. its input, exact (``[V, N, *x]`` with ``V`` the number of entries of one
  sample's input) or sampled (``[M, N, *x]`` for ``M`` Monte-Carlo samples), scaled
  as the reduction scales the loss.

This module imports torch and einops, and no jacmem code but the registry's lookups
(:func:`jacmem.derivatives.registered_type`, :func:`jacmem.derivatives.recognised`)
and the layer files that register themselves at the bottom.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from math import prod
from typing import Any

import torch
from torch import Tensor, nn

from jacmem.derivatives.registry import forward_of, recognised, registered_type


def _no_hyperparams(module: nn.Module) -> dict[str, Any]:
    return {}


@dataclass
class Passthrough:
    """How factors cross one module type.

    hyperparams: ``module -> dict`` of keyword arguments, read at forward time; the
        generic path adds ``forward`` (the module's bound ``forward``, or the stock
        type's for a type that stands for one: :func:`jacmem.derivatives.forward_of`).
    jac_t: ``(xs, out, S, **hp) -> tuple`` of ``[V, N, *in_i]`` (``None`` where input
        ``i`` needs nothing), from ``xs`` (the tensor inputs), ``out`` and
        ``S [V, N, *out]``. ``None``: the generic vjp of ``forward``.
    df, d2f: for elementwise functions, ``(x, out, **hp) -> [N, *]``, the first and
        second derivative; ``d2f=None`` where it is zero (piecewise linear). Every
        other module's second derivative w.r.t. its input is taken as zero (linear
        maps, pooling, padding: DiagHessian adds no residual for them).
    sample_independent: the input Jacobian is the same for every sample (KFRA then
        needs it once, not per sample).
    keep_output: the derivatives read ``out``.
    keep_input: the derivatives read the values of ``xs`` (not only their shapes):
        ``False`` lets the engine drop an input that autograd does not keep either
        (ReLU, Sigmoid and Tanh save their output, not their input).
    curved: a module that is not elementwise and whose second derivative w.r.t. its
        input is not zero (LayerNorm, RMSNorm): GGN-type factors cross it, DiagHessian
        raises there rather than drop that term.
    """

    hyperparams: Callable[[nn.Module], dict[str, Any]] = _no_hyperparams
    jac_t: Callable[..., tuple[Tensor | None, ...]] | None = None
    df: Callable[..., Tensor] | None = None
    d2f: Callable[..., Tensor] | None = None
    sample_independent: bool = False
    keep_output: bool = False
    keep_input: bool = True
    curved: bool = False

    def params(self, module: nn.Module) -> dict[str, Any]:
        hp = self.hyperparams(module)
        if self.jac_t is None and self.df is None:
            hp["forward"] = forward_of(module)
        return hp

    @property
    def elementwise(self) -> bool:
        return self.df is not None

    def backprop(self, xs: tuple[Tensor, ...], out: Tensor | None, S: Tensor, hp: dict, inplace: bool = False):
        """``S [V, N, *out]`` -> one ``[V, N, *in_i]`` (or ``None``) per input; an
        elementwise map overwrites ``S`` where ``inplace``."""
        if self.df is not None:
            df = self.df(xs[0], out, **hp)
            return (S.mul_(df) if inplace else S * df,)
        if self.jac_t is not None:
            return self.jac_t(xs, out, S, **hp)
        return vjp_generic(hp["forward"], xs, S)


def diagonal_factor(d: Tensor) -> Tensor:
    """A factor of ``diag(d²)`` per sample: ``d [N, *F] -> [prod(F), N, *F]``, zero off
    the diagonal."""
    eye = torch.eye(prod(d.shape[1:]), dtype=d.dtype, device=d.device).reshape(-1, 1, *d.shape[1:])
    return eye * d.unsqueeze(0)


def vjp_generic(forward: Callable, xs: tuple[Tensor, ...], S: Tensor) -> tuple[Tensor | None, ...]:
    """``S [V, N, *out]`` -> ``J_iᵀ S`` per floating-point input, ``[V, N, *in_i]``;
    ``None`` for integer inputs.

    Up to :data:`LOOP_V` vectors: one forward with a graph, then one
    ``torch.autograd.grad`` of ``⟨out, S[v]⟩`` per vector (a scalar: an explicit
    ``grad_outputs`` makes torch import sympy, about 1 s and 80 MB on first use). More:
    ``torch.func.vjp`` vmapped over ``V``, which batches the backward but costs about
    5 ms more per call, and, on first use in a process, about 1.5 s and 80 MB to import
    ``torch._dynamo``."""
    diff = [i for i, x in enumerate(xs) if x.is_floating_point()]
    out: list = [None] * len(xs)
    if not diff:
        return tuple(out)
    if S.shape[0] <= LOOP_V:
        with torch.enable_grad():
            free = [xs[i].detach().requires_grad_() for i in diff]
            y = forward(*_substitute(xs, diff, free))
            rows = [torch.autograd.grad((y * s).sum(), free, retain_graph=True, allow_unused=True) for s in S]
        grads = [
            torch.stack([r[k] if r[k] is not None else torch.zeros_like(free[k]) for r in rows])
            for k in range(len(free))
        ]
    else:
        with torch.enable_grad():
            _, vjp = torch.func.vjp(lambda *free: forward(*_substitute(xs, diff, free)), *[xs[i] for i in diff])
            grads = torch.vmap(vjp)(S)
    for i, g in zip(diff, grads):
        out[i] = g
    return tuple(out)


#: up to this many vectors, :func:`vjp_generic` loops over them
LOOP_V = 32


def _substitute(xs: tuple[Tensor, ...], at, values) -> list:
    """``xs`` with ``values`` at the positions ``at``."""
    full = list(xs)
    for i, t in zip(at, values):
        full[i] = t
    return full


@dataclass
class LossHessian:
    """Factors of a loss's Hessian w.r.t. its input ``x [N, C, *D]``.

    check: ``module -> None``; raises for settings whose Hessian is not implemented.
    sqrt_hessian: ``(x, y, **hp) -> [V, N, *x.shape[1:]]`` with
        ``Σ_v S[v] S[v]ᵀ`` the exact Hessian of each sample's loss, as reduced.
    sampled: ``(x, y, mc_samples, **hp) -> [M, N, *x.shape[1:]]``,
        whose outer products equal the Hessian in expectation (gradients of the loss at
        targets drawn from the model's predictive distribution, over ``√M``).
    """

    check: Callable[[nn.Module], None]
    sqrt_hessian: Callable[..., Tensor]
    sampled: Callable[..., Tensor]
    hyperparams: Callable[[nn.Module], dict[str, Any]] = _no_hyperparams

    def params(self, module: nn.Module) -> dict[str, Any]:
        self.check(module)
        hp = self.hyperparams(module)
        hp["forward"] = forward_of(module)
        return hp


PASSTHROUGH: dict[type, Passthrough] = {}
LOSSES: dict[type, LossHessian] = {}


def passthrough(*module_types: type, **fields) -> Passthrough:
    """Declare how factors cross ``module_types``; returns the (shared) entry.

    Also the public way to let second-order extensions through a module of your own:
    ``jacmem.derivatives.jacobians.passthrough(MyModule)`` uses the vjp of its
    ``forward`` (it must be deterministic, with tensor inputs and one tensor output).
    """
    entry = Passthrough(**fields)
    for t in module_types:
        PASSTHROUGH[t] = entry
    return entry


def loss(module_type: type, entry: LossHessian) -> LossHessian:
    LOSSES[module_type] = entry
    return entry


#: how factors cross a module that computes a registered layer's function without being
#: of its type (timm's ``LayerNorm``, HF's ``LlamaRMSNorm``; :func:`jacmem.derivatives.recognised`):
#: the vjp of its own forward; its second derivative is not known, so DiagHessian stops there
RECOGNISED = Passthrough(curved=True)


def lookup_passthrough(module: nn.Module, x: Any = None, output: Any = None) -> Passthrough | None:
    """How factors cross ``module`` (:func:`jacmem.derivatives.registered_type`); given a
    call's first input ``x`` and ``output``, :data:`RECOGNISED` for a module that computes
    a registered layer's function (:func:`jacmem.derivatives.recognised`)."""
    cls = registered_type(PASSTHROUGH, type(module))
    if cls is not None:
        return PASSTHROUGH[cls]
    return RECOGNISED if output is not None and recognised(module, x, output) is not None else None


def lookup_loss(module: nn.Module) -> LossHessian | None:
    """The Hessian factors of the loss ``module`` (:func:`jacmem.derivatives.registered_type`)."""
    cls = registered_type(LOSSES, type(module))
    return None if cls is None else LOSSES[cls]


def ea_jac_t_mat_jac(entry: Passthrough, xs, out: Tensor | None, out_shape, H: Tensor, hp: dict) -> Tensor:
    """KFRA's step ``1/N Σ_n J_nᵀ H J_n``: ``H [D_out, D_out] -> [D_in, D_in]``, with
    ``D`` the number of entries of one sample's output (input), ``out_shape`` that of
    the whole output; first input only."""
    x = xs[0]
    n, d_in = x.shape[0], prod(x.shape[1:])
    out_shape = tuple(out_shape[1:])
    if entry.elementwise:
        df = entry.df(x, out, **hp).reshape(n, -1)
        return (df.T @ df).mul_(H).div_(n)  # Σ_n df_n df_nᵀ ⊙ H / N, one matmul
    samples = range(1 if entry.sample_independent else n)

    def apply(M: Tensor, i: int) -> Tensor:
        """[V, *out] -> [V, D_in]: Jᵀ of sample i applied to each row."""
        S = M.reshape(M.shape[0], 1, *out_shape)
        x_i = tuple(t[i : i + 1] for t in xs)
        out_i = None if out is None else out[i : i + 1]
        return entry.backprop(x_i, out_i, S, hp)[0].reshape(M.shape[0], d_in)

    result = torch.zeros(d_in, d_in, dtype=H.dtype, device=H.device)
    for i in samples:  # Jᵀ H Jᵀ = (Jᵀ (Jᵀ H)ᵀ)ᵀ
        result += apply(apply(H, i).T, i).T
    return result / len(samples)


def _eval_only(module: nn.Module) -> dict[str, Any]:
    if module.training:
        raise NotImplementedError(
            f"second-order extensions need {type(module).__name__} in eval mode: in training mode it mixes "
            "the samples of the batch (batch statistics). Call model.eval() first"
        )
    return {}


# Layers whose input Jacobian is that of their own forward (their parameters'
# derivatives are in their first-order layer files): transposed convolutions,
# BatchNorm in eval mode, Embedding (an integer input: nothing to pass on).
passthrough(nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d, sample_independent=True)
passthrough(nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, sample_independent=True, hyperparams=_eval_only)
passthrough(nn.Embedding)

# The other layer families register themselves on import.
from jacmem.derivatives import activations, losses, pooling, shape  # noqa: E402,F401
