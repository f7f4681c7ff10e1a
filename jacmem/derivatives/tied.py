"""The norm of a sum over calls (a tied parameter: a module called twice, an embedding
tied to a Linear head), from each call's ghost factors, without per-sample gradients.

A layer may write one call's per-sample gradient of a matrix parameter ``[R, C]`` as
``G_n = Σ_t r[n, t] ⊗ c[n, t]`` (its ``ghost_factors``, see
:class:`jacmem.derivatives.registry.LayerDerivatives`): ``r`` is ``[N, T, R]``, or
``[N, T]`` row indices (one-hot rows, an embedding's), and ``c`` is ``[N, T, C]``.
Then ``⟨G_n, H_n⟩ = Σ_{t,s} ⟨r_t, r'_s⟩⟨c_t, c'_s⟩``, where ``⟨e_i, r'_s⟩ = r'_s[i]``
(a gather) and ``⟨e_i, e_j⟩ = [i = j]``: ``O(N T S (R + C))`` per pair of calls
(``O(N T S C)`` with an embedding), never ``[N, R, C]``. This is "phantom clipping"
(Ding et al., ICML 2024) for any number of calls of layers with factors.
"""

from __future__ import annotations

import torch
from torch import Tensor

from jacmem.derivatives.embedding import add_rows
from jacmem.derivatives.quantities import BATCH_L2, GRAD, SUM_GRAD_SQUARED, add_moments
from jacmem.derivatives.registry import Cost

#: the quantities :func:`summed_moments` gives from the ghost factors of a parameter's calls
FROM_FACTORS = frozenset((BATCH_L2, SUM_GRAD_SQUARED, GRAD))


def _row_gram(r: Tensor, s: Tensor) -> Tensor:
    """``⟨r_t, s_u⟩`` per sample: ``[N, T, R]`` or ``[N, T]`` indices, ``[N, U, R]`` or
    ``[N, U]`` -> ``[N, T, U]``"""
    if r.is_floating_point() and s.is_floating_point():
        return torch.einsum("ntr,nur->ntu", r, s)
    if not r.is_floating_point() and not s.is_floating_point():
        return r[:, :, None] == s[:, None, :]
    if r.is_floating_point():
        return _row_gram(s, r).transpose(1, 2)
    return s.gather(2, r[:, None, :].expand(-1, s.shape[1], -1)).transpose(1, 2)  # s_u[r_t]


def factor_dot(f: tuple[Tensor, Tensor], h: tuple[Tensor, Tensor]) -> Tensor:
    """``⟨G_n, H_n⟩`` of two calls' gradients from their ghost factors ``(r, c)``: -> ``[N]``"""
    cols = torch.einsum("ntc,nuc->ntu", f[1], h[1])
    return (_row_gram(f[0], h[0]).to(cols.dtype) * cols).sum((1, 2))


