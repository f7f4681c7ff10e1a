"""The second-order engine (:class:`SecondOrderEngine`): the façade a block starts.

In the forward pass it makes each call of a module or function it knows a
:class:`.graph.Node`, with hooks on the node's output and on the autograd nodes that
take its inputs (the chain check's taps). In each backward pass either the module
chain (:mod:`.chain`) or the autograd path (:mod:`.autograd_path`) computes the
quantities; both hand them back here to stage until the pass ends.
"""

from __future__ import annotations

import copy
import functools
import weakref
from dataclasses import replace

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from jacmem import compat, walker
from jacmem.derivatives import lookup_loss, lookup_passthrough
from jacmem.derivatives.functional import FUNCTIONAL, Merged, Reduced, StandInLoss
from jacmem.derivatives.quantities import FactorKind, factor_kind
from jacmem.derivatives.registry import REGISTRY, own_parameters, registered_type
from jacmem.engine import broadcast, hooks, planner, precision
from jacmem.engine.base import Context, Engine, Write
from jacmem.engine.recorder import Recorder, tracked_name
from jacmem.engine.secondorder.autograd_path import AutogradPath
from jacmem.engine.secondorder.chain import Chain
from jacmem.engine.secondorder.graph import Node, PassState, Tied
from jacmem.errors import UnsupportedCurvatureError
from jacmem.extensions.secondorder.base import Call, Factor, SecondOrderExtension, UnsupportedModule
from jacmem.extensions.secondorder.sqrt_ggn import root_vjps

#: how far up the autograd graph a forward looks for the tracked module that an
#: untracked operation consumed (only to name it in the error)
_SEARCH_NODES = 64
#: how many autograd nodes of one module call the chain check searches for those that
#: take the call's inputs; past it, the call's gradient row is computed instead
_TAP_NODES = 256


def _outside_mode(method):
    """The engine's own tensor work (in module hooks and backward hooks) runs without
    :class:`_Functional`, which would otherwise see each of its calls."""

    @functools.wraps(method)
    def run(self, *args):
        with compat.without_function_mode(self.mode):
            return method(self, *args)

    return run


