"""The recorder of forward calls, inside a block and for :func:`track`.

A :class:`Recorder` turns each forward call of a module with trainable parameters into
a :class:`jacmem.engine.hooks.Record` whose output hooks call ``on_grad(record)`` in backward,
and keeps the hooks' handles so that :meth:`Recorder.close` takes them all off. The
first-order engine owns one for the calls inside its block; :func:`track` gives a
model one (a :class:`Tracker`) for forwards run before a block, whose records go to
the block that owns the tracking (a private model's), or else to the ``jacmem.extend``
block active when their gradients arrive (:data:`SINK`).
"""

from __future__ import annotations

import functools
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from jacmem import compat, walker
from jacmem.derivatives import REGISTRY, registered_type
from jacmem.derivatives.expanded import use_entry
from jacmem.derivatives.generic import normalises_over_batch
from jacmem.derivatives.registry import own_parameters, recognised_before
from jacmem.engine import fsdp, hooks
from jacmem.engine.broadcast import Origin, watch

#: a use record (:func:`jacmem.engine.hooks.record_use`) and the tensor its gradient arrives at
_Use = tuple[hooks.Record, Tensor]


class Recorder:
    """Records forward calls; ``close()`` removes every hook it set and frees the records.

    ``once``: let a layer run through :class:`jacmem.engine.hooks.ComputeOnce` where the layer
    allows it (``on_grad`` then returns its parameters' summed gradients).

    Broadcasts over the batch are made explicit (:mod:`jacmem.engine.broadcast`), so that what
    meets the batch gets per-sample quantities without recomputing a module per sample:

    * a module of no registered type reads its own trainable parameters as watched
      views during its forward (:meth:`enter`, :meth:`leave`): each use that meets the
      batch is recorded apart (:func:`jacmem.engine.hooks.record_use`); a parameter with a use
      that may mix the samples is left to the module's own record (the generic
      recomputation), and its use records are dropped;
    * a call on a batch of one, after calls on a larger batch in the same outermost
      forward, or on integer ids (an embedding of ``[1, T]`` position ids), returns a
      watched view of its output: each use that meets the batch is a record of the
      module with its input expanded to that batch.

    ``batch_first=False``: calls take their batch on axis 1 (:mod:`jacmem.engine.layout`).
    Broadcasts are then not made explicit: the parameters that a module of no registered
    type reads in its forward are left to its own record (the generic recomputation), and
    only those it does not read (Opacus's DPLSTM holds its cells' parameters) are left
    to the records of the submodules that use them; a call on a batch of one is recorded
    as one (the engine's batch-size check names it). The calls of one outermost forward
    must agree on the batch size; one that does not raises at once.
    """

    def __init__(self, on_grad: hooks.OnGrad, once: bool = False, batch_first: bool = True, hand_uses: bool = False):
        self.on_grad = on_grad
        self.once = once
        self.batch_first = batch_first
        self.tensor_handles = hooks.Handles()
        #: the live records of this recorder, by parameter: which weights its calls tie
        self.uses = hooks.Uses()
        #: what each record is made with: ``(on_grad, handles, uses)``
        self._sink = (on_grad, self.tensor_handles, self.uses)
        self.records: weakref.WeakSet[hooks.Record] = weakref.WeakSet()
        #: the batch of the latest call on more than one sample, in the running forward of
        #: the outermost module (a call on a batch of one after it may be broadcast)
        self.batch = 1
        #: in a compiled forward, the first call on one row of ids before any call on more
        #: rows: the forward's batch may be that one row, or the call's output may be
        #: broadcast over a batch that comes later (then :meth:`record` raises)
        self.one_row: hooks.Record | None = None
        #: under batch_first=False, the first call of the running outermost forward:
        #: (its name, its batch size)
        self.first: tuple[str, int] | None = None
        #: whether the running outermost forward is one torch.compile traces: its module calls
        #: return plain tensors (no watched views), as a compiled graph takes nothing else
        self.compiled = False
        #: name -> type of each module recorded in a compiled model's forward whose call
        #: Dynamo did not trace: it ran eagerly (in a frame torch.compile gave up on), for explain()
        self.eager: dict[str, str] = {}
        #: the module a compiled model's wrapper runs: its own hooks run eagerly, around
        #: its compiled forward
        self.compiled_root: nn.Module | None = None
        #: the number of calls recorded so far; where a compiled model's forward began
        #: (:meth:`leave` checks that its compiled code recorded any)
        self.made = 0
        self.compiled_start: int | None = None
        #: module -> its parameters' origins and their use records (with the tensors their
        #: gradients arrive at), from enter to record
        self.direct: dict[nn.Module, tuple[Callable[[], None], dict[str, Origin], list[_Use]]] = {}
        #: whether :meth:`record` hands over the exact use records of the call it records
        #: (:attr:`used`), for an engine that builds on them (second order)
        self.hand_uses = hand_uses
        #: where ``hand_uses``: ``(module, [(use record, the tensor its gradient arrives at)])``
        #: of the latest call recorded with direct uses, until its taker clears it
        self.used: tuple[nn.Module, list[_Use]] | None = None

    def enter(self, module: nn.Module, name: Callable[[nn.Module], str]) -> None:
        """Before ``module``'s forward (``name(module)``: its name, asked only where needed):
        where its type is registered nowhere and no
        earlier call of it was recognised as a registered layer's (timm's LayerNorm),
        its own trainable parameters become watched views until :meth:`leave` (not
        where a BatchNorm inside it mixes the samples)."""
        self.compiled = self.compiled or hooks.compiled() or compat.compiled_in_place(module)
        # (a compiled model's wrapper enters from a compiled() hook: an eager forward asks nothing)
        if self.compiled and compat.is_compiled_module(module):
            self.compiled_root, self.compiled_start = compat.uncompiled(module), self.made
        stale = self.direct.pop(module, None)  # what a forward that raised left behind
        if stale is not None:
            _void([rec for rec, _ in stale[2]])
        known = registered_type(REGISTRY, type(module)) is not None or recognised_before(module)
        if known or normalises_over_batch(module):
            return
        params = {n: p for n, p in module.named_parameters(recurse=False) if p.requires_grad}
        if not params or not torch.is_grad_enabled() or compat.functorch_transforms_active() or self.compiled:
            return  # (a compiled forward takes plain tensors only: left to the module's own record)
        uses: list[_Use] = []
        name = name(module)

        def on_use(pname: str, p: nn.Parameter, expanded: Tensor) -> None:
            if not self.batch_first:  # expanded on axis 0, not the batch: left to the module's record
                origins[pname].unsafe.append("a use under batch_first=False")
                return
            entry = use_entry(pname, tuple(p.shape))
            uses.append((hooks.record_use(module, name, entry, {pname: p}, None, expanded, *self._sink), expanded))

        origins = {n: Origin(p, functools.partial(on_use, n, p)) for n, p in params.items()}
        restore = compat.swap_parameters(module, {n: watch(o) for n, o in origins.items()})
        self.direct[module] = (restore, origins, uses)

    def leave(self, module: nn.Module, outermost: bool) -> None:
        """After ``module``'s forward (however it ended): its parameters are back; after
        the outermost module's, the next forward starts afresh."""
        state = self.direct.get(module)
        if state is not None:
            state[0]()
        if self.compiled_start is not None and compat.is_compiled_module(module):
            start, self.compiled_start = self.compiled_start, None
            if self.made == start and torch.is_grad_enabled() and any(p.requires_grad for p in module.parameters()):
                raise RuntimeError(_STALE_COMPILED.format(type=type(compat.uncompiled(module)).__name__))
        if outermost:
            self.batch, self.first, self.compiled, self.one_row = 1, None, False, None

    def _direct_uses(self, module: nn.Module) -> tuple[str, ...]:
        """The parameters of ``module`` whose uses in the forward just ended were each
        recorded apart; those with a use that may have mixed the samples are left to the
        module's own record (their use records are dropped)."""
        state = self.direct.pop(module, None)
        if state is None:
            return ()
        _, origins, uses = state
        exact = tuple(n for n, o in origins.items() if not o.unsafe)
        _void([rec for rec, _ in uses if next(iter(rec.params)) not in exact])
        self.records.update(rec for rec, _ in uses if next(iter(rec.params)) in exact)
        if self.hand_uses:
            self.used = (module, [(rec, t) for rec, t in uses if next(iter(rec.params)) in exact])
        return exact

    def record(self, module: nn.Module, args: tuple, kwargs: dict, output, name: str) -> Any:
        """Record one call; returns the output to use (new where it runs through
        ComputeOnce, or a watched view where it may be broadcast), or None to keep it."""
        exclude = self._direct_uses(module) if self.direct else ()  # (most calls: none, asked without a call)
        given = output
        if self.batch_first and self.compiled and not hooks.compiled() and isinstance(output, Tensor):
            args, output = hooks.spread(args, output, self.batch)  # an eager call in a compiled forward, as traced ones
        rec, new = hooks.record(module, args, kwargs, output, name, *self._sink, self.once, exclude, self.batch_first)
        if rec is None:
            return None
        self.made += 1
        if self.compiled and not hooks.compiled() and module is not self.compiled_root:
            self.eager[name] = type(module).__name__
        self.records.add(rec)
        if not self.batch_first:
            self._check_batch(rec)
            return None if new is given else new
        n = rec.outputs[0][0][0] if rec.outputs and len(rec.outputs[0][0]) else 1
        if n > 1:
            self.batch = n
            if self.one_row is not None:  # a compiled forward's call on one row before the batch
                one = self.one_row
                raise RuntimeError(_COMPILED_BROADCAST.format(name=one.name, type=type(one.module).__name__))
        elif n == 1 and (self.batch > 1 or _indices(rec.x)) and isinstance(new, Tensor):
            if not (self.compiled or hooks.compiled()):
                new = self._broadcast(rec, new)
            elif self.batch > 1:
                raise RuntimeError(_COMPILED_BROADCAST.format(name=rec.name, type=type(module).__name__))
            else:  # a batch of one, so far: the whole forward's, unless a call on more rows follows
                self.one_row = self.one_row or rec
        return None if new is given else new

    def make(self, module: nn.Module, args: tuple, kwargs: dict, output, name: str) -> hooks.Record | None:
        """A record of one call as it ran, with every trainable parameter the one rule
        counts (:func:`jacmem.engine.hooks.counted`), none left to use records, and its
        output as it is (never run through ComputeOnce, never a watched view): for an
        engine that follows broadcasts its own way (second order), where the block's
        recorder did not record the call whole. None where the call counts no parameter."""
        rec, _ = hooks.record(module, args, kwargs, output, name, *self._sink)
        if rec is not None:
            self.records.add(rec)
        return rec

    def _check_batch(self, rec: hooks.Record) -> None:
        """Under batch_first=False, a call whose batch size disagrees with that of the
        forward's first call: one of them does not take the batch where jacmem reads it,
        and would get its quantities per row of another axis."""
        n = _batch_of(rec)
        if self.first is None:
            self.first = (rec.name, n)
        elif self.first[1] != n:
            first, m = self.first
            raise ValueError(
                f"jacmem: under batch_first=False, module {rec.name!r} ({type(rec.module).__name__}) has a batch of "
                f"{n} where {first!r} had {m}: one of them does not take the batch on axis 1 (axis 0 for "
                "convolutions; as their own batch_first says for RNNs and attention), and would get its quantities "
                "per row of another axis. Keep the batch on axis 1 where it runs (e.g. out[-1:] rather than "
                "out[-1]), or run the model batch-first with batch_first=True."
            )

    def _broadcast(self, rec: hooks.Record, output: Tensor) -> Tensor:
        """A watched view of ``output`` (a call on a batch of one): each use that meets
        the batch records the call again, its input expanded to that batch."""

        def on_use(expanded: Tensor) -> None:
            rec.release()  # its uses give the per-sample quantities now
            x = _expand_batch(rec.x, expanded.shape[0])
            self.records.add(hooks.record_use(rec.module, rec.name, rec.entry, rec.params, x, expanded, *self._sink))

        rec.broadcast = Origin(output, on_use)
        return watch(rec.broadcast)

    def close(self) -> None:
        for handle in self.tensor_handles:  # (hooks.remove, without the call: a recorder closes at every step)
            handle.remove()
        self.tensor_handles.clear()
        for restore, _, _ in self.direct.values():
            restore()
        self.direct.clear()
        self.used = None
        for rec in list(self.records):
            # a traceback may still hold it; its hooks are off. Out of :attr:`uses`, which
            # forgets every record at once below (its release, without a call per record)
            rec.release.detach()
            rec.x = None  # a ComputeOnce call left in a graph then backpropagates as autograd would:
            rec.void = True  # its owner ignores it (a late backward's ComputeOnce still hands it over)
        self.uses.live.clear()
        self.uses.users.clear()
        self.records = weakref.WeakSet()


