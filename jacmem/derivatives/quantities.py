"""The vocabulary: the quantities first-order extensions ask of one parameter ``p``, and
the kinds of the factors second-order extensions backpropagate, as registered objects.

A :class:`Quantity` knows its name, its shape (:meth:`Quantity.shape`), whether it has
one row per sample (:attr:`Quantity.per_sample`: chunks over the batch are concatenated,
otherwise summed), whether it adds up over a parameter's calls (:attr:`Quantity.linear`),
its degree in the per-sample gradients (:attr:`Quantity.degree`: scaling them by ``c``
scales it by ``c**degree``), and how it derives from the per-sample gradients
(:meth:`Quantity.from_batch_grad`); a layer may also compute it directly, by strategies
registered for its name in the layer's file (:func:`jacmem.derivatives.register`). Its
parameters are the fields of a frozen dataclass: two parameterisations are two quantities
(two keys of the planner's cache, two entries of a result). One registration
(:func:`quantity`) adds one; the built-in four:

====================  ==========================================  =================
quantity              meaning                                     shape
====================  ==========================================  =================
``batch_grad``        per-sample gradients g_n                    ``[N, *p.shape]``
``batch_l2``          their squared norms ‖g_n‖²                  ``[N]``
``sum_grad_squared``  Σ_n g_n ⊙ g_n                               ``p.shape``
``grad``              Σ_n g_n (what autograd puts in ``.grad``)   ``p.shape``
====================  ==========================================  =================

A quantity without parameters equals its name (``BATCH_GRAD == "batch_grad"``, with the
same hash), so the names users and the engine pass work wherever the object does;
:func:`as_quantity` turns a name into the registered object, once, where it is given.

A :class:`FactorKind` says what the outer products of a second-order factor sum to
(:mod:`jacmem.extensions.secondorder.base`): :data:`EXACT`, :class:`MonteCarlo` with its
sample count, :data:`EMPIRICAL`, :data:`RESIDUAL`, :data:`DENSE`. :func:`factor_kind`
reads the names extensions give (``"exact"``, ``"mc3"``), once; downstream, code asks the
object (``kind.samples``), never its name.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import Tensor


class Quantity(str):
    """One quantity of one parameter (module docstring). A quantity *is* its key, a
    ``str``: its name, followed by its parameters where it has any
    (``grad_sketch(dim=4, seed=0)``), so that the dicts and sets the engine keys by
    quantities cost what dicts of names cost, and a name given for a quantity without
    parameters finds it.

    A subclass sets the class attributes below, declares its parameters' names in
    :attr:`parameters`, defines :meth:`shape` and :meth:`from_batch_grad`, and is
    registered with :func:`quantity`. An instance is made with its parameters by keyword
    (``GradSketch(dim=4, seed=0)``, ``docs/guide/custom.rst``); they are read as attributes (``q.seed``) and handed to
    its direct strategies as keyword arguments (:meth:`arguments`). A parameter is a
    hashable value whose ``repr`` tells it apart (an int, a float, a string, a tuple of
    them): two parameterisations are two keys, hence two plans.
    """

    #: the registered name
    name: ClassVar[str] = ""
    #: the names of its parameters, in the order the key spells them
    parameters: ClassVar[tuple[str, ...]] = ()
    #: one row per sample (``[N, ...]``): chunks of the batch are concatenated; otherwise
    #: it is a sum over the samples, and chunks add
    per_sample: ClassVar[bool] = False
    #: it adds up over the calls of a parameter (weight tying, loops)
    linear: ClassVar[bool] = False
    #: scaling every per-sample gradient by ``c`` scales it by ``c ** degree``
    degree: ClassVar[int] = 1
    #: its shape in words, for errors (``"[N, *param.shape]"``)
    spelled: ClassVar[str] = ""
    #: its value depends on the parameter's stable name (a projection's matrices): its
    #: direct strategies and :meth:`from_batch_grad` take it as ``name=``
    named: ClassVar[bool] = False
    #: where a direct strategy of it applies, one of them computes it, never per-sample
    #: gradients reduced (the two give different values: a projection's rules)
    exclusive: ClassVar[bool] = False

    def __new__(cls, **params):
        missing = [p for p in cls.parameters if p not in params]
        unknown = [p for p in params if p not in cls.parameters]
        if missing or unknown or not cls.name:
            raise TypeError(
                f"quantity {cls.__name__} ({cls.name!r}) takes the parameters {list(cls.parameters)} by keyword; "
                f"got {sorted(params)}"
            )
        for value in params.values():
            hash(value)  # a parameter must be hashable: the plan cache keys on it
        key = cls.name
        if cls.parameters:
            key += "(" + ", ".join(f"{p}={params[p]!r}" for p in cls.parameters) + ")"
        self = super().__new__(cls, key)
        self.__dict__.update(params)
        return self

    def __setattr__(self, name, value):
        raise AttributeError(f"quantity {self} is immutable: make another with other parameters")

    def __reduce__(self):
        return _rebuild, (type(self), self.arguments())

    def __repr__(self) -> str:
        """A quantity without parameters as its name's (messages quote it as before);
        one with parameters as its constructor call, ``GradSketch(dim=4, seed=0)``."""
        key = str.__str__(self)
        return str.__repr__(key) if not self.parameters else f"{type(self).__name__}{key[len(self.name) :]}"

    def arguments(self) -> dict:
        """Its parameters by name: the keyword arguments of its direct strategies and their costs."""
        return {p: self.__dict__[p] for p in self.parameters}

    def shape(self, n: int, param_shape: tuple[int, ...]) -> tuple[int, ...]:
        """Its shape for ``n`` samples of a parameter of ``param_shape``."""
        raise NotImplementedError

    def from_batch_grad(self, batch_grad: Tensor) -> Tensor:
        """It from (a chunk of) per-sample gradients ``[n, *p.shape]``: ``[n, ...]`` where
        :attr:`per_sample`, else their contribution to the sum over the samples (with
        ``name=``, the parameter's stable name, where it is :attr:`named`)."""
        raise NotImplementedError


def _rebuild(cls: type[Quantity], params: dict) -> Quantity:
    return cls(**params)


#: name -> the registered quantity's class
QUANTITIES: dict[str, type[Quantity]] = {}


def quantity(cls: type[Quantity]) -> type[Quantity]:
    """Decorator: register a :class:`Quantity` subclass under its ``name``; strategies
    that compute it directly then register for that name in the layer files
    (:func:`jacmem.derivatives.register`), and any it has not come from per-sample
    gradients (:meth:`Quantity.from_batch_grad`)."""
    if not (isinstance(cls, type) and issubclass(cls, Quantity) and cls.name and cls.spelled):
        raise TypeError(f"jacmem.quantity: {cls!r} must subclass Quantity and set name and spelled")
    QUANTITIES[cls.name] = cls
    return cls


def as_quantity(spec: str | Quantity) -> Quantity:
    """The registered quantity ``spec`` names (a quantity passes as it is); raises
    ``ValueError`` listing the names for an unknown one, ``TypeError`` for one that takes
    parameters."""
    if isinstance(spec, Quantity):
        return spec
    cls = QUANTITIES.get(spec)
    if cls is None:
        raise ValueError(f"unknown quantity {spec!r}; valid: {', '.join(QUANTITIES)}")
    return cls()


def _param_shape(n: int, param_shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(param_shape)


@quantity
class PerSampleGradients(Quantity):
    """g_n: ``[N, *p.shape]``."""

    name, per_sample, linear, degree, spelled = "batch_grad", True, True, 1, "[N, *param.shape]"

    def shape(self, n, param_shape):
        return (n, *param_shape)

    def from_batch_grad(self, batch_grad):
        return batch_grad


@quantity
class SquaredNorms(Quantity):
    """‖g_n‖²: ``[N]``."""

    name, per_sample, linear, degree, spelled = "batch_l2", True, False, 2, "[N]"

    def shape(self, n, param_shape):
        return (n,)

    def from_batch_grad(self, batch_grad):
        return squared_norms(batch_grad)


@quantity
class SecondMoment(Quantity):
    """Σ_n g_n ⊙ g_n: ``p.shape``."""

    name, per_sample, linear, degree, spelled = "sum_grad_squared", False, False, 2, "param.shape"
    shape = staticmethod(_param_shape)

    def from_batch_grad(self, batch_grad):
        return sum_of_squares(batch_grad)[0]


@quantity
class SummedGradient(Quantity):
    """Σ_n g_n, what autograd puts in ``.grad``: ``p.shape``."""

    name, per_sample, linear, degree, spelled = "grad", False, True, 1, "param.shape"
    shape = staticmethod(_param_shape)

    def from_batch_grad(self, batch_grad):
        return batch_grad.sum(0)


BATCH_GRAD, BATCH_L2, SUM_GRAD_SQUARED, GRAD = PerSampleGradients(), SquaredNorms(), SecondMoment(), SummedGradient()


def squared_norms(batch_grad: Tensor) -> Tensor:
    """‖g_n‖² per sample, one fused reduction without a squared copy: [n, *shape] -> [n]
    (``shape`` may be ``()``: a 0-dim parameter's per-sample gradients are ``[n]``)"""
    return torch.linalg.vector_norm(batch_grad.unsqueeze(-1).flatten(1), dim=1).square_()


#: bytes of samples squared at once by :func:`sum_of_squares`
_SQUARE_BLOCK_BYTES = 4 * 2**20
#: per-sample size from which sum_of_squares takes one fused call per sample
_SAMPLE_LOOP_BYTES = 64 * 2**10


def sum_of_squares(batch_grad: Tensor, with_sum: bool = False) -> tuple[Tensor, Tensor | None]:
    """Σ_n g_n ⊙ g_n, and Σ_n g_n where ``with_sum`` (else None): [n, *shape] -> shape,
    shape (:func:`add_moments` into zeros)."""
    out = batch_grad.new_zeros(batch_grad.shape[1:])
    total = batch_grad.new_zeros(out.shape) if with_sum else None
    add_moments(batch_grad, out, total)
    return out, total


def add_moments(batch_grad: Tensor, squares: Tensor | None, total: Tensor | None) -> None:
    """``squares += Σ_n g_n ⊙ g_n`` and ``total += Σ_n g_n`` in place (either may be
    None): [n, *shape] into shape.

    A sample of :data:`_SAMPLE_LOOP_BYTES` or more: one fused multiply-add per sample
    into the result (``addcmul_``: each gradient read once, no squared copy), 2.5-3.5×
    faster than squaring and summing on the seed CNN's convs. Smaller ones: as many
    samples at a time as fill :data:`_SQUARE_BLOCK_BYTES`, squared and summed (a call per
    sample would cost more than its work). A norm over axis 0 (``vector_norm(dim=0)``)
    would need no copy but runs some 50× slower on CPU. The sum is taken sample by sample
    (or block by block) too, while that is in cache: on the seed CNN's two large convs,
    6-10% less time than a second pass over the whole chunk (2 threads).
    """
    per_sample = max(batch_grad[0].numel() * batch_grad.element_size(), 1) if len(batch_grad) else 1
    if per_sample >= _SAMPLE_LOOP_BYTES:
        for g in batch_grad:
            if squares is not None:
                squares.addcmul_(g, g)
            if total is not None:
                total.add_(g)
        return
    for block in batch_grad.split(max(1, _SQUARE_BLOCK_BYTES // per_sample)):
        if squares is not None:
            squares += block.square().sum(0)
        if total is not None:
            total += block.sum(0)


def derive(batch_grad: Tensor, quantities: Iterable[str | Quantity], name: str | None = None) -> dict[Quantity, Tensor]:
    """Every quantity of ``quantities`` (:class:`Quantity` objects, or the names of ones
    without parameters) from (a chunk of) per-sample gradients ``[n, *shape]``: the second
    moments and the sum in one sweep where both are asked, the rest by
    :meth:`Quantity.from_batch_grad` (``name``: the parameter's stable name, for the
    :attr:`~Quantity.named` ones)."""
    wanted = set(quantities)
    out: dict[Quantity, Tensor] = {}
    if SUM_GRAD_SQUARED in wanted:
        out[SUM_GRAD_SQUARED], total = sum_of_squares(batch_grad, with_sum=GRAD in wanted)
        if total is not None:
            out[GRAD] = total
    if BATCH_GRAD in wanted:  # (the built-in ones inline: this runs at every step)
        out[BATCH_GRAD] = batch_grad
    if GRAD in wanted and GRAD not in out:
        out[GRAD] = batch_grad.sum(0)
    for q in wanted.difference(out):
        q = q if isinstance(q, Quantity) else as_quantity(q)
        out[q] = q.from_batch_grad(batch_grad, name=name) if q.named else q.from_batch_grad(batch_grad)
    return out


class FactorKind(str):
    """What the outer products of a second-order factor sum to
    (:mod:`jacmem.extensions.secondorder.base`). As a :class:`Quantity`, a kind *is* its
    key (``"exact"``, ``"mc3"``), so that ``f.kind in kinds`` costs a string comparison
    and the names extensions give find the kinds; code asks its attributes, never its
    name. ``ggn``: its outer products sum to the GGN, exactly or in expectation (the
    autograd path serves it); ``serves``: the autograd path makes its factors;
    ``exact_root``: it needs the loss Hessian's exact root at the loss."""

    ggn: ClassVar[bool] = False
    serves: ClassVar[bool] = False
    exact_root: ClassVar[bool] = False
    #: the Monte-Carlo samples of the loss Hessian it takes (0: it samples nothing)
    samples: int = 0

    def __setattr__(self, name, value):
        raise AttributeError(f"factor kind {self!r} is immutable")


class _Exact(FactorKind):
    ggn = serves = exact_root = True


class _Empirical(FactorKind):
    serves = True


class _NeedsRoot(FactorKind):
    exact_root = True


class MonteCarlo(FactorKind):
    """``samples`` Monte-Carlo samples of the loss Hessian (``"mc<samples>"``): the GGN
    in expectation."""

    ggn = serves = True

    def __new__(cls, samples: int):
        if not isinstance(samples, int) or isinstance(samples, bool) or samples < 1:
            raise ValueError(f"mc_samples must be a positive integer, got {samples!r}")
        self = super().__new__(cls, f"mc{samples}")
        self.__dict__["samples"] = samples
        return self

    def __reduce__(self):
        return MonteCarlo, (self.samples,)


#: the loss Hessian's exact root, backpropagated: the GGN
EXACT = _Exact("exact")
#: the gradient at the true targets: the empirical Fisher
EMPIRICAL = _Empirical("empirical")
#: the rest of the Hessian, each activation's ``f''(x) ⊙ g_out`` (DiagHessian)
RESIDUAL = _NeedsRoot("residual")
#: one dense ``[D, D]`` batch-averaged GGN per module output (KFRA)
DENSE = _NeedsRoot("dense")
#: name -> the factor kind without parameters
FACTOR_KINDS: dict[str, FactorKind] = {k: k for k in (EXACT, EMPIRICAL, RESIDUAL, DENSE)}
_MONTE_CARLO = re.compile(r"mc([0-9]+)")


def factor_kind(spec: str | FactorKind) -> FactorKind:
    """The factor kind ``spec`` names (``"exact"``, ``"mc3"``; a kind passes as it is);
    ``ValueError`` listing the names for an unknown one. The one place a kind's name is read."""
    if isinstance(spec, FactorKind):
        return spec
    if spec in FACTOR_KINDS:
        return FACTOR_KINDS[spec]
    mc = _MONTE_CARLO.fullmatch(spec) if isinstance(spec, str) else None
    if mc is None:
        raise ValueError(f"unknown factor kind {spec!r}; valid: {', '.join(FACTOR_KINDS)}, mc<M> (M samples)")
    return MonteCarlo(int(mc.group(1)))
