"""EK-FAC: eigenvalue-corrected KFAC (George et al., NeurIPS 2018), the curvature behind
kronfluence's influence functions.

KFAC's ``G ⊗ A`` (:mod:`.kfac`) has the eigenbasis ``U_G ⊗ U_A`` and the eigenvalues
``λ_G ⊗ λ_A``. EK-FAC keeps the basis and replaces the eigenvalues by the second moments
of the per-sample gradients in it: for a weight ``[O, I]`` (Linear; HF's Conv1D and
Embedding: of ``weight.T``, as their factors),

``Λ[i, j] = Σ_{v,n} (U_Gᵀ Ĝ_{v,n} U_A)[i, j]²``, ``Ĝ_{v,n} = Σ_t s_{v,n,t} a_{n,t}ᵀ``,

``Ĝ_{v,n}`` the gradient sample ``n``'s loss would give the weight with the root
``s_{v,n}`` as its output gradient: the same roots as the factors (``fisher``:
``"mc"``, sampled targets, as KFAC; ``"exact"``, the loss Hessian's exact roots, as
KFLR; ``"empirical"``, the gradient at the true targets, as KFACEF), so that the
corrected ``U Λ Uᵀ`` has the diagonal, in that basis, of the curvature the factors
approximate. A bias: ``Λ_b[i] = Σ_{v,n} (U_Gᵀ Σ_t s_{v,n,t})[i]²``.

**One backward.** The factors, their eigenbases and the correction all come from the
same batch and the same roots (kronfluence and curvlinops fit the factors first and
correct in a second pass over the data; on one batch with deterministic roots,
``"exact"`` and ``"empirical"``, the two agree). ``Λ`` is the first-order
``sum_grad_squared`` of the rotated input ``x U_A`` and roots ``s U_G``, so every
first-order strategy of the layer serves, in chunks under the block's budget.

Layers: those whose Kronecker rule is channels-last (Linear, HF's Conv1D, Embedding,
whose ``A`` is diagonal: ``U_A`` is the identity, stored as ``None``); LayerNorm and
RMSNorm get KFAC's diagonal ``[d]`` (a diagonal is its own eigen-correction);
convolutions are refused. A call the batch shares (position embeddings of ``[1, T]``
ids) is corrected with each sample's own gradient of it, the sum over that sample's uses
(the autograd path repeats the call over the batch). The bases need all of a layer's
roots at once: where the autograd path hands them over in slices of their columns
(``fisher="exact"`` or ``mc_samples > 1``, with more columns than ``chunk_bytes`` holds),
it goes over the slices twice, the factors from all of them first (``fit``), then ``Λ``
in their bases, summed over the slices.
"""

from __future__ import annotations

import torch
from torch import Tensor

from jacmem.derivatives.quantities import SUM_GRAD_SQUARED, MonteCarlo, factor_kind
from jacmem.extensions.secondorder.base import Call, UnsupportedModule
from jacmem.extensions.secondorder.diag_ggn import vjp_chunks
from jacmem.extensions.secondorder.kfac import KroneckerExtension, approx_repr, check_approx

FISHERS = ("mc", "exact", "empirical")


def _eigenvectors(M: Tensor) -> Tensor:
    """The eigenvectors of the symmetric ``M [k, k]``, columns, row-major (``eigh`` gives
    them column-major, which ``torch.kron`` and views of users' code reject)."""
    return torch.linalg.eigh(M).eigenvectors.contiguous()


class EKFAC(KroneckerExtension):
    """Eigenvalue-corrected KFAC (the module docstring), ``param.ekfac``: a weight
    ``[U_G [O, O], U_A [I, I] (None for Embedding), Λ [O, I]]``, a bias ``[U_G, Λ [O]]``,
    LayerNorm/RMSNorm ``[d]``; ``fisher``: ``"mc"`` (``mc_samples`` sampled targets),
    ``"exact"`` or ``"empirical"``; ``kfac_approx`` as for :class:`jacmem.KFAC` (it
    chooses the factors whose eigenbases are taken)."""

    savefield = "ekfac"
    fits = True  # the bases, from all the roots, before the correction

    def __init__(self, fisher: str = "mc", mc_samples: int = 1, kfac_approx: str | None = None):
        if fisher not in FISHERS:
            raise ValueError(f"fisher must be one of {FISHERS}, got {fisher!r}")
        self.fisher, self.mc_samples = fisher, mc_samples
        self.kinds = (MonteCarlo(mc_samples),) if fisher == "mc" else (factor_kind(fisher),)
        self.kfac_approx = check_approx(kfac_approx)

    def __repr__(self) -> str:
        args = [f"fisher={self.fisher!r}"] + ([f"mc_samples={self.mc_samples}"] if self.fisher == "mc" else [])
        approx = approx_repr(self.kfac_approx)
        return f"EKFAC({', '.join(args + ([approx] if approx else []))})"

    def fit(self, call: Call) -> dict[str, list]:
        """KFAC's factors from one slice of the roots (``G`` sums over the slices)."""
        return super().compute(call)

    def merge_fit(self, a: list, b: list) -> list:
        return super().merge_chunks(a, b)

    def merge_chunks(self, a: list, b: list) -> list:
        """Two slices' results, in the bases of all the roots (``call.fitted``): ``Λ`` sums."""
        return [*a[:-1], a[-1] + b[-1]]

    def check(self, call: Call) -> None:
        super().check(call)
        rule = call.entry.kronecker
        if rule.input_factor is not None and not rule.channels_last:
            raise UnsupportedModule(
                f"{self!r} has no eigenvalue correction for {type(call.module).__name__} (module {call.name!r}): its "
                "input factor is over patches, not the input's channels; use KFAC, or freeze its parameters"
            )

    def compute(self, call: Call) -> dict[str, list]:
        self.check(call)
        sliced = call.fitted is not None and call.entry.kronecker.input_factor is not None
        factors = call.fitted if sliced else super().compute(call)  # sliced: all the roots' factors
        rule = call.entry.kronecker
        if rule.input_factor is None:  # LayerNorm, RMSNorm: the diagonal
            return factors
        U_G = _eigenvectors(next(iter(factors.values()))[0])  # the weight's and the bias's G are one
        A = factors["weight"][1] if "weight" in factors else None
        U_A = None if A is None or A.dim() == 1 else _eigenvectors(A)
        x = call.x if U_A is None else call.x @ U_A
        out = {}
        for name, p in call.params.items():
            lam = torch.zeros_like(p)
            for f in call.of_kind(*self.kinds):
                for _, part in vjp_chunks(call, f.S @ U_G, name, SUM_GRAD_SQUARED, x=x):
                    lam.add_(part, alpha=f.sign)
            if name == "weight":
                out[name] = [U_G, U_A, lam.T if rule.transposed else lam]
            else:
                out[name] = [U_G, lam]
        return out
