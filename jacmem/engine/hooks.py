"""Forward hook: keep what the extensions will need; backward: hand it over, then free it.

A forward hook turns one call of one module into a :class:`Record`: the module, what
its derivatives need of the inputs, and its trainable parameters. It registers a hook
on each output tensor; once every output's gradient has arrived, the record goes to
``on_grad(record)``, and drops what it kept.

The record lives in the hooks' closures, and so in the autograd graph: when the graph
is freed, so is everything kept. Whoever installs the hooks keeps their handles, to
take them off (and so free the records) when it is done.
"""

from __future__ import annotations

import functools
import itertools
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Collection
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from jacmem import compat
from jacmem.derivatives import LayerDerivatives, detached, lookup, lookup_passthrough
from jacmem.derivatives.registry import (
    REGISTRY,
    VERSION,
    Passthrough,
    first_input,
    no_hyperparams,
    own_parameters,
    registered_type,
    same_output,
    unarranged,
)
from jacmem.engine import layout, notices
from jacmem.engine.broadcast import Origin

#: what a record's owner does when the output gradients of a call have arrived; for a
#: :class:`ComputeOnce` call it returns the parameters' summed gradients (or None)
OnGrad = Callable[["Record"], dict[str, Tensor] | None]


class Uses:
    """The live records of one recorder, by parameter: a parameter with more than one (a
    module called twice, tied weights) needs its per-sample gradients summed over calls
    before any norm or square is taken. The recorder that makes the records owns it, so
    that the calls of another recorder (another block's, a tracked model's) never count.
    Keyed by ``id(parameter)``: a record holds its parameters, so an id counted here is
    not reused while it is."""

    __slots__ = ("live", "users")

    def __init__(self):
        #: id(parameter) -> the number of records alive that will contribute to it
        self.live: dict[int, int] = {}  # (a dict, not a Counter: its update and del are Python calls)
        #: id(parameter) -> those records (while ``live`` counts any; a record released
        #: early may still be listed until it is freed): a weak reference to the first, a
        #: WeakSet from the second on (most parameters have one record: no set made)
        self.users: dict[int, weakref.ref | weakref.WeakSet] = {}

    def of(self, key: int) -> list:
        """The records listed for the parameter ``key`` (``id(parameter)``) still alive."""
        known = self.users.get(key)
        if type(known) is weakref.ref:
            rec = known()
            return [] if rec is None else [rec]
        return [] if known is None else list(known)

    # (A record counts itself in, in Record.__init__: a call less at every recorded call.)

    def release(self, keys: list[int]) -> None:
        """Take a record out: ``keys``, the ids of its parameters."""
        live = self.live
        for key in keys:
            n = live.get(key, 0) - 1
            if n > 0:
                live[key] = n
            else:
                live.pop(key, None)
                self.users.pop(key, None)


#: whether the module hook running now was called from a forward that torch.compile
#: traces (:func:`eager`); one entry per hook call in progress (:func:`compiled` reads it;
#: so do the hot paths, without the call)
COMPILED: list[bool] = []


def eager(hook: Callable, target: list[Callable | None] | None = None, inside: list[bool] | None = None) -> Callable:
    """``hook``, a module hook of jacmem's (pre-hook ``(module, args)``, leave hook
    ``(module, args, output)`` or forward hook ``(module, args, kwargs, output)``), as a
    compiled forward calls it: traced, with no graph break. There, the forward hook of a
    module that reads trainable parameters itself (:func:`_has_trainable`), called on
    tensors and returning one,
    runs at the graph's run time, on real tensors, in the op ``jacmem::tap``
    (:func:`_tap`); the gradient of the module's output reaches its records through
    ``jacmem::tapped`` in the compiled backward (:class:`Tap`). The other calls of the
    hooks are skipped: modules without trainable parameters record nothing, and the
    pre- and leave hooks only follow broadcasts, which a compiled graph cannot take
    (the compiled model's wrapper, whose hooks run eagerly, begins and ends the forward).

    A forward hook on other arguments (keyword arguments, non-tensors, a tuple output)
    runs eagerly: torch.compile breaks its graph there, with a reason that names jacmem,
    and compiles the module's forward on either side. While the hook runs,
    :func:`compiled` says whether the forward is a compiled one.

    ``target``: a one-entry list; an eager call runs ``target[0]`` in place of ``hook``
    while it is set (a block's own method, one call less than through a dispatcher),
    while a compiled forward always traces ``hook``, so that its guards hold from one
    block to the next. ``inside``: a two-entry list; while its first is True (a block's
    outermost forward is running, and its engines ignore such calls, see
    :attr:`jacmem.engine.base.Engine.skips_leaves`), an eager call of a module with no
    parameter and no submodule of its own (an activation, a loss, dropout) returns at
    once: it records nothing, and inside a forward it is no model's outermost call; so
    do the pre- and leave hooks of a module of a registered type with no submodule
    (:func:`passes_inside`), but the leave hook of a forward that raised; and the
    forward hook goes to its second entry where it is set (the ``on_forward`` of a
    block's one engine, one call less than through the block)."""

    def traced(*args, **kwargs):  # torch.compile traces this; is_compiling() is then a constant True
        if not torch.compiler.is_compiling():
            wrapper = _WRAPPERS_BY_REF.get(weakref.ref(type(args[0]))) if args else False  # (WRAPPERS.get)
            if wrapper is None:
                wrapper = _is_wrapper(args[0])
            # (the batch to reset is 1 outside compiled forwards: no need to ask)
            if _TRACED_BATCH["n"] != 1 and (wrapper or compat.compiled_in_place(args[0])):
                _TRACED_BATCH["n"] = 1  # a compiled model begins or ends a forward
            fn = hook if target is None or target[0] is None else target[0]
            if not wrapper and not COMPILED and compat.dynamo_callback() is None:
                if inside is not None and inside[0]:
                    own, children = compat.own_slots(args[0])
                    if not children:
                        if not own:
                            return None  # a leaf with nothing to record, inside a forward
                        if len(args) == 2 or len(args) == 3 and args[2] is not None:  # (a forward that raised: on)
                            # (passes_inside(), inline: at every call of a layer)
                            cls = type(args[0])
                            layer = _LAYERS_BY_REF.get(weakref.ref(cls))  # (_LAYERS.get)
                            if layer is None or layer[0] != VERSION[0] or layer[1] is not cls.forward:
                                layer = _layer(cls)
                            if layer[2]:
                                return None  # a registered layer's enter or leave, inside a forward
                    if len(args) == 4 and inside[1] is not None:
                        return inside[1](*args)  # a call inside a forward: to the block's one engine
                return fn(*args, **kwargs)  # (no frame would be compiled, and compiled() says False: as _run)
            return _run(fn, wrapper, args, kwargs)
        if len(args) != 4 or not _has_trainable(args[0]) or not torch.is_grad_enabled():
            return None
        module, margs, mkwargs, output = args
        if mkwargs or not isinstance(output, Tensor) or not all(isinstance(a, Tensor) for a in margs):
            return _run(hook, True, args, kwargs)
        if not output.requires_grad:
            return None
        margs, output = _spread(margs, output)  # (it spreads integer ids only: never a fused call's input)
        slot = _slot(hook, module)
        params = [p for p in compat.parameter_slots(module).values() if p is not None and p.requires_grad]
        if len(margs) == 1 and all(t.dtype == output.dtype for t in (*margs, *params)) and _fusable(module):
            token = torch.ops.jacmem.tap(slot, list(margs), output, True)
            return Fused.apply(slot, token, margs[0], [output.detach()], *params)
        token = torch.ops.jacmem.tap(slot, list(margs), output, False)
        return Tap.apply(output, token, *margs)

    compat.never_compile_alone(traced)  # where an eager forward calls it, it is not a frame to compile
    return functools.wraps(hook)(traced)