_COMPILED_BROADCAST = (
    "jacmem: module {name!r} ({type}) ran on a batch of one inside a forward that torch.compile traces; its output "
    "may be broadcast over the batch, which jacmem follows in eager forwards only (a watched view, which a "
    "compiled graph cannot take). Give its input the batch axis (e.g. position_ids=torch.arange(T).expand(N, -1)), "
    "freeze its parameters, or run the model without torch.compile."
)


_STALE_COMPILED = (
    "jacmem: the compiled model ({type}) ran code that torch.compile built before jacmem's hooks were set (its "
    "first forward ran outside jacmem.extend and jacmem.track): none of its calls was recorded, so no extension "
    "would get anything. Run its first compiled forward inside the block (or after jacmem.track(model)), or call "
    "torch.compiler.reset() before the block."
)


def _batch_of(rec: hooks.Record) -> int:
    """A call's batch size: axis 1 of its output where its batch was moved first;
    otherwise axis 0 of what its layer kept, arranged (of its output, where it kept nothing)."""
    if rec.relaid:
        return rec.outputs[0][0][1]
    first = next((t for t in compat.tree_flatten(rec.x)[0] if isinstance(t, Tensor) and t.dim()), None)
    return first.shape[0] if first is not None else rec.outputs[0][0][0]


