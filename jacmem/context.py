"""``extend()``: the one active configuration, and ``track()`` for forwards run before it.

Inside ``with jacmem.extend(*extensions):`` a global forward hook records every call of
a module with trainable parameters (see :mod:`jacmem.hooks`). When a call's output
gradient arrives, the block computes what its extensions need for that call's
parameters and stages it; at the end of the backward pass it writes the results to
the parameters, all at once. On exit, however the block ends, every hook comes off
and everything kept is dropped.
"""

from __future__ import annotations

import sys
import threading
import warnings
import weakref
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules import module as module_hooks

from jacmem import distributed, hooks
from jacmem.extensions.firstorder import (
    LINEAR_QUANTITIES,
    FirstOrderExtension,
    Plan,
    batch_size,
    derive,
    execute,
    itemsize,
    plan,
    plan_key,
    shapes,
)
from jacmem.extensions.secondorder import SecondOrderExtension
from jacmem.extensions.secondorder.backprop import Engine
from jacmem.strategies import AUTO, Decision, StrategyPlan, StrategySpec

_ACTIVE: extend | None = None
_LOCK = threading.Lock()

#: models registered with track(): model -> Tracker
_TRACKED: weakref.WeakKeyDictionary[nn.Module, Tracker] = weakref.WeakKeyDictionary()

DEFAULT_CHUNK_BYTES = 64 * 2**20

#: :func:`plan_key`, the module's name, the strategy asked for it and the parameter's
#: itemsize -> (the plan, the decisions it took): a parameter's strategies are chosen
#: once per call shape, not at every step of every block
_PLANS: dict[tuple, tuple[Plan, tuple[Decision, ...]]] = {}
#: how many plans ``_PLANS`` holds before it starts over
_MAX_PLANS = 4096


def _tracked_name(module: nn.Module) -> str | None:
    if not _TRACKED:
        return None
    for tracker in _TRACKED.values():
        if module in tracker.names:
            return tracker.names[module]
    return None


class Tracker:
    """Forward hooks on one model's modules, for forwards that run outside a block."""

    def __init__(self, model: nn.Module):
        self.names: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
        self.model = weakref.ref(model)
        self.module_handles: list = []
        self.tensor_handles: list = []
        self.records: weakref.WeakSet[hooks.Record] = weakref.WeakSet()
        for name, module in model.named_modules():
            if next(module.parameters(recurse=False), None) is None:
                continue
            self.names[module] = name or type(module).__name__
            self.module_handles.append(module.register_forward_hook(self._on_forward, with_kwargs=True))

    def _on_forward(self, module, args, kwargs, output):
        self.tensor_handles[:] = [h for h in self.tensor_handles if h.hooks_dict_ref() is not None]
        rec, _ = hooks.record(module, args, kwargs, output, self.names[module], _dispatch, self.tensor_handles)
        if rec is not None:
            self.records.add(rec)

    def close(self):
        hooks.remove(self.module_handles)
        hooks.remove(self.tensor_handles)
        for rec in list(self.records):
            rec.release()


def _dispatch(rec: hooks.Record) -> None:
    """A tracked call's gradient arrived: compute, if a block is active."""
    if _ACTIVE is not None:
        _ACTIVE._on_grad(rec)


def track(model: nn.Module) -> nn.Module:
    """Keep, from now on, what the extensions need from ``model``'s forward passes,
    so that a backward inside :func:`extend` can use a forward run before it.
    Returns the model. Undo with :func:`untrack`."""
    if model not in _TRACKED:
        _TRACKED[model] = Tracker(model)
    return model


def untrack(model: nn.Module) -> nn.Module:
    """Remove the hooks of :func:`track`, and everything they kept."""
    tracker = _TRACKED.pop(model, None)
    if tracker is not None:
        tracker.close()
    return model


class _Staged:
    """What one backward pass has computed so far for one parameter."""

    __slots__ = ("param", "batch_size", "quantities", "summed", "grad")

    def __init__(self, param: nn.Parameter, batch_size: int, summed: bool):
        self.param, self.batch_size, self.summed = param, batch_size, summed
        self.quantities: dict[str, Tensor] = {}
        #: the summed gradient, where this pass computed it (ComputeOnce): NaN or Inf in
        #: any per-sample quantity puts NaN or Inf in it, so the check reads it instead
        self.grad: Tensor | None = None

    def add(self, values: dict[str, Tensor]) -> None:
        for q, v in values.items():
            self.quantities[q] = v if q not in self.quantities else self.quantities[q] + v


