"""The per-backward pass, and the interface every engine implements.

An engine (first order: :mod:`jacmem.engine.firstorder`; second order:
:mod:`jacmem.engine.secondorder.engine`) sees a block's forward calls and, in
each backward pass, computes what its extensions ask for. What it computes in one pass
it keeps in that pass's state (:meth:`Pass.state`), never on the parameters: when the
pass ends, :meth:`Pass.__call__` asks each engine for its results
(:meth:`Engine.finish`) and only then writes them all. autograd holds the pass as the
backward's final callback and the engine only a weak reference, so a pass that fails
never commits, and its state goes with it: nothing is written.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from jacmem import compat
from jacmem.engine import distributed, fsdp, precision, recorder

#: (object, attribute, value): one result to write at the end of a pass
Write = tuple[Any, str, Any]


class Engine:
    """What a block asks of an engine. Every method is called in the block's thread.

    - ``on_enter(module)``: a module's forward is about to run inside the block.
    - ``on_leave(module, outermost)``: it ended, returning or raising (before
      ``on_forward``); ``outermost``: no other module's forward is running.
    - ``on_forward(module, args, kwargs, output)``: a module's forward returned inside
      the block; return a replacement output, or None to keep it.
    - ``on_call(model, args, kwargs, output)``: the outermost forward of a model (called
      in the block, or tracked) returned; its inputs and output.
    - ``on_record(record)``: the output gradients of a call recorded by
      :func:`jacmem.track` arrived (the block's own calls reach the engine by the hooks
      it set); return the summed gradients where the engine computed them, or None.
    - ``on_backward(tensors, grad_tensors, alone, reached)``: a backward
      (``torch.autograd.backward`` or ``grad``, outside any other) of the block's thread
      is about to begin; ``alone``: no other engine runs in the block; ``reached``: the
      trainable parameters its graph reaches.
    - ``on_track(model)``: from now on, ``model``'s calls reach the engine by
      ``on_record`` wherever they run (the block tracks it).
    - ``new_state()``: this engine's state for one backward pass.
    - ``finish(state)``: the pass ended; compute the final results from ``state``, write
      nothing, and return them as ``(object, attribute, value)``.
    - ``close()``: the block ends; drop every hook and everything kept.

    ``handles``: the hooks it holds on tensors and autograd nodes (those of freed graphs
    are dropped now and then, see :class:`jacmem.engine.hooks.Handles`). ``notes``: lines
    for :meth:`jacmem.engine.block.Block.explain`, on choices no strategy decision holds.
    """

    handles: list = []
    notes: list[str] = []
    #: whether the engine does nothing with a call, inside a forward, of a module with no
    #: parameter and no submodule of its own (an activation, a loss, dropout), nor with the
    #: enter and leave of a module of a registered type with no submodule, nor with a leaf
    #: called alone but as an outermost call (its ``on_call``), so that the block's global
    #: hooks may let them pass at once (second order needs them)
    skips_leaves: bool = False

    def on_enter(self, module) -> None:
        pass

    def on_leave(self, module, outermost: bool) -> None:
        pass

    def on_forward(self, module, args: tuple, kwargs: dict, output) -> Any:
        return None

    def on_call(self, model, args: tuple, kwargs: dict, output) -> None:
        pass

    def on_record(self, record) -> dict | None:
        return None

    def on_backward(self, tensors, grad_tensors, alone: bool, reached: list) -> None:
        pass

    def on_track(self, model) -> None:
        pass

    def new_state(self) -> Any:
        return None

    def finish(self, state) -> list[Write]:
        return []

    def close(self) -> None:
        pass


class Pass:
    """One backward pass (one autograd graph task, with the tasks nested in it) through a
    block: each engine's state, committed when the pass ends."""

    __slots__ = ("states", "on_end", "written", "thread", "ended", "create_graph", "__weakref__")

    def __init__(self, on_end: Callable[[set[int]], None] | None, written: set[int], create_graph: bool = False):
        #: engine -> its state for this pass
        self.states: dict[Engine, Any] = {}
        self.on_end = on_end
        #: where the ids of the objects it writes to go (:attr:`Passes.written`)
        self.written = written
        #: whether the backward runs with ``create_graph=True``: its results are
        #: :func:`undifferentiable`
        self.create_graph = create_graph
        #: the thread that runs it (autograd's, on an accelerator)
        self.thread = threading.get_ident()
        #: whether it has begun to commit
        self.ended = False

    def state(self, engine: Engine):
        """``engine``'s state for this pass, made on first use."""
        st = self.states.get(engine)
        if st is None:
            st = self.states[engine] = engine.new_state()
        return st

    def __call__(self) -> None:
        """The pass ended: every engine finishes, then every result is written, all at
        once (a failure before writes nothing)."""
        self.ended = True
        states, self.states = self.states, {}
        writes = []  # (loops, not comprehensions: this runs at every pass)
        with precision.uncast():
            for engine, st in states.items():
                writes.extend(engine.finish(st))
        written = set()
        for obj, field, value in writes:
            setattr(obj, field, undifferentiable(obj, field, value) if self.create_graph else value)
            written.add(id(obj))
        self.written.update(written)
        if self.on_end is not None:
            self.on_end(written)

    def drop(self) -> None:
        self.states.clear()


