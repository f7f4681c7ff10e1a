"""The second-order engine: factors flow backward module by module, checked against autograd.

In the forward pass (inside :func:`jacmem.extend`), every call of a module that
:mod:`jacmem.derivatives` knows (a layer it can pass factors through, or a
loss) becomes a :class:`Node`: its inputs, its output where its derivatives read it,
and, for each input, the node that produced it (if a tracked module did). So does each
call of a function of :data:`jacmem.derivatives.functional.FUNCTIONAL` made outside
the modules it knows (``F.relu``, ``torch.flatten``, ``out += identity``,
``F.cross_entropy``), with the derivatives of its module equivalent: a
:class:`torch.overrides.TorchFunctionMode` (:class:`_Functional`) sees the calls while
the block is open, and nothing outside it; the engine's own tensor work runs without
it. A function call becomes a node where it takes a tracked output (a loss: always; an
op after a loss: never). In-place calls (``relu_``, ``add_``, ``nn.ReLU(inplace=True)``)
are nodes whose input is the graph edge the in-place op took (read before the call, or
from its autograd node). **Where the GGN splits:** at the input of the recognised loss
(a loss module, or a loss function of the table); where that input is the output of a
reshape that merged the batch axis with the next ones (``logits.view(-1, V)``), at the
tensor before the reshape, whose rows are the samples. A loss with
``reduction="none"`` is recognised at its ``.sum()`` or ``.mean()``.

A hook on the node's output runs when autograd has the gradient of that output, which
is after every consumer of the output has run its own hook:

1. A loss node makes the factors of its Hessian (exact, sampled, or KFRA's
   batch-summed dense Hessian) and hands them to its input's producer.
2. Any other node sums what its consumers handed it, lets the extensions compute its
   parameters' quantities, and hands ``Jᵀ S`` (and, for DiagHessian, its own
   residual factors) to its inputs' producers. Each factor is freed as soon as it has
   crossed the module: memory holds the factors of one layer's input and output at a
   time, and factors larger than the block's ``chunk_bytes`` cross in slices of ``V``.
   KFRA's matrix crosses as ``1/N Σ_n J_nᵀ Ḡ J_n``; at a module with several inputs it
   goes on as per-sample roots, which collapse back where all their paths have met
   (:mod:`.kfac` gives the rule).

**The chain check.** Each node compares the gradient autograd delivers to its output
with the part of it that came through the tracked modules that consume the output:
autograd computes that part itself, ``J_cᵀ g_c`` for each consumer ``c``, and a hook on
each autograd node of ``c``'s call that takes the output directly (found at forward
time, by a search of ``c``'s own graph) hands it over, so the check costs no
arithmetic but a comparison (none when the only consumer's part is autograd's very
tensor). They differ (beyond rounding) exactly when some operation jacmem does not
see sits between this module and the loss (``torch.sin(x)``, ``x * y``, a broadcast
sum on a branch); then, or when nothing was handed over at all, the backward raises
:class:`ChainError`, naming the module, the op that took its output (its ``grad_fn``)
and the tracked call it leads to, rather than return a wrong curvature. A consumer whose own graph is too large to search (past
``_TAP_NODES`` autograd nodes) hands over ``J_cᵀ g_c`` computed by its Jacobian
instead, as one more row beside the factors. (What the check cannot see: an operation
applied *after* the loss. A loss scaled by ``c > 0`` or a sum of losses is fine; the
Hessian of anything else is not the GGN's.)
"""

from __future__ import annotations

import functools
import weakref
from collections import deque
from collections.abc import Callable
from fractions import Fraction
from math import sqrt

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from jacmem import compat, hooks, precision
from jacmem.derivatives import LossHessian, Passthrough, detached, lookup, lookup_loss, lookup_passthrough
from jacmem.derivatives.functional import FUNCTIONAL, Merged, Reduced, StandInLoss
from jacmem.derivatives.jacobians import diagonal_factor, ea_jac_t_mat_jac, vjp_generic
from jacmem.extensions.secondorder.autograd_path import AutogradPath
from jacmem.extensions.secondorder.base import Call, Factor, SecondOrderExtension, UnsupportedModule
from jacmem.extensions.secondorder.kfac import kfra_average, kfra_roots
from jacmem.notices import LIMIT, listing
from jacmem.passes import Engine as _Engine
from jacmem.passes import Setup, Write

