"""Hand-built pieces of the attribution tests' float64 references: a layer's inputs and
output gradients sample by sample (autograd), and a dense damped EK-FAC/KFAC block built
from them (explicit ``[P, P]`` matrices, never jacmem's code)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def tiny_mlp() -> nn.Module:
    """``Linear(4, 5) -> Tanh -> Linear(5, 3)``, float64, seeded: the attribution tests' model."""
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()


def summed_cross_entropy(model: nn.Module, batch) -> Tensor:
    """The ``loss_fn(model, batch)`` Influence takes: the batch's cross-entropies summed."""
    x, y = batch
    return F.cross_entropy(model(x), y, reduction="sum")


def layer_stats_of(model: nn.Module, loss_fn, x: Tensor, y: Tensor, layer: nn.Module) -> tuple[Tensor, Tensor]:
    """``layer``'s inputs ``[n, *, I]`` and output gradients ``[n, *, O]``, by one forward
    and one autograd call per sample of ``loss_fn(model, (x[i:i+1], y[i:i+1]))``."""
    xs, gs = [], []
    for i in range(len(x)):
        out = {}
        h = layer.register_forward_hook(lambda m, a, o: out.update(x=a[0], o=o))
        loss = loss_fn(model, (x[i : i + 1], y[i : i + 1]))
        h.remove()
        xs.append(out["x"].detach()[0])
        gs.append(torch.autograd.grad(loss, out["o"])[0][0])
    return torch.stack(xs), torch.stack(gs)


def with_ones(a: Tensor) -> Tensor:
    """``[..., I] -> [..., I + 1]``: a column of ones appended (a bias's input)."""
    return torch.cat([a, torch.ones(*a.shape[:-1], 1, dtype=a.dtype)], dim=-1)


def kronecker_block(vecs: Tensor, G: Tensor, A: Tensor, curvature: str, damping: float | None) -> Tensor:
    """The damped curvature ``[O·I, O·I]`` of a block whose per-sample matrices are ``vecs
    [n, O·I]`` (row-major ``[O, I]``): KFAC's basis ``U_G ⊗ U_A`` of ``G [O, O]``, ``A [I, I]``
    (``A [I]``: a diagonal, the identity basis), ``Λ`` the Kronecker product of their
    eigenvalues (``"kfac"``) or ``Σ_n (Uᵀ vec_n)²`` (``"ekfac"``); ``damping`` ``None``:
    ``0.1 ×`` the mean of ``Λ``."""
    lg, Ug = torch.linalg.eigh(G)
    la, Ua = (A, torch.eye(len(A), dtype=A.dtype)) if A.dim() == 1 else torch.linalg.eigh(A)
    U = torch.kron(Ug.contiguous(), Ua.contiguous())
    lam = torch.kron(lg, la) if curvature == "kfac" else (vecs @ U).square().sum(0)
    d = 0.1 * lam.mean() if damping is None else damping
    return U @ torch.diag(lam) @ U.T + d * torch.eye(len(lam), dtype=lam.dtype)


def folded_order(O: int, I: int, transposed: bool = False) -> Tensor:
    """For a weight and its bias stored one after the other (``weight [O, I]``, or ``[I, O]``
    ``transposed``, then ``bias [O]``), the position of each entry of the folded ``[O, I + 1]``
    (row-major; column ``I`` the bias) among those ``O·I + O`` stored entries."""
    o, c = torch.meshgrid(torch.arange(O), torch.arange(I + 1), indexing="ij")
    weight = c * O + o if transposed else o * I + c
    return torch.where(c == I, O * I + o, weight).flatten()


def unfold_order(C: Tensor, order: Tensor) -> Tensor:
    """``C`` of the folded layout as the matrix of the stored one: ``out[order][:, order] = C``."""
    out = torch.zeros_like(C)
    out[order[:, None], order[None, :]] = C
    return out
