"""TRAK (Park et al., ICML 2023) on jacmem's per-sample gradients, for traker's users.

TRAK scores with the gradients of the model's *output function* ``f`` (for
classification the margin ``f = z_y - logsumexp_{k≠y} z_k`` of the logits ``z``), not of
the loss: with ``Φ [n_train, D]`` the training examples' gradients of ``f``,

``τ(q)_n = φ_qᵀ (ΦᵀΦ + λ)⁻¹ φ_n · Q_n``,

``Q_n = ∂ℓ/∂f`` of example ``n``'s loss (the "out-to-loss" weight; for the margin,
``Q = 1 - p_y = sigmoid(-f)``). ``ΦᵀΦ`` is the Gauss-Newton matrix of ``f`` over the
training set, a dense ``[D, D]``: TRAK makes ``D`` small by a random projection of the
gradients (traker's CUDA kernel; here ``projection=k``, jacmem's
``BatchGradProjection(k, kind="dense")`` on every device, ``D = k ×`` the trainable
parameters). Without one, ``D`` is the number of trainable parameters: for small models
and the last layers of large ones (freeze the rest). One checkpoint; average the scores of
several checkpoints for TRAK's ensemble. Scores are in blocks from the store, as
:class:`~jacmem.attribution.Influence`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from jacmem.attribution import ranks
from jacmem.attribution.blocks import Block
from jacmem.attribution.influence import Influence


def margin(logits: Tensor, targets: Tensor) -> Tensor:
    """TRAK's classification output function: ``z_y - logsumexp_{k≠y} z_k``, ``[N]``, of
    logits ``[N, C]`` and class indices ``[N]``."""
    correct = logits.gather(1, targets[:, None])[:, 0]
    others = logits.scatter(1, targets[:, None], float("-inf"))
    return correct - others.logsumexp(1)


def _sigmoid_of_minus(f: Tensor) -> Tensor:
    return torch.sigmoid(-f)


class TRAK(Influence):
    """TRAK's scores (the module docstring). ``output_fn(model, batch) -> [N]`` gives the
    batch's outputs ``f`` (e.g. ``margin(model(x), y)``); ``out_to_loss(f) -> [N]`` its
    weights ``Q`` (default ``sigmoid(-f)``, the margin's with cross-entropy); ``damping``
    λ added to ``ΦᵀΦ`` (TRAK uses none; with more parameters than training examples
    ``ΦᵀΦ`` is singular, so give one). :meth:`fit`, :meth:`scores` as
    :class:`~jacmem.attribution.Influence`; :meth:`self_influence` is not TRAK's.
    ``projection=k``: TRAK's dense Johnson-Lindenstrauss projection of each parameter's
    gradient to ``k`` (``BatchGradProjection(kind="dense")``), the kernel ``[D, D]`` over
    ``D = k ×`` the trainable parameters."""

    projection_kind = "dense"

    def __init__(
        self,
        model: nn.Module,
        output_fn: Callable[[nn.Module, Any], Tensor],
        *,
        out_to_loss: Callable[[Tensor], Tensor] = _sigmoid_of_minus,
        damping: float = 0.0,
        projection: int | None = None,
        store: str | Path | None = None,
        progress: bool | None = None,
        process_group: Any = None,
    ):
        super().__init__(
            model,
            self._summed,
            curvature="identity",
            projection=projection,
            store=store,
            progress=progress,
            process_group=process_group,
        )
        if damping < 0:
            raise ValueError(f"jacmem.attribution.TRAK: damping must be >= 0, got {damping!r}")
        self.output_fn, self.out_to_loss, self.trak_damping = output_fn, out_to_loss, damping
        self._stored = "TRAK: output gradients times out-to-loss weights"
        self._outputs: Tensor | None = None

    def _summed(self, model: nn.Module, batch: Any) -> Tensor:
        """``Σ_n f_n``, whose per-sample gradients are ``φ_n``; keeps ``f`` for ``Q``."""
        f = self.output_fn(model, batch)
        if f.dim() != 1:
            raise ValueError(
                f"jacmem.attribution.TRAK: output_fn must return one output per example, [N]; got {list(f.shape)}"
            )
        self._outputs = f.detach()
        return f.sum()

    def _rows(self, batch: Any, role: str) -> Tensor:
        """``φ`` of the batch, ``[N, D]``; training rows (``"train"``) times ``Q``."""
        rows = super()._rows(batch, "query")
        return rows * self.out_to_loss(self._outputs)[:, None] if role == "train" else rows

    def fit(self, train_loader: Iterable) -> TRAK:
        """``(ΦᵀΦ + λ)⁻¹`` over the training set (with a process group, this rank's shard's
        ``ΦᵀΦ`` summed over the ranks), by its Cholesky factor."""
        ranks.check_sharded(self.group, train_loader, "training")
        dtype, device = self.params[0].dtype, self.params[0].device
        K = torch.zeros(self.width, self.width, dtype=dtype, device=device)
        for batch in self._bar(train_loader, "fitting TRAK's kernel"):
            rows = self._rows(batch, "curvature")
            K.addmm_(rows.T, rows)
        K = ranks.summed(self.group, {"K": K})["K"]
        K.diagonal().add_(self.trak_damping)
        L, info = torch.linalg.cholesky_ex(K)
        if info != 0:
            raise ValueError(
                f"jacmem.attribution.TRAK: ΦᵀΦ + {self.trak_damping} is singular ({self.width} parameters); give a "
                "damping > 0, or freeze parameters so that there are fewer than the training examples"
            )
        self.blocks = [Block("all", vector=tuple(self.slots))]
        self.preconditioners = [lambda X: torch.cholesky_solve(X.T, L).T]
        self.fitted = True
        return self

    def self_influence(self, train_loader: Iterable) -> Tensor:
        raise NotImplementedError(
            "jacmem.attribution.TRAK has no self-influence (TRAK defines none); take the diagonal of "
            "scores(train_loader, train_loader), or use Influence"
        )