def _void(records: list[hooks.Record]) -> None:
    """Records of uses to ignore: their parameter's uses are not all known, or not all
    exact."""
    for rec in records:
        rec.void = True
        rec.release()


def _indices(x) -> bool:
    """Whether the kept input is an integer tensor (an embedding's ids, as ``[1, T]``
    position ids; first of a tuple), which may be broadcast over a batch that comes later."""
    first = x[0] if isinstance(x, (tuple, list)) and x else x
    return isinstance(first, Tensor) and not (first.is_floating_point() or first.is_complex())


def _expand_batch(x, n: int):
    """``x`` (a tensor, or tensors in tuples, lists and dicts) with each axis 0 of size
    one expanded to ``n``, as a view."""

    def expand(t):
        return t.expand(n, *t.shape[1:]) if isinstance(t, Tensor) and t.dim() and t.shape[0] == 1 else t

    return compat.tree_map(expand, x)


class Tracker(Recorder):
    """Forward hooks on one model's modules, for forwards that run outside a block.

    ``owner``: the block that takes the model's calls (see :func:`track`); None: the
    block of :data:`SINK`, the active ``jacmem.extend``, if any."""

    def __init__(self, model: nn.Module, owner: Any = None):
        super().__init__(self._dispatch)
        self.owner = owner
        self.names: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
        self.model = weakref.ref(model)
        self.module_handles: list = []
        # traced by a compiled forward: hooks.eager
        enter, leave, forward = (_Hook(hooks.eager(h)) for h in (self._on_enter, self._on_leave, self._on_forward))
        for name, module in model.named_modules():
            # the root always, so that the end of its forward is seen (:meth:`Recorder.leave`)
            if module is not model and not own_parameters(module):
                continue
            self.names[module] = name or type(module).__name__
            # an FSDP2 module's forward hook reshards its parameters: see the call before it
            # (its pre-forward hook, which unshards them, comes first already)
            first = fsdp.is_fsdp(module)
            after = [(leave, {"always_call": True}), (forward, {"with_kwargs": True})]
            self.module_handles.append(module.register_forward_pre_hook(enter))
            for hook, kwargs in reversed(after) if first else after:  # leave, then forward, either way
                self.module_handles.append(module.register_forward_hook(hook, prepend=first, **kwargs))

    @property
    def block(self) -> Any:
        """The block the calls go to now, or None."""
        return self.owner if self.owner is not None else SINK[0]

    def _dispatch(self, rec: hooks.Record) -> dict | None:
        block = self.block
        return None if block is None else block.record(rec)

    # A module missing from ``names`` carries these hooks as a copy (``copy.copy`` shares a
    # module's hooks; deep copies and pickles get :func:`_inert` ones): its calls are left alone.

    def _on_enter(self, module, args):
        if module in self.names:
            self.enter(module, self.names.__getitem__)

    def _on_leave(self, module, args, output):
        if module in self.names:
            self.leave(module, module is self.model())

    def _on_forward(self, module, args, kwargs, output):
        if module not in self.names:
            return None
        # where a block takes the calls, a layer may run through ComputeOnce as the block's
        # own calls do (its backward recomputes the forward where the block has ended by then)
        block = self.block
        self.once = block is not None and block.once
        if block is not None:
            block.recomputing()
        replaced = self.record(module, args, kwargs, output, self.names[module])
        if block is not None and module is self.model():
            block.called(module, args, kwargs, output if replaced is None else replaced)
        return replaced

    def close(self) -> None:
        hooks.remove(self.module_handles)
        super().close()


