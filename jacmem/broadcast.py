"""Broadcasts over the batch made explicit, op by op, so that what meets the batch gets
per-sample gradients.

A tensor without a batch axis that meets batched tensors in a forward pass (a class
token, a position embedding, a learnable scale, the output of an embedding called on
``[1, T]`` position ids) gets from autograd only the gradient summed over the samples:
the broadcast sums it. :class:`Broadcasts` watches such tensors, *origins*, while it is
active (a :class:`~torch.overrides.TorchFunctionMode`), and where one meets a batched
operand in an elementwise op it expands the origin to the batch first:

* ``x + pos_embed`` with ``x: [N, T, D]`` and ``pos_embed: [1, T, D]`` runs as
  ``x + pos_embed.expand(N, T, D)``, the same numbers; the gradient that arrives at the
  expanded tensor is ``[N, T, D]``, one row per sample: :attr:`Origin.on_use` gets it.
* ``cls_token.expand(N, -1, -1)`` is that expansion already.
* ops that act on each entry alone and keep the leading axis (``pos_embed[:, :T]``,
  ``.to(dtype)``, ``.contiguous()``) make a *derived* tensor; where it meets the batch,
  the same ops are replayed on the expanded origin, so the gradient still arrives there.

Any other op that reads an origin or a derived tensor (a matrix product, a reduction,
``pos_embed[0]``) may mix the samples' paths: :attr:`Origin.on_unsafe` is told the op's
name, and the caller must not trust the per-sample gradients of that origin (it falls
back to recomputation, or raises). Reading metadata (``.shape``, ``.dtype``) is safe.

The expansions are views: the forward costs what it cost, except for replayed ops
that copy (a dtype cast of an expanded origin makes ``N`` copies).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten

#: elementwise ops that broadcast their tensor operands against each other
_BROADCASTING = frozenset(
    f"{prefix}{op}{suffix}"
    for op in ("add", "sub", "mul", "div", "truediv")
    for prefix, suffix in (("", ""), ("__", "__"), ("__r", "__"), ("__i", "__"), ("", "_"))
)
#: ops that act on each entry alone, keep the leading axis, and pass gradients back
#: unchanged (a cast, a copy)
_IDENTITY = frozenset({"to", "contiguous", "clone", "type_as", "float", "double", "half", "bfloat16"})


@dataclass(eq=False)
class Origin:
    """A tensor whose uses by the batch are made explicit.

    ``on_use(expanded)``: a use expanded it, ``expanded: [N, *shape]`` (``shape``
    padded with leading ones to the rank of the batched operand, then axis 0 expanded
    from 1 to ``N``); its gradient, once it arrives, is that use's per-sample gradient.
    ``on_unsafe(op)``: an op read it (or a tensor derived from it) in a way that may
    mix the samples.
    """

    tensor: Tensor
    on_use: Callable[[Tensor], None]
    on_unsafe: Callable[[str], None]
    unsafe: list[str] = field(default_factory=list)


@dataclass(eq=False)
class _Derived:
    """A tensor made from an origin by ``replay(origin)``, entry by entry."""

    tensor: Tensor
    origin: Origin
    replay: Callable[[Tensor], Tensor]


def _keeps_batch_axis(index) -> bool:
    """Whether indexing with ``index`` keeps axis 0 whole (``x[:, :T]``, ``x[..., 0]``)."""
    first = index[0] if isinstance(index, tuple) and index else index
    return first is Ellipsis or (isinstance(first, slice) and first == slice(None))


class Broadcasts(TorchFunctionMode):
    """While active, every use of a watched origin by a batched elementwise op is
    expanded to the batch first (see the module docstring)."""

    def __init__(self):
        super().__init__()
        #: id(tensor) -> the origin or derived tensor it is
        self.watched: dict[int, Origin | _Derived] = {}

    def watch(self, origin: Origin) -> None:
        self.watched[id(origin.tensor)] = origin

    def _find(self, t) -> Origin | _Derived | None:
        w = self.watched.get(id(t)) if isinstance(t, Tensor) else None
        return w if w is not None and w.tensor is t else None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, spec = tree_flatten((args, kwargs))
        hits = [(i, w) for i, w in ((i, self._find(a)) for i, a in enumerate(flat)) if w is not None]
        name = getattr(func, "__name__", str(func))
        if not hits or name == "__get__" or name in ("size", "dim", "numel", "element_size", "is_floating_point"):
            return func(*args, **kwargs)
        if len(hits) == 1 and hits[0][0] == 0:
            derived = self._derive(func, name, hits[0][1], args, kwargs)
            if derived is not None:
                return derived
        if name in _BROADCASTING:
            return self._broadcast(func, flat, spec, hits)
        for _, w in hits:
            self._unsafe(w, name)
        return func(*args, **kwargs)

    def _derive(self, func, name: str, w, args, kwargs):
        """``func`` applied to a watched tensor alone: a derived tensor where it keeps
        each sample's entries apart, or an explicit expansion (``expand(N, ...)``)."""
        origin = w if isinstance(w, Origin) else w.origin
        replay = (lambda t: t) if isinstance(w, Origin) else w.replay
        rest = args[1:]
        if name == "expand":
            sizes = rest[0] if len(rest) == 1 and isinstance(rest[0], (tuple, list, torch.Size)) else rest
            out = func(*args, **kwargs)
            if w.tensor.dim() == len(sizes) and w.tensor.shape[0] == 1 and out.shape[0] > 1:
                expanded = self._expand(origin, origin.tensor.dim(), out.shape[0])
                return replay(expanded).expand(out.shape)
            return self._keep(out, origin, lambda t: replay(t).expand(sizes))
        if name == "__getitem__" and _keeps_batch_axis(rest[0]):
            out = func(*args, **kwargs)
            return self._keep(out, origin, lambda t: replay(t)[rest[0]])
        if name in _IDENTITY:
            out = func(*args, **kwargs)
            return self._keep(out, origin, lambda t: getattr(replay(t), name)(*rest, **kwargs))
        return None

    def _keep(self, out, origin: Origin, replay: Callable[[Tensor], Tensor]):
        if isinstance(out, Tensor):
            self.watched[id(out)] = _Derived(out, origin, replay)
        return out

    def _broadcast(self, func, flat: list, spec, hits):
        """An elementwise op between watched tensors and batched ones: each watched
        operand replayed on its origin expanded to the batch of the widest operand."""
        others = [a for i, a in enumerate(flat) if isinstance(a, Tensor) and i not in dict(hits)]
        batched = max(others, key=Tensor.dim, default=None)
        n = batched.shape[0] if batched is not None and batched.dim() > 0 else 1
        for i, w in hits:
            origin = w if isinstance(w, Origin) else w.origin
            rank = batched.dim() if batched is not None else 0
            if rank < w.tensor.dim() or (rank == w.tensor.dim() and w.tensor.shape[0] != 1) or n == 1:
                self._unsafe(w, getattr(func, "__name__", str(func)))
                continue
            replay = (lambda t: t) if isinstance(w, Origin) else w.replay
            if w.tensor.dim() < rank and not isinstance(w, Origin):
                self._unsafe(w, getattr(func, "__name__", str(func)))  # a derived tensor padded: rare, not replayed
                continue
            expanded = self._expand(origin, rank if isinstance(w, Origin) else origin.tensor.dim(), n)
            flat[i] = replay(expanded)
        args, kwargs = tree_unflatten(flat, spec)
        return func(*args, **kwargs)

    @staticmethod
    def _expand(origin: Origin, rank: int, n: int) -> Tensor:
        """The origin padded with leading ones to ``rank`` axes, axis 0 expanded to ``n``;
        its owner hears of it (its gradient is the use's per-sample gradient)."""
        t = origin.tensor
        padded = t.reshape((1,) * (rank - t.dim()) + tuple(t.shape))
        expanded = padded.expand(n, *padded.shape[1:])
        origin.on_use(expanded)
        return expanded

    @staticmethod
    def _unsafe(w, op: str) -> None:
        origin = w if isinstance(w, Origin) else w.origin
        origin.unsafe.append(op)
        origin.on_unsafe(op)
