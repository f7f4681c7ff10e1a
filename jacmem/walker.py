"""The one walk of autograd's graph that every part of jacmem makes (the recorder's
search for the parameters a backward reaches, the broadcast search, the second-order
engine's taps and chain errors, the autograd path's checks, the memory report).

The traversal rules live here, once: a node's successors are the nodes of its
``next_functions`` that are not ``None`` (an input that needs no gradient); a leaf is an
``AccumulateGrad`` node, whose ``variable`` is the tensor it accumulates into; each item
is visited once (held while the walk runs, so no id is reused); a walk may stop after
``limit`` items, and says so (:attr:`Walk.cut`). What a walk collects and where it stops
going down is its caller's: a ``step`` function gives, for one item, the items it leads
to.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Any

from torch import Tensor, nn


def edges(fn) -> list[tuple[Any, int]]:
    """The edges ``(node, output_nr)`` from autograd node ``fn`` down to the nodes of its
    inputs, those that need no gradient (``None``) left out, in ``next_functions`` order."""
    return [(nxt, nr) for nxt, nr in fn.next_functions if nxt is not None]


def children(fn) -> list:
    """The nodes ``fn``'s edges lead to (:func:`edges`), in order."""
    return [nxt for nxt, _ in fn.next_functions if nxt is not None]


def leaf(fn) -> Tensor | None:
    """The tensor an ``AccumulateGrad`` node ``fn`` accumulates into; None for any other node."""
    return getattr(fn, "variable", None)


def roots(tensors) -> list:
    """The autograd nodes of ``tensors`` (a tensor, or a sequence of tensors and anything
    else), those without one (leaves, tensors that need no gradient) left out."""
    given = [tensors] if isinstance(tensors, Tensor) else list(tensors) if isinstance(tensors, (tuple, list)) else []
    return [t.grad_fn for t in given if isinstance(t, Tensor) and t.grad_fn is not None]


class Walk:
    """The items reached from ``starts``, each once, as an iterator: depth first (the last
    found first), or ``breadth`` first. An item is an autograd node, or a pair of a node and
    what the walk carries along the path to it (then ``key`` says what counts as visited:
    the whole item by default). ``step(item)`` gives the items it leads to (by default, a
    node's :func:`children`), each computed once the caller has taken the item; ``None``
    items are skipped. ``limit``: at most that many items; :attr:`cut` is then True where
    more were left."""

    def __init__(
        self,
        starts: Iterable,
        step: Callable[[Any], Iterable] = children,
        *,
        limit: int | None = None,
        breadth: bool = False,
        key: Callable[[Any], Hashable] | None = None,
    ):
        self.starts, self.step, self.limit, self.breadth, self.key = starts, step, limit, breadth, key
        #: whether the walk stopped at ``limit`` with items left
        self.cut = False

    def __iter__(self) -> Iterator:
        todo = deque(self.starts)
        take = todo.popleft if self.breadth else todo.pop
        seen: set = set()
        while todo:
            item = take()
            mark = item if self.key is None else self.key(item)
            if item is None or mark is None or mark in seen:
                continue
            if self.limit is not None and len(seen) >= self.limit:
                self.cut = True
                return
            seen.add(mark)
            yield item
            todo.extend(self.step(item))

    def run(self) -> bool:
        """Walk to the end (the work is ``step``'s); whether nothing was cut."""
        for _ in self:
            pass
        return not self.cut


def parameters(tensors) -> Iterator[nn.Parameter]:
    """The ``nn.Parameter`` leaves whose ``AccumulateGrad`` nodes the graph of ``tensors``
    (a tensor or a sequence of them) reaches, as the walk finds them."""
    for fn in Walk(roots(tensors)):
        variable = leaf(fn)
        if isinstance(variable, nn.Parameter):
            yield variable
