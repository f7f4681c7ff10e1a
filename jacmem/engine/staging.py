"""The staging that the first-order engines share: a block's calls, recorded, turned into
per-parameter quantities and staged in the pass's state.

A :class:`Stager` is held by :class:`jacmem.engine.firstorder.FirstOrderEngine` and by
:class:`jacmem.engine.clipping.ClippingEngine` (composition: neither engine subclasses the
other). Its :class:`jacmem.engine.recorder.Recorder` records every call of a module with
trainable parameters inside the block; calls of tracked models come from their tracker
(:meth:`Stager.on_record`). When a call's output gradients have arrived, the stager
checks it (what no derivative covers raises, by the engine's own words), and hands it to
its engine's ``stage_call``, which stages its parameters' quantities with the stager's
:meth:`Stager.stage`, :meth:`Stager.keep` and :meth:`Stager.compute` (the strategies the
planner chose, :mod:`jacmem.engine.planner`, in the dtype of :mod:`jacmem.engine.precision`).
A parameter used by several calls (a module called twice, tied weights) sums its
per-sample gradients over them first; where only norms are asked for and its layers give
ghost factors, it keeps the calls instead, and at the end of the pass
(:meth:`Stager.settle`) its quantities come from their cross terms
(:mod:`jacmem.derivatives.tied`) or, where the cost model finds it cheaper, from
per-sample gradients. What the stager knows of its block comes down to it in the
block's :class:`jacmem.engine.base.Context`.

A warm step plans nothing: where its engine allows it (first order), each call of a module
whose last call, in this block or an earlier one, left a recipe that still holds (the same
layer and registrations, block settings, shapes, dtypes and devices) runs that call's
strategies, bound, at once (:meth:`Stager.planned`).
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from jacmem import compat
from jacmem.derivatives.quantities import GRAD, Quantity, as_quantity, derive
from jacmem.derivatives.registry import VERSION, Cost, unarranged
from jacmem.derivatives.tied import (
    FROM_FACTORS,
    add_index_terms,
    index_terms_cost,
    per_sample_cost,
    rows_at,
    summed_moments,
    summed_norm_costs,
    summed_squared_norms,
)
from jacmem.engine import hooks, precision
from jacmem.engine.base import Context, Engine
from jacmem.engine.broadcast import behind_broadcasts
from jacmem.engine.notices import and_others, listing
from jacmem.engine.planner import (
    ContractError,
    Step,
    batch_size,
    bind,
    cached_plan,
    chunk_budget,
    execute,
    execute_bound,
    itemsize,
    plain,
    shapes,
)
from jacmem.engine.recorder import TRACKED, Recorder, tracked_name


class MixedBatchesError(ValueError):
    """One parameter's calls in one backward pass hold different numbers of samples."""


class _Kept(NamedTuple):
    """A call of a shared parameter, kept for its ghost factors ``(r, c)`` (their
    ``shapes``); ``dense``: whether ``r`` is dense (a Linear's output gradient), not row
    indices. A dense call whose moments came at its call may let its ``x``, ``g`` and
    factors go (None), see :meth:`Stager.early`."""

    rec: hooks.Record
    pname: str
    x: Tensor | None
    g: Tensor | None
    dtype: torch.dtype
    factors: tuple[Tensor, Tensor] | None
    shapes: tuple[tuple, tuple]
    dense: bool

    @classmethod
    def of(cls, rec: hooks.Record, pname: str, x, g, dtype: torch.dtype) -> _Kept:
        r, c = rec.entry.ghost_factors[pname](x, g, **rec.hp)
        return cls(rec, pname, x, g, dtype, (r, c), (tuple(r.shape), tuple(c.shape)), r.is_floating_point())


class _Staged:
    """What one backward pass has computed so far for one parameter."""

    __slots__ = ("param", "batch_size", "quantities", "summed", "checksum", "calls", "early", "gathered")

    def __init__(self, param: nn.Parameter, batch_size: int, summed: bool):
        self.param, self.batch_size, self.summed = param, batch_size, summed
        self.quantities: dict[str, Tensor] = {}
        #: a parameter shared by several calls whose quantities may come from ghost
        #: factors: each call so far; ``None`` once its per-sample gradients are staged instead
        self.calls: list[_Kept] | None = []
        #: the sum of the summed gradient, where this pass computed it (ComputeOnce), a 0-dim
        #: tensor: NaN or Inf in any per-sample quantity puts NaN or Inf in it, so the check
        #: reads it instead. (Taken at the call: the block holds no reference to the gradient,
        #: which autograd then moves into ``.grad`` without a copy.)
        self.checksum: Tensor | None = None
        #: ``sum_grad_squared`` and ``grad`` of the first kept call whose ghost factor
        #: ``r`` is dense (an LM head's), computed at its call from its own per-sample
        #: products, which give the summed gradient that call returns too (ComputeOnce)
        self.early: dict[str, Tensor] | None = None
        #: id(record) -> that dense call's per-sample gradients at the rows of each other
        #: call of the parameter whose ``r`` holds row indices, ``[N, T, C]``, taken with
        #: ``early`` so that its output gradient need not be held to the end of the pass
        self.gathered: dict[int, Tensor] = {}

    def add(self, values: dict[str, Tensor]) -> None:
        for q, v in values.items():
            self.quantities[q] = v if q not in self.quantities else self.quantities[q] + v