#: how far up the autograd graph a forward looks for the tracked module that an
#: untracked operation consumed (only to name it in the error)
_SEARCH_NODES = 64
#: how many autograd nodes of one module call the chain check searches for those that
#: take the call's inputs; past it, the call's gradient row is computed instead
_TAP_NODES = 256


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
        "params",
        "fo_entry",
        "fo_hp",
        "fo_x",
        "untracked_consumers",
        "row",
        "dtype",
        "cast",
        "whole",
        "__weakref__",
    )

    def __init__(self, module: nn.Module, name: str, loss: LossHessian | None, entry: Passthrough | None):
        self.module, self.name, self.loss, self.entry = module, name, loss, entry
        #: the module it is, or, for a functional op, the module whose output it follows
        self.site = name
        self.untracked_consumers: list[str] = []
        #: what it keeps is 16-bit (autocast), to cast to ``dtype`` on its first backward
        self.cast = False
        #: the dtype it computes in, where that is not what autograd hands it
        self.dtype: torch.dtype | None = None
        #: ``inputs`` are the call's every argument (curvature-matrix products rerun it)
        self.whole = False

    def __repr__(self) -> str:
        return f"{self.name!r} ({type(self.module).__name__})"


class _Deposit:
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


class _State:
    """The engine's state in one backward pass: deposits in flight, results staged
    until its end."""

    __slots__ = ("deposits", "staged", "autograd")

    def __init__(self):
        self.deposits: dict[int, _Deposit] = {}
        #: where the autograd path runs this pass (:mod:`.autograd_path`), what its check
        #: expects at each module's output; the chain's hooks then stand by
        self.autograd: dict | None = None
        #: id(param) -> (param, owner node, {savefield: value})
        self.staged: dict[int, tuple] = {}

    def handover(self, node: Node, i: int, factors, g: Tensor | None, dense, shares: dict) -> None:
        """Factors, KFRA's matrix and its shares to input ``i``'s producer; ``g``, the
        call's part of its gradient, where it is a row (:func:`_tap`)."""
        p = node.producers[i]
        if p is None:
            return
        d = self.deposits.setdefault(id(p), _Deposit())
        if g is not None:
            self.deposit_grad(node, i, g)
        for key, f in factors.items():
            self.deposit(node, i, key, f.kind, f.sign, f.S)
        if dense is not None:
            d.dense = dense if d.dense is None else d.dense + dense
        for key, share in shares.items():
            d.shares[key] = d.shares.get(key, 0) + share

    def deposit_grad(self, node: Node, i: int, g: Tensor) -> None:
        d = self.deposits.setdefault(id(node.producers[i]), _Deposit())
        d.grads.append(g)
        d.sources.append(node.name)

    def deposit(self, node: Node, i: int, key: tuple, kind: str, sign: float, S: Tensor | None):
        if S is None or node.producers[i] is None:
            return
        d = self.deposits.setdefault(id(node.producers[i]), _Deposit())
        have = d.factors.get(key)
        d.factors[key] = Factor(kind, sign, S) if have is None else Factor(kind, sign, have.S.add_(S))


def _tolerance(dtype: torch.dtype) -> float:
    """Relative tolerance of the chain check: rounding of two orders of summation."""
    if dtype == torch.float64:
        return 1e-8
    return 1e-3 if dtype == torch.float32 else 3e-2  # bfloat16, float16 (autocast)


def _outside_mode(method):
    """The engine's own tensor work (in module hooks and backward hooks) runs without
    :class:`_Functional`, which would otherwise see each of its calls."""

    @functools.wraps(method)
    def run(self, *args):
        n = torch._C._len_torch_function_stack()
        if self.mode is None or not n or torch._C._get_function_stack_at(n - 1) is not self.mode:
            return method(self, *args)
        torch._C._pop_torch_function_stack()
        try:
            return method(self, *args)
        finally:
            torch._C._push_on_torch_function_stack(self.mode)

    return run


