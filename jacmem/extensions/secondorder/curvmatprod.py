"""GGNMP, HMP and PCHMP: products with the block-diagonal GGN, Hessian and
positive-curvature Hessian, with BackPACK 1.7.1's call conventions.

Each sets ``param.<savefield>`` to a function ``mat [K, *param.shape] -> [K, *param.shape]``
that multiplies each slice ``mat[k]`` with the parameter's block of the curvature of the
loss (as reduced: summed over the samples of the batch, ``1/N`` for ``"mean"``).

The block comes from the factors the engine (:mod:`.backprop`) brings to the module's
output, as DiagGGN and DiagHessian use them: with ``B[v, n] = J_θ,nᵀ S[v, n]``
(:func:`.sqrt_ggn.root_vjps`), a factor of sign ``s`` adds ``s · Σ_{v,n} vec(B) vec(B)ᵀ``.

* GGNMP: the loss Hessian's exact factor: the GGN block.
* HMP: that, plus every elementwise activation's residual downstream (``f''(x) ⊙ g_out``,
  split into a positive and a negative diagonal factor, :mod:`.diag_hessian`): the
  Hessian block (of parameters whose own second derivative is zero, as for every
  layer of :mod:`jacmem.derivatives`: linear in their parameters).
* PCHMP (Chen et al. 2018, BDA-PCH): the residuals made non-negative before they are
  passed back, ``modify="clip"`` (``max(r, 0)``: the positive factors alone) or
  ``"abs"`` (``|r|``: both factors counted positive).

The function keeps the smaller of the block itself (``[P, P]``) or its roots
(``[V·N, P]`` per factor), computed in the backward pass.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from jacmem.extensions.secondorder.base import Call, Factor, SecondOrderExtension
from jacmem.extensions.secondorder.sqrt_ggn import root_vjps


def _signed_roots(call: Call, factors: list[Factor], name: str) -> list[tuple[float, Tensor]]:
    """``(sign, B [V·N, P])`` per factor, for parameter ``name``."""
    return [(f.sign, root_vjps(call, f, name).flatten(0, 1).flatten(1)) for f in factors]


def mat_prod(roots: list[tuple[float, Tensor]], shape: torch.Size, name: str, ext: str) -> Callable[[Tensor], Tensor]:
    """The function ``mat [K, *shape] -> [K, *shape]``, multiplying with
    ``Σ sign · Bᵀ B`` (``P = prod(shape)``)."""
    p = shape.numel()
    rows = sum(B.shape[0] for _, B in roots)
    block = None
    if p <= rows:
        block = sum((sign * (B.T @ B) for sign, B in roots), roots[0][1].new_zeros(p, p))
        roots = []

    def product(mat: Tensor) -> Tensor:
        if mat.dim() < 1 or mat.shape[1:] != shape:
            raise ValueError(
                f"jacmem: {ext} of {name!r} takes a matrix [K, *{tuple(shape)}] (K vectors shaped like the "
                f"parameter), got {tuple(mat.shape)}; use mat.unsqueeze(0) for a single vector"
            )
        m = mat.reshape(mat.shape[0], p).to(block.dtype if block is not None else roots[0][1].dtype)
        if block is not None:
            out = m @ block
        else:
            out = sum(sign * ((m @ B.T) @ B) for sign, B in roots)
        return out.reshape(mat.shape).to(mat.dtype)

    return product


class _MatProd(SecondOrderExtension):
    def factors(self, call: Call) -> list[Factor]:
        return call.of_kind(*self.kinds)

    def compute(self, call: Call) -> dict[str, Callable[[Tensor], Tensor]]:
        factors = self.factors(call)
        out = {}
        for name, p in call.params.items():
            roots = _signed_roots(call, factors, name)
            if not roots:  # nothing reached the module: its block is zero
                roots = [(1.0, p.new_zeros(0, p.numel()))]
            out[name] = mat_prod(roots, p.shape, name, repr(self))
        return out


class GGNMP(_MatProd):
    """Products with the GGN's diagonal block of each parameter, ``param.ggnmp``:
    ``mat [K, *param.shape] -> [K, *param.shape]``."""

    savefield, kinds = "ggnmp", ("exact",)


class HMP(_MatProd):
    """Products with the Hessian's diagonal block of each parameter, ``param.hmp``:
    ``mat [K, *param.shape] -> [K, *param.shape]``."""

    savefield, kinds = "hmp", ("exact", "residual")


class PCHMP(_MatProd):
    """Products with the positive-curvature Hessian's diagonal block of each parameter,
    ``param.pchmp``: ``mat [K, *param.shape] -> [K, *param.shape]``; ``modify``: how the
    activations' residuals lose their negative part, ``"clip"`` or ``"abs"``."""

    savefield, kinds = "pchmp", ("exact", "residual")

    def __init__(self, modify: str = "clip"):
        if modify not in ("clip", "abs"):
            raise ValueError(f"PCHMP: modify must be 'clip' or 'abs', got {modify!r}")
        self.modify = modify

    def factors(self, call: Call) -> list[Factor]:
        out = []
        for f in call.of_kind(*self.kinds):
            if f.sign > 0:
                out.append(f)
            elif self.modify == "abs":
                out.append(Factor(f.kind, 1.0, f.S))
        return out

    def __repr__(self) -> str:
        return f"PCHMP(modify={self.modify!r})"