class _Constant(torch.autograd.Function):
    """A result of a pass under ``create_graph=True``, in the graph of its parameter, so
    that differentiating it raises, naming jacmem (a constant would give torch's "does
    not require grad")."""

    @staticmethod
    def forward(ctx, value: Tensor, param: Tensor, field: str) -> Tensor:
        ctx.field = field
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad: Tensor):
        raise RuntimeError(
            f"jacmem: {ctx.field!r} is not differentiable: jacmem computes its quantities without a graph, also "
            "under backward(create_graph=True) (BackPACK's are differentiable there). Differentiate a per-sample "
            "computation of your own instead (torch.func.vmap of torch.func.grad, with the quantity built from "
            "it); see 'Porting from BackPACK' in the docs."
        )


def undifferentiable(obj: Any, field: str, value: Any) -> Any:
    """``value``, the result ``field`` of a parameter ``obj`` from a pass under
    ``create_graph=True``, made to raise where it is differentiated (:class:`_Constant`).
    ``.grad`` (ClipGrad's clipped sum) and what is not a plain floating tensor on a plain
    trainable parameter (an FSDP2 ``DTensor``) stay as they are."""
    plain = type(value) is Tensor and type(obj) in (Tensor, nn.Parameter)
    if field == "grad" or not plain or not value.is_floating_point() or not obj.requires_grad:
        return value
    with torch.enable_grad():  # (autograd's final callbacks may run without it)
        return _Constant.apply(value, obj, field)