#: module type -> (the registry's version, the type's ``forward``, whether it is registered
#: then), for :func:`passes_inside`
_LAYERS: weakref.WeakKeyDictionary[type, tuple[int, Callable, bool]] = weakref.WeakKeyDictionary()
#: the dict behind :data:`_LAYERS`, by weak reference: ``_LAYERS_BY_REF.get(weakref.ref(cls))`` is
#: ``_LAYERS.get(cls)`` with no Python frame (a hook reads it at every call)
_LAYERS_BY_REF = _LAYERS.data


def _layer(cls: type) -> tuple[int, Callable, bool]:
    """``cls``'s entry in :data:`_LAYERS`, found now."""
    found = _LAYERS[cls] = (VERSION[0], cls.forward, registered_type(REGISTRY, cls) is not None)
    return found


def passes_inside(module: nn.Module) -> bool:
    """Whether the pre- and leave hooks of ``module`` return at once inside a forward where
    leaves pass (:func:`eager`): a module of a registered type with no submodule. The
    engines that let leaves pass do nothing there: their recorder follows the direct uses
    of an unregistered module's parameters alone, and the block's depth counts neither."""
    cls = type(module)
    layer = _LAYERS.get(cls)
    if layer is None or layer[0] != VERSION[0] or layer[1] is not cls.forward:
        layer = _layer(cls)
    own, children = compat.own_slots(module)
    return bool(own) and not children and layer[2]


#: while torch.compile traces a frame: the batch size of the latest call recorded in it on
#: more than one sample (a trace-time value: torch.compile keeps it as a constant)
_TRACED_BATCH: dict[str, Any] = {"n": 1}


def _spread(args: tuple, output: Tensor) -> tuple[tuple, Tensor]:
    """As torch.compile traces a recorded call: :func:`spread` over the batch of the latest
    call on more than one sample in the same frame."""
    if output.dim() and output.shape[0] > 1:
        _TRACED_BATCH["n"] = output.shape[0]
        return args, output
    return spread(args, output, _TRACED_BATCH["n"])


def spread(args: tuple, output: Tensor, n: int) -> tuple[tuple, Tensor]:
    """``(args, output)`` of a recorded call in a compiled forward, where the call is an
    embedding of ``[1, T]`` ids (default position ids) after a call on a batch of ``n > 1``,
    with the ids and the output expanded to ``n``. The output, which the model broadcasts
    over the batch, then meets it with the same numbers; its gradient arrives per sample,
    and the call is recorded as one on ``n`` samples. (An eager forward follows the
    broadcast op by op: :mod:`jacmem.engine.broadcast`; a compiled graph takes plain
    tensors only.) Other calls are left as they are."""
    ids = args[0] if len(args) == 1 else None
    if n == 1 or output.dim() < 2 or output.shape[0] != 1 or ids is None or ids.dim() < 1 or ids.shape[0] != 1:
        return args, output
    if ids.is_floating_point() or ids.is_complex():
        return args, output
    return (ids.expand(n, *ids.shape[1:]),), output.expand(n, *output.shape[1:])


#: the children whose parameters a module's forward reads itself (:func:`own_parameters`)
_CONTAINERS = (nn.ParameterDict, nn.ParameterList)


#: ``may_read_parameters(module)``: whether ``module``'s forward may read parameters of its
#: own (:func:`own_parameters`), asked without building them: its own, or a parameter
#: container among its children (one call, at every module call)
may_read_parameters = functools.partial(compat.holds_parameters, containers=_CONTAINERS)


def _has_trainable(module: nn.Module) -> bool:
    """Whether ``module``'s forward reads trainable parameters itself (:func:`own_parameters`:
    its own, and its parameter containers', as PEFT's ``lora.Embedding`` reads its matrices)."""
    return any(p.requires_grad for _, p in own_parameters(module))


#: module type -> whether it is the wrapper ``torch.compile(model)`` returns (a type's answer
#: never changes: kept, so that a module call asks once per type, not at each hook; the
#: block reads it too, without a call)
WRAPPERS: weakref.WeakKeyDictionary[type, bool] = weakref.WeakKeyDictionary()
#: the dict behind :data:`WRAPPERS`, read as :data:`_LAYERS_BY_REF` is
_WRAPPERS_BY_REF = WRAPPERS.data


def _is_wrapper(module: Any) -> bool:
    """:func:`jacmem.compat.is_compiled_module`, kept per type."""
    cls = type(module)
    found = WRAPPERS.get(cls)
    if found is None:
        found = WRAPPERS[cls] = compat.is_compiled_module(module)
    return found


@torch.compiler.disable(reason="jacmem records this module call (jacmem.engine.hooks.eager)")
def _run(hook: Callable, compiled: bool, args: tuple, kwargs: dict):
    """``hook(*args, **kwargs)``, with :func:`compiled` saying ``compiled``: whether the
    call comes from a forward torch.compile traces, or is a compiled model's wrapper's."""
    COMPILED.append(compiled)
    try:
        return hook(*args, **kwargs)
    finally:
        COMPILED.pop()