class _Hook:
    """A tracker's module hook, as the modules hold it: pickled with a whole model
    (``torch.save(model)``), it becomes :func:`_inert`, so that the loaded model is one
    jacmem never saw (its hook functions, closures over the tracker, do not pickle)."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable):
        self.fn = fn

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def __reduce__(self):
        return _inert_hook, ()


def _inert(*args, **kwargs) -> None:
    """What a tracker's hook becomes in a pickled model: nothing."""
    return None


def _inert_hook() -> Callable:
    return _inert


#: models registered with track(): model -> Tracker (read without a call where none is: :class:`jacmem.engine.staging.Stager`)
TRACKED: weakref.WeakKeyDictionary[nn.Module, Tracker] = weakref.WeakKeyDictionary()
#: ``[block]``: the block that takes the calls of the models tracked without an owner, the
#: active ``jacmem.extend``, which sets it when it opens (None outside it: it sets None
#: when it closes; a list, set without a call: a block opens at every step). A block has
#: ``record(record)``, which returns the summed gradients where it computed them, and ``once``.
SINK: list[Any] = [None]


def tracked_name(module: nn.Module) -> str | None:
    """The name of ``module`` in a tracked model, or None where it is tracked nowhere."""
    if not TRACKED:
        return None
    for tracker in TRACKED.values():
        if module in tracker.names:
            return tracker.names[module]
    return None


