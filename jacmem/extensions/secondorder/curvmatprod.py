"""GGNMP, HMP and PCHMP: products with the block-diagonal GGN, Hessian and
positive-curvature Hessian, with BackPACK 1.7.1's call conventions.

Each sets ``param.<savefield>`` to a function ``mat [K, *param.shape] -> [K, *param.shape]``
that multiplies each slice ``mat[k]`` with the parameter's block of the curvature of the
loss (as reduced: summed over the samples of the batch, ``1/N`` for ``"mean"``).

The block comes from the factors the engine (:mod:`jacmem.engine.secondorder.engine`) brings to the module's
output ``z``, as DiagGGN and DiagHessian use them: a factor ``S [V, N, *z]`` of sign
``s`` adds ``s · Σ_n J_θ,nᵀ (Σ_v S[v, n] S[v, n]ᵀ) J_θ,n``. The function keeps the factors
and the call's inputs, and multiplies as BackPACK's does, lazily: ``J_θ m``, then the
curvature w.r.t. ``z`` from the factors, then ``J_θᵀ`` (``torch.func.vjp`` of the module's
``forward`` w.r.t. ``θ``), for each of the ``K`` vectors (a loop: ``vmap``'s set-up does
not pay for a few vectors). ``J_θ m`` is the transpose of that vjp (a vjp of the vjp),
not forward mode's Jacobian-vector product: the block is of the Jacobian whose transpose
autograd applies, the one ``.grad`` and the diagonals use, where a layer's backward is a
convention rather than the derivative (an Embedding's ``padding_idx`` row gets zero
gradient, so none of the block). So the backward costs nothing beyond the factors, and a
product costs about a forward and two backwards of this one module. It multiplies in
the parameter's dtype with autocast off, wherever it is called (the factors and inputs
of an autocast forward are kept in float32, :mod:`jacmem.engine.precision`).

* GGNMP: the loss Hessian's exact factor: the GGN block.
* HMP: that, plus every elementwise activation's residual downstream (``f''(x) ⊙ g_out``,
  split into a positive and a negative diagonal factor, :mod:`.diag_hessian`): the
  Hessian block (of parameters whose own second derivative is zero, as for every
  layer of :mod:`jacmem.derivatives`: linear in their parameters).
* PCHMP (Chen et al. 2018, BDA-PCH): the residuals made non-negative before they are
  passed back, ``modify="clip"`` (``max(r, 0)``: the positive factors alone) or
  ``"abs"`` (``|r|``: both factors counted positive).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from jacmem.derivatives import forward_of
from jacmem.derivatives.quantities import EXACT, RESIDUAL
from jacmem.extensions.secondorder.base import Call, Factor, SecondOrderExtension, UnsupportedModule


class _Forward(nn.Module):
    """``module``'s ``forward`` for ``torch.func``, through :func:`jacmem.derivatives.forward_of`:
    the stock layer's for a lean one (whose autograd Functions ``torch.func`` cannot
    transform), without the module's hooks."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *inputs: Tensor) -> Tensor:
        return forward_of(self.module)(*inputs)


def mat_prod(
    module: nn.Module, name: str, param: Tensor, inputs: tuple[Tensor, ...], roots: list[tuple[float, Tensor]], ext: str
) -> Callable[[Tensor], Tensor]:
    """The function ``mat [K, *param.shape] -> [K, *param.shape]``, multiplying with
    ``Σ sign · Σ_n J_nᵀ (Σ_v S[v, n] S[v, n]ᵀ) J_n`` for the ``(sign, S [V, N, *z])`` in
    ``roots``, ``J_n`` the Jacobian of sample ``n``'s output of ``module(*inputs)``
    w.r.t. its parameter ``name``."""
    primal = param.detach()
    call = _Forward(module)
    # every parameter detached: the products are constants to autograd, holding no graph
    fixed = {f"module.{k}": v.detach() for k, v in module.named_parameters() if k != name}

    def forward(t: Tensor) -> Tensor:
        return torch.func.functional_call(call, {**fixed, f"module.{name}": t}, inputs)

    def product(mat: Tensor) -> Tensor:
        if mat.dim() < 1 or mat.shape[1:] != primal.shape:
            raise ValueError(
                f"jacmem: {ext} of {name!r} takes a matrix [K, *{tuple(primal.shape)}] (K vectors shaped like the "
                f"parameter), got {tuple(mat.shape)}; use mat.unsqueeze(0) for a single vector"
            )
        with torch.autocast(primal.device.type, enabled=False):  # in the parameter's dtype, wherever called
            m = mat.to(primal.dtype)
            out, vjp = torch.func.vjp(forward, primal)
            # J_θ m: the transpose of autograd's J_θᵀ (the vjp of the vjp, linear in its cotangent, so
            # taken at zero), not forward mode's (see the module's docstring)
            _, jac = torch.func.vjp(lambda g: vjp(g)[0], torch.zeros_like(out))
            u = torch.stack([jac(v)[0] for v in m]).flatten(2)  # [K, N, D]
            G = torch.zeros_like(u)
            for sign, S in roots:
                S = S.flatten(2)  # [V, N, D]
                G += sign * torch.einsum("kvn,vnd->knd", torch.einsum("vnd,knd->kvn", S, u), S)
            return torch.stack([vjp(g.reshape(out.shape))[0] for g in G]).to(mat.dtype)

    return product


class _MatProd(SecondOrderExtension):
    def factors(self, call: Call) -> list[Factor]:
        return call.of_kind(*self.kinds)

    def check(self, call: Call) -> None:
        if call.inputs is None:
            raise UnsupportedModule(
                f"{self!r} repeats a module's forward, but module {call.name!r} was called with keyword or "
                "non-tensor arguments; call it with its tensor inputs by position"
            )

    def compute(self, call: Call) -> dict[str, Callable[[Tensor], Tensor]]:
        self.check(call)
        # copies: the engine overwrites its factors as they cross elementwise modules
        roots = [(f.sign, f.S.clone()) for f in self.factors(call)]
        return {name: mat_prod(call.module, name, p, call.inputs, roots, repr(self)) for name, p in call.params.items()}


class GGNMP(_MatProd):
    """Products with the GGN's diagonal block of each parameter, ``param.ggnmp``:
    ``mat [K, *param.shape] -> [K, *param.shape]``."""

    savefield, kinds = "ggnmp", (EXACT,)


class HMP(_MatProd):
    """Products with the Hessian's diagonal block of each parameter, ``param.hmp``:
    ``mat [K, *param.shape] -> [K, *param.shape]``."""

    savefield, kinds = "hmp", (EXACT, RESIDUAL)


class PCHMP(_MatProd):
    """Products with the positive-curvature Hessian's diagonal block of each parameter,
    ``param.pchmp``: ``mat [K, *param.shape] -> [K, *param.shape]``; ``modify``: how the
    activations' residuals lose their negative part, ``"clip"`` or ``"abs"``."""

    savefield, kinds = "pchmp", (EXACT, RESIDUAL)

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
