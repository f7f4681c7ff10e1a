"""The second-order engine's graph: a module call as a :class:`Node`, what its consumers
hand it in a backward pass (:class:`Deposit`), one pass's state, and the chain check's
tolerance. Both ways through it, the module chain (:mod:`.chain`) and the autograd path
(:mod:`.autograd_path`), share these.
"""

from __future__ import annotations

from fractions import Fraction

import torch
from torch import Tensor, nn

from jacmem.derivatives import LossHessian, Passthrough
from jacmem.derivatives.quantities import FactorKind
from jacmem.engine import precision
from jacmem.extensions.secondorder.base import Factor


class ChainError(RuntimeError):
    """An operation that jacmem cannot backpropagate curvature through sits between
    a module and the loss."""


class Node:
    """One call of one module, as the second-order engine sees it."""

    __slots__ = (
        "module",
        "name",
        "site",
        "loss",
        "entry",
        "hp",
        "inputs",
        "out",
        "out_shape",
        "producers",
        "record",
        "params",
        "param_entry",
        "param_hyperparams",
        "param_input",
        "untracked_consumers",
        "grad_by_jacobian",
        "dtype",
        "kept_low_precision",
        "rerunnable",
        "tied",
        "__weakref__",
    )

    def __init__(self, module: nn.Module, name: str, loss: LossHessian | None, entry: Passthrough | None):
        self.module, self.name, self.loss, self.entry = module, name, loss, entry
        #: the module it is, or, for a functional op, the module whose output it follows
        self.site = name
        self.untracked_consumers: list[str] = []
        #: what the call kept: none for a call only the autograd path follows (its parameters' input alone)
        self.inputs: tuple = ()
        self.out: Tensor | None = None
        self.hp = None
        #: what it keeps is 16-bit (autocast), to cast to ``dtype`` on its first backward
        self.kept_low_precision = False
        #: the dtype it computes in, where that is not what autograd hands it
        self.dtype: torch.dtype | None = None
        #: ``inputs`` are the call's every argument (curvature-matrix products rerun it)
        self.rerunnable = False
        #: the names of its parameters that other calls use too (tied weights, a module
        #: called twice): their curvature is the sum over the calls' (:class:`Tied`)
        self.tied: set[str] = set()
        #: the call's record (:class:`jacmem.engine.hooks.Record`), which its parameters,
        #: their derivatives and what they keep come from; None for a call with none
        self.record = None

    def __repr__(self) -> str:
        return f"{self.name!r} ({type(self.module).__name__})"


class Deposit:
    """What a node's consumers handed over to it in one backward pass."""

    __slots__ = ("factors", "grads", "dense", "shares", "sources")

    def __init__(self):
        self.factors: dict[tuple, Factor] = {}
        #: the consumers' parts of the gradient w.r.t. the output (autograd's tensors)
        self.grads: list[Tensor] = []
        #: KFRA's batch-averaged GGN w.r.t. the output [D, D], where it arrived whole
        self.dense: Tensor | None = None
        #: key of a KFRA root factor -> the share of its merge's paths that arrived here
        self.shares: dict[tuple, Fraction] = {}
        self.sources: list[str] = []


class Tied:
    """One parameter used by several calls, in one backward pass: each call's vectors
    ``J_θ,nᵀ S[v, n]`` (``[V, N, *θ.shape]``), summed over the calls per factor key, so
    that the curvature made from them at the pass's end counts the cross terms."""

    __slots__ = ("param", "names", "columns", "count")

    def __init__(self, param: nn.Parameter):
        self.param = param
        #: the calls that used it, as ``'name' (Type)``
        self.names: list[str] = []
        #: factor key -> the calls' vectors so far, summed
        self.columns: dict[tuple, Factor] = {}
        #: (id(node), kind) -> how many of its columns one call has added (the autograd
        #: path's columns arrive one at a time, in the same order at every call)
        self.count: dict[tuple, int] = {}

    def add(self, key: tuple, kind: FactorKind, sign: float, B: Tensor) -> None:
        have = self.columns.get(key)
        self.columns[key] = Factor(kind, sign, B) if have is None else Factor(kind, sign, have.S.add_(B))


