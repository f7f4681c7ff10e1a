"""A laplace-torch backend: jacmem's extensions behind laplace-torch's curvature interface::

    from laplace import Laplace
    from jacmem.laplace import JacmemGGN

    la = Laplace(model, "classification", subset_of_weights="all", hessian_structure="kron", backend=JacmemGGN)
    la.fit(train_loader)
    la.optimize_prior_precision()
    probs = la(X_test, pred_type="glm", link_approx="probit")

The backends mirror laplace-torch's BackPACK backend (``laplace/curvature/backpack.py``),
with jacmem in place of BackPACK, and keep its conventions:

* The loss is laplace's ``lossfunc``, ``CrossEntropyLoss`` or ``MSELoss`` with
  ``reduction="sum"``; every curvature and loss is multiplied by laplace's ``factor``
  (1 for classification, ½ for regression: ``MSELoss`` is twice the Gaussian negative
  log-likelihood), so ``diag`` returns ``factor · Σ_n diag(J_nᵀ Λ_n J_n)``.
* Classification outputs ``[N, ..., C]`` are flattened to ``[N·..., C]`` for the loss,
  as BackPACK's backend does.
* ``kron`` gives one entry per parameter, in ``model.parameters()`` order: ``[G, A]``
  for a weight (``[O, O]``, ``[I, I]``, the order of BackPACK's ``kflr``, so
  ``G ⊗ A`` is the block of the weight flattened row-major), ``[G]`` for a bias. A is
  multiplied by ``M / N`` (the batch over the data set size), so that the factors of
  the batches add up to the data set's. A parameter that has no Kronecker factors in
  jacmem (BatchNorm's weight and bias) gets its diagonal (the exact GGN's, or the
  empirical Fisher's ``Σ_n g_n²``) as a diagonal block;
  an Embedding gets ``[diag(A), G]`` (its weight is ``weight.T`` of a Linear on one-hot
  inputs); a grouped convolution (block-diagonal factors) is refused.
* A layer that shares its weight over positions (a convolution) follows curvlinops'
  ``kfac_approx="expand"`` convention by default, whose Kronecker diagonal is closer to
  the exact GGN diagonal than BackPACK's (``kfac_approx=None``); see :class:`JacmemInterface`.
* ``last_layer=True`` (laplace's ``subset_of_weights="last_layer"``, whose model is a
  ``FeatureExtractor``): the features come from a forward without a graph and jacmem
  extends the last layer alone, fed them; ``subnetwork_indices`` (laplace's
  ``"subnetwork"``) restricts ``diag``, ``full``, ``jacobians`` and ``gradients``.
* ``jacobians`` are ``[N, C, P]`` and ``gradients`` ``[N, P]``, with ``P`` the
  parameters (of ``subnetwork_indices`` where given) concatenated in order.
* The input ``x`` goes to the model as it comes: a tensor ``[N, *]``, or a dict-like
  batch (Hugging Face's) whose ``dict_key_x`` entry is ``[N, *]``.

jacmem computes the curvature through the modules of the model while the backward pass
runs; it must be able to follow the model's chain (see :class:`jacmem.ChainError`).
Importing this module imports laplace-torch (the ``laplace`` extra); ``import jacmem``
does not.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import torch
from torch import Tensor

try:
    from laplace.curvature import CurvatureInterface, EFInterface, GGNInterface
    from laplace.utils import Kron
except ModuleNotFoundError as err:
    raise ModuleNotFoundError(
        f'jacmem.laplace needs laplace-torch ({err}): pip install "jacmem[laplace]"', name=err.name
    ) from err

import jacmem

__all__ = ["JacmemInterface", "JacmemGGN", "JacmemEF"]

#: every attribute that the extensions used here write on a parameter
_FIELDS = ("grad_batch", "sum_grad_squared", "diag_ggn_exact", "diag_ggn_mc", "kfac", "kflr", "kfac_ef")


class JacmemInterface(CurvatureInterface):
    """What :class:`JacmemGGN` and :class:`JacmemEF` share: the parameters, the
    extension runs, ``diag`` and ``kron`` by the extensions each names, ``jacobians`` and
    ``gradients`` by :class:`jacmem.BatchGrad`.

    ``kfac_approx`` is ``kron``'s convention for weight sharing (a convolution's positions,
    a sequence's tokens), overridden per call by laplace's ``kfac_approx`` keyword:
    ``"expand"`` (the default, curvlinops' convention and laplace's default backend's),
    ``"reduce"``, or ``None`` (jacmem's per-layer default: BackPACK's convention for a
    convolution, whose Kronecker diagonal is farther from the exact GGN diagonal)."""

    def __init__(self, *args: Any, kfac_approx: str | None = "expand", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.kfac_approx = kfac_approx

    def _diag_extension(self, mc_samples: int | None) -> tuple[Any, str]:
        """``diag``'s extension and the attribute it writes; ``mc_samples``: laplace's keyword, if given."""
        raise NotImplementedError

    def _kron_extension(self, mc_samples: int | None, kfac_approx: str | None) -> tuple[Any, str]:
        """``kron``'s extension and the attribute it writes."""
        raise NotImplementedError

    def diag(self, x: Tensor, y: Tensor, **kwargs: Any) -> tuple[Tensor, Tensor]:
        """``factor · loss`` and the curvature's diagonal, ``factor ·`` the sum over samples: ``[P]``."""
        extension, field = self._diag_extension(kwargs.get("mc_samples"))
        with jacmem.extend(extension):
            _, loss = self._loss(x, y)
            got = self._run(loss, field, torch.zeros_like)
        diag = self._flat(self._every(got, f"{extension!r} diagonal"), batched=False)
        return self.factor * loss.detach(), self.factor * diag

    def kron(self, x: Tensor, y: Tensor, N: int, **kwargs: Any) -> tuple[Tensor, Kron]:
        """``factor · loss`` and the Kronecker-factored curvature as laplace's :class:`Kron`
        (see the module docstring for the factors and their scaling); laplace's keywords
        ``mc_samples`` and ``kfac_approx`` override the backend's."""
        if self.subnetwork_indices is not None:
            raise ValueError("jacmem.laplace: kron has no subnetwork; use hessian_structure='full' with a subnetwork")
        mc_samples = kwargs.get("mc_samples")
        extension, field = self._kron_extension(mc_samples, kwargs.get("kfac_approx", self.kfac_approx))
        with jacmem.extend(extension):
            _, loss = self._loss(x, y)
            try:
                got = self._run(loss, field, _zero_factors)
            except (
                jacmem.UnsupportedCurvatureError
            ) as err:  # raised before the backward: those get their diagonal below
                refused = {id(p) for p in err.params}
                kron = iter(self._run(loss, field, _zero_factors, [p for p in self.params if id(p) not in refused]))
                got = [None if id(p) in refused else next(kron) for p in self.params]
        missing = [p for p, g in zip(self.params, got) if g is None]
        if missing:  # no Kronecker factors in jacmem (a norm's weight): the diagonal
            diag_extension, diag_field = self._diag_extension(mc_samples)
            with jacmem.extend(diag_extension):
                _, loss = self._loss(x, y)
                diags = iter(self._run(loss, diag_field, torch.zeros_like, params=missing))
            got = self._every([_diagonal_block(next(diags)) if g is None else g for g in got], "diagonal")
        names = {p: n for n, p in self._model.named_parameters()}
        kfacs = [_laplace_factors(names[p], factors, len(y), N) for p, factors in zip(self.params, got)]
        return self.factor * loss.detach(), Kron(kfacs) * self.factor

    def _run(self, out: Tensor, field: str, zero, params: list | None = None, grad_outputs: Tensor | None = None):
        """One backward of ``out`` (inside the caller's jacmem block): the attribute
        ``field`` of each parameter in ``params`` (default: the curvature's), removed from
        the parameter; ``zero(p)`` for a parameter that ``out`` does not depend on, ``None``
        where jacmem gave none (the caller decides). ``.grad`` is untouched."""
        params = self.params if params is None else params
        try:
            grads = torch.autograd.grad(out, params, grad_outputs=grad_outputs, retain_graph=True, allow_unused=True)
            return [zero(p) if g is None else getattr(p, field, None) for p, g in zip(params, grads)]
        finally:
            for p in params:
                for name in _FIELDS:
                    if hasattr(p, name):
                        delattr(p, name)

    def _every(self, values: list, what: str) -> list:
        """``values``, one per parameter, or an error naming the first that has none."""
        for p, v in zip(self.params, values):
            if v is None:
                name = next(n for n, q in self._model.named_parameters() if q is p)
                raise ValueError(
                    f"jacmem.laplace: jacmem gave no {what} for parameter '{name}'; "
                    "freeze it (requires_grad=False) or make its module one jacmem supports"
                )
        return values

    def _output(self, x) -> Tensor:
        """The model's output on ``x``; for last-layer Laplace, the last layer's output on
        the features, which are computed without a graph (laplace's ``FeatureExtractor``),
        so that jacmem sees the last layer alone."""
        if not self.last_layer:
            return self.model(x)
        with torch.no_grad():
            _, features = self.model.forward_with_features(x)
        return self._model(features)

    def _loss(self, x, y) -> tuple[Tensor, Tensor]:
        """The model's output ``f`` on ``x`` and laplace's summed loss; classification
        outputs ``[N, ..., C]`` flattened to ``[N·..., C]``, as laplace's BackPACK backend."""
        f = self._output(x)
        if self.likelihood == "classification" and f.dim() > 2:  # a reshape jacmem follows only where needed
            f, y = f.reshape(-1, f.shape[-1]), y.reshape(-1)
        return f, self.lossfunc(f, y)

    def _batch_size(self, x: Tensor | MutableMapping) -> int:
        """N: of ``x [N, *]``, or of ``x[dict_key_x]`` for a dict-like input (a Hugging Face batch)."""
        return len(x[self.dict_key_x] if isinstance(x, MutableMapping) else x)

    def _flat(self, tensors: list[Tensor], batched: bool) -> Tensor:
        """Parameter-shaped tensors concatenated flat (``[N, P]`` where ``batched``, else
        ``[P]``), restricted to ``subnetwork_indices`` where given."""
        flat = torch.cat([t.flatten(start_dim=int(batched)) for t in tensors], dim=int(batched))
        return flat if self.subnetwork_indices is None else flat[..., self.subnetwork_indices]

    def jacobians(self, x: Tensor, enable_backprop: bool = False) -> tuple[Tensor, Tensor]:
        """Per-sample Jacobians of the outputs by one forward and one :class:`jacmem.BatchGrad`
        backward per output: ``x [N, *]`` -> ``Js [N, C, P]``, ``f [N, C]``.

        ``enable_backprop=True`` (Jacobians differentiable in ``x`` or the parameters)
        uses laplace's ``torch.func`` Jacobians: jacmem's quantities are constants."""
        if enable_backprop:
            return CurvatureInterface.jacobians(self, x, enable_backprop=True)
        with jacmem.extend(jacmem.BatchGrad()):
            f = self._output(x)
            if f.dim() != 2:
                raise ValueError(
                    f"jacmem.laplace: jacobians need model outputs [N, C], got {list(f.shape)}; "
                    "flatten the model's output (e.g. end the model with nn.Flatten())"
                )
            columns = []
            for k in range(f.shape[1]):
                onehot = torch.zeros_like(f)
                onehot[:, k] = 1.0
                got = self._run(f, "grad_batch", _zero_batch(len(f)), grad_outputs=onehot)
                columns.append(self._flat(self._every(got, "Jacobian"), batched=True))
        return torch.stack(columns, dim=1).detach(), f.detach()

    def gradients(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        """Per-sample gradients of laplace's summed loss by :class:`jacmem.BatchGrad`:
        ``Gs [N, P]`` and the loss (unscaled, as laplace's other backends)."""
        with jacmem.extend(jacmem.BatchGrad()):
            _, loss = self._loss(x, y)
            got = self._run(loss, "grad_batch", _zero_batch(self._batch_size(x)))
        return self._flat(self._every(got, "per-sample gradient"), batched=True), loss.detach()


class JacmemGGN(JacmemInterface, GGNInterface):
    """laplace-torch's GGN (``stochastic=True``: its Monte-Carlo Fisher) by jacmem:
    ``diag`` by :class:`jacmem.DiagGGNExact` (:class:`jacmem.DiagGGNMC`), ``kron`` by
    :class:`jacmem.KFLR` (:class:`jacmem.KFAC`), ``full`` from the Jacobians
    (laplace's own, for small models).

    ``num_samples`` is the Monte-Carlo samples of ``stochastic=True``, overridden per call
    by laplace's ``mc_samples`` keyword of ``diag``, ``kron`` and ``full``;
    ``kfac_approx`` as for :class:`JacmemInterface`."""

    def __init__(
        self,
        model: torch.nn.Module,
        likelihood: str,
        last_layer: bool = False,
        subnetwork_indices: torch.LongTensor | None = None,
        dict_key_x: str = "input_ids",
        dict_key_y: str = "labels",
        stochastic: bool = False,
        num_samples: int = 1,
        kfac_approx: str | None = "expand",
    ) -> None:
        super().__init__(
            model,
            likelihood,
            last_layer,
            subnetwork_indices,
            dict_key_x,
            dict_key_y,
            stochastic,
            num_samples,
            kfac_approx=kfac_approx,
        )

    def _diag_extension(self, mc_samples: int | None) -> tuple[Any, str]:
        if self.stochastic:
            return jacmem.DiagGGNMC(mc_samples=mc_samples or self.num_samples), "diag_ggn_mc"
        return jacmem.DiagGGNExact(), "diag_ggn_exact"

    def _kron_extension(self, mc_samples: int | None, kfac_approx: str | None) -> tuple[Any, str]:
        if self.stochastic:
            return jacmem.KFAC(mc_samples or self.num_samples, kfac_approx=kfac_approx), "kfac"
        return jacmem.KFLR(kfac_approx=kfac_approx), "kflr"

    def full(self, x: Tensor, y: Tensor, **kwargs: Any) -> tuple[Tensor, Tensor]:
        """laplace's GGN ``[P, P]`` from the Jacobians, with laplace's ``mc_samples``
        keyword (default ``num_samples``) for the Monte-Carlo Fisher of ``stochastic``."""
        num_samples, self.num_samples = self.num_samples, kwargs.get("mc_samples", self.num_samples)
        try:
            return GGNInterface.full(self, x, y)
        finally:
            self.num_samples = num_samples


class JacmemEF(JacmemInterface, EFInterface):
    """laplace-torch's empirical Fisher by jacmem: ``diag`` by
    :class:`jacmem.SumGradSquared` (``Σ_n g_n²``), ``kron`` by :class:`jacmem.KFACEF`
    (curvlinops' ``fisher_type="empirical"``, as laplace's ``CurvlinopsEF``), ``full``
    from :meth:`gradients`; ``kfac_approx`` as for :class:`JacmemInterface`."""

    def _diag_extension(self, mc_samples: int | None) -> tuple[Any, str]:
        return jacmem.SumGradSquared(), "sum_grad_squared"

    def _kron_extension(self, mc_samples: int | None, kfac_approx: str | None) -> tuple[Any, str]:
        return jacmem.KFACEF(kfac_approx=kfac_approx), "kfac_ef"


def _zero_batch(n: int):
    """The per-sample zeros ``[n, *p.shape]`` of a parameter ``p`` the output does not use."""
    return lambda p: p.new_zeros(n, *p.shape)


def _diagonal_block(diag: Tensor | None) -> list[Tensor] | None:
    """A parameter's GGN diagonal ``[*p.shape]`` as laplace's one-matrix block ``[[P, P]]``."""
    return None if diag is None else [torch.diag(diag.flatten())]


def _zero_factors(p: Tensor) -> list[Tensor]:
    """The Kronecker factors of a parameter the loss does not use: laplace's ``Kron``
    layout, ``[0 [O, O], 0 [I, I]]`` for a weight, ``[0 [P, P]]`` for a vector."""
    if p.dim() == 1:
        return [p.new_zeros(p.numel(), p.numel())]
    return [p.new_zeros(p.shape[0], p.shape[0]), p.new_zeros(p[0].numel(), p[0].numel())]


def _laplace_factors(name: str, factors: list[Tensor], M: int, N: int) -> list[Tensor]:
    """jacmem's factors of the parameter ``name`` (BackPACK's ``[G, A]``, ``[G]``, a
    LayerNorm's or RMSNorm's GGN diagonal ``[d]``, or jacmem's diagonal ``A [I]`` of an
    Embedding) as laplace's ``[Q, H]``, with ``Q ⊗ H``
    the block of the parameter flattened row-major, or ``[B]``; ``A`` scaled by ``M / N``."""
    if len(factors) == 1:  # a vector's [P, P] block, or a norm's GGN diagonal [P]
        (f,) = factors
        return [torch.diag(f) if f.dim() == 1 else f]
    G, A = factors
    if G.dim() == 3 or A.dim() == 3:
        raise ValueError(
            f"jacmem.laplace: {name} is a grouped convolution's weight, whose Kronecker factors are "
            "block-diagonal (one pair per group), which laplace's Kron cannot hold; use hessian_structure='diag'"
        )
    if A.dim() == 1:  # an Embedding: weight [V, D] is weight.T of a Linear on one-hot inputs
        return [torch.diag(A * M / N), G]
    return [G, A * M / N]
