"""nn.Embedding and nn.EmbeddingBag (modes ``sum``, ``mean``, ``max``), with
``padding_idx``, ``max_norm``, ``scale_grad_by_freq``, ``offsets`` and
``per_sample_weights``.

Both layers gather rows of ``weight [V, D]``: position ``t`` of sample ``n`` reads row
``i[n, t]``. So each per-sample weight gradient is a scatter of per-position rows,

    grad[n] = Σ_t e_{i[n, t]} G[n, t]ᵀ        [V, D]

where ``G[n, t] ∈ R^D`` is what position ``t`` sends to its row:

* ``Embedding``, input ``[N, *]``, ``g [N, *, D]``: ``G[n, t] = c[n, t] g[n, t]``;
* ``EmbeddingBag``, one bag per sample, ``g [N, D]``: ``sum``: ``c[n, t] g[n]`` with ``c``
  the ``per_sample_weights`` (1 without); ``mean``: ``g[n] / |bag n|``; ``max``: for each
  ``d``, ``g[n, d]`` goes to the position whose row attained the maximum (recomputed from
  the weight, which the hyper-parameters hold by reference, not copied).

Semantics, as autograd has them:

* ``padding_idx``: ``Embedding`` gives that row zero gradient; ``EmbeddingBag`` drops
  those entries from their bag (and from the mean's count).
* ``max_norm``: the forward renormalises the rows it reads in place, under ``no_grad``,
  before the lookup. Autograd's gradient is w.r.t. the rows as used and does not
  differentiate the renormalisation; since the gradient of a gather does not read the
  weight, nothing here changes (``max`` mode reads the weight as renormed).
* ``scale_grad_by_freq``: autograd divides row ``v``'s gradient by the number of times
  ``v`` occurs in the whole mini-batch's input. The per-sample gradients here use the
  same batch-level counts, ``grad[n][v] = Σ_{t: i[n,t]=v} G[n, t] / count_batch(v)``, so
  that ``grad_batch.sum(0) == grad``; they are *not* the gradient sample ``n`` would get
  alone (with its own counts). The counts come from :class:`Batch`, which chunking over
  the batch does not slice. Clipping refuses such a layer (:func:`shared`): a sample's
  share changes with the other samples, so clipping it bounds nothing.
* ``per_sample_weights``: an input, not a parameter: autograd gives it its gradient if it
  requires one; here it is kept, detached, as the coefficients ``c``.

``keep`` turns the input into ``(i [N, T], mask [N, T] or None, per_sample_weights
[N, T] or None, Batch)``. An ``EmbeddingBag`` input that is 1d with ``offsets`` is padded
to ``[N_bags, L_max]`` with a mask (memory ``N_bags·L_max``, more than the flat input when
bag lengths vary a lot). Without ``include_last_offset`` (which ``keep`` cannot see) the
offsets make ``len(offsets)`` bags; with it, there is one more (empty) bag than outputs,
and the derivatives drop it: they use the first ``g.shape[0]`` rows.

Strategies: per-sample gradients are ``[N, V, D]``, large. Only ``batch_grad`` forms them.

* ``batch_grad`` ``scatter``: ``index_add`` into ``[N·V, D]``.
* ``batch_l2`` ``ghost``: ``Σ_{t,s} [i_t = i_s] G_t·G_s`` per sample, ``[N, T, T]``.
* ``batch_l2`` and ``sum_grad_squared`` ``segment``: sum ``G`` over the positions of each
  (sample, row) pair that occurs (found by sorting the pairs), ``S [N·T, D]``, of which
  the ``U ≤ N·T`` pairs fill the first rows and zeros the rest; then
  ``‖grad[n]‖² = Σ_{pairs of n} ‖S‖²`` and ``Σ_n grad[n]² = Σ_{pairs of row v} S²``,
  scattered into ``[V, D]``. Never ``[N, V, D]``.
* ``grad`` ``scatter``: ``index_add`` into ``[V, D]``.

The derivatives read nothing on the host (no size depends on the data; only ``keep``
of a 1d ``EmbeddingBag`` input does, in the forward): the row counts are an
``index_add``, not ``bincount``, and the pairs are sorted, not made ``unique``.
"""