class Engine(_Engine):
    """Second-order extensions for one :func:`jacmem.extend` block (the interface is
    :class:`jacmem.passes.Engine`)."""

    def __init__(self, extensions: list[SecondOrderExtension], setup: Setup):
        self.extensions = extensions
        self.kinds = {k for ext in extensions for k in ext.kinds}
        self.name, self.budget, self.strategies = setup.name, setup.chunk_bytes, setup.strategies
        self.passes, self.notices = setup.passes, setup.notices
        self.handles = hooks.Handles()
        self.producer = compat.WeakTensorKeyDictionary()
        self.warned: set = set()
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
        self.mode = _Functional(self)
        self.mode.__enter__()
        self.autograd = AutogradPath(self)

    def close(self) -> None:
        if self.mode is not None:
            self.mode.__exit__(None, None, None)
            self.mode = None
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self.autograd.close()
        self.producer = compat.WeakTensorKeyDictionary()
        self.merged = compat.WeakTensorKeyDictionary()
        self.unreduced = compat.WeakTensorKeyDictionary()

    def new_state(self) -> _State:
        return _State()

    def on_record(self, rec) -> None:
        """A call recorded by :func:`jacmem.track` (forward outside the block) reached
        the backward: curvature needs the forward inside the block."""
        if rec.module not in self.seen:
            raise RuntimeError(
                f"jacmem: second-order extensions need the forward pass inside the block, but module "
                f"{rec.name!r} ran it outside (with jacmem.track): run the forward inside jacmem.extend(...)"
            )

    # -- forward -------------------------------------------------------------------

    def on_enter(self, module: nn.Module) -> None:
        known = lookup_loss(module) is not None or lookup_passthrough(module) is not None
        self.known.append(known)
        self.inside += known

    def on_leave(self, module: nn.Module, outermost: bool) -> None:
        if self.known:
            self.inside -= self.known.pop()

    @_outside_mode
    def on_forward(self, module: nn.Module, args: tuple, kwargs: dict, output) -> None:
        if not torch.is_grad_enabled() or compat.functorch_transforms_active():
            return
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
        node.whole = keep and len(inputs) == len(args) and not kwargs
        node.out = output.detach() if entry is not None and (entry.keep_output or entry.df is not None) else None
        node.out_shape = tuple(output.shape)
        node.producers = [self._producer_of(x) for x in inputs]
        for x, p in zip(inputs, node.producers):
            if p is None and x.grad_fn is not None:
                self._mark_untracked_path(x.grad_fn, node)
                self.autograd.untracked = True
        self._tap(node, inputs, output, edges or tuple((x.grad_fn, x.output_nr) for x in inputs))
        self._first_order(node, args, kwargs, output)
        # 16-bit tensors (autocast): computed with in float32 (jacmem.precision)
        node.cast = output.dtype in precision.LOW
        for x in inputs:
            node.cast = node.cast or x.dtype in precision.LOW
        self.producer[output] = node
        if output.grad_fn is not None:
            output.grad_fn.metadata["jacmem"] = weakref.ref(node)
        # the hook (so the graph) holds the node: it goes when the graph goes
        self.handles.add(output.register_hook(lambda grad: self._on_grad(node, grad)))
        self.autograd.record(node, output)

    def _first_order(self, node: Node, args: tuple, kwargs: dict, output: Tensor) -> None:
        """``node.params``: the module's own trainable parameters that its first-order
        entry covers (a warning names the others), with what that entry keeps."""
        module = node.module
        first = args[0] if args else None
        node.params = {n: p for n, p in module.named_parameters(recurse=False) if p.requires_grad}
        if node.params:
            fo = lookup(module, first, output)
            if fo is None or any(n not in fo.params for n in node.params):
                self._unsupported(node)
                node.params = {n: p for n, p in node.params.items() if fo is not None and n in fo.params}
            if node.params:
                node.fo_entry, node.fo_hp = fo, fo.hyperparams(module)
                x = fo.keep(args, kwargs)
                node.fo_x = fo.arrange_input(detached(x), **node.fo_hp)

    def _tap(self, node: Node, inputs: tuple[Tensor, ...], output: Tensor, into: tuple) -> None:
        """Hooks on the autograd nodes of this call that take an input with a producer
        (along the edges ``into``, one per input): in backward they hand that producer
        autograd's own part of its gradient (see the module docstring). ``node.row``:
        the search failed, the row it is."""
        taps = {e: i for i, (e, p) in enumerate(zip(into, node.producers)) if p is not None}
        found = taps and output.grad_fn is not None
        edges = _input_edges(output.grad_fn, taps, {fn for fn, _ in into}) if found else {}
        node.row = edges is None
        for fn, ks in (edges or {}).items():
            self.handles.add(fn.register_hook(lambda grad_inputs, _, ks=ks: self._on_tap(node, ks, grad_inputs)))

    def _producer_of(self, x: Tensor) -> Node | None:
        """The node whose output ``x`` is, also through identities that full backward
        hooks (``register_full_backward_hook``, BackPACK, Opacus) put around modules."""
        node = self.producer.get(x)
        fn, index = x.grad_fn, x.output_nr
        while node is None and compat.is_backward_hook_node(fn):
            fn, index = fn.next_functions[index]
            ref = fn.metadata.get("jacmem") if fn is not None else None
            node = ref() if ref is not None else None
        return node

    def _mark_untracked_path(self, fn, consumer: Node) -> None:
        """Tell the tracked nodes above ``fn`` (through untracked operations) who
        consumes their output, through which unsupported module, and which operation
        (its ``grad_fn``) took their output, for the error."""
        seen, queue = set(), deque([(fn, None, None)])
        while queue and len(seen) < _SEARCH_NODES:
            fn, via, op = queue.popleft()
            if fn is None or fn in seen:
                continue
            seen.add(fn)
            ref = fn.metadata.get("jacmem")
            node = ref() if ref is not None else None
            if node is not None:
                through = f"module {via}" if via else f"the operation {op}"
                node.untracked_consumers.append(f"{consumer.name!r} (through {through})")
                continue
            via = via or fn.metadata.get("jacmem_unsupported")
            queue.extend((f, via, fn.name()) for f, _ in fn.next_functions)

    def _untracked(self, module: nn.Module, args: tuple, kwargs: dict, output) -> None:
        """A leaf module that nothing here can pass through: marked in the graph (for
        the chain error); one whose parameters have first-order derivatives is kept for
        the autograd path (:mod:`.autograd_path`), any other with trainable parameters
        is warned about."""
        if next(module.children(), None) is not None:
            return
        fn = getattr(output, "grad_fn", None)
        if fn is not None:
            fn.metadata["jacmem_unsupported"] = f"{self.name(module)!r} ({type(module).__name__})"
            self.autograd.untracked = True
        if module in self.warned or not any(p.requires_grad for p in module.parameters(recurse=False)):
            return
        if (
            self.autograd.serves()
            and isinstance(output, Tensor)
            and output.requires_grad
            and lookup(module, args[0] if args else None, output)
        ):
            self.seen.add(module)
            node = Node(module, self.name(module), None, None)
            node.out_shape = tuple(output.shape)
            self._first_order(node, args, kwargs, output)
            if node.params:
                self.autograd.record(node, output)
            return
        self.warned.add(module)
        exts = ", ".join(map(repr, self.extensions))
        first = f"{self.name(module)!r} ({type(module).__name__})"

        def say(modules: list[str]) -> str:
            others = f" (also {listing(modules[1:], LIMIT - 1)})" if len(modules) > 1 else ""
            return (
                f"jacmem: module {first}{others} is not supported by {exts}: its parameters get nothing, and "
                "curvature cannot pass through it (a backward through it raises)."
            )

        self.notices.add(("second-order unsupported module",), self.name(module), say)

    def _unsupported(self, node: Node) -> None:
        if node.module in self.warned:
            return
        self.warned.add(node.module)
        exts = ", ".join(map(repr, self.extensions))
        first = str(node)

        def say(modules: list[str]) -> str:
            others = f" (also {listing(modules[1:], LIMIT - 1)})" if len(modules) > 1 else ""
            return (
                f"jacmem: module {first}{others} has trainable parameters that {exts} cannot handle; they "
                "get nothing. Register their first-order derivatives (jacmem.register), or freeze them "
                "(requires_grad=False)."
            )

        self.notices.add(("second-order unsupported parameters",), node.name, say)

    # -- backward ------------------------------------------------------------------

    def on_backward(self, tensors, grad_tensors, alone: bool) -> None:
        self.autograd.on_backward(tensors, grad_tensors, alone)

    @_outside_mode
    def _on_grad(self, node: Node, grad: Tensor) -> None:
        if self.autograd.busy:
            return  # the autograd path's own products
        run = self.passes.state(self)
        if run.autograd is not None:
            return
        with precision.computing(grad.device):
            if node.loss is not None:
                self._loss(run, node, _in_compute_dtype(node, grad) if node.cast or node.dtype else grad)
            else:
                self._layer(run, node, grad)

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

    def _loss(self, run: _State, node: Node, grad: Tensor) -> None:
        x, y = node.inputs[0], node.inputs[1] if len(node.inputs) > 1 else None
        if len(node.producers) > 1 and node.producers[1] is not None:
            raise NotImplementedError(
                f"jacmem: the target of loss {node} comes from tracked modules; second-order "
                "extensions need it constant (detach it)"
            )
        c = float(grad)
        if not c >= 0:
            raise ValueError(
                f"jacmem: loss {node} enters the backward with weight {c}; the GGN needs a non-negative "
                "one (call backward on the loss, a positive multiple of it, or a sum of losses)"
            )
        hp = {k: v for k, v in node.hp.items() if k != "forward"}
        factors: dict[tuple, Factor] = {}
        dense = None
        if "exact" in self.kinds or "residual" in self.kinds or "dense" in self.kinds:
            S = node.loss.sqrt_hessian(x, y, **hp) * sqrt(c)
            if "dense" in self.kinds:
                flat = S.flatten(2)
                dense = torch.einsum("vni,vnj->ij", flat, flat)
            if "exact" in self.kinds or "residual" in self.kinds:
                factors[("exact", id(node), 1)] = Factor("exact", 1.0, S)
        for kind in sorted(k for k in self.kinds if k.startswith("mc")):
            S = node.loss.sampled(x, y, int(kind[2:]), **hp) * sqrt(c)
            factors[(kind, id(node), 1)] = Factor(kind, 1.0, S)
        g = vjp_generic(node.hp["forward"], node.inputs, grad.reshape(1))[0][0] if node.row else None
        run.handover(node, 0, factors, g, dense, {})

    def _layer(self, run: _State, node: Node, grad: Tensor) -> None:
        dep = run.deposits.pop(id(node), None)
        _check_chain(node, dep, grad)  # in autograd's dtype, with its tolerance
        if node.cast or node.dtype:
            grad = _in_compute_dtype(node, grad)
        factors, dense, shares = dep.factors, self._kfra_whole(dep), dep.shares
        if node.params:
            self._compute(run, node, list(factors.values()), dense)
        if not any(p is not None for p in node.producers):
            return
        entry, xs, hp = node.entry, node.inputs, node.hp
        if dense is not None and len(xs) > 1:
            # backward, the paths fork here: KFRA's matrix goes on as per-sample roots (kfac.py)
            for sign, S in kfra_roots(dense, xs[0].shape[0], node.out_shape[1:]):
                key = ("kfra", id(node), sign)
                factors[key], shares[key] = Factor("kfra", sign, S), Fraction(1)
            dense = None
        try:
            for key in list(factors):
                f = factors.pop(key)  # freed once it has crossed
                for i, S_in in enumerate(_owned(self._backprop(entry, xs, node.out, f.S, hp))):
                    run.deposit(node, i, key, f.kind, f.sign, S_in)
                del f
            rows = entry.backprop(xs, node.out, grad.unsqueeze(0), hp) if node.row else [None] * len(xs)
            residual = _residual(node, grad) if "residual" in self.kinds else {}
            dense_in = None if dense is None else ea_jac_t_mat_jac(entry, xs, node.out, node.out_shape, dense, hp)
        except (ChainError, NotImplementedError):
            raise
        except Exception as err:
            raise RuntimeError(f"jacmem: passing curvature through module {node} failed: {err}") from err
        tracked = sum(p is not None for p in node.producers)
        split = {key: share / tracked for key, share in shares.items()}
        for i, p in enumerate(node.producers):
            if p is not None:
                row = None if rows[i] is None else rows[i][0]
                run.handover(node, i, residual if i == 0 else {}, row, dense_in, split)

    @staticmethod
    def _kfra_whole(dep: _Deposit) -> Tensor | None:
        """KFRA's matrix at this output: what arrived whole, plus the roots all of whose
        merge's paths met here, collapsed (kfac.py); the other roots stay in ``dep``."""
        dense = dep.dense
        for key in [k for k, share in dep.shares.items() if share == 1]:
            del dep.shares[key]
            f = dep.factors.pop(key, None)
            if f is None:  # its paths carried nothing (inputs that need no factor)
                continue
            part = f.sign * kfra_average(f.S)
            dense = part if dense is None else dense + part
        return dense

    def _backprop(self, entry: Passthrough, xs, out, S: Tensor, hp: dict) -> tuple[Tensor | None, ...]:
        """``Jᵀ S`` per input, in slices of ``V`` where ``S`` is larger than the budget;
        ``S`` is the engine's own (no one else holds it): elementwise maps overwrite it."""
        if entry.elementwise:
            return entry.backprop(xs, out, S, hp, inplace=True)
        v = S.shape[0]
        step = max(1, int(self.budget // max(S[0].numel() * S.element_size() * 2, 1)))
        if step >= v:
            return entry.backprop(xs, out, S, hp)
        outs: list | None = None
        for start in range(0, v, step):
            part = entry.backprop(xs, out, S[start : start + step], hp)
            if outs is None:
                outs = [None if t is None else t.new_empty((v, *t.shape[1:])) for t in part]
            for o, t in zip(outs, part):
                if o is not None:
                    o[start : start + step] = t
        return tuple(outs)

    def _compute(self, run: _State, node: Node, factors: list[Factor], dense: Tensor | None) -> None:
        self._check_unshared(run, node)
        call = self.call(node, factors, dense)
        results: dict[str, dict[str, object]] = {pname: {} for pname in node.params}
        for ext in self.extensions:
            out = self.run_extension(ext, call)
            for pname, value in (out or {}).items():
                results[pname][ext.savefield] = precision.result(value, node.params[pname])
        self.stage(run, node, results)

    @staticmethod
    def _check_unshared(run: _State, node: Node) -> None:
        for pname, p in node.params.items():
            if id(p) in run.staged:
                raise NotImplementedError(
                    f"jacmem: parameter {pname!r} of module {node} is used by more than one call in this "
                    f"backward pass (also by {run.staged[id(p)][1]}: a module called twice, or tied weights). "
                    "Second-order extensions need each parameter used once: a shared parameter's curvature has "
                    "cross terms between its calls, which they do not form. Give each call its own parameter, "
                    "freeze it (requires_grad=False), or use first-order extensions, which sum the calls"
                )

    def call(self, node: Node, factors: list[Factor], dense: Tensor | None) -> Call:
        """What the extensions see of ``node`` with these factors at its output."""
        module, offered = node.module, node.fo_entry.names()
        return Call(
            module=module,
            name=node.name,
            params=node.params,
            entry=node.fo_entry,
            hp=node.fo_hp,
            x=node.fo_x,
            inputs=node.inputs if node.whole else None,
            out_shape=node.out_shape,
            factors=factors,
            dense=dense,
            choose=lambda pname, quantity, options: self.strategies.choose(
                module, node.name, offered, pname, quantity, options, 4
            ),
            budget=self.budget,
        )

    def run_extension(self, ext: SecondOrderExtension, call: Call) -> dict | None:
        """``ext.compute(call)``; ``None`` (and a warning, once) where ``ext`` has nothing
        for the module."""
        try:
            return ext.compute(call)
        except UnsupportedModule as err:
            if (call.module, type(ext)) not in self.warned:
                self.warned.add((call.module, type(ext)))
                self.notices.add(("second-order unsupported", ext), call.name, _unsupported_by(ext, err))
            return None
        except NotImplementedError:
            raise
        except Exception as err:
            raise RuntimeError(
                f"jacmem: computing {ext!r} for module {call.name!r} ({type(call.module).__name__}) failed: {err}"
            ) from err

    def stage(self, run: _State, node: Node, results: dict[str, dict[str, object]]) -> None:
        """``{param name: {savefield: value}}``, written when the pass ends."""
        self._check_unshared(run, node)
        for pname, p in node.params.items():
            run.staged[id(p)] = (p, node, results[pname])

    def finish(self, run: _State) -> list[Write]:
        staged, run.staged = run.staged, {}
        run.deposits.clear()
        return [(p, field, value) for p, _, values in staged.values() for field, value in values.items()]


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


def _op_name(func) -> str:
    """``F.relu`` -> ``relu``, ``Tensor.add_`` -> ``add_``."""
    return getattr(func, "__name__", None) or str(func)


def _residual(node: Node, grad: Tensor) -> dict[tuple, Factor]:
    """DiagHessian's residual of an elementwise activation at its input:
    ``f''(x) ⊙ g_out`` split into ``diag(√r₊)`` (+) and ``diag(√r₋)`` (-)."""
    entry = node.entry
    if entry.curved:
        raise NotImplementedError(
            f"jacmem: DiagHessian cannot pass curvature through module {node}: its second derivative w.r.t. "
            "its input is not zero and jacmem has none; use DiagGGNExact"
        )
    if entry.d2f is None:
        return {}
    r = entry.d2f(node.inputs[0], node.out, **node.hp) * grad
    out = {}
    for sign, part in ((1.0, r.clamp(min=0)), (-1.0, (-r).clamp(min=0))):
        if bool(part.any()):
            out[("residual", id(node), sign)] = Factor("residual", sign, diagonal_factor(part.sqrt()))
    return out


def _check_chain(node: Node, dep: _Deposit | None, grad: Tensor) -> None:
    fix = (
        " Second-order extensions follow a chain of modules, and of the functional ops in "
        "jacmem.derivatives.functional.FUNCTIONAL (F.relu, x + y, x * c, torch.flatten, F.cross_entropy, ...), "
        "from the loss back: write other operations as modules that jacmem knows (jacmem.nn.Scale, "
        "jacmem.nn.Sum / jacmem.nn.Residual / jacmem.nn.Parallel for sums and skip connections) or register "
        "one (jacmem.derivatives.passthrough), and compute the loss inside the block."
    )
    downstream = ""
    if node.untracked_consumers:
        names = ", ".join(dict.fromkeys(node.untracked_consumers))
        downstream = f" on its way to {names}"
    if dep is None:
        raise ChainError(
            f"jacmem: the output of module {node} reaches the loss only through operations jacmem cannot "
            f"backpropagate curvature through{downstream}." + fix
        )
    if len(dep.grads) == 1 and _same(dep.grads[0], grad):
        return  # one consumer, whose part autograd passed on as it was: nothing else added to it
    diff = float((sum(dep.grads) - grad).norm()) if dep.grads else float(grad.norm())
    scale = sum(float(g.norm()) for g in dep.grads) + float(grad.norm())
    if diff == diff and diff > _tolerance(grad.dtype) * scale:  # NaN passes: nothing to compare
        raise ChainError(
            f"jacmem: the output of module {node} reaches the loss through operations jacmem cannot "
            f"backpropagate curvature through{downstream}, besides the tracked modules "
            f"{', '.join(map(repr, dict.fromkeys(dep.sources)))} (the gradient they pass back differs "
            f"from autograd's by {diff / max(scale, 1e-300):.2e}, relative)." + fix
        )


def _unsupported_by(ext: SecondOrderExtension, err: Exception) -> Callable[[list[str]], str]:
    """How to say that ``ext`` has nothing for the modules gathered: the first one's
    reason in full, then how many others, and a few of their names."""
    reason = str(err).strip().rstrip(".")

    def say(modules: list[str]) -> str:
        more = len(modules) - 1
        others = f" The same holds for {more} more module(s): {listing(modules[1:], LIMIT - 1)}." if more else ""
        return f"jacmem: {reason}. Its parameters get no {ext.savefield}.{others}"

    return say


def _in_compute_dtype(node: Node, grad: Tensor) -> Tensor:
    """``grad`` in the node's compute dtype (:mod:`jacmem.precision`); the first time,
    also what the node kept (an autocast forward keeps bf16 or fp16 tensors)."""
    if node.cast:
        node.dtype = dtype = precision.compute_dtype((*node.inputs, *node.params.values()))
        node.inputs = tuple(_kept_as(x, dtype) for x in node.inputs)
        node.out = None if node.out is None else node.out.to(dtype)
        node.hp = precision.cast(node.hp, dtype)
        if node.params:
            node.fo_x = precision.cast(node.fo_x, dtype)
            node.fo_hp = precision.cast(node.fo_hp, dtype)
        node.cast = False
    return grad if node.dtype is None or grad.dtype == node.dtype else grad.to(node.dtype)


def _kept_as(x: Tensor, dtype: torch.dtype) -> Tensor:
    """A kept input in ``dtype``: a stand-in for its shape (:func:`_shape_of`) stays one."""
    if x.dtype == dtype or not x.is_floating_point():
        return x
    if x.dim() and all(s == 0 for s in x.stride()):
        return x.new_zeros((), dtype=dtype).expand(x.shape)
    return x.to(dtype)


def _input_edges(fn, taps: dict[tuple, int], stop: set) -> dict[object, list[tuple[int, int]]] | None:
    """The autograd nodes of one module call that take its inputs: ``{node: [(position
    in its next_functions, input index)]}`` for the edges ``(grad_fn, output_nr)`` in
    ``taps``, searched from the call's output ``fn`` down to its inputs' grad_fns
    (``stop``) and tracked outputs; ``None`` past ``_TAP_NODES`` nodes."""
    edges: dict[object, list[tuple[int, int]]] = {}
    seen, todo = set(), [fn]
    while todo:
        fn = todo.pop()
        if fn in seen:
            continue
        seen.add(fn)
        if len(seen) > _TAP_NODES:
            return None
        for k, (nxt, nr) in enumerate(fn.next_functions):
            i = taps.get((nxt, nr))
            if i is not None:
                edges.setdefault(fn, []).append((k, i))
            elif nxt is not None and nxt not in stop and "jacmem" not in nxt.metadata:
                todo.append(nxt)
    return edges


def _shape_of(x: Tensor) -> Tensor:
    """A stand-in for an input whose derivatives read only its shape: one element,
    expanded to ``x``'s shape, so the input itself can go when autograd lets it."""
    return x.new_zeros(()).expand(x.shape)


def _same(a: Tensor, b: Tensor) -> bool:
    """The same numbers: one tensor, or views of the same memory alike."""
    return a is b or (
        a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
    )


def _owned(tensors: tuple[Tensor | None, ...]) -> tuple[Tensor | None, ...]:
    """Each deposit owns its tensor (deposits are updated in place): a tensor handed to
    several inputs (a Sum's) is copied for all but the first."""
    seen: set = set()
    out = []
    for t in tensors:
        out.append(t.clone() if t is not None and id(t) in seen else t)
        seen.add(id(t))
    return tuple(out)