class Passes:
    """The passes running through one block: graph task id -> :class:`Pass`, held weakly
    (autograd holds each pass until it ends).

    ``on_end``: called after each pass has written its results, with the ids of the
    objects it wrote to (the block drops stale results, then warns).
    ``started`` counts the passes begun, ``written`` holds the ids of the objects
    (parameters) the passes wrote results to, and ``warned`` those of the parameters an
    engine has warned it cannot give results to (a module it does not support), so that
    the block can tell whether a backward reached any of its hooks, and which parameters
    it reached got nothing unsaid."""

    def __init__(self, on_end: Callable[[set[int]], None] | None = None):
        self._live: weakref.WeakValueDictionary[int, Pass] = weakref.WeakValueDictionary()
        self.on_end = on_end
        self.started = 0
        self.written: set[int] = set()
        self.warned: set[int] = set()
        #: whether the outermost backward now running was called with ``create_graph=True``
        #: (the block's :class:`jacmem.engine.recorder.BackwardWatch` says)
        self.create_graph = False

    def current(self) -> Pass:
        """The running backward pass, begun (and queued to commit at its end) on its
        first hook. Call only from inside a backward.

        A graph task that begins while a pass of this thread runs is nested in it: a
        reentrant checkpoint (``torch.utils.checkpoint`` with ``use_reentrant=True``)
        recomputes its segment and backpropagates through it with a backward of its own,
        from inside the outer one. Its calls join the outer pass, so that the pass's
        results (ClipGrad's norms over every parameter) cover both."""
        task = compat.current_graph_task_id()
        run = self._live.get(task)
        if run is None:
            run = self._enclosing() if self._live else None  # (no pass running: none encloses it, no call)
            if run is None:
                run = Pass(self.on_end, self.written, self.create_graph)
                compat.queue_callback(run)
                self.started += 1
            self._live[task] = run
        return run

    def _enclosing(self) -> Pass | None:
        """A pass of this thread that has not begun to commit: autograd holds a pass
        until its task ends, and drops it where the task fails."""
        here = threading.get_ident()
        for run in self._live.values():  # (a loop, not a generator: asked at each pass's first hook)
            if run.thread == here and not run.ended:
                return run
        return None

    def state(self, engine: Engine):
        """``engine``'s state in the running backward pass (:meth:`current`)."""
        return self.current().state(engine)

    def close(self) -> None:
        """Drop every pass's state: a pass still queued in autograd then writes nothing."""
        for run in list(self._live.values()):
            run.drop()
            run.on_end = None
        self._live = weakref.WeakValueDictionary()