from __future__ import annotations

from math import log2, prod

import torch
from opt_einsum import contract
from torch import Tensor, nn

from jacmem.derivatives.projection import factors, kronecker, outer_sum
from jacmem.derivatives.registry import Cost, Kronecker, layer, passthrough, register


class Batch:
    """The whole mini-batch's indices, for ``scale_grad_by_freq``'s counts. It is no
    tensor, tuple or list, so chunking over the batch hands it whole to every chunk (as
    it does a dict), and the counts are computed once, for the batch.

    idx: ``[N, T]`` (or ``[N, *]``); mask: ``[N, T]`` bool, the entries that are real
    (``None``: all).
    """

    def __init__(self, idx: Tensor, mask: Tensor | None):
        self.idx, self.mask = idx, mask
        self._counts: Tensor | None = None

    def counts(self, num_embeddings: int) -> Tensor:
        """How often each row occurs in the batch: ``[V]``, computed once."""
        if self._counts is None:
            self._counts = row_counts(self.idx, self.mask, num_embeddings)
        return self._counts


def row_counts(idx: Tensor, valid: Tensor | None, num_embeddings: int) -> Tensor:
    """How often each row occurs among the entries of ``idx [N, *]`` that ``valid`` (bool,
    the same shape; ``None``: all) marks: ``[V]``."""
    flat = idx.flatten()
    ones = torch.ones_like(flat) if valid is None else valid.flatten().to(flat.dtype)
    return flat.new_zeros(num_embeddings).index_add_(0, flat, ones)


def add_rows(target: Tensor, index: Tensor, rows: Tensor) -> Tensor:
    """``target[index[k]] += rows[k]`` in place, repeated indices summed:
    ``[R, D]``, ``[K]``, ``[K, D]`` -> ``target``. On CUDA ``index_add_``; elsewhere
    ``index_put_`` with ``accumulate``, which on the CPU is ~10x faster than ``index_add_``
    (1024 rows of 768 into a 50257-row table: 16 ms against 150 ms, torch 2.13)."""
    if target.is_cuda:
        return target.index_add_(0, index, rows)
    return target.index_put_((index,), rows, accumulate=True)


def _argument(args: tuple, kwargs: dict, position: int, name: str):
    return args[position] if len(args) > position else kwargs.get(name)


def keep_embedding(args: tuple, kwargs: dict) -> tuple:
    """``Embedding(input)``: input ``[N, *]`` -> ``(input, None, None, Batch)``."""
    idx = _argument(args, kwargs, 0, "input")
    return idx, None, None, Batch(idx, None)


def keep_bag(args: tuple, kwargs: dict) -> tuple:
    """``EmbeddingBag(input, offsets, per_sample_weights)`` -> ``(idx [B, L], mask [B, L]
    or None, per_sample_weights [B, L] or None, Batch)``, one bag per row."""
    idx = _argument(args, kwargs, 0, "input")
    offsets = _argument(args, kwargs, 1, "offsets")
    weights = _argument(args, kwargs, 2, "per_sample_weights")
    weights = None if weights is None else weights.detach()  # an input: its own gradient is autograd's
    if idx.dim() == 2:
        return idx, None, weights, Batch(idx, None)
    total = idx.shape[0]
    ends = torch.cat([offsets[1:], offsets.new_tensor([total])])
    lengths = ends - offsets
    width = int(lengths.max()) if lengths.numel() else 0
    pos = torch.arange(width, device=idx.device)
    mask = pos < lengths[:, None]
    # index ``total`` reads the extra slot appended below, for the positions past a bag's end
    where = torch.where(mask, offsets[:, None] + pos, total)
    idx = torch.cat([idx, idx.new_zeros(1)])[where]
    if weights is not None:
        weights = torch.cat([weights, weights.new_zeros(1)])[where]
    return idx, mask, weights, Batch(idx, mask)


