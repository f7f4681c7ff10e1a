"""SqrtGGNExact and SqrtGGNMC: a matrix square root of the GGN, as BackPACK 1.7.1 lays it out.

For a parameter ``θ`` of a module with output ``z``, the engine (:mod:`jacmem.engine.secondorder.engine`)
brings factors ``S [V, N, *z]`` to ``z`` with ``Σ_v S[v, n] S[v, n]ᵀ`` sample ``n``'s GGN
w.r.t. ``z`` (the loss Hessian's exact factor, ``V`` = the entries of one sample's model
output; or ``M`` Monte-Carlo samples). Its vector-Jacobian products
``B[v, n] = J_θ,nᵀ S[v, n]`` (``[V, N, *θ.shape]``) are the per-sample gradients ``θ``
would get if ``S[v]`` were the output gradient (every first-order derivative of
:mod:`jacmem.derivatives` computes them, :func:`.diag_ggn.vjp_chunks`), and

    Σ_{v, n} vec(B[v, n]) vec(B[v, n])ᵀ  =  the GGN block of θ

(concatenated over parameters, the whole GGN). Scaling follows BackPACK: with
``reduction="mean"`` the loss Hessian carries ``1/N``.

``subsampling``: BackPACK's option, a list of sample indices (repeats allowed): the
result holds only those samples, ``[V, len(subsampling), *θ.shape]``, with the loss
scaled as for the whole batch (``1/N`` of the whole batch for ``"mean"``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from jacmem.derivatives.quantities import BATCH_GRAD, EXACT, MonteCarlo
from jacmem.extensions.firstorder import checked_subsampling, subsample
from jacmem.extensions.secondorder.base import Call, Factor, SecondOrderExtension
from jacmem.extensions.secondorder.diag_ggn import vjp_chunks


def _take(obj, subsampling: list[int]):
    """Each tensor's samples at ``subsampling`` (axis 0), through tuples and lists; the
    rest (a dict that all samples share) passes whole, as chunking leaves it."""
    if isinstance(obj, Tensor):
        return subsample(obj, subsampling)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_take(o, subsampling) for o in obj)
    return obj


def root_vjps(call: Call, f: Factor, name: str, subsampling: list[int] | None = None) -> Tensor:
    """``B[v, n] = J_θ,nᵀ S[v, n]`` for parameter ``name`` and factor ``f``:
    ``[V, N, *p.shape]`` (``N`` = ``len(subsampling)`` where given; the factor's sign is
    not applied)."""
    S, x = f.S, call.x
    n = S.shape[1]
    if subsampling is not None:
        bad = [i for i in subsampling if not -n <= i < n]
        if bad:
            raise IndexError(
                f"subsampling index {bad[0]} is out of range for the batch of {n} samples; pass indices in [0, {n})"
            )
        index = torch.tensor([i % n for i in subsampling], device=S.device)
        S, x = S.index_select(1, index), _take(x, index)
        n = len(subsampling)
    v, out, start = S.shape[0], None, 0
    for c, res in vjp_chunks(call, S, name, BATCH_GRAD, x=x, kept=True):
        if c == v:
            return res.unflatten(0, (c, n))
        out = res.new_empty((v, n, *res.shape[1:])) if out is None else out
        out[start : start + c] = res.unflatten(0, (c, n))  # in place: no second copy for a cat
        start += c
    return out


class _SqrtGGN(SecondOrderExtension):
    sums_calls = True

    def __init__(self, subsampling: Sequence[int] | None = None):
        self.subsampling = checked_subsampling(subsampling, type(self).__name__)

    def merge_chunks(self, a: Tensor, b: Tensor) -> Tensor:
        """Slices of ``V`` stack along ``V``."""
        return torch.cat((a, b))

    def compute(self, call: Call) -> dict[str, Tensor]:
        """Several factors of the kind (a sum of losses) stack along ``V``."""
        out = {}
        factors = call.of_kind(*self.kinds)
        for name in call.params:
            roots = [root_vjps(call, f, name, self.subsampling) for f in factors]
            out[name] = roots[0] if len(roots) == 1 else torch.cat(roots)
        return out


class SqrtGGNExact(_SqrtGGN):
    """A square root of the GGN from the exact loss Hessian, ``param.sqrt_ggn_exact``:
    ``[C, N, *param.shape]`` (``C`` the entries of one sample's model output; ``N`` the
    samples, or ``len(subsampling)``)."""

    savefield, kinds = "sqrt_ggn_exact", (EXACT,)

    def __repr__(self) -> str:
        return f"SqrtGGNExact(subsampling={self.subsampling})"


class SqrtGGNMC(_SqrtGGN):
    """A Monte-Carlo square root of the GGN, ``param.sqrt_ggn_mc``: ``[M, N, *param.shape]``
    for ``M = mc_samples`` targets drawn from the model's predictive distribution."""

    savefield = "sqrt_ggn_mc"

    def __init__(self, mc_samples: int = 1, subsampling: Sequence[int] | None = None):
        super().__init__(subsampling)
        self.mc_samples = mc_samples
        self.kinds = (MonteCarlo(mc_samples),)

    def __repr__(self) -> str:
        return f"SqrtGGNMC(mc_samples={self.mc_samples}, subsampling={self.subsampling})"