class Context:
    """What the engines of one block know of it, handed down to each engine it starts
    (``engine_class(extensions, context)``) and read by them in every pass: the engines
    never call up into the block. The block fills in what its forward calls show
    (:attr:`names`, :attr:`roots`); the models, groups and shardings follow from those and
    from what is tracked, read when a pass needs them.

    ``route``: the key the recorder routes tracked models' calls by (the block; only
    compared, never called)."""

    __slots__ = (
        "strategies", "chunk_bytes", "passes", "notices", "batch_first", "process_group", "route", "owner", "names",
        "roots", "sharded", "recorder", "stable",
    )  # fmt: skip

    def __init__(
        self, strategies, chunk_bytes: float, passes: Passes, notices, batch_first: bool, process_group: Any, route
    ):
        #: the block's :class:`jacmem.engine.strategies.StrategyChoices`
        self.strategies = strategies
        #: temporary memory a strategy may use at once
        self.chunk_bytes = chunk_bytes
        self.passes = passes
        #: the block's :class:`jacmem.engine.notices.Notices`
        self.notices = notices
        #: whether the block's calls take their batch on axis 0 (else 1: :mod:`jacmem.engine.layout`)
        self.batch_first = batch_first
        #: the process group to sum global quantities over (None: that of a DDP model, if any)
        self.process_group = process_group
        self.route = route
        #: the thread that opened the block (None while it is closed)
        self.owner: int | None = None
        #: module -> its qualified name in the model called at depth 0 in the block
        self.names: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
        #: the models called at depth 0 in the block, as weak references, in order
        self.roots: list[weakref.ref] = []
        #: whether a model called in the block holds FSDP2 modules (the block's check says)
        self.sharded = False
        #: the block's :class:`jacmem.engine.recorder.Recorder`, whose records of its calls
        #: every engine of the block consumes: made by the first engine that records (first
        #: order's or clipping's stager; second order's own where the block has neither)
        self.recorder: recorder.Recorder | None = None
        #: :func:`stable_names` of the models, made when a quantity first needs one
        self.stable: tuple[dict[tuple[int, str], str], dict[int, str]] = ({}, {})

    def clear(self) -> None:
        """The block closed: drop the state of a pass still running (:meth:`Passes.close`;
        most blocks close after their passes ended: no call), forget its thread, models,
        names and recorder."""
        if self.passes._live:
            self.passes.close()
        self.owner = None
        self.names = weakref.WeakKeyDictionary()
        self.roots = []
        self.sharded = False
        self.recorder = None
        self.stable = ({}, {})

    def name(self, module: nn.Module) -> str:
        """``module``'s qualified name in a model called in the block or tracked, or its type's."""
        return self.names.get(module) or recorder.tracked_name(module) or type(module).__name__

    def stable_name(self, module: nn.Module, pname: str) -> str:
        """The stable name of ``module``'s parameter ``pname`` (:func:`stable_names`): the
        same under DDP, ``torch.compile`` and FSDP, and one name for a tied parameter's
        every use. Found in the models called in the block or tracked (walked again where a
        module is not in them yet); a module of none of them: its name in the block."""
        key = (id(module), pname)
        found = self.stable[0].get(key)
        if found is None:
            self.stable = stable_names(self.roots_and_models())
            prefix = self.stable[1].get(id(module))
            found = self.stable[0].get(key) or (f"{self.name(module)}.{pname}" if prefix is None else prefix + pname)
            self.stable[0][key] = found
        return found

    def models(self) -> list[nn.Module]:
        """The tracked models whose calls reach the block."""
        return recorder.routed_to(self.route)

    def roots_and_models(self) -> list[nn.Module]:
        """The models called in the block, then the tracked ones."""
        models = []
        for ref in self.roots:  # (a loop, not a generator: asked at every pass's end)
            m = ref()
            if m is not None:
                models.append(m)
        return models + self.models()

    def shardings(self) -> list[fsdp.Sharding]:
        """The FSDP2 parameters of the models called in the block and the tracked ones
        (none where no model called holds FSDP2 modules (:attr:`sharded`): no walk of the models)."""
        return fsdp.shardings(self.roots_and_models()) if self.sharded else []

    def groups(self) -> list[tuple[Any, list[nn.Parameter]]]:
        """(process group, its parameters in model order) for the models called in the
        block and the tracked ones: :attr:`process_group`, or that of a
        ``DistributedDataParallel`` model; FSDP2's parameters are :meth:`shardings`'."""
        groups: list[tuple[Any, list[nn.Parameter]]] = []
        if self.process_group is None and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return groups  # no model's group to find (distributed.process_group_of's answer, without the walk)
        seen = set()
        for model in self.roots_and_models():
            group = self.process_group if self.process_group is not None else distributed.process_group_of(model)
            if group is None:
                continue
            params = [p for p in model.parameters() if p.requires_grad and id(p) not in seen and not fsdp.sharded(p)]
            seen.update(map(id, params))
            groups.append((group, params))
        return groups


def stable_names(models: list[nn.Module]) -> tuple[dict[tuple[int, str], str], dict[int, str]]:
    """``(id(module), name) -> the parameter's stable name`` and ``id(module) -> its prefix``
    (``"transformer.h.0."``) in ``models``: qualified names without the segments of wrappers
    (:func:`jacmem.compat.wraps`: DDP's ``module.``, ``torch.compile``'s ``_orig_mod.``,
    FSDP1's); a parameter held by several modules (tied) has the first name
    ``named_parameters()`` gives it, whichever module's it is."""
    names: dict[tuple[int, str], str] = {}
    prefixes: dict[int, str] = {}
    first: dict[int, str] = {}
    for model in models:
        todo = [(model, "")]
        while todo:  # pre-order, children in order: named_modules()'s
            module, prefix = todo.pop()
            if id(module) in prefixes:
                continue
            prefixes[id(module)] = prefix
            for pname, p in compat.parameter_slots(module).items():
                if p is not None:
                    names[(id(module), pname)] = first.setdefault(id(p), prefix + pname)
            children = [(c, prefix if compat.wraps(module, n) else f"{prefix}{n}.")
                        for n, c in compat.child_slots(module).items() if c is not None]  # fmt: skip
            todo.extend(reversed(children))
    return names, prefixes