def embedding_hyperparams(module: nn.Embedding) -> dict:
    """Keyword arguments of the derivatives, read off the module."""
    return dict(
        num_embeddings=module.num_embeddings,
        padding_idx=module.padding_idx,
        scale_grad_by_freq=module.scale_grad_by_freq,
        mode="lookup",
        weight=None,
    )


def bag_hyperparams(module: nn.EmbeddingBag) -> dict:
    """Keyword arguments of the derivatives; ``max`` mode holds the weight (a reference)."""
    return dict(
        num_embeddings=module.num_embeddings,
        padding_idx=module.padding_idx,
        scale_grad_by_freq=module.scale_grad_by_freq,
        mode=module.mode,
        weight=module.weight if module.mode == "max" else None,
    )


def _times(coef: Tensor | None, factor: Tensor) -> Tensor:
    return factor if coef is None else coef * factor


def positions(x: tuple, g: Tensor, *, num_embeddings, padding_idx, scale_grad_by_freq, mode, weight):
    """Each position's row and what it sends there: ``x`` from ``keep``, ``g`` ``[N, *, D]``
    (``Embedding``) or ``[N, D]`` (``EmbeddingBag``) -> ``idx [N, T]``, ``G [N, T, D]``."""
    idx, mask, weights, batch = x
    n, d = g.shape[0], g.shape[-1]
    idx = idx[:n].reshape(n, -1)
    valid = None if padding_idx is None else idx != padding_idx
    if mask is not None:
        valid = mask[:n] if valid is None else valid & mask[:n]
    coef = None if valid is None else valid.to(g.dtype)  # [N, T], None: all ones
    if weights is not None:
        coef = _times(coef, weights[:n])
    if mode == "mean":
        size = g.new_full((n, 1), idx.shape[1]) if valid is None else valid.sum(1, keepdim=True).clamp(min=1)
        coef = _times(coef, 1.0 / size.to(g.dtype))
    if scale_grad_by_freq:
        # clamped: a padded position (coefficient 0) may read a row that never occurs
        coef = _times(coef, 1.0 / batch.counts(num_embeddings)[idx].clamp(min=1).to(g.dtype))

    if mode == "lookup":
        rows = g.reshape(n, -1, d)
    elif mode == "max":
        picked = weight.detach()[idx]  # [N, T, D]
        if valid is not None:
            picked = picked.masked_fill(~valid[..., None], float("-inf"))
        winner = picked.argmax(1, keepdim=True)  # [N, 1, D]
        rows = g.new_zeros(picked.shape).scatter_(1, winner, g[:, None, :])
    else:  # sum, mean: the bag's gradient goes to each of its entries
        rows = g[:, None, :].expand(n, idx.shape[1], d)
    return idx, rows if coef is None else rows * coef[..., None]


def _keys(idx: Tensor, num_embeddings: int) -> Tensor:
    """[N, T] -> [N·T]: ``n·V + i``, the (sample, row) pair of each position."""
    offsets = torch.arange(idx.shape[0], device=idx.device)[:, None] * num_embeddings
    return (offsets + idx).flatten()


def _dims(xs, gs, mode, num_embeddings) -> tuple[int, int, int, int]:
    """Shapes of x and g -> (N, T, D, V)."""
    n = gs[0]
    t = prod(gs[1:-1]) if mode == "lookup" else xs[0][1]
    return n, t, gs[-1], num_embeddings


def _scatter_cost(xs, gs, *, mode, num_embeddings, **_):
    n, t, d, v = _dims(xs, gs, mode, num_embeddings)
    # filling [N, V, D], and reading it again for any norm or square, dominates
    return Cost(flops=n * v * d + 2 * n * t * d, workspace=2 * n * t * d)


