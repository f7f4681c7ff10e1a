"""The registry: module type -> per-parameter derivatives, each with named strategies.

A *strategy* is one implementation of one quantity (:mod:`.quantities`), registered by name:

.. code-block:: python

    @register(nn.Conv2d, "weight", "batch_grad", "unfold", cost=unfold_cost)
    def conv_weight_unfold(x, g, *, stride, ...):
        '''x: [N, C_in, *spatial_in], g: [N, C_out, *spatial_out] -> [N, *weight.shape]'''

Each function takes ``(x, g, **hyperparams)``: what the layer's ``keep`` returns of
its inputs (default: the first positional input), the gradient of the loss w.r.t. its
output(s), both with the batch axis first, and the keyword hyper-parameters that the
layer's ``hyperparams(module)`` reads off the module. The optional ``cost`` takes the
same arguments' *shapes* and returns a :class:`Cost`, or ``None`` where the strategy
does not apply; ``auto`` picks the cheapest. A strategy without ``cost`` counts as
free, so it always wins ``auto``.

A layer may also register optional capabilities on its entry, where the extensions
look for them instead of testing the module's type: :class:`Kronecker` (the factor
rules of KFAC, KFLR and KFRA) and ``squared_vjps`` (a direct form of the GGN diagonal).

A class that stands for a stock layer (``jacmem.memory``'s lean layers, which keep
less for the backward pass but compute the same function) declares it as a class
attribute, ``stands_for = nn.Conv2d``: every lookup (:func:`registered_type`) then
answers with the stock type's entries, and nothing is registered for it.

Second-order extensions backpropagate factors ``S [V, N, *out]``
(:mod:`jacmem.derivatives.jacobians`). Two more tables serve them:
:data:`PASSTHROUGH` (:func:`passthrough`: how factors cross a module, ``S_in[v] = J_nᵀ
S[v]`` per input, by default the vjp of its ``forward``) and :data:`LOSSES` (:func:`loss`:
a symmetric factorisation of a loss's Hessian w.r.t. its input, exact ``[V, N, *x]`` or
sampled ``[M, N, *x]``, scaled as the reduction scales the loss).

This module imports torch, and no jacmem code but :func:`~jacmem.derivatives.jacobians.vjp_generic`.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from torch import Tensor, nn
from torch.nn.utils import parametrize

from jacmem import compat
from jacmem.derivatives.jacobians import vjp_generic
from jacmem.derivatives.quantities import QUANTITIES, Quantity, as_quantity


@dataclass(frozen=True)
class Cost:
    """Estimated cost of one strategy on the whole batch.

    ``flops``: floating-point operations. ``workspace``: bytes of temporary memory,
    excluding the result; it scales with the batch, so chunking divides it.
    """

    flops: float
    workspace: float


@dataclass(frozen=True)
class Strategy:
    """One implementation of one quantity. ``fn(x, g, **hp)``; ``cost(xs, gs, **hp)``
    with the shapes of ``x`` and ``g``. ``writes_out``: a ``batch_grad`` strategy that
    also takes ``out=`` (a contiguous ``[N, *param.shape]`` tensor), writes its result
    there and returns it, so that chunks need no copy into the whole result. ``also``:
    other quantities the same work gives (the summed gradient beside the per-sample
    products' squares); called with ``also=`` a non-empty subset of them, ``fn`` returns
    ``{quantity: tensor}`` for its own quantity and those."""

    fn: Callable[..., Any]
    cost: Callable[..., Cost | None] | None = None
    writes_out: bool = False
    also: tuple[str, ...] = ()


def _no_reason(**hp) -> str | None:
    return None


@dataclass(frozen=True)
class Kronecker:
    """How KFAC, KFLR and KFRA factor the GGN block of a layer's weight as ``G ⊗ A``
    (:mod:`jacmem.extensions.secondorder.kfac` gives the math); an optional capability
    of a layer's entry.

    input_factor: ``(x, out_shape, dtype, approx, **hyperparams) -> A``, from what
        ``keep`` kept and the shape of the whole output: ``[I, I]``; ``[g, m, m]`` for a
        layer in ``g`` groups (the weight's block is then ``block_diag(G[j] ⊗ A[j])``,
        with ``G[j]`` the diagonal blocks of ``G``); or the diagonal ``[I]`` of a
        diagonal ``A``. ``dtype``: the weight's. ``approx``: how the ``T`` positions
        that share the weight count (``"expand"``, ``"reduce"`` or ``None``, the
        layer's default; :mod:`jacmem.extensions.secondorder.kfac`). ``None``: the
        layer has no factors (``why_not`` says why).
    channels_last: the output is ``[N, *, O]``, with a factor per position (Linear);
        otherwise ``[N, O, *]``, whose output factor sums over positions first
        (convolutions) unless ``approx="expand"``.
    refuse: ``(approx, **hyperparams) -> str | None``: why a layer with factors has
        none with these settings (``"with scale_grad_by_freq=True (...); construct it
        with ..."``), or ``None``.
    why_not: with ``input_factor=None``, why the layer has no factors.
    diagonal: the layer's parameters are scaled elementwise (LayerNorm, RMSNorm):
        no Kronecker form; KFAC and KFLR give each parameter its GGN diagonal from the
        same factors instead, ``[d]`` with ``d.shape == param.shape``.
    transposed: ``G ⊗ A`` approximates the block of ``weight`` with its dims 0 and 1
        swapped (HF's Conv1D ``[I, O]``, Embedding ``[V, D]``, a transposed
        convolution's ``[C_in, C_out/g, *K]``), not of ``weight``.
    with_bias: ``input_factor``'s signature and rule, of the inputs with a 1 appended
        to each position's input ``a_t`` (the bias as a column of ones in the
        activations: ``[a_t; 1]``, one per patch position for a convolution), so
        that ``G ⊗ A`` covers ``[weight | bias]``: ``[I + 1, I + 1]`` (``[g, m + 1,
        m + 1]`` in groups); ``None``: the layer's bias cannot join its weight's block.
    """

    input_factor: Callable[..., Tensor] | None = None
    channels_last: bool = False
    refuse: Callable[..., str | None] = _no_reason
    why_not: str = ""
    diagonal: bool = False
    transposed: bool = False
    with_bias: Callable[..., Tensor] | None = None

    def positions(self, out_shape: Sequence[int]) -> int:
        """The rows ``N·T`` of an output ``out_shape``: the positions over the batch at
        which the weight is applied (a token of ``[N, T, O]``, a pixel of ``[N, O, H, W]``)."""
        channels = out_shape[-1] if self.channels_last else out_shape[1]
        return math.prod(out_shape) // channels


def first_input(args: tuple, kwargs: dict) -> Any:
    """The first positional input, or the first keyword one (``linear(input=x)``)."""
    return args[0] if args else next(iter(kwargs.values()))


def same_output(output: Any) -> Any:
    """The layer's output as it is (the default ``outputs``; a record asks it no call)."""
    return output


def no_hyperparams(module: nn.Module) -> dict[str, Any]:
    """A layer without hyper-parameters (the default; a record asks it no call)."""
    return {}


def unarranged(value: Any, **hp) -> Any:
    """``value`` as it is: a layer's derivatives take it so (the default; a record asks it
    no call)."""
    return value


@dataclass(frozen=True)
class _Undo:
    """How to take back one :func:`register` call: the strategy it replaced (or ``None``),
    and whether it added the ``(param, quantity)`` table and the type's entry."""

    param: str
    quantity: str
    strategy: str
    replaced: Strategy | None
    new_table: bool
    new_entry: bool


@dataclass
class LayerDerivatives:
    """Everything jacmem knows about one module type.

    hyperparams: ``module -> dict`` of keyword arguments for the derivative functions,
        read at forward time (so a BatchNorm's mode and statistics are those it ran with).
    keep: ``(args, kwargs) -> x``, what to keep of the forward inputs, batch axis first.
    arrange_input: ``(x, **hyperparams) -> x``, applied to what ``keep`` returned where
        the layout depends on the module (an RNN's ``batch_first``): after it, every
        tensor in ``x`` (or in its tuples and lists) has the batch on axis 0, since
        chunking slices axis 0; a dict in ``x`` passes whole to every chunk (a mask that
        all samples share, say).
    outputs: ``output -> tensor or tuple of tensors`` whose gradients make ``g``.
    arrange: ``(g, **hyperparams) -> g``, puts the batch axis of the output gradient(s)
        first (e.g. an RNN with ``batch_first=False``); chunking slices axis 0.
    input_free: parameters whose derivatives never read ``x`` (biases): when only
        those are trainable, no input is kept.
    for_module: ``module -> LayerDerivatives``, for a layer whose parameter names depend on
        the instance (an RNN's ``weight_ih_l{k}``): the entry registered for the type
        shows the names of one instance (the support table's rows), and ``lookup``
        asks this for the entry of each module.
    compute_once: inside a block, a call of the layer may run through one
        ``autograd.Function`` whose backward gives the per-sample quantities, the
        summed gradient and the input gradient together (:class:`jacmem.engine.hooks.ComputeOnce`),
        instead of autograd computing the weight gradient a second time. The input
        gradient is the layer's ``jac_t`` (its :func:`passthrough` entry),
        which must then be registered.
    own_layout: the layer places its batch axis itself, whatever a block's ``batch_first``
        says: from its own flag (an RNN's or attention's ``batch_first``, read by
        ``arrange_input`` and ``arrange``), or on axis 0 by its layout (convolutions,
        GroupNorm: ``[N, C, *]``). Otherwise, under ``batch_first=False``, the block
        hands ``keep`` the call's inputs and ``arrange`` its output gradients with axis 1
        moved first (:mod:`jacmem.engine.layout`), so that the derivatives see the batch first.
    kronecker: the layer's Kronecker factor rules (:class:`Kronecker`), or ``None``.
    squared_vjps: ``(x, S, params, batch, budget, **hyperparams) -> {name: tensor} or
        None``, a direct form of ``Σ_v (J_θᵀ S[v])²`` for the GGN and Hessian diagonals
        (:mod:`jacmem.extensions.secondorder.diag_ggn`): ``S [V, N, *out]``, ``params``
        the names and shapes of the parameters to compute, summed over the samples
        (``p.shape``) or per sample where ``batch`` (``[N, *p.shape]``), temporary
        memory under ``budget`` bytes; ``None`` where it does not apply to these
        inputs (the extension then repeats the inputs over ``V``).
    ghost_factors: parameter name -> ``(x, g, **hyperparams) -> (r, c)``, one call's
        per-sample gradient of that matrix parameter ``[R, C]`` as ``Σ_t r[n, t] ⊗ c[n, t]``:
        ``r [N, T, R]`` (or ``[N, T]`` row indices: one-hot rows), ``c [N, T, C]``. With
        it, the norm of a sum over several calls (tied weights) comes from cross terms
        (:mod:`jacmem.derivatives.tied`) instead of per-sample gradients.
    shared: ``(**hyperparams) -> str | None``: why a call's per-sample gradients are
        shares of the batch's gradient that depend on the other samples (an embedding
        with ``scale_grad_by_freq=True``), so that no sample has a gradient of its own
        and clipping cannot bound one sample's effect; ``None`` where each sample's is
        its own (the default). ``BatchGrad`` returns the shares; ``ClipGrad`` refuses.
    recognise: ``(module, x, output) -> hyperparams or None``, for a module of no
        registered type that may compute this layer's function (a subclass that
        overrides ``forward``, as timm's ``LayerNorm``; HF's ``LlamaRMSNorm``): the
        hyper-parameters where, on this call's kept input ``x``, the layer's function
        gives ``output`` to rounding; ``None`` otherwise (see :func:`recognised`).
    strategies: ``(param, quantity) -> {name: Strategy}``. ``param`` is the name of one
        of the module's own parameters, or the dotted name of a submodule's parameter
        that the module's forward uses itself (``MultiheadAttention`` calls its
        ``out_proj`` functionally: ``"out_proj.weight"``), which the module's record
        then covers.
    unconfirmed: how to take back the :func:`register` calls for this entry whose
        parameter names no instance has confirmed yet, in order (see :func:`lookup`).
    recomputed: the entry is the generic fallback's (:func:`fallback`): it recomputes the
        module one sample at a time, exact but slower than a closed form, so the block
        warns (with ``strict=True``, raises) naming the module.
    """

    hyperparams: Callable[[nn.Module], dict[str, Any]] = no_hyperparams
    keep: Callable[[tuple, dict], Any] = first_input
    outputs: Callable[[Any], Any] = same_output
    arrange: Callable[..., Any] = unarranged
    arrange_input: Callable[..., Any] = unarranged
    for_module: Callable[[nn.Module], LayerDerivatives] | None = None
    input_free: set = field(default_factory=set)
    compute_once: bool = False
    own_layout: bool = False
    kronecker: Kronecker | None = None
    squared_vjps: Callable[..., dict[str, Tensor] | None] | None = None
    ghost_factors: dict[str, Callable[..., tuple[Tensor, Tensor]]] = field(default_factory=dict)
    shared: Callable[..., str | None] = _no_reason
    recognise: Callable[[nn.Module, Any, Any], dict[str, Any] | None] | None = None
    strategies: dict[tuple[str, str], dict[str, Strategy]] = field(default_factory=dict)
    unconfirmed: list[_Undo] = field(default_factory=list, compare=False, repr=False)
    recomputed: bool = False

    @property
    def params(self) -> tuple[str, ...]:
        """Names of the parameters that have at least a ``batch_grad``."""
        names = []  # (a loop, not a generator: read at every recorded call)
        for p, q in self.strategies:
            if q == "batch_grad":
                names.append(p)
        return tuple(names)

    def names(self) -> set:
        """Every strategy name this layer offers, for any parameter and quantity."""
        return {name for table in self.strategies.values() for name in table}


def entries(obj) -> int:
    """Entries of a tensor, or of the tensors in a (nested) tuple or list; 0 for the rest."""
    if isinstance(obj, Tensor):
        return obj.numel()
    return sum(entries(o) for o in obj) if isinstance(obj, (tuple, list)) else 0


def detached(x: Any) -> Any:
    """``x`` with every tensor detached, through tuples, lists and dicts: what a record
    keeps of a module's inputs, without holding on to their graph."""
    if isinstance(x, Tensor):
        return x.detach()
    if isinstance(x, (tuple, list)):
        return type(x)(detached(t) for t in x)
    if isinstance(x, dict):
        return {k: detached(v) for k, v in x.items()}
    return x


#: module type -> its entry; a key may also be a type's qualified name,
#: ``"package.module.Class"`` (:func:`qualified_name`), for a type of a library that
#: jacmem does not import (``"transformers.pytorch_utils.Conv1D"``)
REGISTRY: dict[type | str, LayerDerivatives] = {}


def layer(
    module_type: type,
    *,
    hyperparams: Callable[[nn.Module], dict[str, Any]] | None = None,
    keep: Callable[[tuple, dict], Any] | None = None,
    outputs: Callable[[Any], Any] | None = None,
    arrange: Callable[..., Any] | None = None,
    arrange_input: Callable[..., Any] | None = None,
    for_module: Callable[[nn.Module], LayerDerivatives] | None = None,
    input_free: tuple[str, ...] = (),
    compute_once: bool = False,
    own_layout: bool = False,
    kronecker: Kronecker | None = None,
    squared_vjps: Callable[..., dict[str, Tensor] | None] | None = None,
    ghost_factors: dict[str, Callable[..., tuple[Tensor, Tensor]]] | None = None,
    recognise: Callable[[nn.Module, Any, Any], dict[str, Any] | None] | None = None,
    shared: Callable[..., str | None] | None = None,
) -> LayerDerivatives:
    """Declare (or update) how jacmem reads a module type, and its optional
    capabilities (``kronecker``, ``squared_vjps``, ``ghost_factors``); returns its entry."""
    _changed()
    entry = REGISTRY.setdefault(module_type, LayerDerivatives())
    given = dict(
        hyperparams=hyperparams,
        keep=keep,
        outputs=outputs,
        arrange=arrange,
        arrange_input=arrange_input,
        for_module=for_module,
        kronecker=kronecker,
        squared_vjps=squared_vjps,
        recognise=recognise,
        shared=shared,
    )
    for field_name, value in given.items():
        if value is not None:
            setattr(entry, field_name, value)
    entry.ghost_factors.update(ghost_factors or {})
    entry.input_free |= set(input_free)
    entry.compute_once |= compute_once
    entry.own_layout |= own_layout
    return entry


def register(
    module_type: type,
    param: str,
    quantity: str | type[Quantity] = "batch_grad",
    strategy: str = "default",
    *,
    cost: Callable[..., Cost | None] | None = None,
    writes_out: bool = False,
    also: tuple[str, ...] = (),
) -> Callable[[Callable], Callable]:
    """Decorator: register ``fn`` as strategy ``strategy`` of ``quantity`` (a registered
    quantity's name or class, :mod:`.quantities`) for the parameter ``param`` of
    ``module_type``. A quantity with parameters hands them to ``fn`` and ``cost`` as
    keyword arguments, beside the layer's hyper-parameters: one strategy serves every
    parameterisation.

    This is also the public way to teach jacmem a module of your own, see
    ``examples/plot_custom_module.py``. Declare the module's hyper-parameters and what to
    keep with :func:`layer` first, where the defaults do not fit.

    ``param`` is checked against the module at the first lookup of an instance of
    ``module_type`` (the type alone does not tell its parameters' names): a name the
    module does not have raises a ``ValueError`` that lists the names it has, and the
    registrations under that name that no instance has confirmed yet are withdrawn, so
    the registry is as it was before them and a corrected registration works.
    """
    quantity = quantity.name if isinstance(quantity, type) and issubclass(quantity, Quantity) else quantity
    if quantity not in QUANTITIES:
        raise ValueError(f"unknown quantity {quantity!r}; valid: {', '.join(QUANTITIES)}")
    also = tuple(map(as_quantity, also))

    def decorate(fn: Callable) -> Callable:
        _changed()
        new_entry = module_type not in REGISTRY
        entry = REGISTRY.setdefault(module_type, LayerDerivatives())
        new_table = (param, quantity) not in entry.strategies
        table = entry.strategies.setdefault((param, quantity), {})
        entry.unconfirmed.append(_Undo(param, quantity, strategy, table.get(strategy), new_table, new_entry))
        table[strategy] = Strategy(fn, cost, writes_out, tuple(also))
        return fn

    return decorate


def stands_for(module_type: type) -> type | None:
    """The stock type whose function ``module_type`` computes, where it (or the base
    class whose ``forward`` it keeps) declares ``stands_for``; else ``None``."""
    for cls in module_type.__mro__:
        if "stands_for" in cls.__dict__:
            return cls.__dict__["stands_for"] if cls.forward is module_type.forward else None
    return None


def qualified_name(module_type: type) -> str:
    """``"package.module.Class"``, as a registry key for a type jacmem does not import."""
    return f"{module_type.__module__}.{module_type.__qualname__}"


def registered_type(table: Mapping[type | str, Any], module_type: type) -> type | str | None:
    """The key of ``table`` whose entry describes ``module_type``: the type itself (or its
    :func:`qualified_name`); else the stock type it :func:`stands_for`; else its nearest
    base class in ``table``, where the subclass keeps that class's ``forward`` (so its
    math is the same); else ``None``. Every registry of jacmem (first-order, Jacobians,
    losses) looks up through this one rule; the answer is kept per table and type until
    the table's size, the registrations (:func:`_changed`) or the type's ``forward``
    change (a forward looks up each module several times)."""
    forward = module_type.forward
    kept = _FOUND.setdefault(module_type, {})
    seen = kept.get(id(table))
    if seen is not None and seen[0] == len(table) and seen[1] == VERSION[0] and seen[2] is forward:
        return seen[3]
    found = _registered_type(table, module_type, forward)
    kept[id(table)] = (len(table), VERSION[0], forward, found)
    return found


#: module type -> {id(table): (the table's size, the registration count, the type's
#: forward, :func:`registered_type`'s answer then)}; the tables are the module's own
_FOUND: weakref.WeakKeyDictionary[type, dict[int, tuple]] = weakref.WeakKeyDictionary()


def _registered_type(table: Mapping[type | str, Any], module_type: type, forward) -> type | str | None:
    for cls in module_type.__mro__:
        stock = cls.__dict__.get("stands_for")
        key = cls if cls in table else qualified_name(cls)
        if key in table or stock is not None:
            if cls.forward is not forward:
                return None
            return key if key in table else registered_type(table, stock)
    return None


def forward_of(module: nn.Module) -> Callable:
    """The ``forward`` whose derivatives the registries hold, bound to ``module``: its
    own, or that of the stock type it :func:`stands_for` (a lean layer's own forward
    runs autograd Functions that ``torch.func`` cannot transform)."""
    stock = stands_for(type(module))
    return module.forward if stock is None else stock.forward.__get__(module)


def lookup(module: nn.Module, x: Any = None, output: Any = None, batch_axis: int = 0) -> LayerDerivatives | None:
    """The entry for ``module``'s type (:func:`registered_type`); otherwise, given a call's
    kept input ``x`` and ``output``, the entry of a layer whose function it computes
    (:func:`recognised`); otherwise the generic fallback for the module's own parameters
    (the one :func:`fallback` declares, for a call whose batch is on ``batch_axis`` of its inputs
    and outputs), or ``None`` where that does not apply either. Raises
    ``ValueError`` where a parameter name registered for the type is not one of the
    module's (see :func:`register`)."""
    cls = registered_type(REGISTRY, type(module))
    if cls is None:
        found = None if output is None else recognised(module, x, output)
        return found or (_FALLBACK[0](module, batch_axis) if _FALLBACK else None)
    entry = REGISTRY[cls]
    if entry.for_module is not None:
        entry = entry.for_module(module)
    parametrized = (
        sorted({p for p, _ in entry.strategies if parametrize.is_parametrized(module, p)})
        if parametrize.is_parametrized(module)  # (most modules have none: one question, not one per name)
        else ()
    )
    if parametrized:  # before the names' check, which would take the layer's registrations back
        raise ParametrizedError(_PARAMETRIZED.format(type=type(module).__name__, names=parametrized))
    key = (type(module), id(entry))
    if _CHECKED.get(key) != VERSION[0]:
        bad = missing_names(module, entry)
        if _withdraw(cls, bad):
            raise ValueError(_misspelt(module, cls, bad))
        _CHECKED[key] = VERSION[0]  # (a confirmed name this instance lacks: its own are unsupported, as any)
    return entry


#: module -> the entry :func:`recognised` found for it (``None``: none), on its first call
_RECOGNISED: weakref.WeakKeyDictionary[nn.Module, LayerDerivatives | None] = weakref.WeakKeyDictionary()


def recognised(module: nn.Module, x: Any, output: Any) -> LayerDerivatives | None:
    """The entry of the registered layer whose function ``module`` computes, as its
    ``recognise`` verifies on the module's first call (input ``x``, ``output``), with the
    hyper-parameters found then; ``None`` where no layer's does. One check per module:
    a forward of the candidate's function, without a graph."""
    if module not in _RECOGNISED:
        found = None
        for entry in REGISTRY.values():
            hp = None if entry.recognise is None else entry.recognise(module, x, output)
            if hp is not None:
                found = replace(entry, hyperparams=lambda m, hp=hp: hp, recognise=None)
                break
        _RECOGNISED[module] = found
    return _RECOGNISED[module]


def recognised_before(module: nn.Module) -> bool:
    """Whether an earlier call of ``module`` was :func:`recognised` as a registered
    layer's function (its parameters then serve that function alone)."""
    return _RECOGNISED.get(module) is not None


class ParametrizedError(ValueError):
    """A layer whose registered parameters are under a parametrization: no exact
    per-sample derivatives (``jacmem.extensions.clipping.check`` raises it as an
    ``UnsupportedModuleError``)."""


_PARAMETRIZED = (
    "jacmem: {type} has parameter(s) {names} under a parametrization (torch.nn.utils.parametrize: weight_norm, "
    "spectral_norm, orthogonal, ...): its forward reads a tensor computed from other parameters, and jacmem has no "
    "per-sample derivatives through a parametrization. Remove it before the block or make_private "
    "(torch.nn.utils.parametrize.remove_parametrizations(module, name)), or freeze what it parametrizes."
)

#: registrations so far (each :func:`layer`, :func:`register`, :func:`passthrough`, :func:`loss`, and
#: each withdrawal), read without a call: a lookup checks names again after any, and what was found
#: from the registry is found again (:class:`jacmem.engine.hooks.Recipe`, a plan bound to its strategies)
VERSION = [0]
#: (module type, id(entry)) -> the registration count when its names were checked
_CHECKED: dict[tuple[type, int], int] = {}


def _changed() -> None:
    VERSION[0] += 1


def own_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` of what ``module``'s forward reads itself: its own parameters,
    and those of its ``ParameterDict`` and ``ParameterList`` children by dotted name
    (``"lora_embedding_A.default"``: PEFT's ``lora.Embedding``), since a parameter
    container is never called and its parameters are its parent's to use. (A list, not
    a generator: it is read at every recorded call.)"""
    found, seen = [], set()  # as named_parameters(recurse=False), which it is without the module walk
    for name, p in compat.parameter_slots(module).items():
        if p is not None and id(p) not in seen:
            seen.add(id(p))
            found.append((name, p))
    for child_name, child in compat.child_slots(module).items():
        if isinstance(child, (nn.ParameterDict, nn.ParameterList)):
            for name, p in own_parameters(child):
                found.append((f"{child_name}.{name}", p))
    return found


def _has_parameter(module: nn.Module, name: str) -> bool:
    """Whether ``name`` (dotted for a submodule's) is a parameter of ``module``, or one
    it declares absent (``bias=False`` registers ``bias`` as ``None``)."""
    owner, _, leaf = name.rpartition(".")
    try:
        sub = module.get_submodule(owner) if owner else module
    except AttributeError:
        return False
    own = dict(sub.named_parameters(recurse=False, remove_duplicate=False))
    return leaf in own or (hasattr(sub, leaf) and getattr(sub, leaf) is None)


def missing_names(module: nn.Module, entry: LayerDerivatives) -> list[str]:
    """The parameter names registered in ``entry`` that ``module`` does not have."""
    return sorted({p for p, _ in entry.strategies if not _has_parameter(module, p)})


def _misspelt(module: nn.Module, module_type: type | str, bad: list[str]) -> str:
    """The error for parameter names ``bad`` registered for ``module_type`` that ``module``
    lacks, whose registrations were taken back: the type, the bad names, the names it has,
    and the fix."""
    names = [n for n, _ in module.named_parameters()]
    return (
        f"jacmem.register: {type(module).__name__} has no parameter {', '.join(map(repr, bad))}, yet a "
        f"derivative is registered for it (for {getattr(module_type, '__name__', module_type)}); its parameters are "
        f"{names}. Register the derivative under one of those names; the registration under the wrong name is "
        "withdrawn, so a corrected one works"
    )


def confirm_all() -> None:
    """The registrations so far are confirmed: none is taken back when an instance lacks
    its name (jacmem's own, whose names are the stock modules')."""
    for entry in REGISTRY.values():
        entry.unconfirmed = []


def _withdraw(module_type: type | str, bad: list[str]) -> bool:
    """An instance of ``module_type`` was checked: the unconfirmed registrations under a
    name in ``bad`` are taken back, latest first, and the others are confirmed. Returns
    whether any was taken back."""
    entry = REGISTRY[module_type]
    taken = [u for u in reversed(entry.unconfirmed) if u.param in bad]
    entry.unconfirmed = []
    if taken:
        _changed()  # (the strategies change in place)
    for undo in taken:
        table = entry.strategies[undo.param, undo.quantity]
        if undo.replaced is None:
            del table[undo.strategy]
        else:
            table[undo.strategy] = undo.replaced
        if undo.new_table and not table:
            del entry.strategies[undo.param, undo.quantity]
        if undo.new_entry and entry == LayerDerivatives():
            del REGISTRY[module_type]
    return bool(taken)


#: the entry of a module of no registered type, ``(module, batch_axis) -> entry or None``:
#: :mod:`jacmem.derivatives.generic`'s recomputation, declared with :func:`fallback`
_FALLBACK: list[Callable[[nn.Module, int], LayerDerivatives | None]] = []


def fallback(fn: Callable[[nn.Module, int], LayerDerivatives | None]) -> Callable:
    """Decorator: ``fn(module, batch_axis)`` gives the entry of a module whose type no
    registration describes (see :func:`lookup`)."""
    _FALLBACK[:] = [fn]
    return fn


def all_strategy_names() -> set:
    """Every strategy name registered for any layer."""
    return {name for entry in REGISTRY.values() for name in entry.names()}


# -- Second order: how factors cross a module, and where curvature starts -------------


@dataclass
class Passthrough:
    """How factors cross one module type.

    hyperparams: ``module -> dict`` of keyword arguments, read at forward time; the
        generic path adds ``forward`` (the module's bound ``forward``, or the stock
        type's for a type that stands for one: :func:`jacmem.derivatives.forward_of`).
    jac_t: ``(xs, out, S, **hp) -> tuple`` of ``[V, N, *in_i]`` (``None`` where input
        ``i`` needs nothing), from ``xs`` (the tensor inputs), ``out`` and
        ``S [V, N, *out]``. ``None``: the generic vjp of ``forward``.
    vjp: ``(x, g, **hp) -> [N, *in]``, the gradient of the first input for one output
        gradient ``g [N, *out]``, where the layer gives it in fewer ops than ``jac_t`` on
        ``g[None]`` (a layer run through ComputeOnce computes it at every call); ``None``:
        ``jac_t``'s.
    df, d2f: for elementwise functions, ``(x, out, **hp) -> [N, *]``, the first and
        second derivative; ``d2f=None`` where it is zero (piecewise linear). Every
        other module's second derivative w.r.t. its input is taken as zero (linear
        maps, pooling, padding: DiagHessian adds no residual for them).
    sample_independent: the input Jacobian is the same for every sample (KFRA then
        needs it once, not per sample).
    keep_output: the derivatives read ``out``.
    keep_input: the derivatives read the values of ``xs`` (not only their shapes):
        ``False`` lets the engine drop an input that autograd does not keep either
        (ReLU, Sigmoid and Tanh save their output, not their input).
    curved: a module that is not elementwise and whose second derivative w.r.t. its
        input is not zero (LayerNorm, RMSNorm): GGN-type factors cross it, DiagHessian
        raises there rather than drop that term.
    """

    hyperparams: Callable[[nn.Module], dict[str, Any]] = no_hyperparams
    jac_t: Callable[..., tuple[Tensor | None, ...]] | None = None
    vjp: Callable[..., Tensor] | None = None
    df: Callable[..., Tensor] | None = None
    d2f: Callable[..., Tensor] | None = None
    sample_independent: bool = False
    keep_output: bool = False
    keep_input: bool = True
    curved: bool = False

    def params(self, module: nn.Module) -> dict[str, Any]:
        hp = self.hyperparams(module)
        if self.jac_t is None and self.df is None:
            hp["forward"] = forward_of(module)
        return hp

    @property
    def elementwise(self) -> bool:
        return self.df is not None

    def backprop(self, xs: tuple[Tensor, ...], out: Tensor | None, S: Tensor, hp: dict, inplace: bool = False):
        """``S [V, N, *out]`` -> one ``[V, N, *in_i]`` (or ``None``) per input; an
        elementwise map overwrites ``S`` where ``inplace``."""
        if self.df is not None:
            df = self.df(xs[0], out, **hp)
            return (S.mul_(df) if inplace else S * df,)
        if self.jac_t is not None:
            return self.jac_t(xs, out, S, **hp)
        return vjp_generic(hp["forward"], xs, S)


@dataclass
class LossHessian:
    """Factors of a loss's Hessian w.r.t. its input ``x [N, C, *D]``.

    check: ``module -> None``; raises for settings whose Hessian is not implemented.
    sqrt_hessian: ``(x, y, **hp) -> [V, N, *x.shape[1:]]`` with
        ``Σ_v S[v] S[v]ᵀ`` the exact Hessian of each sample's loss, as reduced.
    sampled: ``(x, y, mc_samples, **hp) -> [M, N, *x.shape[1:]]``,
        whose outer products equal the Hessian in expectation (gradients of the loss at
        targets drawn from the model's predictive distribution, over ``√M``).
    empirical: ``(x, y, **hp) -> [1, N, *x.shape[1:]]``, the gradient of the loss at the
        true targets, scaled as ``sampled``: the empirical Fisher's root.
    """

    check: Callable[[nn.Module], None]
    sqrt_hessian: Callable[..., Tensor]
    sampled: Callable[..., Tensor]
    hyperparams: Callable[[nn.Module], dict[str, Any]] = no_hyperparams
    empirical: Callable[..., Tensor] | None = None

    def params(self, module: nn.Module) -> dict[str, Any]:
        self.check(module)
        hp = self.hyperparams(module)
        hp["forward"] = forward_of(module)
        return hp


PASSTHROUGH: dict[type, Passthrough] = {}
LOSSES: dict[type, LossHessian] = {}


def passthrough(*module_types: type, **fields) -> Passthrough:
    """Declare how factors cross ``module_types``; returns the (shared) entry.

    Also the public way to let second-order extensions through a module of your own:
    ``jacmem.derivatives.passthrough(MyModule)`` uses the vjp of its
    ``forward`` (it must be deterministic, with tensor inputs and one tensor output).
    """
    entry = Passthrough(**fields)
    _changed()
    for t in module_types:
        PASSTHROUGH[t] = entry
    return entry


def loss(module_type: type, entry: LossHessian) -> LossHessian:
    _changed()
    LOSSES[module_type] = entry
    return entry


#: how factors cross a module that computes a registered layer's function without being
#: of its type (timm's ``LayerNorm``, HF's ``LlamaRMSNorm``; :func:`jacmem.derivatives.recognised`):
#: the vjp of its own forward; its second derivative is not known, so DiagHessian stops there
RECOGNISED = Passthrough(curved=True)


def lookup_passthrough(module: nn.Module, x: Any = None, output: Any = None) -> Passthrough | None:
    """How factors cross ``module`` (:func:`jacmem.derivatives.registered_type`); given a
    call's first input ``x`` and ``output``, :data:`RECOGNISED` for a module that computes
    a registered layer's function (:func:`jacmem.derivatives.recognised`)."""
    cls = registered_type(PASSTHROUGH, type(module))
    if cls is not None:
        return PASSTHROUGH[cls]
    return RECOGNISED if output is not None and recognised(module, x, output) is not None else None


def lookup_loss(module: nn.Module) -> LossHessian | None:
    """The Hessian factors of the loss ``module`` (:func:`jacmem.derivatives.registered_type`)."""
    cls = registered_type(LOSSES, type(module))
    return None if cls is None else LOSSES[cls]
