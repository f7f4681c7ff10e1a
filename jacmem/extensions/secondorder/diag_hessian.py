"""DiagHessian and BatchDiagHessian.

The Hessian of the loss w.r.t. a parameter is the GGN plus, for every elementwise
activation ``a = f(x)`` downstream, the *residual* ``J_x,θᵀ diag(f''(x) ⊙ ∂L/∂a) J_x,θ``.
As in BackPACK, each residual diagonal is split into its positive and negative parts,
factored as ``diag(√r₊)`` and ``diag(√r₋)`` (``V`` = the activation's size per
sample), and backpropagated with signs + and -, beside the GGN's exact factor; linear
layers, pooling, padding and losses add nothing (their second derivative w.r.t. their
input is zero, or in the loss's exact factor). The diagonal is then the signed sum of
squared vector-Jacobian products, as for the GGN (:mod:`.diag_ggn`).

Unlike BackPACK's, this works through residual and branching architectures built
from :mod:`jacmem.nn` (factors from different paths add where the paths meet).
"""

from __future__ import annotations

from jacmem.derivatives.quantities import EXACT, RESIDUAL
from jacmem.extensions.secondorder.base import Call, SecondOrderExtension
from jacmem.extensions.secondorder.diag_ggn import squared_vjps


class DiagHessian(SecondOrderExtension):
    """Diagonal of the Hessian, ``param.diag_h``: ``param.shape``."""

    savefield, kinds = "diag_h", (EXACT, RESIDUAL)
    batch = False

    def compute(self, call: Call):
        return squared_vjps(call, call.of_kind(*self.kinds), self.batch)


class BatchDiagHessian(DiagHessian):
    """Per-sample Hessian diagonals, ``param.diag_h_batch``: ``[N, *param.shape]``
    (the Hessian of each sample's term of the loss, as reduced)."""

    savefield, batch = "diag_h_batch", True