#: slot -> (forward hook, module, weakly) of the calls a compiled graph records (:func:`_tap`),
#: until the module is freed
_SLOTS: dict[int, tuple[Callable, weakref.ref]] = {}
#: the slots' numbers, never reused (a graph keeps its slots as constants)
_NUMBERS = itertools.count()
#: module -> forward hook -> its slot
_SLOT_OF: weakref.WeakKeyDictionary[nn.Module, dict[Callable, int]] = weakref.WeakKeyDictionary()
#: id -> the output-gradient hook of a record made in a compiled graph, until its graph
#: is freed or its recorder closes (:func:`_hook`); that of a :class:`Fused` call returns
#: the gradients of the call's input and parameters
_TAPPED: OrderedDict[int, Callable[[Tensor], Any]] = OrderedDict()  # (weakly referable, for the handles)
#: while :func:`_tap` runs a forward hook: the ids in ``_TAPPED`` of the hooks its records set
_DEFERRED: list[list[int]] = []
#: while :func:`_tap` runs a forward hook: whether its graph runs the call through :class:`Fused`
_FUSING: list[bool] = []


@torch.compiler.assume_constant_result
def _slot(hook: Callable, module: nn.Module) -> int:
    """The number a compiled graph names ``hook`` on ``module`` by: run when torch.compile
    traces the call, and a constant of the graph."""
    slots = _SLOT_OF.setdefault(module, {})
    if hook not in slots:
        slots[hook] = next(_NUMBERS)
        _SLOTS[slots[hook]] = (hook, weakref.ref(module))
        weakref.finalize(module, _SLOTS.pop, slots[hook], None)  # (its entry in _SLOT_OF goes by itself)
    return slots[hook]


@torch.compiler.assume_constant_result
def _fusable(module: nn.Module) -> bool:
    """Whether a compiled graph runs calls of ``module`` through :class:`Fused`: its type
    is registered, its layer can run through :class:`ComputeOnce`, and that layer covers
    each of its trainable parameters (run when torch.compile traces the call; a constant
    of the graph)."""
    if registered_type(REGISTRY, type(module)) is None:
        return False
    entry, jac = lookup(module), lookup_passthrough(module)
    params = [n for n, p in own_parameters(module) if p.requires_grad]
    return (
        entry is not None and entry.compute_once and jac is not None and jac.jac_t is not None
        and all("." not in n and n in entry.params for n in params)
    )  # fmt: skip


@torch.library.custom_op("jacmem::tap", mutates_args=())
def _tap(slot: int, args: list[Tensor], output: Tensor, fused: bool) -> Tensor:
    """At a compiled graph's run time: the forward hook of ``slot`` on the call
    ``module(*args) -> output``, as in an eager forward; returns, as a [K] int64 CPU
    tensor, the ids of the output-gradient hooks its records set (in ``_TAPPED``,
    dropped when the tensor is freed with the graph that saves it). ``fused``: the graph
    runs the call through :class:`Fused`, whose backward takes the parameters'
    gradients from its record where the block computes them."""
    hook, module = _SLOTS[slot]
    module = module()  # alive: the model whose compiled graph runs holds it
    _DEFERRED.append([])
    _FUSING.append(fused)
    try:
        with compat.autograd_inside_op(), torch.enable_grad():
            _run(hook, True, (module, tuple(args), {}, output.detach().requires_grad_()), {})
    finally:
        ids = _DEFERRED.pop()
        _FUSING.pop()
    token = torch.tensor(ids, dtype=torch.int64)
    weakref.finalize(token, _untap, ids)
    return token


@_tap.register_fake
def _(slot, args, output, fused):
    return torch.empty(0, dtype=torch.int64)  # (its length is data-dependent: torch.compile never reads it)


def _untap(ids: list[int]) -> None:
    for i in ids:
        _TAPPED.pop(i, None)


def _hooks_of(token: Tensor):
    """The output-gradient hooks of ``token``'s records (:func:`_tap`) still held."""
    for i in token.tolist():
        hook = _TAPPED.get(i)
        if hook is not None:
            yield hook


@torch.library.custom_op("jacmem::tapped", mutates_args=())
def _tapped(grad: Tensor, token: Tensor, args: list[Tensor]) -> None:
    """In a compiled backward: ``grad``, the gradient of a call's output, and ``args``, the
    call's inputs as the backward holds them, to the hooks of ``token`` (:func:`_tap`).
    It writes nothing: declared effectful (:func:`~jacmem.compat.ordered_op`), the graph
    keeps it though it returns nothing, and gives it ``grad`` as a plain input, laid out
    as the traced graph had it. (Declared as writing ``grad``, a view of a convolution's
    input gradient, which inductor lays out channels-last, it was handed the view's
    traced strides on that buffer: values shuffled within each sample.)"""
    with compat.autograd_inside_op():
        for hook in _hooks_of(token):
            hook(grad, args)


@_tapped.register_fake
def _(grad, token, args):
    return None


compat.ordered_op(torch.ops.jacmem.tapped.default)


class Tap(torch.autograd.Function):
    """The output of a call recorded in a compiled graph: a copy (later in-place ops may
    write it), whose gradient goes to the call's records (``jacmem::tapped``), with the
    call's inputs ``args``, which the graph keeps for its backward (saved, or recomputed
    there) as it keeps its own tensors (:class:`TappedHook`)."""

    @staticmethod
    def forward(ctx, output: Tensor, token: Tensor, *args: Tensor) -> Tensor:
        ctx.save_for_backward(token, *args)
        return output.clone()

    @staticmethod
    def backward(ctx, grad: Tensor):
        token, *args = ctx.saved_tensors
        torch.ops.jacmem.tapped(grad, token, args)
        return grad, None, *[None] * len(args)


@torch.library.custom_op("jacmem::fused", mutates_args=())
def _fused(grad: Tensor, token: Tensor, slot: int, x: Tensor, params: list[Tensor], needs_x: bool) -> list[Tensor]:
    """In a compiled backward: ``grad``, the gradient of the output of a call run through
    :class:`Fused`, to its record (:func:`_tap`); returns the gradients of the call's input
    (where ``needs_x``) and parameters, ``[x, *params]`` or ``params``: the record's, as
    :class:`ComputeOnce` gives them, or, where it gives none (no block takes them), those
    of the module's forward run again (:func:`_recomputed`)."""
    with compat.autograd_inside_op():
        for hook in _hooks_of(token):
            # (a record not run fused, as a block that computes no summed gradients makes: its plain hook)
            grads = hook(grad, x, needs_x) if isinstance(hook, FusedHook) else hook(grad, [x])
            if grads is not None:
                return grads
        module = _SLOTS[slot][1]()
        names = [n for n, p in own_parameters(module) if p.requires_grad]
        grads = _recomputed(module, names, x, params, grad, [needs_x] + [True] * len(params))
        return grads if needs_x else grads[1:]