class PassState:
    """The engine's state in one backward pass: deposits in flight, results staged
    until its end."""

    __slots__ = ("deposits", "staged", "autograd", "tied", "empirical")

    def __init__(self):
        self.deposits: dict[int, Deposit] = {}
        #: where the autograd path runs this pass (:mod:`.autograd_path`), what its check
        #: expects at each module's output; the chain's hooks then stand by
        self.autograd: dict | None = None
        #: id(param) -> (param, owner node, {savefield: value})
        self.staged: dict[int, tuple] = {}
        #: id(param) -> the vectors of a parameter that several calls use
        self.tied: dict[int, Tied] = {}
        #: the loss nodes whose empirical Fisher's roots the chain made (one is allowed)
        self.empirical: list[Node] = []

    def handover(self, node: Node, i: int, factors, g: Tensor | None, dense, shares: dict) -> None:
        """Factors, KFRA's matrix and its shares to input ``i``'s producer; ``g``, the
        call's part of its gradient, where it is a row (:func:`_tap`)."""
        p = node.producers[i]
        if p is None:
            return
        d = self.deposits.setdefault(id(p), Deposit())
        if g is not None:
            self.deposit_grad(node, i, g)
        for key, f in factors.items():
            self.deposit(node, i, key, f.kind, f.sign, f.S)
        if dense is not None:
            d.dense = dense if d.dense is None else d.dense + dense
        for key, share in shares.items():
            d.shares[key] = d.shares.get(key, 0) + share

    def deposit_grad(self, node: Node, i: int, g: Tensor) -> None:
        d = self.deposits.setdefault(id(node.producers[i]), Deposit())
        d.grads.append(g)
        d.sources.append(node.name)

    def deposit(self, node: Node, i: int, key: tuple, kind: FactorKind, sign: float, S: Tensor | None):
        if S is None or node.producers[i] is None:
            return
        d = self.deposits.setdefault(id(node.producers[i]), Deposit())
        have = d.factors.get(key)
        d.factors[key] = Factor(kind, sign, S) if have is None else Factor(kind, sign, have.S.add_(S))


def several_losses(losses: list) -> ChainError:
    """The empirical Fisher's refusal of a backward whose root sums several loss calls:
    its root is one loss's gradient, which no sum of the calls' roots gives."""
    return ChainError(
        f"jacmem: the empirical Fisher needs one loss call per backward; this one has {len(losses)} "
        f"({', '.join(map(repr, losses))}): compute one loss over the whole batch, or use a GGN kind "
        "(KFAC, KFLR), whose losses' Hessians add"
    )


def tolerance(dtype: torch.dtype) -> float:
    """Relative tolerance of the chain check: rounding of two orders of summation."""
    if dtype == torch.float64:
        return 1e-8
    return 1e-3 if dtype == torch.float32 else 3e-2  # bfloat16, float16 (autocast)


def in_compute_dtype(node: Node, grad: Tensor) -> Tensor:
    """``grad`` in the node's compute dtype (:mod:`jacmem.engine.precision`); the first time,
    also what the node kept (an autocast forward keeps bf16 or fp16 tensors)."""
    if node.kept_low_precision:
        node.dtype = dtype = precision.compute_dtype((*node.inputs, *node.params.values()))
        node.inputs = tuple(_kept_as(x, dtype) for x in node.inputs)
        node.out = None if node.out is None else node.out.to(dtype)
        node.hp = precision.cast(node.hp, dtype)
        if node.params:
            node.param_input = precision.cast(node.param_input, dtype)
            node.param_hyperparams = precision.cast(node.param_hyperparams, dtype)
        node.kept_low_precision = False
    return grad if node.dtype is None or grad.dtype == node.dtype else grad.to(node.dtype)


def _kept_as(x: Tensor, dtype: torch.dtype) -> Tensor:
    """A kept input in ``dtype``: a stand-in for its shape (:func:`_shape_of`) stays one."""
    if x.dtype == dtype or not x.is_floating_point():
        return x
    if x.dim() and all(s == 0 for s in x.stride()):
        return x.new_zeros((), dtype=dtype).expand(x.shape)
    return x.to(dtype)