class _Pass:
    """One backward pass (one autograd graph task) through a block: what it has
    computed so far, written to the parameters when it ends.

    autograd holds it as the pass's final callback, and the block only a weak
    reference: a pass that fails never calls it, and frees it with the rest of the
    pass, so nothing it staged is ever written.
    """

    __slots__ = ("block", "staged", "partial", "names", "__weakref__")

    def __init__(self, block: extend):
        self.block = block
        self.staged: dict[int, _Staged] = {}
        #: records whose outputs got only some gradients so far
        self.partial: list[hooks.Record] = []
        #: id(parameter) -> the name of the (first) module it was computed for
        self.names: dict[int, str] = {}

    def __call__(self) -> None:
        self.block._commit(self)


def _gets_grad(node) -> bool:
    """Whether the running backward pass computes the gradient of the parameter whose
    AccumulateGrad ``node`` this is: every parameter's in ``loss.backward()``, those in
    ``inputs`` in ``backward(inputs=...)`` and ``torch.autograd.grad(outputs, inputs)``."""
    try:
        return torch._C._will_engine_execute_node(node)
    except RuntimeError:  # torch.autograd.grad captures this leaf's gradient: it asked for it
        return True


def _stable_dtype(params) -> torch.dtype:
    """Where the quantities are computed: float32 at least (autocast runs the forward in
    bf16 or fp16), float64 for a float64 parameter."""
    dtype = torch.float32
    for p in params:
        dtype = torch.promote_types(dtype, p.dtype)
    return dtype