@_fused.register_fake
def _(grad, token, slot, x, params, needs_x):
    return [torch.empty_like(t) for t in ([x] if needs_x else []) + params]


class Fused(torch.autograd.Function):
    """A call recorded in a compiled graph whose layer runs through :class:`ComputeOnce`
    in an eager forward: its output (a copy), cut from the module's own graph, so that
    the compiled backward computes no weight gradient of its own; the gradients of its
    input and parameters come from ``jacmem::fused``, from the same pass as the per-sample
    quantities."""

    @staticmethod
    def forward(ctx, slot: int, token: Tensor, x: Tensor, out: list, *params: Tensor) -> Tensor:
        ctx.slot = slot
        ctx.save_for_backward(token, x, *params)
        return out[0].clone()

    @staticmethod
    def backward(ctx, grad: Tensor):
        token, x, *params = ctx.saved_tensors
        needs_x = ctx.needs_input_grad[2]
        grads = torch.ops.jacmem.fused(grad, token, ctx.slot, x, params, needs_x)
        return (None, None, grads[0] if needs_x else None, None, *grads[needs_x:])


def compiled() -> bool:
    """Whether the module hook running now (:func:`eager`) was called from a forward
    that torch.compile traces, or is one of a compiled model's wrapper: its outputs go back into a compiled graph, which may
    hold nothing but plain tensors."""
    return bool(COMPILED) and COMPILED[-1]


def trainable(module: nn.Module, entry: LayerDerivatives | None = None) -> dict[str, nn.Parameter]:
    """The module's own parameters that require a gradient, and the submodule parameters
    that ``entry`` declares by dotted name (those its forward uses itself)."""
    params = {}
    for n, p in own_parameters(module):  # (loops, not comprehensions: this runs at every recorded call)
        if p.requires_grad:
            params[n] = p
    for name in () if entry is None else entry.params:
        if "." not in name:
            continue  # (one of its own: found above, where trainable)
        owner, _, leaf = name.rpartition(".")
        p = getattr(module.get_submodule(owner), leaf, None) if owner else None
        if isinstance(p, nn.Parameter) and p.requires_grad:
            params[name] = p
    return params


def counted(
    module: nn.Module, first: Any, output: Any, batch_axis: int = 0
) -> tuple[LayerDerivatives | None, dict[str, nn.Parameter]]:
    """The one rule for which module calls count, for every engine (first order, clipping,
    second order): a call of a module with trainable parameters of its own (its forward
    reads them), or of a registered type with trainable parameters (MultiheadAttention
    reads its ``out_proj``'s itself), given its first input ``first`` and ``output``; its
    batch on ``batch_axis``. Returns its first-order derivatives and its trainable
    parameters (:func:`trainable`); ``(None, {})`` for a container (the layers in it count
    their own calls) and for a module whose parameters are all frozen (nothing to compute:
    its derivatives are not even looked up, which may refuse it). Broadcasts and direct uses of a parameter are
    recorded apart (:class:`jacmem.engine.recorder.Recorder`)."""
    for p in compat.parameter_slots(module).values():  # (its own first: no walk of its submodules where one trains)
        if p is not None and p.requires_grad:
            break  # (one of its own trains: its forward reads parameters, no need to ask)
    else:
        for p in module.parameters():  # (a loop: no Python call per parameter, on every call)
            if p.requires_grad:
                break
        else:
            return None, {}  # frozen whole
        if not may_read_parameters(module) and registered_type(REGISTRY, type(module)) is None:
            return None, {}  # a container
    entry = lookup(module, first, output, batch_axis)
    return entry, trainable(module, entry)


class Recipe:
    """What the calls of one module need to know of it, found once and reused by its later
    calls (:func:`recipe`): whether it is of a registered type (``known``); whether its
    forward may read parameters of its own (``reads``, :func:`may_read_parameters`); and,
    for a module of a registered type with no submodule, what :func:`counted` finds for a
    call (its ``entry`` and trainable ``params``), the names its layer covers
    (``supported``) and, for a layer that may run through :class:`ComputeOnce` with each of
    them, its passthrough (``jac``, :func:`_layer_passthrough`), filled in at its first
    recorded call (:meth:`find`); and ``plans``, the backward's: how the module's last call
    that kept them computed its parameters' quantities, its plans bound to their strategies
    (:class:`jacmem.engine.staging.BoundPlans`, which holds the key it holds for), None until
    then. Forward and backward keep one recipe per module, in one cache; a recipe found
    again takes over the plans of the one it replaces, which hold only while their key does.

    It holds while the registry (:data:`jacmem.derivatives.registry.VERSION`), the
    module's type and that type's ``forward``, its own parameters (which tensors, and
    whether each trains) and its submodules are those it was found with."""

    __slots__ = (
        "cls", "forward", "version", "slots", "grads", "children", "known", "reads", "whole", "entry", "params",
        "supported", "jac", "plans",
    )  # fmt: skip

    def __init__(self, module: nn.Module, own: dict, children: dict):
        cls = type(module)
        self.cls, self.forward, self.version = (
            cls,
            cls.forward,
            VERSION[0],
        )  # (the version first: a change meanwhile counts)
        self.slots, self.children = list(own.values()), list(children.values())
        self.grads = [p is not None and p.requires_grad for p in self.slots]
        self.known = registered_type(REGISTRY, cls) is not None
        self.reads = may_read_parameters(module)
        #: whether :attr:`entry` and :attr:`params` are those :func:`counted` finds for a call (a
        #: submodule's parameters may count, and an unregistered type's entry depends on the call)
        self.whole = self.known and not self.children
        self.entry: LayerDerivatives | None = None
        #: None until :meth:`find` (at the first call recorded: a lookup may refuse the module)
        self.params: dict[str, nn.Parameter] | None = None
        self.supported: tuple[str, ...] = ()
        self.jac: Passthrough | None = None
        self.plans: Any = None

    def find(self, module: nn.Module) -> None:
        """Fill in what :func:`counted` finds for a call of ``module`` (a :attr:`whole` one)."""
        self.entry, self.params = counted(module, None, None)
        entry = self.entry
        self.supported = () if entry is None else entry.params
        self.jac = _layer_passthrough(module, entry, self.params, self.supported)


