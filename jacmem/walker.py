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
from collections.abc import Callable, Container, Hashable, Iterable, Iterator
from typing import Any

from torch import Tensor, nn

#: what :class:`Walk` strips from a node type's name before it asks ``only``
_DIGITS = "0123456789"


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
    """The items reached from ``starts``, each once, in the order visited: depth first (the
    last found first), or ``breadth`` first. An item is an autograd node, or a pair of a
    node and what the walk carries along the path to it (then ``key`` says what counts as
    visited: the whole item by default). ``step(item)`` gives the items it leads to; by
    default, a node's :func:`children`. ``None`` items are skipped. ``limit``: at most that
    many items; :attr:`cut` is then True where more were left. ``only``: the node types
    (their names without the trailing digits: ``"AddBackward"``) whose items ``step`` is
    asked about; any other item is a pair ``(node, carried)`` that leads to each of the
    node's :func:`children` with the same ``carried`` (no call per node where most nodes
    change nothing).

    The walk runs whole when made (one Python call, and one per item where ``step`` is
    given: it runs on each backward); iterate over it, or read :attr:`items`."""

    __slots__ = ("items", "cut")

    def __init__(
        self,
        starts: Iterable,
        step: Callable[[Any], Iterable] | None = None,
        *,
        limit: int | None = None,
        breadth: bool = False,
        key: Callable[[Any], Hashable] | None = None,
        only: Container[str] | None = None,
    ):
        #: the items, in the order visited
        self.items: list = []
        #: whether the walk stopped at ``limit`` with items left
        self.cut = False
        todo = deque(starts)
        take = todo.popleft if breadth else todo.pop
        seen: set = set()  # (held while the walk runs: no id is reused)
        while todo:
            item = take()
            mark = item if key is None or item is None else key(item)
            if mark is None or mark in seen:
                continue
            if limit is not None and len(seen) >= limit:
                self.cut = True
                return
            seen.add(mark)
            self.items.append(item)
            if only is not None and type(item[0]).__name__.rstrip(_DIGITS) not in only:
                node, carried = item
                for nxt, _ in node.next_functions:
                    if nxt is not None:
                        todo.append((nxt, carried))
                continue
            if step is not None:
                todo.extend(step(item))
                continue
            for nxt, _ in item.next_functions:
                if nxt is not None:
                    todo.append(nxt)

    def __iter__(self) -> Iterator:
        return iter(self.items)


def parameters(tensors) -> list[nn.Parameter]:
    """The ``nn.Parameter`` leaves whose ``AccumulateGrad`` nodes the graph of ``tensors``
    (a tensor or a sequence of them) reaches, in the order the walk finds them."""
    found = []
    for fn in Walk(roots(tensors)):
        variable = getattr(fn, "variable", None)  # (as leaf(fn), without the call per node)
        if isinstance(variable, nn.Parameter):
            found.append(variable)
    return found