def _cast(obj, dtype: torch.dtype):
    """Floating tensors, alone or in tuples and lists, to ``dtype``; the rest passes."""
    if isinstance(obj, Tensor):
        return obj.detach().to(dtype) if obj.is_floating_point() and obj.dtype != dtype else obj.detach()
    if isinstance(obj, (tuple, list)):
        return type(obj)(_cast(o, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: _cast(v, dtype) for k, v in obj.items()}
    return obj


def _device(obj) -> torch.device:
    if isinstance(obj, Tensor):
        return obj.device
    return next(_device(o) for o in obj if isinstance(o, (Tensor, tuple, list)))


class extend:
    """Switch extensions on for the backward passes inside the block.

    Args:
        *extensions: e.g. ``BatchGrad(), Variance()``.
        strategy: one strategy name for every layer (``"auto"``, ``"unfold"``,
            ``"save_memory"``, ...), or a dict from module type or qualified module name
            to a name; see :mod:`jacmem.strategies`.
        strict: raise, rather than warn, on a trainable module no extension can handle.
        chunk_bytes: temporary memory a strategy may use at once; larger batches are
            processed in chunks.
        process_group: a ``torch.distributed`` process group over which to sum
            ``sum_grad_squared`` and the gradient of ``variance``, for every model
            called in the block; by default, that of a ``DistributedDataParallel``
            model, none for any other (see :mod:`jacmem.distributed`).

    ``as ctx`` gives the block; ``ctx.explain()`` says what each layer chose, and why.

    Which parameters: those whose gradient the backward pass computes, in every call
    of their module that the pass goes through (``backward(inputs=[...])`` and
    ``torch.autograd.grad(loss, [...])`` get their ``inputs``' quantities only). Each
    backward pass writes its own results at its end, replacing the last ones (they do
    not accumulate as ``.grad`` does); a pass that fails writes nothing. The quantities
    are computed in float32 at least (float64 for float64 parameters), without a graph
    (``create_graph=True`` works; the quantities are constants), and returned in each
    parameter's dtype.

    Threads: one block is active at a time, in the whole process. It extends the
    graphs built by the thread that entered it, inside the block or with
    :func:`track`; the forward passes of other threads are not recorded, and their
    backward passes get nothing.
    """

    def __init__(
        self,
        *extensions: FirstOrderExtension,
        strategy: StrategySpec = AUTO,
        strict: bool = False,
        chunk_bytes: float = DEFAULT_CHUNK_BYTES,
        process_group: Any = None,
    ):
        for ext in extensions:
            if not isinstance(ext, (FirstOrderExtension, SecondOrderExtension)):
                raise TypeError(f"not a jacmem extension: {ext!r}; e.g. jacmem.BatchGrad()")
        extensions = tuple(dict.fromkeys(extensions))
        self.extensions = [e for e in extensions if isinstance(e, FirstOrderExtension)]
        #: second-order extensions, run by their own engine (see jacmem.extensions.secondorder)
        self.second_order = [e for e in extensions if isinstance(e, SecondOrderExtension)]
        self._engine: Engine | None = None
        self.quantities = {q for ext in self.extensions for q in ext.quantities}
        self.plan = StrategyPlan(strategy)
        self.strict = strict
        self.chunk_bytes = chunk_bytes
        self._module_handles: list = []
        self._tensor_handles: list = []
        #: when to drop the handles of freed graphs from ``_tensor_handles``
        self._prune_at = 64
        self._names: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
        self.process_group = process_group
        self._depth = 0
        #: graph task id -> the pass, while autograd holds it
        self._passes: weakref.WeakValueDictionary[int, _Pass] = weakref.WeakValueDictionary()
        self._records: weakref.WeakSet[hooks.Record] = weakref.WeakSet()
        #: the models called at depth 0 in the block, as weak references, in order
        self._roots: list[weakref.ref] = []
        self._owner: int | None = None
        #: modules already warned about (weakly: a long block sees re-created modules)
        self._warned: weakref.WeakSet[nn.Module] = weakref.WeakSet()

    # -- block -------------------------------------------------------------------

    def __enter__(self) -> extend:
        global _ACTIVE
        with _LOCK:
            if _ACTIVE is not None:
                elsewhere = _ACTIVE._owner != threading.get_ident()
                raise RuntimeError(
                    "jacmem.extend blocks do not nest: one is active already"
                    + (" in another thread (one block at a time per process)" if elsewhere else "")
                    + ". Pass all extensions to one block: jacmem.extend(BatchGrad(), Variance())."
                )
            _ACTIVE = self
            self._owner = threading.get_ident()
        self._module_handles = [
            module_hooks.register_module_forward_pre_hook(self._enter_module),
            module_hooks.register_module_forward_hook(self._leave_module, always_call=True),
            module_hooks.register_module_forward_hook(self._on_forward, with_kwargs=True),
        ]
        if self.second_order:
            self._engine = Engine(self.second_order, self.name, self._choose, self.chunk_bytes, self.strict)
        return self

    def _choose(self, module, name, offered, param, quantity, options) -> str:
        return self.plan.choose(module, name, offered, param, quantity, options, 4)

    def __exit__(self, *exc) -> None:
        global _ACTIVE
        hooks.remove(self._module_handles)
        hooks.remove(self._tensor_handles)
        if self._engine is not None:
            self._engine.close()
            self._engine = None
        for rec in list(self._records):
            rec.release()  # a traceback may still hold it; its hooks are off
            rec.x = None  # a ComputeOnce call left in a graph then backpropagates as autograd would
        for run in list(self._passes.values()):
            run.staged.clear()
            run.partial.clear()
        self._passes = weakref.WeakValueDictionary()
        self._records = weakref.WeakSet()
        self._roots = []
        self._names = weakref.WeakKeyDictionary()
        self._depth = 0
        self._owner = None
        with _LOCK:
            _ACTIVE = None

    def explain(self) -> str:
        """What each layer's quantities were computed with, and why."""
        return self.plan.explain()

    # -- forward -----------------------------------------------------------------

    def _enter_module(self, module, args):
        if threading.get_ident() != self._owner:
            return
        if self._depth == 0 and module not in self._names:
            for name, sub in module.named_modules():
                self._names.setdefault(sub, name or type(sub).__name__)
            self._roots.append(weakref.ref(module))
        self._depth += 1

    def _leave_module(self, module, args, output):
        if threading.get_ident() != self._owner:
            return
        self._depth = max(self._depth - 1, 0)
        err = sys.exc_info()[1]
        if output is None and err is not None:  # the forward raised: say why, where we can
            self._explain_dtype(module, args, err)

    def _explain_dtype(self, module: nn.Module, args: tuple, err: BaseException) -> None:
        """An integer or bool input where the module needs floats: name the module and
        the fix, in a note on the forward's exception (a warning before Python 3.11)."""
        floating = [p for p in hooks.trainable(module).values() if p.is_floating_point()]
        wrong = [t for t in args if isinstance(t, Tensor) and not (t.is_floating_point() or t.is_complex())]
        if not floating or not wrong or getattr(err, "_jacmem_explained", False):
            return
        msg = (
            f"jacmem: module {self.name(module)!r} ({type(module).__name__}) got an input of dtype "
            f"{wrong[0].dtype} where it needs a floating-point one, as its parameters are "
            f"({floating[0].dtype}): convert the input first, e.g. X.to({floating[0].dtype})."
        )
        try:
            err._jacmem_explained = True
        except AttributeError:
            pass
        if hasattr(err, "add_note"):
            err.add_note(msg)
        else:
            warnings.warn(msg, stacklevel=2)

    def name(self, module: nn.Module) -> str:
        return self._names.get(module) or _tracked_name(module) or type(module).__name__

    def _on_forward(self, module, args, kwargs, output):
        if threading.get_ident() != self._owner:
            return  # another thread's forward
        if self._engine is not None:
            self._engine.on_forward(module, args, output)
        if _tracked_name(module) is not None or not self.extensions:
            return  # a tracked module, whose tracker records it; or nothing first-order to do
        # the second-order engine hooks the output itself, so it must stay
        once = self._engine is None
        rec, output = hooks.record(
            module, args, kwargs, output, self.name(module), self._on_grad, self._tensor_handles, once
        )
        if rec is not None:
            self._records.add(rec)
            if len(self._tensor_handles) > self._prune_at:  # a block open for many steps
                self._tensor_handles[:] = [h for h in self._tensor_handles if h.hooks_dict_ref() is not None]
                self._prune_at = 2 * len(self._tensor_handles) + 64
        return output

    # -- backward ----------------------------------------------------------------

    def _on_grad(self, rec: hooks.Record) -> dict[str, Tensor] | None:
        """A call's output gradients arrived: compute its quantities. Returns, for a
        call through :class:`hooks.ComputeOnce`, its parameters' summed gradients (the
        block computed them), or None where the block does not extend this backward."""
        if rec.thread != self._owner:
            return None  # a graph another thread built, or the block has ended: not this block's
        if self._engine is not None and rec.module not in self._engine.seen:
            raise RuntimeError(
                f"jacmem: second-order extensions need the forward pass inside the block, but module "
                f"{rec.name!r} ran it outside (with jacmem.track): run the forward inside jacmem.extend(...)"
            )
        task = torch._C._current_graph_task_id()
        run = self._passes.get(task)
        if run is None:
            run = self._passes[task] = _Pass(self)
            torch.autograd.Variable._execution_engine.queue_callback(run)
        if rec.missing:
            run.partial.append(rec)
            return None
        try:
            return self._process(run, rec)
        finally:
            rec.reset()

    def _process(self, run: _Pass, rec: hooks.Record) -> dict[str, Tensor]:
        if rec.entry is None:
            self._unsupported(rec, sorted(rec.params))
            return {}
        supported = rec.entry.params
        missing = [p for p in rec.params if p not in supported]
        if missing:
            self._unsupported(rec, missing)
        self.plan.check(rec.module, rec.name, rec.entry.names)  # a ValueError as it is, not wrapped below
        try:
            with torch.no_grad(), torch.autocast(_device(rec.grads).type, enabled=False):
                return self._compute(run, rec)
        except Exception as err:
            raise RuntimeError(
                f"jacmem: computing {', '.join(map(repr, self.extensions))} for module {rec.name!r} "
                f"({type(rec.module).__name__}) failed: {err}. Another implementation may work: "
                f"strategy={{{rec.name!r}: name}} with a name among {sorted(rec.entry.names())}"
            ) from err

    def _compute(self, run: _Pass, rec: hooks.Record) -> dict[str, Tensor]:
        """Stage the call's quantities; returns each parameter's summed gradient where
        the call runs through :class:`hooks.ComputeOnce` (from the same pass, where one
        is planned), else nothing."""
        entry, hp = rec.entry, rec.hp
        supported = entry.params
        params = {n: p for n, p in rec.params.items() if n in supported and _gets_grad(rec.nodes[n])}
        grads: dict[str, Tensor] = {}
        if not params:
            return grads
        dtype = _stable_dtype(params.values())
        x, g = _cast(rec.x, dtype), _cast(rec.g, dtype)
        n = batch_size(g)
        xs, gs = shapes(x), shapes(g)
        for pname, param in params.items():
            staged = run.staged.get(id(param))
            summed = rec.shared(param) or (staged is not None and staged.summed)
            if staged is None:
                staged = run.staged[id(param)] = _Staged(param, n, summed)
                run.names[id(param)] = rec.name
            elif staged.batch_size != n:
                raise ValueError(
                    f"parameter {pname!r} is used with batch sizes {staged.batch_size} and {n} in one "
                    "backward pass; per-sample quantities need one batch size"
                )
            elif not staged.summed or not all(q in LINEAR_QUANTITIES for q in staged.quantities):
                raise RuntimeError(f"parameter {pname!r} received a second contribution after it was finalised")
            wanted = {"batch_grad"} if summed else self.quantities
            extra = {"grad"} - wanted if rec.once else set()
            if n == 0:  # an empty batch: empty per-sample quantities, zero sums
                values = derive(param.new_zeros((0, *param.shape), dtype=dtype), wanted | extra)
            else:
                chosen = self._plan(rec, xs, gs, itemsize(g), pname, param, wanted | extra)
                values = execute(chosen, entry, hp, x, g, pname, param, self.chunk_bytes)
            if rec.once:
                grads[pname] = (values.pop("grad") if extra else values["grad"]).to(param.dtype)
                staged.grad = grads[pname] if staged.grad is None else staged.grad + grads[pname]
            staged.add(values)
        return grads

    def _plan(self, rec: hooks.Record, xs, gs, size: int, pname: str, param: nn.Parameter, quantities: set) -> Plan:
        """How to compute ``quantities`` of ``param`` in the call ``rec``, whose input and
        output gradient have the shapes ``xs`` and ``gs`` and ``size`` bytes per entry.

        Made once and kept in ``_PLANS`` under everything it depends on (where its
        hyper-parameters are plain values); its decisions go to this block's plan
        either way, for :meth:`explain`."""
        entry, shape = rec.entry, tuple(param.shape)
        key = plan_key(entry, rec.hp, xs, gs, size, pname, shape, quantities)
        if key is not None:
            key += (rec.name, self.plan.requested(rec.module, rec.name), param.element_size())
            cached = _PLANS.get(key)
            if cached is not None:
                self.plan.remember(cached[1])
                return cached[0]
        made: list[Decision] = []

        def choose(quantity, options):
            chosen = self.plan.choose(
                rec.module, rec.name, entry.names(), pname, quantity, options, param.element_size()
            )
            made.append(self.plan.decisions[(rec.name, pname, quantity)])
            return chosen

        result = plan(entry, rec.hp, xs, gs, size, pname, shape, quantities, choose)
        if key is not None:
            if len(_PLANS) >= _MAX_PLANS:
                _PLANS.clear()
            _PLANS[key] = (result, tuple(made))
        return result

    def _commit(self, run: _Pass) -> None:
        """End of the backward pass: finish the partial records and the summed
        parameters, sum over the ranks what is global, then write every result, all
        at once (a failure before writes nothing)."""
        for rec in dict.fromkeys(r for r in run.partial if any(g is not None for g in r.grads)):
            rec.complete()
            try:
                self._process(run, rec)
            finally:
                rec.reset()
        run.partial.clear()
        staged, run.staged = run.staged, {}
        quantities = {
            key: derive(s.quantities["batch_grad"], self.quantities) if s.summed else dict(s.quantities)
            for key, s in staged.items()
        }
        sizes = {key: s.batch_size for key, s in staged.items()}
        self._warn_batch_sizes(run.names, sizes)
        self._warn_nonfinite(run.names, quantities, {key: s.grad for key, s in staged.items()})
        for group, params in self._groups():
            distributed.synchronize(group, params, self.quantities, quantities, sizes)
        results = [
            (s.param, ext.savefield, ext.finalize(quantities[key], sizes[key]).to(s.param.dtype))
            for key, s in staged.items()
            for ext in self.extensions
        ]
        for param, field, value in results:
            setattr(param, field, value)

    def _groups(self) -> list[tuple[Any, list[nn.Parameter]]]:
        """(process group, its parameters in model order) for the models called in the
        block and the tracked ones: the ``process_group`` argument, or that of a
        ``DistributedDataParallel`` model."""
        models = [m for m in (ref() for ref in self._roots) if m is not None] + list(_TRACKED.keys())
        groups: list[tuple[Any, list[nn.Parameter]]] = []
        seen = set()
        for model in models:
            group = self.process_group if self.process_group is not None else distributed.process_group_of(model)
            if group is None:
                continue
            params = [p for p in model.parameters() if p.requires_grad and id(p) not in seen]
            seen.update(map(id, params))
            groups.append((group, params))
        return groups

    def _warn_batch_sizes(self, names: dict[int, str], sizes: dict[int, int]) -> None:
        """One warning per backward pass whose modules disagree on the batch size: a
        module whose axis 0 is not the batch (a sequence-first layer, a reshaped batch)
        would otherwise get quantities per row of axis 0, silently."""
        by_size: dict[int, list[str]] = {}
        for key, n in sizes.items():
            by_size.setdefault(n, []).append(names[key])
        if len(by_size) < 2:
            return
        seen = "; ".join(f"{n}: {', '.join(map(repr, dict.fromkeys(mods)))}" for n, mods in by_size.items())
        warnings.warn(
            f"jacmem: the modules of one backward pass see different batch sizes ({seen}). Per-sample "
            "quantities take axis 0 of a module's input as the batch, so a module whose axis 0 is not "
            "the batch (batch_first=False, e.g. nn.TransformerEncoderLayer; or a batch reshaped into "
            "another axis) gets them per row of axis 0, not per sample. Put the batch first "
            "(batch_first=True), or ignore this if the block really holds several batches.",
            RuntimeWarning,
            stacklevel=2,
        )

    def _warn_nonfinite(
        self, names: dict[int, str], quantities: dict[int, dict[str, Tensor]], grads: dict[int, Tensor | None]
    ) -> None:
        """One warning per backward pass, naming the modules whose quantities hold NaN or
        Inf: their input or output gradient did. It costs one sum per parameter, of its
        smallest quantity or of its summed gradient where ``grads`` has it (a sum over
        the samples holds NaN or Inf wherever a sample does; summing the per-sample
        gradients took 12 of the 37 ms of the MLP's BatchGrad step), and one transfer
        per device."""
        by_device: dict[torch.device, list[int]] = {}
        for key, q in quantities.items():
            if q:
                by_device.setdefault(next(iter(q.values())).device, []).append(key)
        bad = set()
        for keys in by_device.values():
            sums = []
            for k in keys:
                candidates = list(quantities[k].values())
                if grads.get(k) is not None:
                    candidates.append(grads[k])
                sums.append(min(candidates, key=Tensor.numel).sum())
            sums = torch.stack(sums)
            bad.update(k for k, finite in zip(keys, sums.isfinite().tolist()) if not finite)
        if not bad:
            return
        modules = list(dict.fromkeys(names[k] for k in reversed(list(quantities)) if k in bad))  # forward order, about
        warnings.warn(
            f"jacmem: the {', '.join(e.savefield for e in self.extensions)} of module(s) "
            f"{', '.join(map(repr, modules))} hold NaN or Inf, as their input or the gradient of the loss "
            f"w.r.t. their output does. If it came with the data, it entered at {modules[0]!r}: check the "
            "data with torch.isfinite(X).all(); otherwise check the loss (log of 0, division by 0) or lower "
            "the learning rate.",
            RuntimeWarning,
            stacklevel=2,
        )

    def _unsupported(self, rec: hooks.Record, params: list[str]) -> None:
        if rec.module in self._warned:
            return
        self._warned.add(rec.module)
        msg = (
            f"jacmem: module {rec.name!r} ({type(rec.module).__name__}) has trainable parameters "
            f"{params} that {', '.join(map(repr, self.extensions))} cannot handle; they get no "
            f"{', '.join(e.savefield for e in self.extensions)}. Register a derivative with "
            "jacmem.register(...), or freeze them (requires_grad=False)."
        )
        if self.strict:
            raise RuntimeError(msg)
        warnings.warn(msg, stacklevel=2)