def summed_squared_norms(factors: list[tuple[Tensor, Tensor]], chunk_bytes: float = float("inf")) -> Tensor:
    """``‖Σ_k G_k‖²`` per sample over the calls' ghost factors:
    ``Σ_k ‖G_k‖² + 2 Σ_{k<l} ⟨G_k, G_l⟩`` -> ``[N]``, over slices of the samples whose
    cross-term matrices (two ``[n, T, S]`` per pair of calls) stay within ``chunk_bytes``"""
    n = factors[0][1].shape[0]
    widest = max(f[1].shape[1] for f in factors)
    step = max(1, min(n, int(chunk_bytes // (2 * widest * widest * factors[0][1].element_size()))))
    return (
        torch.cat([_summed(factors, slice(i, i + step)) for i in range(0, n, step)])
        if n
        else factors[0][1].new_zeros(0)
    )


def _summed(factors: list[tuple[Tensor, Tensor]], rows: slice) -> Tensor:
    """:func:`summed_squared_norms` of the samples ``rows``"""
    factors = [(r[rows], c[rows]) for r, c in factors]
    total = factor_dot(factors[0], factors[0])
    for k in range(1, len(factors)):
        total = total + factor_dot(factors[k], factors[k]) + 2 * sum(factor_dot(factors[k], h) for h in factors[:k])
    return total


def summed_moments(
    factors: list[tuple[Tensor, Tensor]], shape: tuple[int, int], wanted: set, chunk_bytes: float
) -> dict[str, Tensor]:
    """``wanted`` among ``sum_grad_squared`` (``Σ_n G_n ⊙ G_n``, ``[R, C]``), ``grad``
    (``Σ_n G_n``, ``[R, C]``) and ``batch_l2`` (``‖G_n‖²``, ``[N]``) of the per-sample
    gradients ``G_n`` summed over the calls, from their ghost factors (``shape`` is
    ``(R, C)``). ``G_n`` is formed a block of rows of a slice of samples at a time, as
    many as ``chunk_bytes`` holds (at least one row of one sample), and folded into the
    results in place: never ``[n, R, C]``, which for a tied 50k-token embedding is 154 MB
    a sample in float32."""
    cols = factors[0][1]
    n, (rows, width) = cols.shape[0], shape
    per_row = width * cols.element_size()
    step = max(1, min(n, int(chunk_bytes // per_row)))
    block = max(1, min(rows, int(chunk_bytes // (step * per_row))))
    out = {q: cols.new_zeros(shape) for q in wanted & {"sum_grad_squared", "grad"}}
    if "batch_l2" in wanted:
        out["batch_l2"] = cols.new_zeros(n)
    buffer = cols.new_empty(min(step, n) * block + 1, width)  # + a spare row, see _rows
    for i in range(0, n, step):
        for first in range(0, rows, block):
            g = _rows(factors, slice(i, i + step), first, min(block, rows - first), buffer)
            part = slice(first, first + g.shape[1])
            if "batch_l2" in out:
                out["batch_l2"][i : i + g.shape[0]] += torch.linalg.vecdot(g.flatten(1), g.flatten(1))
            squares, total = (out[q][part] if q in out else None for q in ("sum_grad_squared", "grad"))
            add_moments(g, squares, total)
    return out


def rows_at(factors: list[tuple[Tensor, Tensor]], index: Tensor) -> Tensor:
    """Rows ``index[n, t]`` of the calls' per-sample gradients summed, from their ghost
    factors ``(r, c)``: ``G_n[i_t] = Σ_s ⟨e_{i_t}, r_s⟩ c_s`` (a gather of ``r``, or
    ``[i_t = j_s]`` where ``r`` holds row indices ``j``), ``O(N T S C)`` per call:
    ``index [N, T]`` -> ``[N, T, C]``"""
    return sum(torch.bmm(_row_gram(index, r).to(c.dtype), c) for r, c in factors)


def add_index_terms(
    out: dict[str, Tensor], index_calls: list[tuple[tuple[Tensor, Tensor], Tensor | None]]
) -> dict[str, Tensor]:
    """Adds to ``out``'s ``sum_grad_squared`` and ``grad`` (``[R, C]``, those it holds) the
    terms of ``Σ_n (Σ_k G_k)²`` and ``Σ_n Σ_k G_k`` that involve the calls whose ghost
    factor ``r`` holds row indices ``i`` (an embedding's). With ``D`` the sum of the
    calls with dense ``r`` and ``E_l`` the others,
    ``Σ_n (D + Σ_l E_l)² = Σ_n D² + Σ_l Σ_n (2D + Σ_m E_m) ⊙ E_l``, and ``E_l`` is nonzero
    only in the rows ``i_l``: each term is :func:`rows_at` them, times ``c_l``, added at
    ``i_l`` (:func:`~jacmem.derivatives.embedding.add_rows`), ``O(N T S C)`` per pair of
    calls, never ``[N, R, C]``. ``index_calls``: each such call's factors ``(i, c)`` and
    ``D``'s rows at ``i`` (:func:`rows_at` the dense calls' factors; None where there is
    none). ``Σ_n D²`` is the caller's (one per-sample product per dense call,
    :func:`summed_moments`) -> ``out``"""
    for (index, cols), dense_rows in index_calls:
        if "grad" in out:
            add_rows(out["grad"], index.flatten(), cols.flatten(0, 1))
        if "sum_grad_squared" in out:
            rows = rows_at([f for f, _ in index_calls], index)
            rows = rows if dense_rows is None else rows.add_(dense_rows, alpha=2)
            add_rows(out["sum_grad_squared"], index.flatten(), rows.mul_(cols).flatten(0, 1))
    return out


def index_terms_cost(shapes: list[tuple[tuple, tuple]]) -> Cost:
    """The cost of :func:`add_index_terms` over calls whose ghost factors have ``shapes``"""
    n, flops, workspace = shapes[0][1][0], 0, 0
    for r, c in shapes:
        if len(r) == 2:  # row indices
            flops += sum(2 * n * c[1] * c2[1] * (c[2] + 1) for _, c2 in shapes) + 3 * n * c[1] * c[2]
            workspace = max(workspace, n * c[1] * (max(c2[1] for _, c2 in shapes) + 2 * c[2]))
    return Cost(flops, workspace)


def _rows(factors: list[tuple[Tensor, Tensor]], samples: slice, first: int, count: int, buffer: Tensor) -> Tensor:
    """Rows ``first : first + count`` of the summed per-sample gradients of ``samples``, in
    ``buffer`` (``[≥ n·count + 1, C]``): a batched product per call on its rows' slice of
    ``r``, the first of them writing the block (no zeroing), then an
    :func:`~jacmem.derivatives.embedding.add_rows` per call where ``r`` holds row indices
    (those outside the block go to the spare last row, never read, so that no mask needs a
    host sync) -> ``[n, count, C]``"""
    n = factors[0][1][samples].shape[0]
    flat = buffer[: n * count + 1]
    g = flat[:-1].view(n, count, -1)
    dense = [f for f in factors if f[0].is_floating_point()]
    if not dense:
        flat.zero_()
    for k, (r, c) in enumerate(dense):
        g.baddbmm_(r[samples, :, first : first + count].transpose(1, 2), c[samples], beta=min(k, 1))
    for r, c in factors:
        if not r.is_floating_point():
            r, c = r[samples], c[samples]
            local = r - first
            keys = torch.arange(n, device=r.device)[:, None] * count + local
            keys = keys.masked_fill_((local < 0) | (local >= count), n * count)
            add_rows(flat, keys.flatten(), c.flatten(0, 1))
    return g


def add_clipped_sum(total: Tensor | None, f: tuple[Tensor, Tensor], c: Tensor, shape: tuple[int, int]) -> Tensor:
    """``total += Σ_n c_n G_n`` in place, from one call's ghost factors ``(r, c)`` and the
    samples' coefficients ``c [N]``: one product ``rᵀ c`` over the ``N·T`` positions (one
    per sample where the positions of ``r`` or ``c`` do not flatten to a view: an LM
    head's column-major output gradient ``[N, T, V]``, 1 s to copy at V=50257, N·T=1024) with
    the narrower factor scaled (:func:`~jacmem.derivatives.embedding.add_rows` where ``r`` holds row indices), so that
    nothing of the wider factor's size (an LM head's ``[N, T, V]`` output gradient) is
    copied. ``total`` ``[R, C]`` (``shape``), or None: the product is the new total (no
    zeroed buffer first; zeros where ``r`` holds indices) -> ``total``"""
    r, cols = f
    coef = c.to(cols.dtype)[:, None, None]
    if not r.is_floating_point():
        total = cols.new_zeros(shape) if total is None else total
        return add_rows(total, r.flatten(), (cols * coef).flatten(0, 1))
    if r.shape[2] < cols.shape[2]:
        r = r * coef
    else:
        cols = cols * coef
    flat = all(t.shape[0] <= 1 or t.shape[1] <= 1 or t.stride(0) == t.shape[1] * t.stride(1) for t in (r, cols))
    for rows, right in [(r.flatten(0, 1), cols.flatten(0, 1))] if flat else zip(r, cols):
        total = torch.mm(rows.T, right) if total is None else total.addmm_(rows.T, right)
    return total


def projections(t: Tensor, u: Tensor, v: Tensor) -> Tensor:
    """``uₖᵀ T vₖ`` of a tensor seen as a matrix ``[R, C]`` (its first axis by the rest),
    ``u [R, k]``, ``v [C, k]``: the products over ``C`` in ``t``'s dtype (one read of
    ``t``, nothing of its size written), the rest in ``u``'s -> ``[k]``"""
    return ((t.reshape(u.shape[0], -1) @ v.to(t.dtype)).to(u.dtype) * u).sum(0)


def factor_projections(f: tuple[Tensor, Tensor], u: Tensor, v: Tensor) -> Tensor:
    """:func:`projections` of one call's summed gradient ``Σ_n G_n`` from its ghost
    factors ``(r, c)``: ``Σ_{n,t} ⟨r_t, u_k⟩⟨c_t, v_k⟩`` (``u[r_t]``, a gather, where ``r``
    holds row indices), ``O(N T (R + C) k)`` -> ``[k]``"""
    r, cols = f
    right = (cols.flatten(0, 1) @ v.to(cols.dtype)).to(u.dtype)
    left = (r.flatten(0, 1) @ u.to(r.dtype)).to(u.dtype) if r.is_floating_point() else u[r.flatten()]
    return (left * right).sum(0)


def _width(shape: tuple[int, ...]) -> int:
    """The entries a row factor of this shape gives a product: ``R``, 1 for indices."""
    return shape[2] if len(shape) == 3 else 1


def summed_norm_costs(shapes: list[tuple[tuple, tuple]], param_numel: int) -> dict[str, Cost]:
    """Costs of ``‖Σ_k G_k‖²`` over calls whose ghost factors have ``shapes`` (``(r, c)``
    shapes each): from the factors' cross terms (``ghost``), or by materialising and
    summing each call's per-sample gradients ``[N, R, C]`` (``per-sample gradients``)."""
    n = shapes[0][1][0]
    ghost = Cost(0, 0)
    for k, (r, c) in enumerate(shapes):
        for r2, c2 in shapes[: k + 1]:
            pairs = n * c[1] * c2[1]
            ghost = Cost(ghost.flops + 2 * pairs * (min(_width(r), _width(r2)) + c[2]), max(ghost.workspace, 2 * pairs))
    return {"ghost": ghost, "per-sample gradients": per_sample_cost(shapes, param_numel, n * param_numel)}


def per_sample_cost(shapes: list[tuple[tuple, tuple]], param_numel: int, entries: int) -> Cost:
    """Cost of the calls' summed per-sample gradients (:func:`summed_moments`), and of a
    norm or square of them, ``entries`` of them at a time"""
    n = shapes[0][1][0]
    result = n * param_numel
    flops = sum(2 * n * c[1] * _width(r) * c[2] for r, c in shapes) + (len(shapes) + 2) * result
    return Cost(flops, 2 * entries)