class SecondOrderEngine(Engine):
    """Second-order extensions for one block (the interface is
    :class:`jacmem.engine.base.Engine`)."""

    def __init__(self, extensions: list[SecondOrderExtension], context: Context):
        self.extensions = extensions
        #: the factor kinds the extensions ask for, read once (:func:`~jacmem.derivatives.quantities.factor_kind`)
        self.kinds = {factor_kind(k) for ext in extensions for k in ext.kinds}
        self.name, self.budget, self.strategies = context.name, context.chunk_bytes, context.strategies
        self.passes = context.passes
        #: the block's recorder, whose records of the parameterised calls the nodes are built
        #: on (first order's, where the block has that engine), or None
        self.shared = context.recorder
        #: this engine's own recorder, for the calls the block's did not record whole; where
        #: the block has no other engine, the block's, which follows the direct uses of a
        #: module's parameters (:meth:`_use_nodes`). Its records hand nothing on
        self.own = Recorder(_handed_nothing, hand_uses=context.recorder is None)
        if context.recorder is None:
            context.recorder = self.own
        self.handles = hooks.Handles()
        self.producer = compat.WeakTensorKeyDictionary()
        #: the modules whose forward the engine saw
        self.seen: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        #: for each module forward running, whether the engine knows the module (then the
        #: functional calls inside it, and inside its children, are its own, not links)
        self.known: list[bool] = []
        #: how many of them the engine knows
        self.inside = 0
        #: a tensor with its batch axis merged -> :class:`Merged` (for a loss on it)
        self.merged = compat.WeakTensorKeyDictionary()
        #: the output of a loss with ``reduction="none"`` -> (the loss, its inputs)
        self.unreduced = compat.WeakTensorKeyDictionary()
        #: id(record) -> the node made on it (weakly) since the last backward began: the
        #: calls that share a parameter are those its record's recorder counts (``Record.others``)
        self.calls: weakref.WeakValueDictionary[int, Node] = weakref.WeakValueDictionary()
        #: ids of the parameters some call's node covers (its first-order entry has them)
        self.covered: set[int] = set()
        #: id(param) -> (its module, weakly; its name there), for each module whose forward
        #: ran with trainable parameters of its own (to name a parameter nothing covers)
        self.owners: dict[int, tuple[weakref.ref, str]] = {}
        #: id(param) -> (an extension of the block that has nothing for the last call that
        #: used it, why, the parameter's name there with its module's): :meth:`_check`
        self.refused: dict[int, tuple[str, str, str]] = {}
        #: ids of the parameters whose results the running backward asks for
        self.wanted: set[int] = set()
        self.mode = _Functional(self)
        self.mode.__enter__()
        #: compiled models run eagerly while the block is open: the engine follows the
        #: autograd graph op by op, which a compiled graph does not keep
        self.stance = torch.compiler.set_stance("force_eager")
        self.chain = Chain(self)
        self.autograd = AutogradPath(self)

    def close(self) -> None:
        if self.mode is not None:
            self.mode.__exit__(None, None, None)
            self.mode = None
            self.stance.__exit__(None, None, None)
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self.own.close()
        self.autograd.close()
        self.producer = compat.WeakTensorKeyDictionary()
        self.merged = compat.WeakTensorKeyDictionary()
        self.unreduced = compat.WeakTensorKeyDictionary()

    @property
    def notes(self) -> list[str]:
        """Where the autograd path split the GGN in the last backward, and what that costs."""
        return self.autograd.notes

    def new_state(self) -> PassState:
        return PassState()

    def on_record(self, rec) -> None:
        """A call recorded by :func:`jacmem.track` (forward outside the block) reached
        the backward: curvature needs the forward inside the block."""
        if rec.module not in self.seen:
            raise RuntimeError(
                f"jacmem: second-order extensions need the forward pass inside the block, but module "
                f"{rec.name!r} ran it outside (with jacmem.track): run the forward inside jacmem.extend(...)"
            )

    def on_enter(self, module: nn.Module) -> None:
        known = lookup_loss(module) is not None or lookup_passthrough(module) is not None
        self.known.append(known)
        self.inside += known
        if not known and own_parameters(module) and self._records(module):
            self.own.enter(module, self.name)  # its parameters' direct uses, as first order's

    def on_leave(self, module: nn.Module, outermost: bool) -> None:
        if self.known:
            self.inside -= self.known.pop()
        if self.shared is None and (outermost or module in self.own.direct):
            self.own.leave(module, outermost)

    def _records(self, module: nn.Module) -> bool:
        """Whether :attr:`own` is the block's recorder and records ``module``'s calls as
        such (a tracked model's calls its tracker records: :meth:`_record` makes them)."""
        return self.shared is None and tracked_name(module) is None

    @_outside_mode
    def on_forward(self, module: nn.Module, args: tuple, kwargs: dict, output) -> None:
        if not torch.is_grad_enabled() or compat.functorch_transforms_active():
            return
        for pname, p in own_parameters(module):
            if p.requires_grad:
                self.owners.setdefault(id(p), (weakref.ref(module), pname))
        loss = lookup_loss(module)
        first = args[0] if args else None
        entry = None if loss is not None else lookup_passthrough(module, first, output)
        if loss is None and entry is None:
            self._untracked(module, args, kwargs, output)
            return
        self.seen.add(module)
        if not isinstance(output, Tensor) or not output.requires_grad:
            return
        inputs = tuple(a for a in args if isinstance(a, Tensor))
        if loss is not None and getattr(module, "reduction", None) == "none":
            self.unreduced[output] = (copy.copy(module), inputs)  # a loss once its sum or mean is taken
            return
        edges = None
        if any(output is x for x in inputs):
            fn = output.grad_fn
            if fn is None or "jacmem" in fn.metadata or not getattr(module, "inplace", False) or len(inputs) > 1:
                return  # the identity: nothing to pass through
            edges = (fn.next_functions[0],)  # in place: the input is what the op's autograd node takes
        self._node(module, self.name(module), inputs, output, edges, args, kwargs)

    def on_function(self, func, build, args: tuple, kwargs: dict):
        """A call of ``func`` in :data:`FUNCTIONAL`, outside any module the engine knows:
        run it, and make it a node where it takes a tracked output (a loss: always)."""
        first = args[0] if args and isinstance(args[0], Tensor) else None
        before = None if first is None else (first.grad_fn, first.output_nr)  # in-place ops move it
        out = func(*args, **kwargs)
        if not isinstance(out, Tensor) or not out.requires_grad or compat.functorch_transforms_active():
            return out
        if out is first and before == (out.grad_fn, out.output_nr):
            return out  # the input as it was (dropout in eval): nothing to pass through
        op = build(out, *args, **kwargs)
        if isinstance(op, Merged):
            self.merged[out] = op
            return out
        if isinstance(op, Reduced):
            op = self._reduced(op)
        if op is None:
            return out
        module, inputs = op
        if getattr(module, "reduction", None) == "none" and lookup_loss(module) is not None:
            self.unreduced[out] = op  # a loss once its sum or mean is taken
            return out
        producers = [self._producer_of(x) for x in inputs]
        if any(p is not None and p.loss is not None for p in producers):
            return out  # after the loss (2 * loss, a sum of losses): no link of the chain
        if lookup_loss(module) is None and not any(producers):
            return out
        edges = None
        if any(out is x for x in inputs):
            edges = tuple(before if x is first else (x.grad_fn, x.output_nr) for x in inputs)
        site = next((p.site for p in producers if p is not None), None)
        self._node(module, _op_name(func) + (f" after {site}" if site else ""), inputs, out, edges)
        self.producer[out].site = site
        return out

    def _reduced(self, op: Reduced) -> tuple[nn.Module, tuple] | None:
        """The sum or mean of a loss with ``reduction="none"``: that loss, summed and scaled."""
        loss = self.unreduced.get(op.x)
        if loss is None:
            return None
        module, inputs = loss
        module.reduction = "sum"
        return StandInLoss(module, scale=1 / op.x.numel() if op.mean else 1.0), inputs

    def _node(
        self, module: nn.Module, name: str, inputs: tuple, output: Tensor, edges, args: tuple = (), kwargs=None
    ) -> None:
        """Make the call a :class:`Node`; ``edges``: the inputs' ``(grad_fn, output_nr)``
        where the call worked in place (the input's are the output's now); ``args``,
        ``kwargs``: the module's arguments, for its parameters' derivatives."""
        kwargs = kwargs or {}
        first = args[0] if args else None
        loss = lookup_loss(module)
        merged = self.merged.get(inputs[0]) if loss is not None else None
        if merged is not None:  # a loss on x.view(-1, C): a loss on x (functional.py)
            inner, scale = (module.inner, module.scale) if isinstance(module, StandInLoss) else (module, 1.0)
            module = StandInLoss(inner, merged.k, scale)
            loss = lookup_loss(module)
            inputs, edges = (merged.x, *inputs[1:]), None
        entry = None if loss is not None else lookup_passthrough(module, first, output)
        node = Node(module, name, loss, entry)
        node.hp = (loss or entry).params(module)
        keep = entry is None or entry.keep_input
        node.inputs = tuple(x.detach() if keep else _shape_of(x) for x in inputs)
        node.rerunnable = keep and len(inputs) == len(args) and not kwargs
        node.out = output.detach() if entry is not None and (entry.keep_output or entry.df is not None) else None
        node.out_shape = tuple(output.shape)
        node.producers = [self._producer_of(x) for x in inputs]
        for x, p in zip(inputs, node.producers):
            if p is None and x.grad_fn is not None:
                self._mark_untracked_path(x.grad_fn, node)
                self.autograd.untracked = True
        self._tap(node, inputs, output, edges or tuple((x.grad_fn, x.output_nr) for x in inputs))
        self._first_order(node, self._record(module, args, kwargs, output), args, kwargs, output)
        # 16-bit tensors (autocast): computed with in float32 (jacmem.engine.precision)
        node.kept_low_precision = precision.is_low((output, inputs))
        self.producer[output] = node
        if output.grad_fn is not None:
            output.grad_fn.metadata["jacmem"] = weakref.ref(node)
        # the hook (so the graph) holds the node: it goes when the graph goes
        self.handles.add(output.register_hook(lambda grad: self._on_grad(node, grad)))
        self.autograd.record(node, output, *(inputs[:2] if loss is not None else ()))

    def _record(self, module: nn.Module, args: tuple, kwargs: dict, output) -> hooks.Record | None:
        """The record of this call (:class:`jacmem.engine.hooks.Record`, made under the one
        rule for which calls count, :func:`jacmem.engine.hooks.counted`): the block's
        recorder's where it recorded the call with every parameter the rule counts (first
        order's, whose hook ran first), else one :attr:`own` makes (a call it left a direct
        parameter of to a use record, or the call of a tracked model, whose tracker records
        it after); None where the call counts no parameter."""
        if self._records(module):  # (its output, where it is watched, is left: the chain adds broadcasts itself)
            self.own.record(module, args, kwargs, output, self.name(module))
            return _recorded(module, output, self.own)
        rec = _recorded(module, output, self.shared)
        if rec is not None and len(rec.params) == len(hooks.trainable(module, rec.entry)):
            return rec
        return self.own.make(module, args, kwargs, output, self.name(module))

    def _use_nodes(self, module: nn.Module) -> None:
        """A node for each exact direct use of ``module``'s parameters in the call just
        recorded (:attr:`own`'s use records: a parameter read in the module's own forward
        that met the batch only through broadcasts it followed), on the tensor its
        per-sample gradient arrives at, for the autograd path: exact, with no
        recomputation of the module's forward. A parameter with any other use was left
        to the module's own record (the generic recomputation). Where the block's kinds are
        not the autograd path's, none (a backward that reaches such a parameter raises)."""
        uses = self._take_uses(module)
        for rec, expanded in uses if self.autograd.serves() else ():
            node = Node(module, self.name(module), None, None)
            node.out_shape = tuple(expanded.shape)
            self._first_order(node, rec, (), {}, expanded)
            if node.params:
                self.seen.add(module)
                self.autograd.untracked = True  # the path alone gives their curvature
                node.kept_low_precision = precision.is_low(expanded)
                self.autograd.record(node, expanded)

    def _take_uses(self, module: nn.Module) -> list:
        """:attr:`own`'s exact use records of ``module``'s call just recorded, taken (and
        so not held past it)."""
        used, self.own.used = self.own.used, None
        return used[1] if used is not None and used[0] is module else []

    def _first_order(self, node: Node, rec, args: tuple, kwargs: dict, output: Tensor, used=False) -> None:
        """``node.record``: ``rec``, the call's record (:meth:`_record`), or None;
        ``node.params``: its trainable parameters that its first-order entry covers, with
        what it keeps; the backward refuses the others (:meth:`on_backward`). ``used``: only
        those ``output`` depends on (a container's own: a ``logit_scale`` it holds but the
        loss reads is no part of its call)."""
        module = node.module
        node.record = rec
        fo = None if rec is None else rec.entry
        node.params = {} if rec is None else _trainable(module, fo, rec.params)
        if used and node.params:
            ids = set(map(id, walker.parameters(output)))
            node.params = {n: p for n, p in node.params.items() if id(p) in ids}
        if node.params:
            node.param_entry, node.param_hyperparams = fo, rec.hp
            # (a record keeps no input where its parameters need none: a bias alone; a direct use has none)
            x = (
                rec.x
                if rec.x is not None or not args
                else fo.arrange_input(hooks.kept(fo, None, args, kwargs), **rec.hp)
            )
            node.param_input = x
            self._mark_tied(node)
            self.covered.update(map(id, node.params.values()))
            self._check(node)

    def _check(self, node: Node) -> None:
        """Notes ``node``'s parameters in :attr:`refused` where an extension of the block
        has nothing for them (:meth:`SecondOrderExtension.check`: a BatchNorm under KFAC),
        or takes them out of it: a backward that reaches one raises (:meth:`on_backward`)."""
        call = replace(self.call(node, [], None), params=dict(node.params))
        for ext in self.extensions:
            try:
                ext.check(call)
            except UnsupportedModule as err:
                self._refuse(repr(ext), str(err), node.params, str(node))
                return
        for p in node.params.values():
            self.refused.pop(id(p), None)

    def _refuse(self, who: str, why: str, params: dict[str, nn.Parameter], module: str) -> None:
        """Notes ``params`` (by name) of ``module`` (named, with its type) in :attr:`refused`."""
        why = why.strip().rstrip(".")
        self.refused.update((id(p), (who, why, f"{n!r} of module {module}")) for n, p in params.items())

    def _mark_tied(self, node: Node) -> None:
        """``node.tied``: its parameters that another call of this forward uses too
        (marked on both calls): the other live records of its record's recorder that use it
        (:class:`jacmem.engine.hooks.Uses`) with a node made since the last backward began."""
        rec = node.record
        self.calls[id(rec)] = node  # (the node holds its record: the id is not reused while listed)
        for pname, p in node.params.items():
            for other in (self.calls.get(id(r)) for r in rec.others(p)):
                if other is None or other is node or not any(q is p for q in other.params.values()):
                    continue
                node.tied.add(pname)
                other.tied.update(n for n, q in other.params.items() if q is p)

    def _tap(self, node: Node, inputs: tuple[Tensor, ...], output: Tensor, into: tuple) -> None:
        """Hooks on the autograd nodes of this call that take an input with a producer
        (along the edges ``into``, one per input): in backward they hand that producer
        autograd's own part of its gradient (see the module docstring). ``node.grad_by_jacobian``:
        the search failed, the row it is."""
        taps = {e: i for i, (e, p) in enumerate(zip(into, node.producers)) if p is not None}
        found = taps and output.grad_fn is not None
        edges = _input_edges(output.grad_fn, taps, {fn for fn, _ in into}) if found else {}
        node.grad_by_jacobian = edges is None
        for fn, ks in (edges or {}).items():
            self.handles.add(fn.register_hook(lambda grad_inputs, _, ks=ks: self._on_tap(node, ks, grad_inputs)))

    def _producer_of(self, x: Tensor) -> Node | None:
        """The node whose output ``x`` is, also through identities that full backward
        hooks (``register_full_backward_hook``, BackPACK, Opacus) put around modules."""
        node = self.producer.get(x)
        fn, index = x.grad_fn, x.output_nr
        while node is None and compat.is_backward_hook_node(fn):
            fn, index = fn.next_functions[index]
            node = _tracked(fn) if fn is not None else None
        return node

    def _mark_untracked_path(self, start, consumer: Node) -> None:
        """Tell the tracked nodes above autograd node ``start`` (through untracked operations) who
        consumes their output, through which unsupported module, and which operation
        (its ``grad_fn``) took their output, for the error."""

        def step(item: tuple) -> list[tuple]:
            fn, via, _ = item
            if _tracked(fn) is not None:
                return []  # a tracked call's output: the path ends there
            via = via or fn.metadata.get("jacmem_unsupported")
            return [(f, via, fn.name()) for f in walker.children(fn)]

        for fn, via, op in walker.Walk([(start, None, None)], step, limit=_SEARCH_NODES, breadth=True, key=_node_of):
            node = _tracked(fn)
            if node is not None:
                through = f"module {via}" if via else f"the operation {op}"
                node.untracked_consumers.append(f"{consumer.name!r} (through {through})")

    def _untracked(self, module: nn.Module, args: tuple, kwargs: dict, output) -> None:
        """A module that nothing here can pass through. A layer (a leaf, or a module of a
        registered type: MultiheadAttention calls its ``out_proj`` itself) is marked in
        the graph, for the chain error. Where the block's kinds are the autograd path's,
        a module whose trainable parameters (its own, and a submodule's that its forward
        uses itself) have first-order derivatives, registered or the generic
        recomputation's, is kept for that path (:mod:`.autograd_path`), as the first-order
        recorder records it. Any other parameter the backward reaches makes it raise
        (:meth:`on_backward`)."""
        first = args[0] if args else None
        layer = next(module.children(), None) is None or registered_type(REGISTRY, type(module)) is not None
        rec = self._record(module, args, kwargs, output)
        self._use_nodes(module)
        params = {} if rec is None else rec.params
        # (a container's frozen own parameters: no call of its; a layer's: its outputs, for the chain error)
        fo = rec.entry if rec is not None else hooks.counted(module, first, output)[0] if layer else None
        out = output if fo is None else fo.outputs(output)
        if isinstance(out, (tuple, list)) and len(out) == 1:
            out = out[0]  # (the generic recomputation's outputs: a list of one)
        fn = getattr(out, "grad_fn", None)
        if layer and fn is not None:
            fn.metadata["jacmem_unsupported"] = f"{self.name(module)!r} ({type(module).__name__})"
            self.autograd.untracked = True
        if fo is None or not self.autograd.serves():
            return
        why = None
        if isinstance(out, (tuple, list)):
            why = (
                f"its call returns {len(out)} tensors (as an RNN's: its output and final states), and the autograd "
                "path follows one output per call: freeze its parameters (requires_grad_(False)), or use a first-order "
                "extension"
            )
        elif not getattr(module, "batch_first", True):
            why = (
                "it takes the batch on axis 1 (batch_first=False), and the autograd path reads the batch on axis 0 of a "
                "call's output: build it with batch_first=True, or freeze its parameters (requires_grad_(False))"
            )
        if why is not None:  # a backward that reaches its parameters raises (on_backward)
            exts = ", ".join(map(repr, self.extensions))
            self._refuse(exts, why, _trainable(module, fo, params), f"{self.name(module)!r} ({type(module).__name__})")
            return
        if not isinstance(out, Tensor) or not out.requires_grad:
            return
        self.seen.add(module)
        self.autograd.untracked = True  # its parameters' curvature comes by the path alone
        node = Node(module, self.name(module), None, None)
        node.out_shape = tuple(out.shape)
        self._first_order(node, rec, args, kwargs, out, used=not layer)
        if node.params:
            # what it keeps (its parameters' input) is 16-bit under autocast: cast on its first backward
            node.kept_low_precision = precision.is_low((out, node.param_input))
            self.autograd.record(node, out)

    def on_backward(self, tensors, grad_tensors, alone: bool, reached: list) -> None:
        """Before the backward: raises where it reaches (of its ``inputs``, where it has
        them) a trainable parameter no recorded call covers, or one an extension has
        nothing for, naming each with its module and the fix; nothing is written."""
        self.calls.clear()
        self.wanted = {id(p) for p in reached}
        uncovered = [p for p in reached if id(p) not in self.covered]
        if uncovered and not any(id(p) in self.owners for p in reached):
            raise RuntimeError(
                "jacmem: second-order extensions need the forward pass inside the block, but this backward's "
                "forward ran outside it (before the block, or tracked with jacmem.track): run the forward inside "
                "jacmem.extend(...)"
            )
        refused = [p for p in reached if id(p) in self.refused]
        if refused:
            raise self._refused(refused)
        if uncovered:
            raise self._uncovered(uncovered)
        self.autograd.on_backward(tensors, grad_tensors, alone)

    def _owner(self, p: nn.Parameter) -> tuple[nn.Module | None, str | None]:
        """The module whose forward ran that holds ``p`` most directly (fewest dots in
        its name there), and that name; ``(None, None)`` where none does."""
        ref, pname = self.owners.get(id(p), (None, None))
        if ref is not None and ref() is not None:
            return ref(), pname
        found: tuple[nn.Module | None, str | None] = (None, None)
        for module in {id(m): m for m in (r() for r, _ in self.owners.values()) if m is not None}.values():
            for name, q in module.named_parameters():
                if q is p and (found[1] is None or name.count(".") < found[1].count(".")):
                    found = (module, name)
        return found

    def _refused(self, params: list) -> UnsupportedCurvatureError:
        """The refusal of a backward that reaches trainable parameters an extension has
        nothing for (:meth:`_check`), before any result: the first one's module and
        reason in full, the others by name."""
        who, why, _ = self.refused[id(params[0])]
        named = [self.refused[id(p)][2] for p in params]
        return UnsupportedCurvatureError(
            f"jacmem: {who} has no result for {', '.join(named[:5])}"
            + (f" and {len(named) - 5} more" if len(named) > 5 else "")
            + f", which this backward reaches: {why}. Nothing is written (a parameter left out of "
            "backward(inputs=...) is not asked for)",
            params,
        )

    def _uncovered(self, params: list) -> UnsupportedCurvatureError:
        """The refusal of a backward that reaches trainable parameters no recorded call
        covers (before any result): each named with its module, and why."""
        exts = ", ".join(map(repr, self.extensions))
        named = []
        for p in params:
            module, pname = self._owner(p)
            if module is None:
                named.append(f"a parameter of shape {list(p.shape)} read outside every module's forward")
            else:
                named.append(f"{pname!r} of module {self.name(module)!r} ({type(module).__name__})")
        return UnsupportedCurvatureError(
            f"jacmem: {exts} cannot give the curvature of {', '.join(named[:5])}"
            + (f" and {len(named) - 5} more" if len(named) > 5 else "")
            + ": the backward reaches "
            "them, and no module call jacmem has derivatives for uses them (a parameter read directly in a "
            "module's own forward, or by a module of no registered type). Register the module's derivatives "
            "(jacmem.register), or freeze them (requires_grad=False)",
            params,
        )

    @_outside_mode
    def _on_grad(self, node: Node, grad: Tensor) -> None:
        if self.autograd.busy:
            return  # the autograd path's own products
        run = self.passes.state(self)
        if run.autograd is not None:
            return
        self.chain.on_grad(run, node, grad)

    @_outside_mode
    def _on_tap(self, node: Node, edges: list[tuple[int, int]], grad_inputs: tuple) -> None:
        """An autograd node of ``node``'s call ran: its gradients along ``edges``
        (``(position, input)``) are the call's part of its producers' gradients."""
        if self.autograd.busy:
            return
        run = self.passes.state(self)
        if run.autograd is not None:
            return
        for k, i in edges:
            if grad_inputs[k] is not None:
                run.deposit_grad(node, i, grad_inputs[k])

    @staticmethod
    def check_unshared(run: PassState, node: Node) -> None:
        """A parameter staged by another call, which the forward did not see shared
        (the calls' forwards were split by another backward)."""
        for pname, p in node.params.items():
            if pname not in node.tied and id(p) in run.staged:
                raise NotImplementedError(
                    f"jacmem: parameter {pname!r} of module {node} is used by more than one call in this "
                    f"backward pass (also by {run.staged[id(p)][1]}), whose forwards ran on either side of "
                    "another backward: second-order extensions sum a shared parameter's calls only within one "
                    "forward and backward. Run the forwards of the calls together, then one backward"
                )

    def gather(self, run: PassState, node: Node, factors: dict[tuple, Factor], per_sample: bool = False) -> None:
        """The vectors ``J_θ,nᵀ S[v, n]`` of ``node``'s tied parameters (``node.tied``) for
        each factor ``S [V, N, *out]``, added per key to their other calls' (:class:`Tied`);
        ``per_sample``: the call's output is shared by the samples and ``S`` is
        ``[V, N, 1, *out]``, each sample's slice at a time. Raises where an extension of
        the block cannot take the sum over calls, naming the parameter and the fix."""
        unable = [ext for ext in self.extensions if not ext.sums_calls]
        if unable:
            many = len(node.tied) > 1
            names = ("parameters " if many else "parameter ") + ", ".join(map(repr, sorted(node.tied)))
            raise NotImplementedError(
                f"jacmem: {names} of module {node} {'are' if many else 'is'} used by more than one call in this "
                f"backward pass (tied weights, or a module called twice), and {', '.join(map(repr, unable))} cannot "
                "give a shared parameter's curvature: it has cross terms between the calls, which no Kronecker "
                "factor (or Hessian residual) of one call forms (the guide's 'Tied and shared parameters'). "
                "DiagGGNExact, DiagGGNMC, their Batch forms and SqrtGGNExact/MC sum over the calls; for the others "
                "give each call its own parameter (untie it), or freeze it (requires_grad=False)"
            )
        call = self.call(node, list(factors.values()), None, tied=True)
        for pname in node.tied:
            p = node.params[pname]
            tied = run.tied.setdefault(id(p), Tied(p))
            tied.names.append(str(node))
            for key, f in factors.items():
                if per_sample:
                    parts = [root_vjps(call, Factor(f.kind, f.sign, f.S[:, m]), pname) for m in range(f.S.shape[1])]
                    B = torch.cat(parts, 1)
                else:
                    B = root_vjps(call, f, pname)
                tied.add(key, f.kind, f.sign, B)

    def gather_column(self, run: PassState, node: Node, kind: FactorKind, G: Tensor, per_sample: bool) -> None:
        """:meth:`gather` for the autograd path's next column ``G [1, N, *out]`` of ``kind``
        (every call gets the columns in the same order: the key is the column's index)."""
        tied = run.tied.setdefault(id(node.params[min(node.tied)]), Tied(node.params[min(node.tied)]))
        index = tied.count.get((id(node), kind), 0)
        tied.count[(id(node), kind)] = index + 1
        self.gather(run, node, {(kind, index): Factor(kind, 1.0, G)}, per_sample)

    def _tied_writes(self, tied: Tied) -> list[Write]:
        """The extensions' results for a tied parameter from its calls' summed vectors:
        computed as for a parameter used directly (the identity), whose per-sample
        gradient for the output gradient ``B`` is ``B``."""
        p, grouped = tied.param, {}
        for f in tied.columns.values():  # one factor per kind and sign, its keys along V
            grouped.setdefault((f.kind, f.sign), []).append(f.S)
        factors = [Factor(kind, sign, torch.cat(Bs)) for (kind, sign), Bs in grouped.items()]
        call = Call(
            module=None,
            name=" and ".join(dict.fromkeys(tied.names)),
            params={"": p},
            entry=None,
            hp={},
            x=None,
            inputs=None,
            out_shape=tuple(factors[0].S.shape[1:]) if factors else (),
            factors=factors,
            first_order=_identity,
            budget=self.budget,
        )
        writes = []
        for ext in self.extensions if factors else ():
            value = (self.run_extension(ext, call) or {}).get("")
            if value is not None:
                writes.append((p, ext.savefield, precision.result(value, p)))
        return writes

    def call(self, node: Node, factors: list[Factor], dense: Tensor | None, tied: bool = False) -> Call:
        """What the extensions see of ``node`` with these factors at its output: its
        parameters but the tied ones (:meth:`gather`), or only those where ``tied``."""
        module, offered = node.module, node.param_entry.names()
        return Call(
            module=module,
            name=node.name,
            params={n: p for n, p in node.params.items() if (n in node.tied) == tied},
            entry=node.param_entry,
            hp=node.param_hyperparams,
            x=node.param_input,
            inputs=node.inputs if node.rerunnable else None,
            out_shape=node.out_shape,
            factors=factors,
            dense=dense,
            first_order=lambda pname, x, g, quantities: planner.compute(
                node.param_entry,
                node.param_hyperparams,
                x,
                g,
                pname,
                node.params[pname],
                quantities,
                lambda quantity, options: self.strategies.choose(
                    module, node.name, offered, pname, quantity, options, 4
                ),
                self.budget,
            ),
            budget=self.budget,
        )

    def run_extension(self, ext: SecondOrderExtension, call: Call) -> dict | None:
        """``ext.compute(call)``; ``None`` where ``ext`` has nothing for the module and the
        backward asks for none of its parameters (``backward(inputs=...)``)."""
        try:
            return ext.compute(call)
        except UnsupportedModule as err:
            if any(id(p) in self.wanted for p in call.params.values()):  # not seen at its forward
                raise UnsupportedCurvatureError(f"jacmem: {err}", call.params.values()) from err
            return None
        except NotImplementedError:
            raise
        except Exception as err:
            raise RuntimeError(
                f"jacmem: computing {ext!r} for module {call.name!r} ({type(call.module).__name__}) failed: {err}"
            ) from err

    def stage(self, run: PassState, node: Node, results: dict[str, dict[str, object]]) -> None:
        """``{param name: {savefield: value}}``, written when the pass ends (the tied
        parameters' come from :meth:`gather` instead)."""
        self.check_unshared(run, node)
        for pname, p in node.params.items():
            if pname not in node.tied:
                run.staged[id(p)] = (p, node, results[pname])

    def finish(self, run: PassState) -> list[Write]:
        staged, run.staged = run.staged, {}
        tied, run.tied = run.tied, {}
        run.deposits.clear()
        writes = [(p, field, value) for p, _, values in staged.values() for field, value in values.items()]
        writes += [w for t in tied.values() for w in self._tied_writes(t)]
        return [w for w in writes if id(w[0]) in self.wanted]  # those the backward asks for (its inputs)


