"""DiagGGNExact, DiagGGNMC, BatchDiagGGNExact, BatchDiagGGNMC.

The GGN diagonal of a parameter ``θ`` of a module with output ``z`` is
``Σ_n Σ_v (J_θ,nᵀ S[v, n])²``, with ``S`` the factor backpropagated to ``z``: each
``J_θ,nᵀ S[v, n]`` is the per-sample gradient ``θ`` would get if ``S[v]`` were the
output gradient. So the diagonal is the first-order ``sum_grad_squared`` over a batch
of ``V·N`` "samples", and its per-sample version sums the squares over ``V`` only:
every first-order derivative (and strategy) of :mod:`jacmem.derivatives` serves here.
The inputs are repeated over ``V``, in chunks of ``V`` that keep this under the
block's ``chunk_bytes``. A layer may register a direct form with no repetition, its
``squared_vjps`` (:class:`jacmem.derivatives.LayerDerivatives`): Linear without middle
axes, ``Σ_v S² ⊗ x²``; convolutions, one im2col of the input shared by all ``V``
(BackPACK's contraction, in chunks of ``V``).

Scaling follows BackPACK 1.7.1: with ``reduction="mean"`` the loss Hessian carries
``1/N``, so ``diag_ggn_exact_batch.sum(0) == diag_ggn_exact``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from math import prod

from torch import Tensor

from jacmem.derivatives import entries
from jacmem.derivatives.quantities import BATCH_GRAD, EXACT, SUM_GRAD_SQUARED, MonteCarlo, Quantity
from jacmem.extensions.secondorder.base import Call, Factor, SecondOrderExtension


def _repeat(obj, v: int):
    """Each tensor's batch axis repeated ``v`` times, ``v``-major: [N, *] -> [(v N), *]."""
    if isinstance(obj, Tensor):
        return obj.unsqueeze(0).expand(v, *obj.shape).reshape(v * obj.shape[0], *obj.shape[1:])
    if isinstance(obj, (tuple, list)):
        return type(obj)(_repeat(o, v) for o in obj)
    return obj


def vjp_chunks(
    call: Call, S: Tensor, name: str, quantity: Quantity, x=None, kept: bool = False
) -> Iterator[tuple[int, Tensor]]:
    """The first-order ``quantity`` (``batch_grad`` or ``sum_grad_squared``) of parameter
    ``name`` over the ``V·N`` "samples" ``J_θᵀ S[v, n]``, in chunks of ``V`` under the
    block's budget: ``(c, value)`` per chunk of ``c`` vectors, ``value`` ``[(c N), *p.shape]``
    (``batch_grad``, ``v``-major) or ``p.shape``. ``x``: the kept input, if not ``call.x``;
    ``kept``: the ``batch_grad`` values are the caller's result, not temporary memory."""
    x = call.x if x is None else x
    p = call.params[name]
    v, n = S.shape[:2]
    x_bytes = entries(x) // max(n, 1)
    per_sample = p.numel() if quantity == BATCH_GRAD and not kept else 0
    per_v = n * (x_bytes + prod(S.shape[2:]) + per_sample) * S.element_size()
    step = max(1, int(call.budget // max(per_v, 1)))
    for start in range(0, v, step):
        c = min(step, v - start)
        g = S[start : start + c].flatten(0, 1)
        yield c, call.first_order(name, _repeat(x, c), g, {quantity})[quantity]


def squared_vjps(call: Call, factors: Iterable[Factor], batch: bool) -> dict[str, Tensor]:
    """``Σ_factors sign · Σ_v (J_θᵀ S[v])²`` per parameter: summed over the samples
    (``p.shape``), or per sample (``[N, *p.shape]``) where ``batch``."""
    totals: dict[str, Tensor] = {}
    for f in factors:
        S = f.S
        n = S.shape[1]
        direct = getattr(call.entry, "squared_vjps", None)
        parts = None
        if direct is not None:
            shapes = {name: p.shape for name, p in call.params.items()}
            parts = direct(call.x, S, shapes, batch, call.budget, **call.hp)
        if parts is None:
            parts = {}
            for name in call.params:
                acc = None
                for c, res in vjp_chunks(call, S, name, BATCH_GRAD if batch else SUM_GRAD_SQUARED):
                    if batch:
                        res = res.unflatten(0, (c, n)).square().sum(0)
                    acc = res if acc is None else acc + res
                parts[name] = acc
        for name, value in parts.items():
            value = value if f.sign == 1 else f.sign * value
            totals[name] = value if name not in totals else totals[name] + value
    return totals


class _DiagGGN(SecondOrderExtension):
    batch, sums_calls = False, True

    def compute(self, call: Call):
        return squared_vjps(call, call.of_kind(*self.kinds), self.batch)


class DiagGGNExact(_DiagGGN):
    """Diagonal of the generalized Gauss-Newton matrix, ``param.diag_ggn_exact``:
    ``param.shape``. Uses the loss Hessian's exact factor (``V`` = number of outputs of
    one sample)."""

    savefield, kinds = "diag_ggn_exact", (EXACT,)


class BatchDiagGGNExact(DiagGGNExact):
    """Per-sample GGN diagonals, ``param.diag_ggn_exact_batch``: ``[N, *param.shape]``."""

    savefield, batch = "diag_ggn_exact_batch", True


class DiagGGNMC(_DiagGGN):
    """Monte-Carlo estimate of the GGN diagonal, ``param.diag_ggn_mc``: ``param.shape``,
    from ``mc_samples`` targets drawn from the model's predictive distribution."""

    savefield = "diag_ggn_mc"

    def __init__(self, mc_samples: int = 1):
        self.mc_samples = mc_samples
        self.kinds = (MonteCarlo(mc_samples),)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(mc_samples={self.mc_samples})"


class BatchDiagGGNMC(DiagGGNMC):
    """Per-sample Monte-Carlo GGN diagonals, ``param.diag_ggn_mc_batch``:
    ``[N, *param.shape]``."""

    savefield, batch = "diag_ggn_mc_batch", True
