"""The one float64 oracle of the conformance matrix. Nothing here imports jacmem.

- First order, ``ClipGrad`` and the private step: the per-sample autograd loop of
  ``tests/support/reference.py`` (sample ``n`` alone through the model, its loss term
  scaled as the batch loss scales it), and the quantities BackPACK 1.7.1 defines from it.
- Second order: the dense GGN ``Jᵀ H J`` and Hessian from ``torch.func``
  (``tests/support/secondorder_ref.py``), whole batch and per sample; diagonals, the
  diagonal blocks per parameter, and the block products. Kronecker factors (KFLR, KFRA,
  KFAC, EKFAC) are checked where their product is exact: one sample, every trainable
  parameter in a Linear of a plain chain (``Model.kron_exact``); there ``G ⊗ A`` (and
  EK-FAC's ``U diag(Λ) Uᵀ``) equals the GGN block (KFACEF: the gradient's outer product).
- A model in ``batch_first=False`` layout gives its samples along axis 1; the oracle
  slices them there (:func:`sample`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from tests.support import secondorder_ref
from tests.support.clipping import expected as clipped_sums
from tests.support.reference import variance
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

#: the directions the curvature-matrix products are applied to: ``K`` vectors per parameter
K = 2


def sample(X: Tensor, n: int, axis: int) -> Tensor:
    """Sample ``n`` of ``X`` with its batch axis kept (length one): [.., N, ..] -> [.., 1, ..]."""
    return X.narrow(axis, n, 1)


def per_sample_grads(model: nn.Module, lossf: nn.Module, X: Tensor, y: Tensor, axis: int = 0) -> dict[str, Tensor]:
    """name -> [N, *p.shape]: each sample's share of the batch loss's gradient (its
    ``reduction="sum"`` term over the loss's number of terms for ``"mean"``), by a loop."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = [p for p in model.parameters() if p.requires_grad]
    summed = type(lossf)(reduction="sum")
    with torch.no_grad():
        terms = type(lossf)(reduction="none")(model(X), y).numel()
    scale = 1.0 / terms if lossf.reduction == "mean" else 1.0
    rows = []
    for n in range(X.shape[axis]):
        term = summed(model(sample(X, n, axis)), y[n : n + 1]) * scale
        grads = torch.autograd.grad(term, params, allow_unused=True)
        rows.append([torch.zeros_like(p) if g is None else g.detach() for p, g in zip(params, grads)])
    return {name: torch.stack([r[i] for r in rows]) for i, name in enumerate(names)}


def first_order(grad_batch: dict[str, Tensor]) -> dict[str, dict[str, Tensor]]:
    """savefield -> name -> BackPACK's quantity, from the per-sample gradients."""
    return {
        "grad_batch": grad_batch,
        "batch_l2": {k: g.reshape(len(g), -1).square().sum(1) for k, g in grad_batch.items()},
        "sum_grad_squared": {k: g.square().sum(0) for k, g in grad_batch.items()},
        "variance": {k: variance(g) for k, g in grad_batch.items()},
        "grad": {k: g.sum(0) for k, g in grad_batch.items()},
    }


def median_threshold(grad_batch: dict[str, Tensor], n: int) -> float:
    """A flat threshold between the smallest and the largest per-sample norm (the mean's
    ``1/N`` undone, as Opacus defines them), so that some samples clip and some do not."""
    total = torch.stack([(g * n).reshape(len(g), -1).square().sum(1) for g in grad_batch.values()]).sum(0).sqrt()
    lo, hi = total.min().item(), total.max().item()
    return (lo + hi) / 2


def clipped(grad_batch: dict[str, Tensor], max_norm: float, n: int) -> dict[str, Tensor]:
    """name -> Σ_n c_n g_n: the flat-clipped sum of the per-sample gradients."""
    undone = {k: g * n for k, g in grad_batch.items()}
    out = clipped_sums(undone, max_norm)
    return dict(zip(undone, out.values()))


@dataclass
class Curvature:
    """The dense float64 curvature of one model on one batch."""

    ggn: dict[str, Tensor] = field(default_factory=dict)  # name -> [p, p] block
    hess: dict[str, Tensor] = field(default_factory=dict)
    ggn_diag_batch: dict[str, Tensor] = field(default_factory=dict)  # name -> [N, *shape]
    hess_diag_batch: dict[str, Tensor] = field(default_factory=dict)


def curvature(model: nn.Module, lossf: nn.Module, X: Tensor, y: Tensor, axis: int = 0) -> Curvature:
    """Dense GGN and Hessian blocks (whole batch), and per-sample diagonals."""
    if axis != 0:  # torch.func's reference slices axis 0: move the batch there and back
        model = _BatchAxis(model, axis)
        X = X.movedim(axis, 0)
    with sdpa_kernel(SDPBackend.MATH):  # forward-mode AD has no fused attention kernel
        ggn, hess = secondorder_ref.dense(model, lossf, X, y)
        ggn_n, hess_n = secondorder_ref.dense(model, lossf, X, y, per_sample=True)
    strip = _strip(model)
    return Curvature(
        ggn=strip(secondorder_ref.blocks(model, ggn)),
        hess=strip(secondorder_ref.blocks(model, hess)),
        ggn_diag_batch=strip(secondorder_ref.diagonals(model, ggn_n)),
        hess_diag_batch=strip(secondorder_ref.diagonals(model, hess_n)),
    )


class _BatchAxis(nn.Module):
    """A ``batch_first=False`` model seen with its batch on axis 0: [N, T, ..] -> model([T, N, ..])."""

    def __init__(self, inner: nn.Module, axis: int):
        super().__init__()
        self.inner, self.axis = inner, axis

    def forward(self, x: Tensor) -> Tensor:
        return self.inner(x.movedim(0, self.axis))


def _strip(model: nn.Module):
    prefix = "inner." if isinstance(model, _BatchAxis) else ""
    return lambda d: {k.removeprefix(prefix): v for k, v in d.items()}


def directions(model: nn.Module) -> dict[str, Tensor]:
    """name -> [K, *p.shape]: fixed random directions for the curvature-matrix products,
    float64 whatever the model's dtype (a setting casts them): ``torch.randn`` draws other
    numbers in float32 than in float64 from the same seed (its vectorised path, from 16
    entries on), so a float32 model's own draw would not be the oracle's directions."""
    g = torch.Generator().manual_seed(7)
    return {
        n: torch.randn(K, *p.shape, generator=g, dtype=torch.float64)
        for n, p in model.named_parameters()
        if p.requires_grad
    }


def block_product(block: Tensor, mat: Tensor) -> Tensor:
    """[p, p] @ [K, *shape] -> [K, *shape]."""
    return (mat.reshape(len(mat), -1) @ block.T).reshape(mat.shape)


def empirical_block(grad_batch: dict[str, Tensor], name: str) -> Tensor:
    """Σ_n vec(g_n) vec(g_n)ᵀ: KFACEF's curvature block, [p, p]."""
    g = grad_batch[name].reshape(len(grad_batch[name]), -1)
    return g.T @ g


#: the private step's learning rate
LR = 0.5


class Expected:
    """Everything the oracle says about one model on one batch, each part computed once
    when first asked: ``first`` (savefield -> name -> tensor), ``clipped`` and
    ``private_step`` (at the flat threshold ``threshold``), ``curv`` (:class:`Curvature`),
    ``empirical`` (KFACEF's block), ``directions`` and ``shapes``."""

    def __init__(self, model: nn.Module, lossf: nn.Module, X: Tensor, y: Tensor, axis: int, threshold: float):
        self.model, self.lossf, self.X, self.y, self.axis, self.threshold = model, lossf, X, y, axis, threshold
        self.n = X.shape[axis]
        self.shapes = {k: p.shape for k, p in model.named_parameters() if p.requires_grad}
        self._cache: dict = {}

    def _once(self, key, fn):
        if key not in self._cache:
            self._cache[key] = fn()
        return self._cache[key]

    @property
    def grad_batch(self) -> dict[str, Tensor]:
        return self._once("gb", lambda: per_sample_grads(self.model, self.lossf, self.X, self.y, self.axis))

    @property
    def first(self):
        return self._once("first", lambda: first_order(self.grad_batch))

    @property
    def clipped(self) -> dict[str, Tensor]:
        return self._once("clipped", lambda: clipped(self.grad_batch, self.threshold, self.n))

    @property
    def clipped_magnitude(self) -> dict[str, Tensor]:
        """name -> Σ_n c_n |g_n|: the size of the terms each entry of ``clipped`` sums (the
        same factors: a norm ignores signs)."""
        grads = {k: g.abs() for k, g in self.grad_batch.items()}
        return self._once("clipped magnitude", lambda: clipped(grads, self.threshold, self.n))

    @property
    def private_step(self) -> dict[str, Tensor]:
        params = dict(self.model.named_parameters())
        return {k: params[k].detach() - LR / self.n * c for k, c in self.clipped.items()}

    @property
    def curv(self) -> Curvature:
        return self._once("curv", lambda: curvature(self.model, self.lossf, self.X, self.y, self.axis))

    @property
    def empirical(self) -> dict[str, Tensor]:
        return {k: empirical_block(self.grad_batch, k) for k in self.shapes}

    @property
    def directions(self) -> dict[str, Tensor]:
        return self._once("dirs", lambda: directions(self.model))
