"""The conformance matrix's quantities: one table, name -> :class:`Quantity`.

A quantity says what jacmem is asked (``extensions(threshold)``), where the answer goes
(``savefield``), how one parameter's answer is read into a tensor (``read``), and
which part of the oracle it equals (``expect``). ``kind`` groups them for the settings'
declarations: ``first`` (the first-order extensions), ``clip`` (``ClipGrad``),
``private`` (one ``PrivacyEngine`` step, read from the parameters after it), ``second``.

How each is compared (the oracle is ``oracle.py``'s):

- per-sample quantities (``per_sample``) row by row; the others as a whole;
- ``GGNMP``/``HMP``/``PCHMP``: the function stored is applied to fixed directions
  ``[K, *p.shape]`` and compared with the dense block's product;
- ``SqrtGGNExact``: ``Sᵀ S`` over its ``V·N`` rows, against the GGN block (any square
  root of the block has that product);
- Kronecker factors (``one_sample``: run on the first sample alone): ``G ⊗ A`` (row-major
  vec), ``G`` for a bias, EK-FAC's ``(U_G ⊗ U_A) diag(Λ) (U_G ⊗ U_A)ᵀ``, against the
  GGN block, where that is exact (``Model.kron_exact``); KFACEF against the gradient's
  outer product.
- Monte-Carlo kinds (``DiagGGNMC``, ``BatchDiagGGNMC``, ``SqrtGGNMC``, ``KFAC``, EK-FAC's
  default ``fisher="mc"``) draw their targets from torch's global generator, which the
  oracle cannot replay: ``exact`` is False, and the cell checks what holds whatever the
  draws: a finite answer of the right shape for every trainable parameter (``structural``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from tests.support.projection import row_norms, rule
from torch import Tensor

import jacmem

from . import oracle


@dataclass(frozen=True)
class Quantity:
    name: str
    kind: str  # first, clip, private, second
    make: Callable[[float], list]  # threshold -> extensions
    savefield: str
    expect: Callable | None  # (Expected, name) -> Tensor; None: structural only
    per_sample: bool = False
    read: Callable | None = None  # (stored value, name, directions) -> tensor
    one_sample: bool = False
    needs: str = ""  # a model attribute the exact check needs (kron_exact, piecewise_linear)
    #: (Expected, name, tol) -> what each entry may be off beyond ``tol`` under bfloat16
    #: autocast (``cells._close``'s ``slack``); None: nothing beyond it
    autocast_slack: Callable | None = None


def _first(cls, field, per_sample):
    return Quantity(
        cls.__name__, "first", lambda c: [cls()], field, lambda e, n: e.first[field][n], per_sample=per_sample
    )


def _diag(cls, field, batch, hessian):
    def expect(e, n):
        if batch:
            return (e.curv.hess_diag_batch if hessian else e.curv.ggn_diag_batch)[n]
        block = (e.curv.hess if hessian else e.curv.ggn)[n]
        return torch.diagonal(block).reshape(e.shapes[n])

    return Quantity(cls.__name__, "second", lambda c: [cls()], field, expect, per_sample=batch)


def _mc(cls, field, per_sample=False, one_sample=False, read=None):
    return Quantity(
        cls.__name__, "second", lambda c: [cls()], field, None, per_sample=per_sample, one_sample=one_sample, read=read
    )


def _product(cls, field, block, needs=""):
    def read(fn, name, dirs):
        return fn(dirs[name])

    def expect(e, n):
        return oracle.block_product(block(e)[n], e.directions[n])

    return Quantity(cls.__name__, "second", lambda c: [cls()], field, expect, read=read, needs=needs)


def _gram(sqrt: Tensor) -> Tensor:
    """``Sᵀ S`` of a square root ``[V, N, *shape]`` over its ``V·N`` rows: [p, p]."""
    rows = sqrt.reshape(sqrt.shape[0] * sqrt.shape[1], -1)
    return rows.T @ rows


def _kron(factors) -> Tensor:
    out = factors[0]
    for f in factors[1:]:
        out = torch.kron(out, f)
    return out


def _ekfac(value) -> Tensor:
    """EK-FAC's stored ``(U_G, U_A, Λ)`` (``U_A`` None for a diagonal A) as the dense
    ``(U_G ⊗ U_A) diag(vec Λ) (U_G ⊗ U_A)ᵀ``."""
    if isinstance(value, torch.Tensor) or len(value) == 1:  # a diagonal factor (LayerNorm): Λ alone
        lam = value if isinstance(value, torch.Tensor) else value[0]
        return torch.diag(lam.flatten())
    *bases, lam = value
    bases = [b if b is not None else torch.eye(s, dtype=lam.dtype) for b, s in zip(bases, lam.shape)]
    U = _kron(bases)
    return U @ torch.diag(lam.flatten()) @ U.T


#: the projections' seed and dimension in the matrix
SEED, DIM = 5, 6


def _projection(kind: str) -> Quantity:
    """``BatchGradProjection`` of ``kind`` (dim 6, seed 5): the oracle's per-sample gradients
    projected by the rule built from the docs (``tests/support/projection.py``)."""
    return Quantity(
        "BatchGradProjection" + ("" if kind == "kronecker" else "Dense"),
        "first",
        lambda c: [jacmem.BatchGradProjection(DIM, kind=kind, seed=SEED)],
        "grad_proj",
        lambda e, n: rule(e.model, n, e.grad_batch[n], SEED, DIM, kind),
        per_sample=True,
        autocast_slack=lambda e, n, tol: _projection_slack(e, n, tol, kind),
    )


def _projection_slack(e: oracle.Expected, name: str, tol: float, kind: str) -> Tensor:
    """``[N, dim]``: what bfloat16 autocast's rounding of the per-sample gradients may move
    each entry of their projection by, ``tol · max_j |G_nj| · ‖r_i‖₂`` (``r_i``: row ``i``
    of the rule's matrix, ``tests.support.projection.row_norms``).

    Entry ``i`` of sample ``n`` carries the gradient's error ``δ_n`` as ``r_i · δ_n``. The
    rounding errors do not depend on the matrix (drawn from the seed after the fact), so
    that is a sum of ``P`` terms of random sign, of standard deviation ``‖r_i‖₂ ·
    rms(δ_n)``: the slack takes ``rms(δ_n) <= tol · max_j |G_nj|`` (the gradient's
    error, in norm, within ``tol`` of its largest entry: resnet18's convolutions 0.57 to
    0.63 of it; its BatchNorm vectors, of 64 to 512 entries, up to 1.45, far below the
    floor) and one standard deviation; the absolute floor ``tol · scale`` stays above it. The projection thus answers for the
    per-sample gradients' error in norm, which BatchGrad's per-entry check (against the
    largest entry of any parameter) lets through at a larger size: resnet18's
    ``conv1.weight`` under autocast, per-sample gradients 17 % off the float64 oracle in
    norm (torch's own per-sample loop under the same autocast: the same 17 %, jacmem 0.2 %
    from it), ``rms(δ_n)`` at most 0.63 of ``tol · max|G_n|``, its projection's
    entries off by up to 0.158 (``‖δ_n‖ / √dim`` = 0.065 a standard deviation), beyond
    ``tol · scale`` (0.086); the slack there is 0.14. A wrong matrix moves an entry by
    about ``‖G_n‖ / √dim`` (0.44), far beyond it (``test_can_fail.py``)."""
    G = e.grad_batch[name].reshape(e.n, -1)  # (a 0-dim parameter's are [N])
    norms = row_norms(e.model, name, G.shape[1], SEED, DIM, kind)
    return tol * G.abs().amax(1, keepdim=True) * norms


def _kron_quantity(name, make, field, read=lambda v, n, e: _kron(v), expect=lambda e, n: e.curv.ggn[n]):
    return Quantity(name, "second", make, field, expect, read=read, one_sample=True, needs="kron_exact")


QUANTITIES: dict[str, Quantity] = {
    q.name: q
    for q in [
        _first(jacmem.BatchGrad, "grad_batch", True),
        _first(jacmem.BatchL2Grad, "batch_l2", True),
        _first(jacmem.SumGradSquared, "sum_grad_squared", False),
        _first(jacmem.Variance, "variance", False),
        _projection("kronecker"),
        _projection("dense"),
        Quantity("ClipGrad", "clip", lambda c: [jacmem.ClipGrad(c)], "grad", lambda e, n: e.clipped[n]),
        Quantity("PrivacyEngine", "private", lambda c: [], "data", lambda e, n: e.private_step[n]),
        _diag(jacmem.DiagGGNExact, "diag_ggn_exact", False, False),
        _diag(jacmem.BatchDiagGGNExact, "diag_ggn_exact_batch", True, False),
        _diag(jacmem.DiagHessian, "diag_h", False, True),
        _diag(jacmem.BatchDiagHessian, "diag_h_batch", True, True),
        _mc(jacmem.DiagGGNMC, "diag_ggn_mc"),
        _mc(jacmem.BatchDiagGGNMC, "diag_ggn_mc_batch", per_sample=True),
        Quantity(
            "SqrtGGNExact",
            "second",
            lambda c: [jacmem.SqrtGGNExact()],
            "sqrt_ggn_exact",
            lambda e, n: e.curv.ggn[n],
            read=lambda v, n, e: _gram(v),
        ),  # fmt: skip
        _mc(jacmem.SqrtGGNMC, "sqrt_ggn_mc"),
        _product(jacmem.GGNMP, "ggnmp", lambda e: e.curv.ggn),
        _product(jacmem.HMP, "hmp", lambda e: e.curv.hess),
        _product(jacmem.PCHMP, "pchmp", lambda e: e.curv.ggn, needs="piecewise_linear"),
        _kron_quantity("KFLR", lambda c: [jacmem.KFLR()], "kflr"),
        _kron_quantity("KFRA", lambda c: [jacmem.KFRA()], "kfra"),
        _kron_quantity("KFACEF", lambda c: [jacmem.KFACEF()], "kfac_ef", expect=lambda e, n: e.empirical[n]),
        _kron_quantity("EKFAC", lambda c: [jacmem.EKFAC(fisher="exact")], "ekfac", read=lambda v, n, e: _ekfac(v)),
        _mc(jacmem.KFAC, "kfac", one_sample=True, read=lambda v, n, e: _kron(v)),
    ]
}
