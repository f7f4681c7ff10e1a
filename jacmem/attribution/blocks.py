"""The blocks of the curvature and their preconditioners: pure functions of tensors.

A sample's row ``[D]`` is its per-sample gradients, flattened and concatenated in the
order of the trainable parameters. The curvature is block-diagonal; a :class:`Block`
says which parameters it covers and how their slices of a row make its matrix:

* a Kronecker block, ``[O, I]``: a weight's gradient as the ``[O, I]`` its Kronecker
  factors approximate (``weight.T`` for HF's Conv1D and an Embedding, whose factors are
  of the transposed weight; a convolution's ``[C_out, C_in/g · prod(kernel)]``), with,
  where the layer folds it (``Influence._folds``), the bias's gradient as one more column
  (the bias as a column of ones in the activations); a bias alone is ``[O, 1]``;
* a vector block, ``[P]``: the parameters flattened (the diagonal and identity
  curvatures, and parameters whose Kronecker factors are a diagonal: LayerNorm, RMSNorm).

A preconditioner maps a block's matrices ``[n, *shape]`` to ``(C + λ)⁻¹`` of them (the
pseudo-inverse where ``C + λ`` has a zero eigenvalue).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Slot:
    """A parameter's place in a row: ``start`` and its ``shape``."""

    start: int
    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def of(self, rows: Tensor) -> Tensor:
        """This parameter's per-sample gradients of ``rows [n, D]``: ``[n, *shape]``."""
        return rows[:, self.start : self.start + self.size].reshape(len(rows), *self.shape)


@dataclass(frozen=True)
class Block:
    """``name`` (a parameter's, or a module's where its bias is folded into its weight's block);
    ``weight``: the slot of a weight whose Kronecker factors approximate its ``[O, I]``
    (``transposed``: of its dims 0 and 1 swapped), or ``None``; ``bias``: a bias's slot
    (a column of the matrix, or a bias alone), or ``None``; ``vector``: the slots of a
    vector block."""

    name: str
    weight: Slot | None = None
    bias: Slot | None = None
    transposed: bool = False
    vector: tuple[Slot, ...] = ()

    @property
    def kron(self) -> bool:
        return not self.vector

    def matrix(self, rows: Tensor) -> Tensor:
        """The block's matrices of ``rows [n, D]``: ``[n, O, I]`` (Kronecker) or ``[n, P]``."""
        if not self.kron:
            return torch.cat([s.of(rows).flatten(1) for s in self.vector], dim=1)
        cols = []
        if self.weight is not None:
            w = self.weight.of(rows)
            cols.append((w.transpose(1, 2) if self.transposed else w).flatten(2))
        if self.bias is not None:
            cols.append(self.bias.of(rows).unsqueeze(2))
        return torch.cat(cols, dim=2)

    def put(self, matrix: Tensor, rows: Tensor) -> None:
        """Write ``matrix`` (as :meth:`matrix` gives) into its slots of ``rows [n, D]``."""
        n = len(rows)
        if not self.kron:
            at = 0
            for s in self.vector:
                rows[:, s.start : s.start + s.size] = matrix[:, at : at + s.size]
                at += s.size
            return
        if self.weight is not None:
            s = self.weight
            shape = (s.shape[1], s.shape[0], *s.shape[2:]) if self.transposed else s.shape
            w = matrix[:, :, : matrix.shape[2] - (self.bias is not None)].reshape(n, *shape)
            rows[:, s.start : s.start + s.size] = (w.transpose(1, 2) if self.transposed else w).reshape(n, -1)
        if self.bias is not None:
            rows[:, self.bias.start : self.bias.start + self.bias.size] = matrix[:, :, -1]


@dataclass
class Eigen:
    """``(U_G Λ U_Aᵀ-basis curvature + λ)⁻¹``: the curvature ``(U_G ⊗ U_A) diag(vec Λ)
    (U_G ⊗ U_A)ᵀ`` of a Kronecker block, ``U_G [O, O]``, ``U_A [I, I]`` (``None``: the
    identity, a diagonal ``A``), ``lam [O, I]``, ``damping`` λ."""

    U_G: Tensor
    U_A: Tensor | None
    lam: Tensor
    damping: float | Tensor

    def rotate(self, X: Tensor) -> Tensor:
        """``U_Gᵀ X U_A``: ``[n, O, I]`` in the eigenbasis."""
        X = self.U_G.T @ X
        return X if self.U_A is None else X @ self.U_A

    def __call__(self, X: Tensor) -> Tensor:
        Y = self.U_G @ inverse(self.rotate(X), self.lam + self.damping)
        return Y if self.U_A is None else Y @ self.U_A.T


@dataclass
class Diagonal:
    """``(diag(lam) + λ)⁻¹`` of a vector block ``[n, P]``."""

    lam: Tensor
    damping: float | Tensor

    def __call__(self, X: Tensor) -> Tensor:
        return inverse(X, self.lam + self.damping)


def inverse(X: Tensor, denominator: Tensor) -> Tensor:
    """``X / denominator``, and 0 where the denominator is 0 (the pseudo-inverse: a
    direction of no curvature and no damping, in which no training example's vector has
    a component, scores nothing; a parameter the training loss never used)."""
    return torch.where(denominator == 0, torch.zeros_like(X), X / denominator.where(denominator != 0, 1))


def identity(X: Tensor) -> Tensor:
    """No curvature (TracIn, gradient dot products)."""
    return X


def eigh(M: Tensor) -> tuple[Tensor, Tensor]:
    """Eigenvalues and eigenvectors (columns, contiguous) of the symmetric ``M``,
    symmetrised first as kronfluence does (``(M + Mᵀ) / 2``)."""
    values, vectors = torch.linalg.eigh((M + M.T) / 2)
    return values, vectors.contiguous()


def damped(lam: Tensor, damping: float | None) -> float | Tensor:
    """``damping``, or kronfluence's heuristic for ``None``: 0.1 times the mean of ``lam``."""
    return 0.1 * lam.mean() if damping is None else damping