def tracked_models() -> list[nn.Module]:
    """Every tracked model, whichever block takes its calls."""
    return list(TRACKED.keys())


def owner(model: nn.Module) -> Any:
    """The block that owns ``model``'s tracking, or None (not tracked, or tracked by
    :func:`track` without an owner)."""
    tracker = TRACKED.get(model)
    return None if tracker is None else tracker.owner


def routed_to(block: Any) -> list[nn.Module]:
    """The tracked models whose calls go to ``block``: those it owns, and, where it is
    the :data:`SINK`, those without an owner."""
    if not TRACKED:  # (none tracked, most blocks: asked without a comprehension)
        return []
    return [m for m, t in list(TRACKED.items()) if t.owner is block or (t.owner is None and SINK[0] is block)]


def track(model: nn.Module, batch_first: bool = True, *, owner: Any = None) -> nn.Module:
    """Keep, from now on, what the extensions need from ``model``'s forward passes,
    so that a backward inside :func:`jacmem.extend` can use a forward run before it
    (BackPACK's ``extend(model)``). Returns the model. Undo with :func:`untrack`.

    ``batch_first=False``: the model's modules take the batch on axis 1 of their inputs
    and outputs, ``[T, N, ...]`` (Opacus's ``GradSampleModule(batch_first=False)``;
    see :mod:`jacmem.engine.layout`); the block that computes on its calls must say the same.
    Tracking a tracked model again sets the option for its later forwards.

    ``owner``: a block (:class:`jacmem.engine.block.Block`) that takes the model's calls,
    wherever they run, in place of the active ``jacmem.extend`` (a private model's)."""
    tracker = TRACKED.get(model)
    if tracker is not None and tracker.owner is not owner:
        raise ValueError(_taken(model, tracker.owner))
    if tracker is None:
        tracker = TRACKED[model] = Tracker(model, owner)
    tracker.batch_first = batch_first
    return model