#: module -> its :class:`Recipe`
_RECIPES: weakref.WeakKeyDictionary[nn.Module, Recipe] = weakref.WeakKeyDictionary()
#: the dict behind :data:`_RECIPES`, read as :data:`_LAYERS_BY_REF` is
_RECIPES_BY_REF = _RECIPES.data


def recipe(module: nn.Module) -> Recipe:
    """``module``'s :class:`Recipe`: the one found before, where it still holds (checked
    at every call, without a call: the registry's version, the type, its ``forward``,
    the parameters and the submodules), else found now."""
    own, children = compat.own_slots(module)
    found = _RECIPES_BY_REF.get(weakref.ref(module))  # (_RECIPES.get)
    cls = type(module)
    if (
        found is not None and found.version == VERSION[0] and found.cls is cls and found.forward is cls.forward
        and len(own) == len(found.slots) and len(children) == len(found.children)
    ):  # fmt: skip
        # (loops, not generators: this runs at every module call)
        for p, kept, grad in zip(own.values(), found.slots, found.grads):
            if p is not kept or (p is not None and p.requires_grad is not grad):
                break
        else:
            for child, kept in zip(children.values(), found.children):
                if child is not kept:
                    break
            else:
                return found
    stale, found = found, Recipe(module, own, children)
    if stale is not None:  # the backward's plans hold by their own key (a swapped parameter of one kind keeps them)
        found.plans = stale.plans
    _RECIPES[module] = found
    return found


class Record:
    """One call of one module, from its forward to its backward."""

    __slots__ = (
        "module", "name", "entry", "hp", "params", "nodes", "x", "outputs", "grads", "missing", "task", "thread",
        "uses", "release", "once", "broadcast", "void", "batch_first", "autocast", "supported", "recipe",
        "__weakref__",
    )  # fmt: skip

    def __init__(self, module, name, entry, params, x, outputs: list[Tensor], uses: Uses, supported=None, recipe=None):
        self.module: nn.Module = module
        #: the module's :class:`Recipe` as the call found it, where its recorder had it (the
        #: backward keeps its bound plans there): None where not
        self.recipe: Recipe | None = recipe
        self.name: str = name
        self.entry: LayerDerivatives | None = entry
        #: the names of the parameters the layer covers (``entry.params``, where not given: a
        #: :class:`Recipe`'s; none without an entry)
        self.supported: tuple[str, ...] = supported if supported is not None else () if entry is None else entry.params
        #: the derivatives' keyword arguments, read off the module at forward time
        hyperparams = no_hyperparams if entry is None else entry.hyperparams
        self.hp: dict[str, Any] = {} if hyperparams is no_hyperparams else hyperparams(module)
        self.params: dict[str, nn.Parameter] = params
        #: each parameter's AccumulateGrad node: the backward pass tells, through it,
        #: whether it computes that parameter's gradient (``backward(inputs=...)``);
        #: a call through :class:`ComputeOnce` has them as its node's inputs
        self.nodes: dict[str, Any] = {}
        self.x: Any = x
        if x is not None and entry is not None and entry.arrange_input is not unarranged:  # (most layers: as it is)
            self.take(x)
        #: (shape, dtype, device) of each hooked output, to stand in zeros for a
        #: gradient that never arrives (an RNN's unused final state, say)
        self.outputs = []
        for t in outputs:
            self.outputs.append((t.shape, t.dtype, t.device))
        self.grads: list[Tensor | None] = [None] * len(outputs)
        self.missing = len(outputs)
        #: the backward pass (graph task id) that the gradients in ``grads`` come from
        self.task: int | None = None
        #: the thread that ran the forward: a block extends only its own thread's graphs
        self.thread = threading.get_ident()
        #: the live records of the recorder that made this one, by parameter
        self.uses = uses
        keys = []  # counted in ``uses`` for each of its parameters (a loop, not a comprehension: at every call)
        users, live = uses.users, uses.live
        for p in params.values():
            key = id(p)
            keys.append(key)
            live[key] = live.get(key, 0) + 1
            known = users.get(key)  # (no set at a parameter's first record: see Uses.users)
            if known is None:
                users[key] = weakref.ref(self)
            elif type(known) is weakref.ref:
                users[key] = weakref.WeakSet(uses.of(key) + [self])
            else:
                known.add(self)
        #: take this record out of ``uses`` now (it happens anyway when it is freed);
        #: whoever removes the hooks calls it, in case something else still holds it
        self.release = weakref.finalize(self, uses.release, keys)
        #: whether the call runs through :class:`ComputeOnce`
        self.once = False
        #: a call on a batch of one whose output is watched (:mod:`jacmem.engine.broadcast`):
        #: where it met the batch, records of its uses give the per-sample quantities
        self.broadcast: Origin | None = None
        #: a record to ignore: a use of a tensor whose other uses mixed the samples, or one whose recorder closed
        self.void = False
        #: the layout the call was recorded under (:mod:`jacmem.engine.layout`)
        self.batch_first = True
        #: the dtype autocast ran the call in, where it was on: its own ops may have been
        #: 16-bit where its output is not (PEFT's lora.Embedding, recomputed in float32)
        self.autocast = None
        if outputs and torch.is_autocast_enabled(outputs[0].device.type):
            self.autocast = torch.get_autocast_dtype(outputs[0].device.type)

    def take(self, x: Any) -> None:
        """Keep ``x``, what the layer keeps of the call's inputs, arranged as its derivatives
        take it."""
        entry = self.entry  # (most layers take it as it is: no call)
        self.x = (
            x if entry is None or x is None or entry.arrange_input is unarranged else entry.arrange_input(x, **self.hp)
        )

    @property
    def relaid(self) -> bool:
        """Whether the call took its batch on axis 1: ``x`` was kept with it moved first,
        and so is ``g``."""
        return _relaid(self.batch_first, self.entry)

    def shared(self, param: nn.Parameter) -> bool:
        """Whether another live record of the same recorder will also contribute to ``param``."""
        return self.uses.live.get(id(param), 0) > 1

    def others(self, param: nn.Parameter) -> list[Record]:
        """The other live records of the same recorder that contribute to ``param`` (those
        of this pass's calls among them)."""
        return [rec for rec in self.uses.of(id(param)) if rec is not self]

    def complete(self) -> None:
        """Zeros for the gradients that did not arrive."""
        for i, (shape, dtype, device) in enumerate(self.outputs):
            if self.grads[i] is None:
                self.grads[i] = torch.zeros(shape, dtype=dtype, device=device)
        self.missing = 0

    def receive(self, index: int, grad: Tensor) -> None:
        """The gradient of output ``index`` arrived, in the running backward pass."""
        task = compat.current_graph_task_id()
        if self.task != task:
            if self.missing != len(self.grads):  # what an earlier, failed backward left is stale
                self.reset()
            self.task = task
        if self.grads[index] is None:
            self.missing -= 1
        self.grads[index] = grad

    def reset(self) -> None:
        """Ready for the next backward pass through the same graph."""
        self.grads = [None] * len(self.grads)
        self.missing = len(self.grads)

    @property
    def g(self):
        """The output gradient(s), batch axis first, as the derivatives take them."""
        g = self.grads[0] if len(self.grads) == 1 else tuple(self.grads)
        g = layout.front(g) if not self.batch_first and _relaid(False, self.entry) else g
        entry = self.entry  # (most layers take it as it is: no call)
        return g if entry is None or entry.arrange is unarranged else entry.arrange(g, **self.hp)


