"""What a second-order extension asks of the backward pass, and what it gets.

The engine (:mod:`jacmem.engine.secondorder.engine`) backpropagates *factors*,
each a tensor ``S [V, N, *out]`` at a module's output with a sign, such that
``Σ sign · Σ_v S[v] S[v]ᵀ`` is (per sample) a curvature matrix w.r.t. that output.
Factors come in kinds, registered objects (:class:`jacmem.derivatives.quantities.FactorKind`):

=====================  ====================================================================
kind                   what its outer products sum to
=====================  ====================================================================
``EXACT``              the GGN: the loss Hessian's exact factor, backpropagated
``MonteCarlo(M)``      the GGN in expectation: ``M`` Monte-Carlo samples of the loss Hessian
``EMPIRICAL``          the empirical Fisher: the gradient at the true targets
``RESIDUAL``           the rest of the Hessian: each activation's ``f''(x) ⊙ g_out``, as a
                       positive and a negative diagonal factor (BackPACK's DiagHessian)
=====================  ====================================================================

KFRA backpropagates instead one dense ``[D, D]`` matrix per module output, the
batch-averaged GGN (``DENSE``). An extension names the kinds it needs in ``kinds`` (the
objects, or their names, ``"exact"``, ``"mc3"``, which the engine reads once) and turns
a :class:`Call` into its per-parameter results in ``compute``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

from jacmem.derivatives.quantities import FactorKind


@dataclass
class Factor:
    """A backpropagated factor: ``Σ_v S[v] S[v]ᵀ`` counted with ``sign``."""

    kind: FactorKind
    sign: float
    S: Tensor  # [V, N, *out]


@dataclass
class Call:
    """One call of a module with parameters, as the extensions see it in backward.

    ``x``/``hp``/``entry``: what the first-order derivatives take (the module's first
    order registry entry, its kept input and hyper-parameters); ``inputs``: the call's
    arguments, where they were all tensors given by position (``forward(*inputs)``
    repeats the call), else ``None``; ``factors`` and
    ``dense``: what arrived at the output.
    """

    module: nn.Module
    name: str
    params: dict[str, nn.Parameter]
    entry: Any
    hp: dict[str, Any]
    x: Any
    inputs: tuple[Tensor, ...] | None
    out_shape: tuple[int, ...]
    factors: list[Factor] = field(default_factory=list)
    dense: Tensor | None = None
    #: ``(param name, x, g, quantities) -> {quantity: value}``: first-order quantities of
    #: the parameter for input ``x`` and output gradients ``g`` (``[N', *]``), computed by
    #: the strategies the block chooses for this module, chunked under ``budget``
    first_order: Callable[..., dict[str, Tensor]] | None = None
    budget: float = 64 * 2**20
    #: the extension's fit over all of the factors' ``V`` columns, where they come in
    #: slices (:attr:`SecondOrderExtension.fits`); ``None`` where they come whole
    fitted: Any = None

    def of_kind(self, *kinds: FactorKind) -> list[Factor]:
        return [f for f in self.factors if f.kind in kinds]


class UnsupportedModule(NotImplementedError):
    """An extension has nothing for this module's parameters (KFAC for a BatchNorm,
    say): :meth:`SecondOrderExtension.check` raises it at the call's forward, and a
    backward that reaches one of them raises :class:`jacmem.errors.UnsupportedCurvatureError`
    before it begins, naming the parameters, the module and the fix."""


class SecondOrderExtension:
    """Base class. ``savefield``: the parameter attribute; ``kinds``: the factor kinds
    it needs (see the module docstring)."""

    savefield: str = ""
    kinds: tuple[FactorKind, ...] = ()
    #: its result for a parameter depends on the factors only through the vectors
    #: ``J_θ,nᵀ S[v, n]`` (``call.first_order``'s per-sample gradients): for a parameter
    #: that several calls use (tied weights), the engine sums those over the calls and
    #: computes it once, as for a parameter used directly (the cross terms counted)
    sums_calls: bool = False
    #: its result needs something of all of the factors' ``V`` columns before any (EKFAC:
    #: the Kronecker factors whose eigenbases it takes): where the autograd path hands the
    #: columns over in slices, it goes over them twice, ``fit`` on each (merged by
    #: ``merge_fit``), then ``compute`` on each with the whole fit in ``call.fitted``
    fits: bool = False

    def check(self, call: Call) -> None:
        """Raises :class:`UnsupportedModule` (why, and the fix) where it has nothing for
        the call's parameters; ``call`` has no factors yet (the engine asks at the call's
        forward, so that a backward it cannot serve raises before any result)."""

    def compute(self, call: Call) -> dict[str, Any]:
        """``{param name: result}`` for one call."""
        raise NotImplementedError

    def fit(self, call: Call) -> dict[str, Any]:
        """``{param name: what compute needs of all the columns}`` from this call's slice
        of them (where :attr:`fits`)."""
        raise NotImplementedError

    def merge_fit(self, a: Any, b: Any) -> Any:
        """One parameter's fits from two slices, merged (where :attr:`fits`)."""
        raise NotImplementedError

    def merge_chunks(self, a: Any, b: Any) -> Any:
        """One parameter's results from two slices of the factors' ``V`` axis, merged
        (the autograd path, :mod:`jacmem.engine.secondorder.autograd_path`, computes in slices): summed by
        default, tensor by tensor in a list."""
        if isinstance(a, (list, tuple)):
            return type(a)(x + y for x, y in zip(a, b))
        return a + b

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