class BoundPlans(NamedTuple):
    """How one call of a module computed its parameters' quantities, kept for the module's
    next call (:meth:`Stager.planned`) on the module's recipe (:attr:`jacmem.engine.hooks.Recipe.plans`:
    kept past the block, so that the next step's call of the same kind runs its strategies
    at once; a cache: it is used only where everything that made it holds, and gives what
    planning afresh gives): ``key``, everything that decided it (see there);
    ``bound``, each parameter's planned steps bound to their strategies
    (:func:`jacmem.engine.planner.bind`); ``decisions``, the strategies' choices, as
    ``explain()`` reads them; ``extra``: whether the summed gradient was computed for
    ComputeOnce alone (no extension asks for it)."""

    key: tuple
    bound: tuple[tuple[Step, ...], ...]
    decisions: dict
    extra: bool


class Staging:
    """The first-order engine's state in one backward pass."""

    __slots__ = ("staged", "partial", "names")

    def __init__(self):
        self.staged: dict[int, _Staged] = {}
        #: records whose outputs got only some gradients so far
        self.partial: list[hooks.Record] = []
        #: id(parameter) -> the name of the (first) module it was computed for
        self.names: dict[int, str] = {}


_BROADCAST = (
    "jacmem: the output of module {name!r} ({type}) reaches the model's output (or the loss) through a tensor "
    "broadcast over the batch (a leading axis of 1 meets the batch's rows), where autograd sums the samples' "
    "gradients: the "
    "module ran without the batch axis (T5's relative attention bias, on [T, T] bucket ids), or an op after it "
    "mixes the samples (h - h.mean(0)). Its rows are not samples, so its per-sample quantities (under ClipGrad, "
    "its norms and clipped sums) would not be per sample. Give the module's input the batch axis (expand it to "
    "the batch), compute without mixing the samples, or freeze its parameters."
)


def _refuse_broadcasts(outputs: list) -> None:
    """Raise where a recorded call reaches ``outputs`` (a model's output, or a loss)
    through a broadcast over the batch (:func:`~jacmem.engine.broadcast.behind_broadcasts`):
    that call's rows are not samples; so are those of a call on a batch of one whose
    output met the batch through no use jacmem followed (``repeat(N, 2, 1)``). (A
    compiled graph's calls are inside one autograd node: not seen.)"""
    for node in behind_broadcasts(outputs):
        rec = hooks.record_of(node)
        if rec is None or rec.void or not rec.params:
            continue
        if rec.broadcast is None:
            raise RuntimeError(_BROADCAST.format(name=rec.name, type=type(rec.module).__name__))
        if not rec.broadcast.uses:
            raise _one_row(rec)


def _check_broadcast(rec: hooks.Record) -> None:
    """A call on a batch of one whose output met the batch (:mod:`jacmem.engine.broadcast`): its
    uses' records are exact only where no other op read the output."""
    if rec.broadcast.unsafe:
        raise _one_row(rec)


def _one_row(rec: hooks.Record) -> RuntimeError:
    """The error for a call on a batch of one whose output met the batch through ops jacmem
    cannot follow per sample (besides its followed uses, or alone)."""
    ops = ", ".join(dict.fromkeys(rec.broadcast.unsafe)) or "ops jacmem does not see"
    met = "met the batch, but was also read by" if rec.broadcast.uses else "met the batch only through"
    return RuntimeError(
        f"jacmem: module {rec.name!r} ({type(rec.module).__name__}) ran on a batch of one, and its output {met} "
        f"{ops}, which jacmem cannot follow per sample: its per-sample quantities would mix the samples. Give its "
        "input the batch axis (e.g. position_ids.expand(batch_size, -1)), or freeze its parameters."
    )


def _places_batch_second(model: nn.Module) -> bool:
    """Whether a module of ``model`` takes its batch on axis 1 itself (an RNN's or
    attention's ``batch_first=False``)."""
    for m in model.modules():  # (a loop, not a generator)
        if getattr(m, "batch_first", True) is False:
            return True
    return False