def _relaid(batch_first: bool, entry: LayerDerivatives | None) -> bool:
    """Whether a call recorded under ``batch_first`` by ``entry`` has its batch moved
    first: under ``batch_first=False``, unless the layer places it itself."""
    return not batch_first and entry is not None and not entry.own_layout


def _output_tensors(entry: LayerDerivatives | None, output) -> list[Tensor]:
    out = output if entry is None or entry.outputs is same_output else entry.outputs(output)
    if isinstance(out, Tensor):
        return [out]
    return [t for t in out if isinstance(t, Tensor)]


def record(
    module: nn.Module,
    args: tuple,
    kwargs: dict,
    output,
    name: str,
    on_grad: OnGrad,
    handles: Handles | list[RemovableHandle],
    uses: Uses,
    once: bool = False,
    exclude: Collection[str] = (),
    batch_first: bool = True,
    known: Recipe | None = None,
) -> tuple[Record | None, Any]:
    """The forward-hook body: record this call if it has trainable parameters (but those
    in ``exclude``, whose uses are recorded apart: :func:`record_use`); returns the
    record (or None), and the output, which is new where ``once`` lets the layer run
    through :class:`ComputeOnce` (``on_grad`` must then return the parameters' summed
    gradients, or None). ``batch_first=False``: the call takes its batch on axis 1,
    unless its layer places it itself (:mod:`jacmem.engine.layout`). ``uses``: the
    recorder's :class:`Uses`, which counts the record. ``known``: the module's
    :func:`recipe`, where the caller has it.

    Calls inside a torch.func transform are not recorded: they are a derivative's own
    recomputation (see :mod:`jacmem.derivatives.generic`), or the user's.
    """
    if not torch.is_grad_enabled() or compat.functorch_transforms_active():
        return None, output
    if known is not None and known.whole:  # a registered layer: what counted() finds, found before
        if known.params is None:
            known.find(module)
        entry, params, jac = known.entry, dict(known.params), known.jac
    else:
        entry, params = counted(module, args[0] if args else None, output, 0 if batch_first else 1)
        jac = _LOOKED_UP
    for n in exclude:
        params.pop(n, None)
    if not params:
        return None, output
    outputs = []  # (loops, not comprehensions: this runs at every recorded call)
    plain = isinstance(output, Tensor) and (entry is None or entry.outputs is same_output)  # (most calls: no call)
    for t in (output,) if plain else _output_tensors(entry, output):
        if t.requires_grad:
            outputs.append(t)
    if not outputs:
        return None, output
    n = layout.batch_size(module, name, args, kwargs, outputs) if not batch_first and _relaid(False, entry) else None
    needs_input = entry is None
    for p in params if entry is not None else ():  # (a loop, not a generator)
        if p not in entry.input_free:
            needs_input = True
            break
    keeps = entry if needs_input else None
    first = args[0] if keeps is not None and n is None and keeps.keep is first_input and args else None
    # (kept(), inline where the layer keeps its first input, a tensor, as it is: most calls, one call less)
    x = first.detach() if isinstance(first, Tensor) else kept(keeps, n, args, kwargs)
    rec = Record(module, name, entry, params, x, outputs, uses, None if jac is _LOOKED_UP else known.supported, known)
    rec.batch_first = batch_first

    if _DEFERRED:  # in a compiled graph (:func:`_tap`)
        # (its indices are read before the call's backward: an LM head reads its embedding's)
        rec.x = compat.tree_map(_own_indices, rec.x)
    # Where the call runs through ComputeOnce (Fused, in a compiled graph that runs it so): the
    # layer's passthrough (:func:`_layer_passthrough`, a recipe's where found before), where the
    # call fits it: its input first and positional (one by keyword keeps autograd's path), and
    # one dtype (under autocast, casts sit between the parameters and the layer).
    if not once or (_DEFERRED and not _FUSING[-1]):
        jac = None
    else:
        if jac is _LOOKED_UP:
            jac = _layer_passthrough(module, entry, params, rec.supported)
        dtype = output.dtype if isinstance(output, Tensor) else None
        if jac is not None and (rec.x is None or not args or dtype is None or args[0].dtype != dtype):
            jac = None
        for p in params.values() if jac is not None else ():  # (a loop, not a generator: at every call)
            if p.dtype != dtype:
                jac = None
                break
    if _DEFERRED:
        rec.once = jac is not None
        keep = functools.partial(kept, keeps, n)
        _hook(rec, outputs, on_grad, handles, TappedHook(rec, on_grad, keep), jac)
        return rec, output
    if jac is not None:  # through ComputeOnce; its node's inputs: x, then the parameters
        # the input as the layer took it (``rec.x`` may be re-laid batch-first): ``x`` above where
        # that detached it, as most calls do
        kept_x = x if isinstance(first, Tensor) else args[0].detach()
        hp = jac.hyperparams(module)  # (Passthrough.params, without its call: with a jac_t, it adds nothing)
        vjp = (
            functools.partial(jac.vjp, kept_x, **hp) if jac.vjp is not None
            else lambda g: jac.backprop((kept_x,), None, g.unsqueeze(0), hp)[0][0]
        )  # fmt: skip
        fused = ComputeOnce.apply(rec, on_grad, vjp, [output.detach()], args[0], *params.values())
        rec.once = True
        nodes = fused.grad_fn.next_functions
        rec.nodes = {}
        for i, pname in enumerate(params, 1):
            rec.nodes[pname] = nodes[i][0]
        fused.grad_fn.metadata["jacmem.record"] = weakref.ref(rec)  # (_mark, inline: a call less per call)
        return rec, fused
    _hook(rec, outputs, on_grad, handles)
    for t in outputs:
        _mark(t.grad_fn, rec)
    return rec, output