class _Functional(TorchFunctionMode):
    """Sees the calls of :data:`FUNCTIONAL`'s functions while the block is open (nothing
    outside it), and hands those made outside the modules the engine knows to
    :meth:`Engine.on_function`; every other call runs as it is."""

    def __init__(self, engine: Engine):
        super().__init__()
        self.engine = weakref.proxy(engine)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        build = FUNCTIONAL.get(func)
        kwargs = kwargs or {}
        if build is None or self.engine.inside or not torch.is_grad_enabled():
            return func(*args, **kwargs)
        return self.engine.on_function(func, build, args, kwargs)


def _handed_nothing(rec: hooks.Record) -> None:
    """The output-gradient hook of :attr:`SecondOrderEngine.own`'s records: the nodes
    built on them compute."""
    return None


def _recorded(module: nn.Module, output, recorder: Recorder | None) -> hooks.Record | None:
    """The record ``recorder`` made of the call of ``module`` that returned ``output``
    (found from the autograd node of an output tensor: :func:`jacmem.engine.hooks.record_of`),
    or None."""
    if recorder is None:
        return None
    for t in (output,) if isinstance(output, Tensor) else compat.tree_flatten(output)[0]:
        seen = broadcast.watched_tensor(t)  # (a call on a batch of one: first order's watched output)
        fn = getattr(t if seen is None else seen, "grad_fn", None)
        rec = None if fn is None else hooks.record_of(fn)
        if rec is not None and rec.module is module and rec.uses is recorder.uses:
            return rec
    return None


