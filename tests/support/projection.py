"""The projection rule of ``jacmem.BatchGradProjection``, built here from its documented
statement (``jacmem/derivatives/projection.py``'s docstring, ``docs/guide/extensions.rst``),
never from jacmem's code: the references that the projection's tests compare with."""

from __future__ import annotations

import hashlib
import math

import torch
from torch import Tensor, nn

DT = torch.float64
#: the dense rule's block of columns, as documented
BLOCK = 4096


def drawn(seed: int, name: str, rows: int, cols: int) -> Tensor:
    """``[rows, cols]`` of N(0, 1/rows) from a CPU generator seeded by the low 63 bits of
    the little-endian 8-byte BLAKE2b digest of ``"{seed}:{name}"``."""
    key = int.from_bytes(hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest(), "little")
    gen = torch.Generator().manual_seed(key & (2**63 - 1))
    return torch.randn(rows, cols, generator=gen, dtype=DT) / math.sqrt(rows)


def balanced(dim: int) -> tuple[int, int]:
    """``(k_rows, k_cols)``: the most balanced factors of ``dim``, the smaller first."""
    k_rows = max(d for d in range(1, dim + 1) if dim % d == 0 and d * d <= dim)
    return k_rows, dim // k_rows


def kronecker_rule(grads: Tensor, seed: int, name: str, dim: int) -> Tensor:
    """``vec(P_rows G_n P_colsᵀ)`` of per-sample gradients ``[N, R, C, ...]`` as stored
    (the axes after the first two flattened into the columns): ``[N, dim]``."""
    g = grads.flatten(2)
    k_rows, k_cols = balanced(dim)
    p_rows, p_cols = drawn(seed, name + ":rows", k_rows, g.shape[1]), drawn(seed, name + ":cols", k_cols, g.shape[2])
    return torch.einsum("kr,nrc,lc->nkl", p_rows, g, p_cols).flatten(1)


def dense_rule(grads: Tensor, seed: int, name: str, dim: int) -> Tensor:
    """``R vec(G_n)``, ``R``'s block ``b`` of :data:`BLOCK` columns drawn from ``"{name}:{b}"``:
    ``[N, *shape] -> [N, dim]``."""
    flat = grads.reshape(grads.shape[0], -1)  # (a 0-dim parameter's are [N])
    starts = range(0, flat.shape[1], BLOCK)
    R = torch.cat([drawn(seed, f"{name}:{b}", dim, min(BLOCK, flat.shape[1] - s)) for b, s in enumerate(starts)], 1)
    return flat @ R.T


def row_norms(model: nn.Module, name: str, numel: int, seed: int, dim: int, kind: str) -> Tensor:
    """``[dim]``: the Euclidean norm of each row of the matrix that :func:`rule` applies to
    parameter ``name``'s flattened per-sample gradient (``numel`` entries): the dense
    rule's ``R``, or the kronecker rule's ``P_rows ⊗ P_cols`` (row ``(k, l)``'s norm is
    ``‖P_rows[k]‖ ‖P_cols[l]‖``)."""
    if kind == "kronecker" and kronecker_layer(model, name):
        shape = dict(model.named_parameters())[name].shape
        k_rows, k_cols = balanced(dim)
        rows = drawn(seed, name + ":rows", k_rows, shape[0]).norm(dim=1)
        return torch.outer(rows, drawn(seed, name + ":cols", k_cols, numel // shape[0]).norm(dim=1)).flatten()
    starts = range(0, numel, BLOCK)
    squares = [drawn(seed, f"{name}:{b}", dim, min(BLOCK, numel - s)).square().sum(1) for b, s in enumerate(starts)]
    return torch.stack(squares).sum(0).sqrt()


def kronecker_layer(model: nn.Module, name: str) -> bool:
    """Whether the documented kronecker rule applies to parameter ``name`` of ``model``:
    the weight of a Linear, HF Conv1D, Embedding(Bag) or nn.Conv1d/2d/3d (not a transposed
    one, which takes the dense rule) that is called as a
    module (not a MultiheadAttention's ``out_proj``, which it calls functionally)."""
    owner, _, pname = name.rpartition(".")
    modules = dict(model.named_modules())
    module, parent = modules[owner], modules[owner.rpartition(".")[0]]
    if pname != "weight" or isinstance(parent, nn.MultiheadAttention):
        return False
    layers = (nn.Linear, nn.Embedding, nn.EmbeddingBag, nn.Conv1d, nn.Conv2d, nn.Conv3d)
    return isinstance(module, layers) or type(module).__name__ == "Conv1D"


def rule(model: nn.Module, name: str, grads: Tensor, seed: int, dim: int, kind: str) -> Tensor:
    """The documented projection of parameter ``name``'s per-sample gradients ``[N, *shape]``
    (``name`` its first qualified name in ``model``, as ``named_parameters()`` gives it)."""
    kronecker = kind == "kronecker" and kronecker_layer(model, name)
    return (kronecker_rule if kronecker else dense_rule)(grads, seed, name, dim)