#: the passthrough of a call that no :class:`Recipe` gives: look it up (:func:`_layer_passthrough`)
_LOOKED_UP: Any = object()


def kept(entry: LayerDerivatives | None, n: int | None, args: tuple, kwargs: dict) -> Any:
    """What a record keeps of a call's inputs, for every engine (first order's records,
    second order's nodes): its layer's ``keep`` of them, detached, with axis 1 moved first
    where ``n`` (the batch size there) is given; None without ``entry`` (no parameter of
    the call needs them)."""
    if entry is None:
        return None
    if n is not None:  # the derivatives take the batch first
        args, kwargs = layout.inputs_first(args, kwargs, n)
    if entry.keep is first_input and args:  # (most layers: their first input, read without a call)
        first = args[0]
        return first.detach() if isinstance(first, Tensor) else detached(first)  # (detached, inline for a tensor)
    return detached(entry.keep(args, kwargs))


def _own_indices(t: Any) -> Any:
    """``t``, copied where it is a tensor of indices (integers: small beside activations)."""
    return t.clone() if isinstance(t, Tensor) and not (t.is_floating_point() or t.is_complex()) else t


def _owned(t: Any) -> Any:
    return t.clone() if isinstance(t, Tensor) else t


def _mark(node, rec: Record) -> None:
    """Note on ``node``, the autograd node of a recorded call's output, its record (weakly):
    :func:`record_of` finds it from the graph."""
    if node is not None:
        node.metadata["jacmem.record"] = weakref.ref(rec)


def record_of(node) -> Record | None:
    """The live record of the eager call whose output ``node`` is, or None."""
    ref = node.metadata.get("jacmem.record")
    return None if ref is None else ref()


def record_use(
    module: nn.Module,
    name: str,
    entry: LayerDerivatives,
    params: dict[str, nn.Parameter],
    x,
    expanded: Tensor,
    on_grad: OnGrad,
    handles: Handles | list[RemovableHandle],
    uses: Uses,
) -> Record:
    """A record of one use of a tensor broadcast over the batch (:mod:`jacmem.engine.broadcast`):
    a parameter of ``module`` read directly, or the output of a call on a batch of one
    (``x``: that call's kept input, arranged, expanded to the batch); its per-sample
    gradient arrives at ``expanded``."""
    rec = Record(module, name, entry, params, None, [expanded], uses)
    rec.x = x
    _hook(rec, [expanded], on_grad, handles)
    return rec


def _hook(
    rec: Record,
    outputs: list[Tensor],
    on_grad: OnGrad,
    handles,
    tapped: TappedHook | None = None,
    jac: Passthrough | None = None,
) -> None:
    """Hooks on ``outputs`` that hand ``rec`` to ``on_grad`` once all their gradients arrived;
    ``tapped``: the hook of a call recorded in a compiled graph (:func:`_tap`: one output),
    which ``jacmem::tapped`` calls, or, with ``jac`` (the layer's passthrough), the
    :class:`FusedHook` of a call run through :class:`Fused`, which ``jacmem::fused`` calls."""
    rec.nodes = {n: torch.autograd.graph.get_gradient_edge(p).node for n, p in rec.params.items()}
    if tapped is not None:
        handle = RemovableHandle(_TAPPED)
        _TAPPED[handle.id] = tapped if jac is None else FusedHook(tapped, jac)
        _DEFERRED[-1].append(handle.id)
        (handles.add if isinstance(handles, Handles) else handles.append)(handle)
        return
    for i, out in enumerate(outputs):
        handle = out.register_hook(_make_hook(rec, i, on_grad))
        (handles.add if isinstance(handles, Handles) else handles.append)(handle)


def _make_hook(rec: Record, index: int, on_grad: OnGrad):
    def hook(grad: Tensor) -> None:
        rec.receive(index, grad)
        on_grad(rec)

    return hook


class TappedHook:
    """The output-gradient hook of a record made in a compiled graph (:func:`_tap`):
    ``hook(grad, args)``, the gradient of the call's output and the call's inputs as the
    compiled backward holds them, hands the record to ``on_grad`` (:meth:`arrive`).

    The record keeps copies of both, and its inputs from the backward's rather than the
    forward's: inductor writes new values into the buffer of a tensor once the graph no
    longer needs it (buffer reuse, in-place kernels), in the forward after the call (where
    the backward recomputes the tensor, or never reads it) as in the backward after the
    op, while the engines read what a record keeps up to the end of the pass (ClipGrad's
    clipped sums, a tied parameter's calls). Only its indices are kept from the forward
    (copied there), which an LM head reads of its embedding's record before that
    record's backward."""

    def __init__(self, rec: Record, on_grad: OnGrad, keep: Callable[[tuple, dict], Any]):
        self.rec, self.on_grad, self.keep = rec, on_grad, keep

    def __call__(self, grad: Tensor, args: list[Tensor]) -> None:
        self.arrive(grad, args)

    def arrive(self, grad: Tensor, args: list[Tensor]) -> dict[str, Tensor] | None:
        """Hand the record, with copies of ``grad`` and of what it keeps of ``args``, to
        ``on_grad``; returns what that returns."""
        rec = self.rec
        rec.take(compat.tree_map(_owned, self.keep(tuple(args), {})))
        rec.receive(0, grad.clone())
        return self.on_grad(rec)


class FusedHook:
    """The output-gradient hook of a record whose call a compiled graph runs through
    :class:`Fused`: ``hook(grad, x, needs_x)`` hands the record to ``on_grad`` (its
    :class:`TappedHook`, on the call's input ``x``) and returns the gradients of the call's
    input (where ``needs_x``: the layer's ``jac_t`` of ``grad``) and parameters (copies:
    see :meth:`__call__`), or None where ``on_grad`` gives none."""

    def __init__(self, tapped: TappedHook, jac: Passthrough):
        self.tapped, self.jac = tapped, jac

    def __call__(self, grad: Tensor, x: Tensor, needs_x: bool) -> list[Tensor] | None:
        rec = self.tapped.rec
        grads = self.tapped.arrive(grad, [x])
        if grads is None:
            return None
        hp = self.jac.params(rec.module)
        gx = [self.jac.backprop((x,), None, grad.unsqueeze(0), hp)[0][0]] if needs_x else []
        # zeros where the block gives none (ClipGrad writes its clipped sums at the end); copies
        # of the block's: what ``jacmem::fused`` returns is the graph's buffer, which inductor
        # may write into (a tied weight's other gradient added in place), while the block
        # keeps its summed gradients to the end of the pass (Variance's ``grad``)
        return gx + [grads[n].clone() if n in grads else torch.zeros_like(p) for n, p in rec.params.items()]


