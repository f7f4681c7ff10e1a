"""Jacobian math that the layer files and the second-order engine share.

Second-order extensions backpropagate *factors*: tensors ``S`` of shape
``[V, N, *out]`` (a leading axis of ``V`` vectors per sample, BackPACK's convention)
whose outer products sum to a curvature matrix w.r.t. a module's output. Each module
maps them to its inputs, ``S_in[v] = J_nᵀ S[v]`` per sample ``n``; how each module type
does so is its :class:`~jacmem.derivatives.registry.Passthrough` entry, by default
:func:`vjp_generic` of its ``forward``.
"""

from __future__ import annotations

from collections.abc import Callable
from math import prod

import torch
from torch import Tensor


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
    ``grad_outputs`` makes torch import sympy on first use). More: ``torch.func.vjp``
    vmapped over ``V``, which batches the backward but costs a fixed set-up per call,
    and, on first use in a process, the import of ``torch._dynamo``."""
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


def ea_jac_t_mat_jac(entry, xs, out: Tensor | None, out_shape, H: Tensor, hp: dict) -> Tensor:
    """KFRA's step ``1/N Σ_n J_nᵀ H J_n`` through the module whose
    :class:`~jacmem.derivatives.registry.Passthrough` is ``entry``:
    ``H [D_out, D_out] -> [D_in, D_in]``, with
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