class Stager:
    """A first-order engine's calls, from record to staged quantities (see the module
    docstring). ``engine``: the engine that holds it, the key of its state in each pass
    (:meth:`jacmem.engine.base.Pass.state`); the engine's own steps, handed down:
    ``stage_call(run, rec)`` stages one call's quantities (with :meth:`stage`,
    :meth:`keep`, :meth:`compute`) and returns the summed gradients of a call through
    ComputeOnce; ``unsupported(rec, params)`` raises for parameters of a call that no
    derivative covers; ``check(rec)``, where given, refuses a call before it is computed;
    ``recipes``: see :attr:`recipes`."""

    def __init__(
        self,
        engine: Engine,
        extensions: list,
        quantities: set[str],
        context: Context,
        stage_call: Callable[[Any, hooks.Record], dict[str, Tensor]],
        unsupported: Callable[[hooks.Record, list[str]], None],
        check: Callable[[hooks.Record], None] | None = None,
        recipes: bool = False,
    ):
        self.engine, self.extensions, self.quantities = engine, extensions, quantities
        #: whether ``stage_call`` stages each parameter of a call used by that call alone,
        #: staged first, with all of ``quantities`` (and the summed gradient of a call through
        #: ComputeOnce): then a call runs its module's recipe where one holds (:meth:`planned`)
        self.recipes = recipes
        self.stage_call, self.unsupported, self.check = stage_call, unsupported, check
        self.strategies, self.chunk_bytes = context.strategies, context.chunk_bytes
        self.passes, self.notices, self.name = context.passes, context.notices, context.name
        #: module -> its name, the context's (read without a call)
        self.names = context.names
        #: ``(module, parameter name) -> the parameter's stable name`` (the context's), which
        #: the quantities that are :attr:`~jacmem.derivatives.quantities.Quantity.named` read
        self.stable_name = context.stable_name
        self.named = False
        for q in quantities:  # (a loop, not a generator: a stager is made at every step)
            self.named = self.named or (q if isinstance(q, Quantity) else as_quantity(q)).named
        self.owner: int | None = context.owner
        self.batch_first = context.batch_first
        #: ``models()``: the tracked models whose calls reach the block
        self.models = context.models
        #: the block's own calls; a layer that allows it runs through ComputeOnce
        self.recorder = Recorder(self.on_record, once=True, batch_first=context.batch_first)
        context.recorder = self.recorder  # (the block's engines share its records: second order's nodes)
        #: (size, axis) -> the first model whose outermost call since the last pass had an
        #: input of that size on axis 0 or 1: the batch sizes it may hold are those on axis 0,
        #: and on axis 1 where it places the batch there (:meth:`unoffered` tells, when asked)
        self.offered: dict[tuple[int, int], nn.Module] = {}
        #: model -> whether its inputs may hold the batch on axis 1 (:func:`_places_batch_second`)
        self.second: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()

    def on_enter(self, module):
        # A call that may be recorded: its forward may read parameters of its own, or it runs in
        # a compiled forward (a compiled model's wrapper too, which has none: the recorder learns
        # the forward is compiled). (hooks.compiled(), read without a call: at every module call)
        recordable = (hooks.COMPILED and hooks.COMPILED[-1]) or hooks.recipe(module).reads
        if recordable and (not TRACKED or tracked_name(module) is None):  # (none tracked: no call)
            self.recorder.enter(module, self.name)

    def on_leave(self, module, outermost):
        recorder = self.recorder
        # (nothing to undo: most calls, asked without a call)
        if recorder.direct or recorder.compiled_start is not None:
            recorder.leave(module, outermost)
        elif outermost:  # (Recorder.leave's reset, inline: at every outermost call)
            recorder.batch, recorder.first, recorder.compiled, recorder.one_row = 1, None, False, None

    def on_call(self, model, args, kwargs, output):
        """Refuse calls behind a broadcast over the batch, and note the batch sizes the
        model's inputs offer, for a forward that builds a graph (not one that recomputes
        a call inside a backward)."""
        if torch.is_grad_enabled() and compat.current_graph_task_id() == -1:
            _refuse_broadcasts([output] if isinstance(output, Tensor) else compat.tree_flatten(output)[0])
            offered = self.offered
            for t in (*args, *kwargs.values()):  # (a loop, not comprehensions: this runs at every model call)
                if isinstance(t, Tensor) and t.dim():
                    offered.setdefault((t.shape[0], 0), model)
                    if t.dim() > 1:
                        offered.setdefault((t.shape[1], 1), model)

    def on_backward(self, tensors, grad_tensors, alone: bool, reached: list) -> None:
        if TRACKED and self.models():  # tracked: a forward that ran before the block was not checked
            _refuse_broadcasts(compat.tree_flatten(tensors)[0])

    def on_forward(self, module, args, kwargs, output):
        """A module's forward returned: record the call, where it counts. The global hooks
        call this directly inside a forward of a block whose one engine holds this stager
        (:func:`jacmem.engine.hooks.eager`): it checks the thread and a recomputation in a
        backward as :meth:`jacmem.engine.block.Block.forward` does."""
        if threading.get_ident() != self.owner:
            return None  # another thread's forward
        if compat.current_graph_task_id() != -1:  # (Block.recomputing, without the call)
            self.passes.current()
        own, children = compat.own_slots(module)
        if not own and not children:
            return None  # a leaf (an activation, a loss): nothing to record (asked without a call)
        known = hooks.recipe(module)
        if not known.reads and not known.known:
            return None  # a container, an activation, a loss: nothing to record (as the recorder would find)
        if TRACKED.data and tracked_name(module) is not None:  # (none tracked: asked without a call, nor __len__'s)
            return None  # its tracker records it
        # (Context.name, its first step inline, and names.get without a Python frame: most calls)
        name = self.names.data.get(weakref.ref(module)) or self.name(module)
        return self.recorder.record(module, args, kwargs, output, name, known)

    @property
    def handles(self) -> list:
        return self.recorder.tensor_handles

    def on_record(self, rec: hooks.Record) -> dict[str, Tensor] | None:
        """A call's output gradients arrived: compute its quantities. Returns, for a
        call through :class:`hooks.ComputeOnce`, its parameters' summed gradients (the
        engine computed them), or None where the block does not extend this backward."""
        if rec.thread != self.owner or rec.void:
            return None  # a graph another thread built, or the block has ended: not this block's
        if rec.broadcast is not None and rec.broadcast.uses:
            _check_broadcast(rec)
            return None  # the records of its uses give its per-sample quantities
        current = self.passes.current()
        run = current.states.get(self.engine)  # (Pass.state, inline: calls less)
        if run is None:
            run = current.states[self.engine] = self.engine.new_state()
        if rec.missing:
            run.partial.append(rec)
            return None
        try:
            return self._process(run, rec)
        finally:  # (rec.reset(), inline: this runs for every call)
            rec.grads = [None] * len(rec.grads)
            rec.missing = len(rec.grads)

    def _process(self, run: Staging, rec: hooks.Record) -> dict[str, Tensor]:
        if self.check is not None:
            self.check(rec)
        supported = rec.supported
        reached = []  # (a loop, not comprehensions: this runs for every call)
        for n in sorted(rec.params):
            if n not in supported and compat.will_engine_execute_node(rec.nodes[n]):
                reached.append(n)
        if reached:  # (a backward(inputs=...) that leaves them out asks nothing of them)
            self.unsupported(rec, reached)
        if rec.entry is None:
            return {}
        if rec.entry.recomputed:
            self._recomputed(rec)
        if self.strategies.overrides:  # (none asked for: nothing to check)
            self.strategies.check(rec.module, rec.name, rec.entry.names)  # a ValueError as it is, not wrapped below
        first = rec.grads[0]
        device = first.device if isinstance(first, Tensor) else precision.device_of(rec.grads)
        try:
            if torch.is_grad_enabled() or torch.is_autocast_enabled(device.type):
                with precision.computing(device):
                    return self.stage_call(run, rec)
            # a backward's usual mode (what computing() makes, with no call), where recipes run
            grads, key = self.planned(run, rec) if self.recipes else (None, None)
            if grads is None:
                grads = self.stage_call(run, rec)
                if key is not None:
                    self.remember(rec, key)
            return grads
        except (ContractError, MixedBatchesError):
            raise
        except Exception as err:
            raise RuntimeError(self._failed(rec, err)) from err

    def _failed(self, rec: hooks.Record, err: Exception) -> str:
        """The message for a computation that raised: the module, the strategy, the
        other strategies it offers (none where there is no other)."""
        failed = getattr(err, "jacmem_strategy", None)
        text = str(err).strip().rstrip(".")
        where = f" (strategy {failed!r})" if failed is not None else ""
        others = sorted(rec.entry.names() - {failed})
        hint = (
            f" Another implementation may work: strategy={{{rec.name!r}: name}} with a name among {others}."
            if others
            else " It has no other strategy to try."
        )
        return (
            f"jacmem: computing {', '.join(map(repr, self.extensions))} for module {rec.name!r} "
            f"({type(rec.module).__name__}) failed: {text}{where}." + hint
        )

    def planned(self, run: Staging, rec: hooks.Record) -> tuple[dict[str, Tensor] | None, tuple | None]:
        """Stage the quantities of a call whose module's last call kept a recipe that holds
        (:meth:`remember`): the same layer and registrations, block settings, name, shapes,
        dtypes and devices of its input, output gradient and the parameters this backward
        computes, each of them staged first here and used by this call alone; its
        strategies run at once, with no plan, cast, check or chunk (its first call had
        them). Returns ``(grads, key)``: ``grads`` as :meth:`_process` returns them, or
        None where no recipe holds; ``key``, what a recipe made by this call would hold
        for, None where it may not keep one (a parameter shared, a layout arranged, a
        hyper-parameter not a plain value, a strategy asked for by module)."""
        x, grads, entry, hp = rec.x, rec.grads, rec.entry, rec.hp
        g = grads[0]
        if (
            len(grads) != 1 or not isinstance(g, Tensor) or not (x is None or isinstance(x, Tensor))
            or entry.arrange is not unarranged or not (rec.batch_first or entry.own_layout)
            or self.strategies.overrides or (hp and not plain(hp.values()))
        ):  # fmt: skip
            return None, None
        # the parameters this backward computes, as :meth:`params` finds them (a loop, inline:
        # this runs for every call)
        supported, live, staged, executed = rec.supported, rec.uses.live, run.staged, compat.executed(rec.nodes)
        params, meta = {}, []
        for pname, p in rec.params.items():
            if pname in supported and pname in executed:
                if live.get(id(p), 0) > 1 or id(p) in staged:
                    return None, None  # shared: its calls are summed or kept
                params[pname] = p
                meta.extend((pname, p.shape, p.dtype, p.device))
                if self.named:  # (a recipe holds its stable name, as its steps do)
                    meta.append(self.stable_name(rec.module, pname))
        if not params:
            return None, None  # (nothing to compute: the engine returns at once)
        strategies = self.strategies
        key = (
            entry, VERSION[0], rec.name, rec.once, rec.batch_first, self.quantities, strategies.default,
            strategies.autotune, self.chunk_bytes, g.shape, g.dtype, g.device, tuple(hp.items()), tuple(meta),
            None if x is None else (x.shape, x.dtype, x.device),
        )  # fmt: skip
        known = rec.recipe if rec.recipe is not None else hooks.recipe(rec.module)
        recipe = known.plans
        if recipe is None or recipe.key != key:
            return None, key
        for steps in recipe.bound:  # each still bound to the strategy its table holds (one replaced in place)
            for step in steps:
                if entry.strategies.get(step.table, _NO_TABLE).get(step.name) is not step.strategy:
                    return None, key
        strategies.decisions.update(recipe.decisions)  # (the decisions taken then, as explain()'s)
        # (detached only where they need a gradient: outside create_graph, which plans afresh, neither does)
        if x is not None and x.requires_grad:
            x = x.detach()
        values = execute_bound(recipe.bound, x, g.detach() if g.requires_grad else g)
        n, once, grads = g.shape[0], rec.once, {}
        for (pname, param), v in zip(params.items(), values):  # (as stage() makes a parameter's first staging)
            s = staged[id(param)] = _Staged(param, n, False)
            run.names[id(param)] = rec.name
            if once:
                grads[pname] = grad = (v.pop(GRAD) if recipe.extra else v[GRAD]).to(param.dtype)
                s.checksum = grad.sum()
            s.quantities = v
        return grads, key

    def remember(self, rec: hooks.Record, key: tuple) -> None:
        """Keep how ``stage_call`` just computed the quantities of this call's parameters
        (each staged first, by this call alone: see :attr:`recipes`), as :meth:`planned`
        reuses it under ``key``: its plans (:func:`~jacmem.engine.planner.cached_plan`, as
        it just made them), bound. None is kept where the call's input or output gradient
        had to be cast to the compute dtype, its batch is empty, or a step must be chunked."""
        x, g, params = rec.x, rec.grads[0], self.params(rec)
        extra = {"grad"} - self.quantities if rec.once else set()
        wanted = self.quantities | extra
        dtype = precision.compute_dtype(params.values())
        if g.dtype != dtype or (x is not None and x.dtype != dtype) or not g.shape[0]:
            return
        xs, gs, size = None if x is None else tuple(x.shape), tuple(g.shape), g.element_size()
        bound = []
        for pname, param in params.items():
            chosen = cached_plan(
                self.strategies, rec.module, rec.name, rec.entry, rec.hp, xs, gs, size, pname, param,
                wanted, x, g, self.chunk_bytes,
            )  # fmt: skip
            label = self.stable_name(rec.module, pname) if self.named else None
            steps = bind(chosen, rec.entry, rec.hp, pname, param, g, self.chunk_bytes, label)
            if steps is None:
                return
            bound.append(steps)
        # the plans' decisions, in the order they were taken (explain()'s)
        decisions = {k: d for k, d in self.strategies.decisions.items() if k[0] == rec.name and k[1] in params}
        known = rec.recipe if rec.recipe is not None else hooks.recipe(rec.module)
        known.plans = BoundPlans(key, tuple(bound), decisions, bool(extra))

    @staticmethod
    def params(rec: hooks.Record) -> dict[str, nn.Parameter]:
        """The call's parameters that its layer covers and this backward pass computes."""
        supported, executed, params = rec.supported, compat.executed(rec.nodes), {}
        for n, p in rec.params.items():  # (a loop, not a comprehension: this runs for every call)
            if n in supported and n in executed:
                params[n] = p
        return params

    def stage(self, run: Staging, rec: hooks.Record, pname: str, param: nn.Parameter, n: int) -> _Staged:
        """The parameter's staging in this pass, made on its first call; a parameter
        shared by several calls (``summed``) sums their per-sample gradients."""
        staged = run.staged.get(id(param))
        summed = rec.uses.live.get(id(param), 0) > 1 or (staged is not None and staged.summed)  # (rec.shared, inline)
        if staged is None:
            staged = run.staged[id(param)] = _Staged(param, n, summed)
            run.names[id(param)] = rec.name
        elif staged.batch_size != n:
            raise MixedBatchesError(
                f"jacmem: parameter {pname!r} of module {rec.name!r} ({type(rec.module).__name__}) is used with "
                f"batch sizes {staged.batch_size} and {n} in one backward pass. Row n of each call is sample n (two "
                "views of one sample, as in a siamese network), so per-sample quantities need one batch size. "
                "Micro-batches of different samples take one backward pass each (their results add up), not one "
                "backward of their summed losses."
            )
        elif not staged.summed or not all(as_quantity(q).linear for q in staged.quantities):
            raise RuntimeError(f"parameter {pname!r} received a second contribution after it was finalised")
        return staged

    def keep(self, staged: _Staged, rec: hooks.Record, pname: str, x, g, dtype) -> bool:
        """Keep this call of a shared parameter for its quantities from ghost factors (no
        per-sample gradients are asked for, and every call so far has factors); else
        stage per-sample gradients, those of the calls kept so far first."""
        if not staged.summed or staged.calls is None:
            return False
        if self.quantities <= FROM_FACTORS and pname in rec.entry.ghost_factors:
            staged.calls.append(_Kept.of(rec, pname, x, g, dtype))
            return True
        self._materialise(staged)
        return False

    def first_dense(self, staged: _Staged) -> bool:
        """Whether the call just kept is the first of the parameter's kept calls whose
        ghost factor ``r`` is dense, and the pass asks for ``sum_grad_squared`` or
        ``grad`` without ``batch_l2``: its moments may then come now (:meth:`early`)."""
        if not self.quantities or self.quantities - {"grad", "sum_grad_squared"}:
            return False
        return staged.calls[-1].dense and sum(call.dense for call in staged.calls) == 1

    def early(self, staged: _Staged, rec: hooks.Record, pname: str, dtype: torch.dtype) -> dict[str, Tensor]:
        """The moments of a parameter's one dense call (:attr:`_Staged.early`), a block of
        rows of a slice of samples at a time; returns its summed gradient where the call
        runs through :class:`hooks.ComputeOnce` (from the same per-sample products).
        Where every other live call of the parameter has row indices (an LM head's
        embedding), its per-sample gradients at their rows are taken now too
        (:attr:`_Staged.gathered`), and its ``x``, ``g`` and factors go: an LM head's
        output gradient ``[N, T, V]`` is not held to the end of the pass."""
        call = staged.calls[-1]
        wanted = self.quantities | ({"grad"} if rec.once else set())
        budget = chunk_budget(self.chunk_bytes, staged.param.device)
        staged.early = summed_moments([call.factors], tuple(staged.param.shape), wanted, budget)
        index = [(other, _index_rows(other, staged.param, dtype)) for other in rec.others(staged.param)]
        if all(rows is not None for _, rows in index):
            staged.gathered = {id(other): rows_at([call.factors], rows) for other, rows in index}
            staged.calls[-1] = call._replace(x=None, g=None, factors=None)
        if not rec.once:
            return {}
        # The summed gradient, where it stays in ``early``, is only read by autograd: a
        # gradient it gets while another reference lives is neither stolen into .grad nor
        # added to in place, so :func:`add_index_terms` may add to it at the end of the pass.
        grad = staged.early["grad"] if "grad" in self.quantities else staged.early.pop("grad")
        staged.checksum = grad.sum() if staged.checksum is None else staged.checksum + grad.sum()
        return {pname: grad.to(staged.param.dtype)}

    def _materialise(self, staged: _Staged) -> None:
        """Stage the per-sample gradients of the calls kept so far, summed."""
        calls, staged.calls = staged.calls, None
        for rec, pname, x, g, dtype, *_ in calls:
            staged.add(self.compute(rec, pname, staged.param, {"batch_grad"}, x, g, dtype))

    def settle(self, run: Any) -> dict[int, _Staged]:
        """End of the backward pass: finish the partial records and the shared parameters'
        kept calls; the staged parameters, ``id(param) -> _Staged``, taken from ``run``."""
        if run.partial:
            self._finish_partial(run)
        staged, run.staged = run.staged, {}
        for s in staged.values():
            if s.calls:  # (none kept: nothing to resolve, asked without a call)
                self._resolve_tied(s)
        return staged

    def _resolve_tied(self, staged: _Staged) -> None:
        """A shared parameter's kept calls: its ``batch_l2`` from their ghost factors'
        cross terms, or from per-sample gradients, whichever the cost model finds
        cheaper; its ``sum_grad_squared`` and ``grad`` (and ``batch_l2`` where so chosen)
        from the per-sample gradients summed over the calls, a block of rows of a slice of
        samples at a time within ``chunk_bytes`` (:func:`summed_moments`), never one
        sample's ``p.shape`` whole where that exceeds it; or, where some calls' rows are
        indices (an embedding tied to a head) and the cost model finds it cheaper, the
        per-sample gradients of the dense calls alone (the one dense call's are
        :attr:`_Staged.early`), with the embeddings' terms from gathers
        (:func:`add_index_terms`). The choices are ``explain()``'s, under the first
        call's module."""
        calls, staged.calls = staged.calls, []
        if not calls:
            return
        factors = [call.factors for call in calls]
        shapes_ = [call.shapes for call in calls]
        rec, pname = calls[0].rec, calls[0].pname
        size = next(f for f in factors if f is not None)[1].element_size()  # (index calls keep theirs)

        def choose(quantity: str, options: dict) -> str:
            return self.strategies.choose(
                rec.module, rec.name, rec.entry.names(), pname, quantity, options, size, staged.param.device
            )

        rest = self.quantities - {"batch_l2"}
        if "batch_l2" in self.quantities:
            options = summed_norm_costs(shapes_, staged.param.numel())
            if choose("batch_l2", {f"tied {k}": c for k, c in options.items()}) == "tied ghost":
                staged.add({"batch_l2": summed_squared_norms(factors, self.chunk_bytes)})
            else:
                rest = self.quantities
        if not rest:
            return
        shape, dense = tuple(staged.param.shape), [call for call in calls if call.dense]
        early = staged.early is not None and len(dense) == 1
        budget = chunk_budget(self.chunk_bytes, staged.param.device)
        entries = min(staged.param.numel() * staged.batch_size, max(1, int(budget // size)))
        options = {}
        if all(f is not None for f in factors):  # (not where the dense call's factors went, see _early)
            options["tied per-sample gradients"] = per_sample_cost(shapes_, staged.param.numel(), entries)
        if "batch_l2" not in rest and len(dense) < len(calls):
            moments = [] if early else [call.shapes for call in dense]
            options["tied index terms"] = _sum_costs(
                index_terms_cost(shapes_), per_sample_cost(moments, staged.param.numel(), entries) if moments else None
            )
        if {choose(q, options) for q in sorted(rest)} != {"tied index terms"}:  # sorted: explain()'s order
            staged.quantities.update(summed_moments(factors, shape, rest, budget))
            return
        if early:
            out = staged.early  # its summed gradient, handed to autograd, is ours alone by now (see _early)
        elif dense:
            out = summed_moments([call.factors for call in dense], shape, rest, budget)
        else:
            out = {q: factors[0][1].new_zeros(shape) for q in rest}
        index = [(call.factors, self._dense_rows(staged, call, dense)) for call in calls if not call.dense]
        staged.quantities.update(add_index_terms(out, index))

    @staticmethod
    def _dense_rows(staged: _Staged, call: _Kept, dense: list[_Kept]) -> Tensor | None:
        """The dense calls' per-sample gradients summed, at the rows of ``call`` (one
        whose ``r`` holds row indices): taken at the dense call where its factors went
        (:meth:`early`), else from their factors; None where there is no dense call."""
        if dense and dense[0].factors is None:
            return staged.gathered[id(call.rec)]  # every live call with indices was gathered
        return rows_at([d.factors for d in dense], call.factors[0]) if dense else None

    def compute(self, rec: hooks.Record, pname: str, param: nn.Parameter, wanted: set, x, g, dtype) -> dict:
        """``wanted`` quantities of one parameter in one call, from its input ``x`` and
        output gradient ``g`` (in ``dtype``), by the planned strategies (those that read the
        parameter's stable name get it, :meth:`jacmem.engine.base.Context.stable_name`)."""
        label = self.stable_name(rec.module, pname) if self.named else None
        first = g if isinstance(g, Tensor) else None  # (one tensor, most calls: read without a call)
        if (
            batch_size(g) if first is None else first.shape[0]
        ) == 0:  # an empty batch: empty per-sample quantities, zero sums
            return derive(param.new_zeros((0, *param.shape), dtype=dtype), wanted, label)
        gs, size = (shapes(g), itemsize(g)) if first is None else (tuple(first.shape), first.element_size())
        xs = tuple(x.shape) if isinstance(x, Tensor) else shapes(x)
        chosen = cached_plan(
            self.strategies, rec.module, rec.name, rec.entry, rec.hp, xs, gs, size, pname, param,
            wanted, x, g, self.chunk_bytes,
        )  # fmt: skip
        return execute(chosen, rec.entry, rec.hp, x, g, pname, param, self.chunk_bytes, rec.name, label)

    def _finish_partial(self, run: Staging) -> None:
        """The records whose outputs got only some gradients: zeros for the others."""
        for rec in dict.fromkeys(r for r in run.partial if any(g is not None for g in r.grads)):
            rec.complete()
            try:
                self._process(run, rec)
            finally:
                rec.reset()
        run.partial.clear()

    def unoffered(self, n: int) -> str | None:
        """The inputs of the models' outermost calls since the last pass (``"size ('model')"``,
        each batch size they offer), where batch size ``n`` is none of them; None where it
        is one, or no call offered any. The next pass counts afresh."""
        offered, self.offered = self.offered, {}
        sizes: dict[int, str] = {}
        for (size, axis), model in offered.items():
            if size not in sizes and (axis == 0 or self._places_batch_second(model)):
                sizes[size] = self.name(model)
        if not sizes or not n or n in sizes:
            return None
        return "; ".join(f"{size} ({name!r})" for size, name in sorted(sizes.items()))

    def _places_batch_second(self, model: nn.Module) -> bool:
        """Whether ``model``'s inputs may hold the batch on axis 1: under the block's
        ``batch_first=False``, or where a module of it says so (:func:`_places_batch_second`)."""
        second = self.second.get(model)
        if second is None:
            second = self.second[model] = not self.batch_first or _places_batch_second(model)
        return second

    def check_one_row(self, names: dict[int, str], sizes: dict[int, int]) -> None:
        """Raise where modules of the pass ran on a batch of one while no input of the
        models' outermost calls since the last pass has an axis of one: the samples shared
        their input, which reached the batch in a way jacmem could not follow (in a
        compiled forward, PEFT's prompt tuning with the rest of the model frozen), so
        their quantities would be the batch's sums."""
        if 1 not in sizes.values():  # (no module on a batch of one: the offers are only forgotten)
            self.offered = {}
            return
        inputs = self.unoffered(1)
        if inputs is None:
            return
        ones = [names[key] for key, n in sizes.items() if n == 1]
        raise RuntimeError(
            f"jacmem: module(s) {listing(ones)} ran on a batch of one, but no input of the model's call has an axis "
            f"of one (it offers {inputs}): their input was shared by the samples and reached the batch in a way "
            f"jacmem cannot follow per sample, so their {', '.join(e.savefield for e in self.extensions)} would be "
            "the batch's sums. Give their input the batch axis (expand it to the batch), or freeze their parameters."
        )

    def check_batch_sizes(self, names: dict[int, str], sizes: dict[int, int]) -> None:
        """One warning per backward pass whose modules disagree on the batch size: a
        module whose axis 0 is not the batch (a sequence-first layer, a reshaped batch)
        would otherwise get quantities per row of axis 0, silently. A module on a batch
        of one beside larger batches is an error: its input was broadcast over the batch
        in a way jacmem could not follow, and its "per-sample" quantities would be the
        batch's sums."""
        by_size: dict[int, list[str]] = {}
        for key, n in sizes.items():
            by_size.setdefault(n, []).append(names[key])
        if len(by_size) < 2:
            return
        if 1 in by_size:
            largest = max(by_size)
            raise RuntimeError(
                f"jacmem: module(s) {listing(by_size[1])} ran on a batch of one while {listing(by_size[largest])} "
                f"ran on {largest} samples in the same backward pass: their input was shared by the samples and "
                "broadcast over the batch after them in a way jacmem cannot follow per sample, so their "
                f"{', '.join(e.savefield for e in self.extensions)} would be the batch's sums. Give their input "
                f"the batch axis (e.g. position_ids.expand({largest}, -1)), or freeze their parameters."
            )
        seen = "; ".join(f"{n}: {listing(mods)}" for n, mods in by_size.items())
        if not self.batch_first:
            raise RuntimeError(
                f"jacmem: under batch_first=False, the modules of one backward pass see different batch sizes "
                f"({seen}): a module whose axis 1 is not the batch (a layer on out[-1] rather than out[-1:], a "
                "convolution fed [T, N, ...]) would get its quantities per row of that axis, not per sample. Keep "
                "the batch on axis 1 (axis 0 for convolutions, and as the module's own batch_first says for "
                "RNNs and attention), and run one batch per backward pass."
            )
        warnings.warn(
            f"jacmem: the modules of one backward pass see different batch sizes ({seen}). Per-sample "
            "quantities take axis 0 of a module's input as the batch, so a module whose axis 0 is not "
            "the batch (a sequence-first model, e.g. nn.TransformerEncoderLayer(batch_first=False); or a batch "
            "reshaped into another axis) gets them per row of axis 0, not per sample. For a model fed "
            "[T, N, ...], pass batch_first=False to jacmem.extend (and jacmem.track); otherwise put the batch "
            "first, or ignore this if the block really holds several batches.",
            RuntimeWarning,
            stacklevel=2,
        )

    def _recomputed(self, rec: hooks.Record) -> None:
        """A module the generic fallback recomputes per sample: one notice (a warning
        gathered with the others of its kind; with ``strict``, an error now, before the
        pass writes anything)."""
        fields = ", ".join(e.savefield for e in self.extensions)
        label = f"{rec.name!r} ({type(rec.module).__name__})"
        self.notices.add(("first-order recomputed",), rec.name, _recomputed_notice(label, fields))


def _recomputed_notice(label: str, fields: str) -> Callable[[list[str]], str]:
    """The words of the generic fallback's notice about the module ``label`` (and others)."""

    def say(modules: list[str]) -> str:
        return (
            f"jacmem: module {label} has no registered derivative, so the per-sample gradients behind its {fields} "
            "are recomputed one sample at a time (torch.func.vmap): exact, but slower than a closed form. Register "
            "one with jacmem.layer and "
            "jacmem.register (docs: 'Adding a layer or a strategy'); strict=True makes this an error."
            + and_others(modules)
        )

    return say


_NO_TABLE: dict = {}


def _index_rows(rec: hooks.Record, param: nn.Parameter, dtype: torch.dtype) -> Tensor | None:
    """The row indices ``[N, T]`` of a call of ``param`` whose ghost factor ``r`` holds
    them (an embedding's), from its kept input alone (its factors on a zero output
    gradient that takes no memory); None for a call with a dense ``r`` or none, or one
    whose batch was moved to axis 0 (its factors then follow its own layout)."""
    name = next((n for n, p in rec.params.items() if p is param), None)
    factor = None if rec.entry is None else rec.entry.ghost_factors.get(name)
    if factor is None or rec.x is None or rec.relaid:
        return None
    shape, _, device = rec.outputs[0]
    r, _ = factor(precision.cast(rec.x, dtype), torch.zeros((), dtype=dtype, device=device).expand(shape), **rec.hp)
    return None if r.is_floating_point() else r


def _sum_costs(a: Cost, b: Cost | None) -> Cost:
    """Two steps one after the other: their FLOPs add, the larger workspace counts."""
    return a if b is None else Cost(a.flops + b.flops, max(a.workspace, b.workspace))