class ComputeOnce(torch.autograd.Function):
    """One call of a layer whose parameters' gradients the block computes itself.

    autograd would compute the weight gradient, and the block the per-sample
    gradients, whose sum it is: twice the work. In this Function's backward,
    ``on_grad(record)`` computes the per-sample quantities and, from the same pass,
    each parameter's summed gradient; the input gradient is ``vjp(g)``, the layer's
    (:attr:`~jacmem.derivatives.registry.Passthrough.vjp`, else its ``jac_t``).
    The forward's result is reused (its own graph is dropped), so the forward runs once.

    Where ``on_grad`` gives no gradients (the block has ended, or another thread runs
    the backward) and under ``create_graph=True``, the backward is autograd's own, on a
    recomputed forward.
    """

    @staticmethod
    def forward(ctx, rec: Record, on_grad: OnGrad, vjp: Callable, out: list, x: Tensor, *params: Tensor):
        ctx.rec, ctx.on_grad, ctx.vjp = rec, on_grad, vjp
        ctx.save_for_backward(x, *params)  # x is the record's input: no copy
        # the forward's result, detached; passed in a list, as an input tensor returned
        # as it is would become a view, which in-place ops (ReLU(inplace=True)) may not touch
        return out.pop()

    @staticmethod
    def backward(ctx, g: Tensor):
        rec: Record = ctx.rec
        x, *params = ctx.saved_tensors
        needs = ctx.needs_input_grad[4:]
        create_graph = torch.is_grad_enabled()
        if len(rec.grads) == 1:  # (rec.receive(0, g), inline for one output, whatever an earlier backward left)
            rec.task, rec.grads[0], rec.missing = compat.current_graph_task_id(), g, 0
        else:
            rec.receive(0, g)
        grads = ctx.on_grad(rec)
        if grads is None or create_graph:
            return (None, None, None, None, *_recomputed(rec.module, list(rec.params), x, params, g, needs))
        gx = ctx.vjp(g) if needs[0] else None
        out = [None, None, None, None, gx]
        for name in rec.params:
            out.append(grads.get(name))
        return tuple(out)


def _recomputed(module: nn.Module, names: list[str], x: Tensor, params, g: Tensor, needs) -> list:
    """The gradients of this call alone w.r.t. ``(x, *params)`` (``params`` the module's
    parameters ``names``; ``None`` where not needed), by ``torch.func.vjp`` of the
    module's forward run again (its hooks do not run): partial derivatives, so a
    parameter that also produced ``x`` (a tied embedding before its output head) gets
    only this call's part, and none of ``x``'s history is traversed. Under
    ``create_graph`` they are differentiable, as autograd's are."""

    def forward(x: Tensor, *params: Tensor) -> Tensor:
        restore = compat.swap_parameters(module, dict(zip(names, params)))
        try:
            return type(module).forward(module, x)
        finally:
            restore()

    _, vjp = torch.func.vjp(forward, x, *params)
    return [grad if need else None for grad, need in zip(vjp(g), needs)]


def _layer_passthrough(
    module: nn.Module, entry: LayerDerivatives | None, params: dict, supported: tuple[str, ...]
) -> Passthrough | None:
    """How the input gradient of a call of ``module`` is computed where its layer (``entry``,
    covering the parameters ``supported``) can run through :class:`ComputeOnce` (or
    :class:`Fused`) with each of its trainable ``params``: the layer's passthrough, with a
    ``jac_t``; else None. (Whether a call fits it, :func:`record` asks.)"""
    if entry is None or not entry.compute_once:
        return None
    for pname in params:  # (a loop, not a generator)
        if pname not in supported:
            return None  # a parameter jacmem cannot handle
    jac = lookup_passthrough(module)
    return None if jac is None or jac.jac_t is None else jac


class Handles(list):
    """The handles of hooks set on tensors and autograd nodes, to take off at the end.
    In a block open for many steps, those of freed graphs are dropped now and then."""

    #: the length past which the next :meth:`add` drops the handles of freed graphs (a class
    #: default until the first prune: a recorder, and its handles, are made at every step)
    _prune_at = 64

    def add(self, handle: RemovableHandle) -> None:
        self.append(handle)
        if len(self) > self._prune_at:
            self[:] = [h for h in self if compat.handle_alive(h)]
            self._prune_at = 2 * len(self) + 64


def remove(handles: list[RemovableHandle]) -> None:
    """Take every hook off, freeing what their records kept."""
    for handle in handles:
        handle.remove()
    handles.clear()


class LateBackward:
    """Warns when a backward pass reaches a graph whose forward ran inside a block after
    the block has closed: its records went with the block, so no extension takes part
    and ``.grad`` is autograd's plain gradient.

    :meth:`watch` puts a pre-hook on the ``grad_fn`` of each tensor of an outermost
    call's output. The hook lives with that graph, holds only this small object, and
    compares two flags: a backward that reaches it while the block is open disarms it;
    the first one after the block has closed (and set :attr:`open` False) warns, once for
    the block.
    """

    #: whether the block is open (it sets False when it closes) and whether it warned; class
    #: defaults until set (a block makes one at every step, with no call)
    open = True
    warned = False

    def watch(self, output: Any) -> None:
        """``output``: what an outermost module call in the block returned (any pytree)."""
        if compat.functorch_transforms_active():
            return  # a torch.func transform's own graph, not the user's
        nodes = set()  # (a loop, not a comprehension)
        for t in (output,) if isinstance(output, Tensor) else compat.tree_flatten(output)[0]:
            if isinstance(t, Tensor) and t.grad_fn is not None:
                nodes.add(t.grad_fn)
        reached = [False]

        def prehook(grad_outputs):
            reached[0] = reached[0] or self.open
            if not reached[0] and not self.warned:
                self.warned = True
                notices.warn(
                    "jacmem: a backward pass went through a forward that ran inside a jacmem.extend(...) block, "
                    "after the block had closed: no extension took part (nothing like grad_batch was written, "
                    "and .grad is autograd's plain, unclipped gradient). Call loss.backward() inside the block, "
                    "or call jacmem.track(model) before the forward and open the block around the backward.",
                    UserWarning,
                )

        for node in nodes:
            node.register_prehook(prehook)