def untrack(model: nn.Module, *, owner: Any = None) -> nn.Module:
    """Remove the hooks of :func:`track` (given the same ``owner``), and everything they kept."""
    tracker = TRACKED.get(model)
    if tracker is not None and tracker.owner is not owner:
        raise ValueError(_taken(model, tracker.owner))
    if tracker is not None:
        del TRACKED[model]
        tracker.close()
    return model


def _taken(model: nn.Module, by: Any) -> str:
    where = "by jacmem.track(model)" if by is None else f"by another block ({type(by).__name__})"
    fix = "jacmem.untrack(model)" if by is None else "that block's end (a private model's: engine.detach())"
    return f"jacmem: the model ({type(model).__name__}) is tracked {where} already; free it first with {fix}."


def _refuse_second_backward(grad: torch.Tensor) -> None:
    raise RuntimeError(
        "jacmem: this backward differentiates the gradients of a backward(create_graph=True) run in the same "
        "jacmem.extend block (a gradient penalty, a Hessian-vector product). Its 'loss' is a function of "
        "gradients, not a sum of per-sample terms: per-sample quantities of this second backward are not "
        "defined. Run it after the block, outside `with jacmem.extend(...)`: the first backward's quantities "
        "stay as they were written."
    )


class BackwardWatch:
    """Watches each backward of the thread ``owner`` from its making to :meth:`close`
    (and from :meth:`open` again), for three jobs: it tells the block a
    backward is about to begin (``on_backward``: the second-order engine's autograd path
    starts there), it warns where that backward reached no record of the block, and it
    warns where it reached a parameter that got none of the block's results.

    The second is BackPACK's habit: the forward ran before the block on a model nobody
    tracked, then ``loss.backward()`` inside it. No hook of the block runs in that
    backward, and the parameters silently get nothing. The third is a parameter read
    outside every module call (a free ``nn.Parameter``, or ``logits * model.logit_scale``
    in the loss): it gets ``.grad`` and nothing else.

    While the block is open, ``torch.autograd.backward`` and ``torch.autograd.grad``
    (which ``Tensor.backward`` calls) are wrapped: before a backward of the block's
    thread that begins outside any other, its graph is searched for the parameters whose
    AccumulateGrad it reaches (of its ``inputs``, where it has them), and
    ``on_backward(tensors, grad_tensors, reached)`` runs (``ClipGrad`` guards those no
    model of the block holds; second order refuses those it has nothing for). After it,
    of those parameters: where no pass of the block
    began, the block warns, once, naming ``jacmem.track``; otherwise it warns, once per
    parameter, naming each that the passes wrote nothing to (``describe(param)``: its
    name)."""

    def __init__(
        self, passes, describe: Callable, shards: Callable[[], dict[int, Any]], on_backward: Callable, owner: int
    ):
        self.passes = passes
        #: ``(tensors, grad_tensors, reached)``: a backward of the block's thread is about
        #: to begin, reaching the parameters ``reached`` (the second-order engine's
        #: autograd path starts there)
        self.on_backward = on_backward
        #: ``describe(param)``: the parameter's name, for the warnings
        self.describe = describe
        #: ``shards()``: ``id(unsharded) -> sharded`` of the FSDP2 parameters, whose
        #: results go to the shard
        self.shards = shards
        #: the thread whose backwards it watches (None once closed)
        self.owner: int | None = owner
        self.warned = False
        #: ids of the parameters already named in a warning
        self.missed: set[int] = set()
        #: the hooks of :meth:`_refuse_through`, taken off when the block ends
        self.refusals: list = []
        #: ends the watch of ``torch.autograd.backward`` and ``grad`` (:func:`compat.watch_autograd`),
        #: which begins here (not in :meth:`open`: a block is made and opened at every step)
        self.unwatch: Callable[[], None] | None = compat.watch_autograd(self._around)

    def open(self, owner: int) -> None:
        """Watch again, after :meth:`close` (a block entered again), the same thread's
        backwards, with the warnings given so far kept."""
        self.owner = owner
        self.unwatch = compat.watch_autograd(self._around)

    def close(self) -> None:
        for handle in self.refusals:
            handle.remove()
        self.refusals = []
        if self.unwatch is not None:
            self.unwatch()
        self.unwatch, self.owner = None, None

    def _around(self, run: Callable, tensors, grad_tensors, inputs, create_graph: bool):
        """A call of ``torch.autograd.backward`` or ``grad`` (:func:`compat.watch_autograd`):
        ``run()`` makes it."""
        if threading.get_ident() != self.owner or compat.current_graph_task_id() != -1:
            return run()
        reached = list(walker.parameters(tensors))
        if inputs is not None:  # the parameters it accumulates into, or returns the gradients of
            wanted = {id(t) for t in ([inputs] if isinstance(inputs, torch.Tensor) else inputs)}
            reached = [p for p in reached if id(p) in wanted]
        if self.on_backward is not None:
            self.on_backward(tensors, grad_tensors, reached)
        started = self.passes.started
        self.passes.written.clear()
        self.passes.create_graph = create_graph
        try:
            out = run()
        finally:
            self.passes.create_graph = False
        if create_graph:
            given = [inputs] if isinstance(inputs, torch.Tensor) else inputs
            results = list(out) if out is not None else [t.grad for t in (reached if given is None else given)]
            self._refuse_through(results)
        if self.warned:
            return out
        if self.passes.started == started:
            if reached:
                self._untracked()
        else:
            said, shards = self.passes.written | self.passes.warned | self.missed, self.shards()
            missed = []
            for p in reached:  # (a loop, not a comprehension: this runs at every backward)
                if id(shards.get(id(p), p)) not in said:
                    missed.append(p)
            if missed:
                self._missed(missed)
        return out

    def _refuse_through(self, gradients: list) -> None:
        """Hooks on ``gradients``, the results (``.grad``, or ``torch.autograd.grad``'s)
        of a backward with ``create_graph=True``, that refuse a later backward of the
        block through them (a gradient penalty, a Hessian-vector product): its "loss" is a
        function of gradients, not a sum of per-sample terms, so it has no per-sample
        quantities, and it would write ones that mean nothing over the first backward's."""
        for g in gradients:
            if isinstance(g, torch.Tensor) and g.requires_grad:
                self.refusals.append(g.register_hook(_refuse_second_backward))

    def _untracked(self) -> None:
        self.warned = True
        warnings.warn(
            "jacmem: a backward pass inside jacmem.extend(...) computed parameter gradients, but none of "
            "the module calls it went through was recorded: their forward ran before the block, on a "
            "model jacmem does not track, so no extension gets anything. Call jacmem.track(model) before "
            "that forward (BackPACK's extend(model)), or run the forward inside the block.",
            UserWarning,
            stacklevel=5,
        )

    def _missed(self, params: list[nn.Parameter]) -> None:
        self.missed.update(map(id, params))
        names = ", ".join(self.describe(p) for p in params[:5]) + (
            f" and {len(params) - 5} more" if len(params) > 5 else ""
        )
        warnings.warn(
            f"jacmem: the backward pass reached {names}, which got .grad but none of the block's results: "
            "jacmem computes them from the module calls it records, and no recorded call read the parameter. "
            "It was read outside every module's forward (a free nn.Parameter, or e.g. `logits * "
            "model.logit_scale` in the loss). Read it inside a module's forward: move the op into the "
            "model's forward, or wrap it in a small nn.Module.",
            UserWarning,
            stacklevel=5,
        )