def _trainable(module: nn.Module, fo, params: dict[str, nn.Parameter]) -> dict[str, nn.Parameter]:
    """Of the trainable parameters the one rule counts for ``module``'s call (``params``:
    :func:`jacmem.engine.hooks.counted`), those its first-order entry ``fo`` has derivatives
    for (the others stay uncovered: :meth:`SecondOrderEngine.on_backward`), but one a
    submodule holds as its own (HF BERT's prediction head's bias, its decoder's): that
    submodule's call records it, as first order's direct uses leave it to it."""
    if fo is None:
        return {}
    held = {id(q) for m in module.modules() if m is not module for _, q in own_parameters(m)}
    return {n: p for n, p in params.items() if n in fo.params and ("." in n or id(p) not in held)}


def _identity(pname: str, x, g: Tensor, quantities: set[str]) -> dict[str, Tensor]:
    """First-order quantities of a parameter used as it is: for output gradients
    ``g [N', *p.shape]`` its per-sample gradients are ``g``."""
    return {q: g if q == "batch_grad" else g.square().sum(0) for q in quantities}


def _op_name(func) -> str:
    """``F.relu`` -> ``relu``, ``Tensor.add_`` -> ``add_``."""
    return getattr(func, "__name__", None) or str(func)


def _input_edges(fn, taps: dict[tuple, int], stop: set) -> dict[object, list[tuple[int, int]]] | None:
    """The autograd nodes of one module call that take its inputs: ``{node: [(position
    in its next_functions, input index)]}`` for the edges ``(grad_fn, output_nr)`` in
    ``taps``, searched from the call's output ``fn`` down to its inputs' grad_fns
    (``stop``) and tracked outputs; ``None`` past ``_TAP_NODES`` nodes."""
    edges: dict[object, list[tuple[int, int]]] = {}

    def step(fn) -> list:
        following = []
        for k, (nxt, nr) in enumerate(fn.next_functions):
            i = taps.get((nxt, nr))
            if i is not None:
                edges.setdefault(fn, []).append((k, i))
            elif nxt is not None and nxt not in stop and "jacmem" not in nxt.metadata:
                following.append(nxt)
        return following

    return None if walker.Walk([fn], step, limit=_TAP_NODES).cut else edges


def _tracked(fn) -> Node | None:
    """The live node whose call's output autograd node ``fn`` is, or None."""
    ref = fn.metadata.get("jacmem")
    return ref() if ref is not None else None


def _node_of(item: tuple):
    """The autograd node of a walk's item ``(node, ...)``: what counts as visited."""
    return item[0]


def _shape_of(x: Tensor) -> Tensor:
    """A stand-in for an input whose derivatives read only its shape: one element,
    expanded to ``x``'s shape, so the input itself can go when autograd lets it."""
    return x.new_zeros(()).expand(x.shape)
