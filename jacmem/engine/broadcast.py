"""Broadcasts over the batch made explicit, op by op, so that what meets the batch gets
per-sample gradients.

A tensor without a batch axis that meets batched tensors in a forward pass (a class
token, a position embedding, a learnable scale, the output of an embedding called on
``[1, T]`` position ids) gets from autograd only the gradient summed over the samples:
the broadcast sums it. :func:`watch` returns a view of such a tensor, an *origin*, whose
ops jacmem sees (a tensor subclass with ``__torch_function__``, as Opacus's
ExpandedWeights; no other op pays anything). Where the view meets a batched operand in
an elementwise op, the origin is expanded to the batch first:

* ``x + pos_embed`` with ``x: [N, T, D]`` and ``pos_embed: [1, T, D]`` runs as
  ``x + pos_embed.expand(N, T, D)``, the same numbers; the gradient that arrives at the
  expanded tensor is ``[N, T, D]``, one row per sample: :attr:`Origin.on_use` gets it.
* ``cls_token.expand(N, -1, -1)`` is that expansion already, and ``prompts.repeat(N, 1, 1)``
  its copy.
* ops that act on each entry alone and keep the leading axis (``pos_embed[:, :T]``,
  ``.to(dtype)``, ``.contiguous()``) give another watched view, a *derived* one; where it
  meets the batch, the same ops are replayed on the expanded origin, so the gradient
  still arrives there.

Any other op that reads a watched view (a matrix product, a reduction, ``pos_embed[0]``)
may mix the samples' paths: :attr:`Origin.unsafe` gets the op's name, and the caller
must not trust the per-sample gradients of that origin (it falls back to
recomputation, or raises). Reading metadata (``.shape``, ``.dtype``) is safe. Results
are plain tensors, except derived views.

The expansions are views: the forward costs what it cost, except for replayed ops that
copy (a dtype cast of an expanded origin makes ``N`` copies).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from jacmem import compat, walker

#: elementwise ops that broadcast their tensor operands against each other
_BROADCASTING = frozenset(
    f"{prefix}{op}{suffix}"
    for op in ("add", "sub", "mul", "div", "truediv")
    for prefix, suffix in (("", ""), ("__", "__"), ("__r", "__"), ("__i", "__"), ("", "_"))
)
#: ops that act on each entry alone, keep the leading axis, and pass gradients back
#: unchanged (a cast, a copy)
_IDENTITY = frozenset({"to", "contiguous", "clone", "type_as", "float", "double", "half", "bfloat16"})
#: ops that only read metadata; an attribute (``__get__``) that gives a tensor (``.T``,
#: ``.mT``, ``.data``) is a use like any other
_METADATA = frozenset({"__get__", "size", "dim", "numel", "element_size", "is_floating_point", "__len__"})


@dataclass(eq=False)
class Origin:
    """A tensor whose uses by the batch are made explicit.

    ``on_use(expanded)``: a use expanded it, ``expanded: [N, *shape]`` (``shape``
    padded with leading ones to the rank of the batched operand, then axis 0 expanded
    from 1 to ``N``); its gradient, once it arrives, is that use's per-sample gradient.
    ``unsafe``: the ops that read it (or a view derived from it) in a way that may mix
    the samples; ``uses`` counts the expansions.
    """

    tensor: Tensor
    on_use: Callable[[Tensor], None]
    unsafe: list[str] = field(default_factory=list)
    uses: int = 0


class _Watched(Tensor):
    """A view of an origin, or of what ops derived from it entry by entry; ``_jacmem``:
    ``(origin, replay)``, with ``replay(t)`` the same ops applied to ``t`` (:func:`_same`
    for the origin's own view)."""

    _jacmem: tuple[Origin, Callable[[Tensor], Tensor]]

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with compat.plain_torch_function():
            return _dispatch(func, args, kwargs)


def watch(origin: Origin) -> Tensor:
    """A view of ``origin.tensor`` whose uses by the batch are made explicit (its
    autograd history goes on through the view)."""
    return _derived(origin.tensor, origin, _same)


def watched_tensor(t) -> Tensor | None:
    """The tensor whose watched view ``t`` is (the origin's, also for a view derived from
    it), or None where ``t`` is no watched view."""
    return t._jacmem[0].tensor if isinstance(t, _Watched) else None


def _same(t: Tensor) -> Tensor:
    return t


def _derived(t: Tensor, origin: Origin, replay: Callable[[Tensor], Tensor]) -> Tensor:
    view = t.as_subclass(_Watched)
    view._jacmem = (origin, replay)
    return view


def _watched(a) -> tuple | None:
    return a._jacmem if isinstance(a, _Watched) else None


def _dispatch(func, args: tuple, kwargs: dict):
    name = getattr(func, "__name__", str(func))
    flat, spec = compat.tree_flatten((args, kwargs))
    hits = [(i, w) for i, w in ((i, _watched(a)) for i, a in enumerate(flat)) if w is not None]
    if name in _METADATA:
        out = func(*args, **kwargs)
        if isinstance(out, Tensor):
            attribute = getattr(getattr(func, "__self__", None), "__name__", name)
            for _, (origin, _) in hits:
                origin.unsafe.append(f".{attribute}")
        return out
    if len(hits) == 1 and hits[0][0] == 0:
        derived = _derive(func, name, hits[0][1], args, kwargs)
        if derived is not None:
            return derived
    if name in _BROADCASTING:
        return _broadcast(func, name, flat, spec, hits)
    for _, (origin, _) in hits:
        origin.unsafe.append(name)
    return func(*args, **kwargs)


def _derive(func, name: str, watched: tuple, args: tuple, kwargs: dict) -> Tensor | None:
    """``func`` applied to a watched view alone: another view where it keeps each
    sample's entries apart, or an explicit expansion (``expand(N, ...)``)."""
    origin, replay = watched
    self, rest = args[0], args[1:]
    if name == "expand":
        sizes = _sizes(rest)
        out = func(*args, **kwargs)
        if self.dim() == len(sizes) and self.shape[0] == 1 and out.shape[0] > 1:
            return replay(_expand(origin, origin.tensor.dim(), out.shape[0])).expand(out.shape)
        return _derived(out, origin, lambda t: replay(t).expand(sizes))
    if name == "repeat":  # ``repeat(N, 1, …)`` of a leading 1 is ``expand(N, …)``, copied (PEFT's prompt tuning)
        sizes = _sizes(rest)
        if len(sizes) == self.dim() and self.shape[0] == 1 and sizes[0] > 1 and set(sizes[1:]) <= {1}:
            return replay(_expand(origin, origin.tensor.dim(), sizes[0])).contiguous()
        return None
    if name == "__getitem__" and _keeps_batch_axis(rest[0]):
        return _derived(func(*args, **kwargs), origin, lambda t: replay(t)[rest[0]])
    if name in _IDENTITY:
        return _derived(func(*args, **kwargs), origin, lambda t: getattr(replay(t), name)(*rest, **kwargs))
    return None


def _sizes(rest: tuple) -> tuple:
    """The sizes of ``expand(*sizes)`` or ``repeat(*sizes)``, given as one sequence or one by one."""
    return tuple(rest[0] if len(rest) == 1 and isinstance(rest[0], (tuple, list, torch.Size)) else rest)


def _keeps_batch_axis(index) -> bool:
    """Whether indexing with ``index`` keeps axis 0 whole (``x[:, :T]``, ``x[..., 0]``)."""
    first = index[0] if isinstance(index, tuple) and index else index
    return first is Ellipsis or (isinstance(first, slice) and first == slice(None))


def _broadcast(func, name: str, flat: list, spec, hits: list):
    """An elementwise op between watched views and batched tensors: each view replayed
    on its origin expanded to the batch of the widest other operand. A view that does
    not broadcast over that batch (it has a batch axis of its own, or meets no batch) is
    an unsafe use, and so is a derived view that would need padding to the batch's rank
    (its replay would index the wrong axes)."""
    positions = {i for i, _ in hits}
    others = [a for i, a in enumerate(flat) if isinstance(a, Tensor) and i not in positions]
    batched = max(others, key=Tensor.dim, default=None)
    rank = 0 if batched is None else batched.dim()
    n = batched.shape[0] if rank else 1
    for i, (origin, replay) in hits:
        view, base = flat[i], origin.tensor
        if n > 1 and replay is _same and (view.dim() < rank or (view.dim() == rank and view.shape[0] == 1)):
            flat[i] = _expand(origin, rank, n)
        elif n > 1 and replay is not _same and view.dim() == base.dim() == rank and view.shape[0] == base.shape[0] == 1:
            flat[i] = replay(_expand(origin, rank, n))
        else:
            origin.unsafe.append(name)
            flat[i] = view.as_subclass(Tensor)
    args, kwargs = compat.tree_unflatten(flat, spec)
    return func(*args, **kwargs)


def _expand(origin: Origin, rank: int, n: int) -> Tensor:
    """The origin padded with leading ones to ``rank`` axes, axis 0 expanded to ``n``;
    its owner hears of it (its gradient is the use's per-sample gradient)."""
    t = origin.tensor
    padded = t.reshape((1,) * (rank - t.dim()) + tuple(t.shape))
    expanded = padded.expand(n, *padded.shape[1:])
    origin.uses += 1
    origin.on_use(expanded)
    return expanded


def behind_broadcasts(tensors: list[Tensor]) -> list:
    """The autograd nodes of the graph of ``tensors`` whose output reaches them
    through a broadcast over the leading axis: a broadcasting op's output (an
    elementwise op's, ``expand``'s) has more than one row and one of its inputs has one
    (``[1, H, T, T] + [N, 1, 1, T]``), or fewer axes. Autograd
    sums the gradient over the batch there, so a module call behind it gets no
    per-sample gradient: it ran without the batch axis (T5's relative attention bias,
    called on ``[T, T]`` bucket ids), or the op mixes the samples (``h - h.mean(0)``).
    ``repeat`` counts as a broadcast: tiling the batch axis sums its copies' gradients.
    A watched origin (:func:`watch`) is expanded before it meets the batch: its call
    is behind ``expand``, whose broadcast :class:`Origin` answers for (where it has a
    use: one that met the batch only through an op jacmem cannot follow has none)."""

    def step(item: tuple) -> list[tuple]:  # (asked of broadcasting ops' nodes only: the others carry ``crossed`` on)
        fn, crossed = item
        rows = _leading(fn, 0)
        rank = len(compat.node_output_shape(fn, 0) or ()) if rows > 1 else 0
        following = []
        for nxt, nr in fn.next_functions:
            if nxt is not None:
                following.append((nxt, crossed or rows > 1 and _leading(nxt, nr, rank) == 1))
        return following

    behind: dict = {}
    starts = []
    for t in tensors:  # (walker.roots, inline; loops, not comprehensions: this runs at every model call)
        if isinstance(t, Tensor) and t.grad_fn is not None:
            starts.append((t.grad_fn, False))
    for fn, crossed in walker.Walk(starts, step, only=_BROADCAST_NODES).items:
        if crossed:
            behind[fn] = None
    return list(behind)


#: the autograd nodes of ops that broadcast their operands against each other
_BROADCAST_NODES = frozenset(
    f"{op}Backward" for op in "Add Sub Mul Div Expand Repeat Where Maximum Minimum Pow Addcmul Addcdiv Lerp".split()
)


def _leading(fn, index: int, rank: int = 0) -> int:
    """The size of the leading axis of output ``index`` of ``fn``'s forward op, 1 where it
    has fewer than ``rank`` axes (it broadcasts there); 0 where unknown."""
    shape = compat.node_output_shape(fn, index)
    if shape is None:
        return 0
    return 1 if len(shape) < rank else shape[0] if shape else 0