def weight_batch_grad(x, g: Tensor, **hp) -> Tensor:
    """Per-sample gradients by ``index_add``: -> ``[N, V, D]``"""
    idx, rows = positions(x, g, **hp)
    n, t, d = rows.shape
    v = hp["num_embeddings"]
    out = rows.new_zeros(n * v, d).index_add_(0, _keys(idx, v), rows.reshape(n * t, d))
    return out.view(n, v, d)


def grad_cost(xs, gs, *, mode, num_embeddings, **_):
    n, t, d, v = _dims(xs, gs, mode, num_embeddings)
    return Cost(flops=2 * n * t * d, workspace=2 * n * t * d)


def weight_grad(x, g: Tensor, **hp) -> Tensor:
    """The summed gradient, by :func:`add_rows`: -> ``[V, D]``"""
    idx, rows = positions(x, g, **hp)
    return add_rows(rows.new_zeros(hp["num_embeddings"], rows.shape[-1]), idx.flatten(), rows.flatten(0, 1))


def ghost_cost(xs, gs, *, mode, num_embeddings, **_):
    n, t, d, v = _dims(xs, gs, mode, num_embeddings)
    return Cost(flops=2 * n * t * t * (d + 1), workspace=2 * n * t * d + 3 * n * t * t)


def weight_batch_l2_ghost(x, g: Tensor, **hp) -> Tensor:
    """Squared norms ``Σ_{t,s} [i_t = i_s] G_t·G_s``, without the gradients: -> ``[N]``"""
    idx, rows = positions(x, g, **hp)
    same = (idx[:, :, None] == idx[:, None, :]).to(rows.dtype)  # [N, T, T]
    return contract("nts,ntd,nsd->n", same, rows, rows)


def segments(x, g: Tensor, **hp) -> tuple[Tensor, Tensor]:
    """Sums of ``G`` over the positions of each (sample, row) pair that occurs:
    -> ``keys [N·T]`` (``n·V + v``), ``sums [N·T, D]``; the ``U`` pairs that occur fill the
    first ``U`` rows, and the rest hold key 0 and zero sums."""
    idx, rows = positions(x, g, **hp)
    keys, order = _keys(idx, hp["num_embeddings"]).sort()
    segment = torch.diff(keys, prepend=keys[:1]).ne(0).cumsum(0)  # [N·T]: the rank of each sorted position's pair
    sums = rows.new_zeros(keys.shape[0], rows.shape[-1]).index_add_(0, segment, rows.flatten(0, 1)[order])
    return keys.new_zeros(keys.shape).scatter_(0, segment, keys), sums


def _segment_cost(xs, gs, *, mode, num_embeddings, **_):
    n, t, d, v = _dims(xs, gs, mode, num_embeddings)
    return Cost(flops=n * t * (4 * d + 2 * log2(max(n * t, 2))), workspace=3 * n * t * d + 3 * n * t)


def weight_batch_l2_segment(x, g: Tensor, **hp) -> Tensor:
    """Squared norms from the per-(sample, row) sums: -> ``[N]``"""
    keys, sums = segments(x, g, **hp)
    n = g.shape[0]
    return sums.new_zeros(n).index_add_(0, keys // hp["num_embeddings"], sums.square().sum(1))


def weight_sum_grad_squared_segment(x, g: Tensor, **hp) -> Tensor:
    """``Σ_n grad[n]²`` from the per-(sample, row) sums, without ``[N, V, D]``: -> ``[V, D]``"""
    keys, sums = segments(x, g, **hp)
    v = hp["num_embeddings"]
    return sums.new_zeros(v, sums.shape[-1]).index_add_(0, keys % v, sums.square())


def grad_proj_cost(xs, gs, *, dim, kind, mode, num_embeddings, **_):
    """Each position's row projected, and its column of ``P_in`` gathered (``None`` for the
    dense kind: from per-sample gradients)"""
    if kind != "kronecker":
        return None
    n, t, d, v = _dims(xs, gs, mode, num_embeddings)
    k_rows, k_cols = factors(dim)
    return Cost(flops=2 * n * t * (d * k_cols + dim), workspace=n * t * (d + k_rows + k_cols))


def weight_grad_proj(x, g: Tensor, *, dim, kind, seed, name, **hp) -> Tensor:
    """The kronecker projection of ``weight [V, D]``: ``Σ_t P_rows[:, i_t] (P_cols G_t)ᵀ``,
    the columns of ``P_rows`` gathered at the ids (one-hot rows), never ``[N, V, D]``:
    -> ``[N, dim]``"""
    idx, rows = positions(x, g, **hp)
    p_rows, p_cols = kronecker(seed, name, dim, hp["num_embeddings"], rows.shape[-1], dtype=g.dtype, device=g.device)
    return outer_sum(p_rows.T[idx], rows @ p_cols.T)


def kronecker_input(x: tuple, out_shape, dtype, approx=None, *, num_embeddings, padding_idx, **_) -> Tensor:
    """KFAC-expand's input factor of a Linear on one-hot inputs, diagonal: ``a[v]`` =
    the count of index ``v`` among the ``N·T`` positions ``/ (N·T)``, 0 for
    ``padding_idx``: ``[V]`` (the layout of ``weight.T``)"""
    n = out_shape[0]
    idx = x[0][:n]
    counts = row_counts(idx, None if padding_idx is None else idx != padding_idx, num_embeddings)
    return counts.to(dtype) / (n * prod(out_shape[1:-1]))


def kronecker_refuse(approx=None, *, scale_grad_by_freq, **_) -> str | None:
    if approx == "reduce":
        return (
            "with kfac_approx='reduce' (its input factor, the per-sample means of the one-hot inputs, "
            "is a dense [V, V] matrix, not a diagonal); use kfac_approx='expand'"
        )
    if scale_grad_by_freq:
        return (
            "with scale_grad_by_freq=True (autograd scales each row's gradient by its count in the whole batch, "
            "so no per-sample Jacobian exists); construct it with scale_grad_by_freq=False"
        )
    return None


def shared(*, scale_grad_by_freq, **_) -> str | None:
    if scale_grad_by_freq:
        return (
            "has scale_grad_by_freq=True: autograd divides each row's gradient by its count in the whole batch, "
            "so a sample's share of it depends on the other samples and no sample has a gradient of its own. "
            "Construct it with scale_grad_by_freq=False"
        )
    return None


layer(
    nn.Embedding,
    hyperparams=embedding_hyperparams,
    shared=shared,
    keep=keep_embedding,
    kronecker=Kronecker(kronecker_input, channels_last=True, refuse=kronecker_refuse, transposed=True),
    ghost_factors={"weight": positions},  # one-hot rows: the row indices [N, T], what each sends [N, T, D]
)
layer(
    nn.EmbeddingBag,
    hyperparams=bag_hyperparams,
    keep=keep_bag,
    own_layout=True,
    ghost_factors={"weight": positions},
    shared=shared,
)  # one bag per row of axis 0
for _module in (nn.Embedding, nn.EmbeddingBag):
    register(_module, "weight", "batch_grad", "scatter", cost=_scatter_cost)(weight_batch_grad)
    register(_module, "weight", "grad", "scatter", cost=grad_cost)(weight_grad)
    register(_module, "weight", "batch_l2", "ghost", cost=ghost_cost)(weight_batch_l2_ghost)
    register(_module, "weight", "batch_l2", "segment", cost=_segment_cost)(weight_batch_l2_segment)
    register(_module, "weight", "sum_grad_squared", "segment", cost=_segment_cost)(weight_sum_grad_squared_segment)
    register(_module, "weight", "grad_proj", "kronecker", cost=grad_proj_cost)(weight_grad_proj)

# second-order extensions: an integer input, nothing to pass on
passthrough(nn.Embedding)
