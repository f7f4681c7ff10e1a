"""``extend()``: the one active configuration, and ``track()`` for forwards run before it.

Inside ``with jacmem.extend(*extensions):`` a global forward hook records every call of
a module with trainable parameters (see :mod:`jacmem.hooks`). When a call's output
gradient arrives, the block computes what its extensions need for that call's
parameters and stages it; at the end of the backward pass it writes the results to
the parameters, all at once. On exit, however the block ends, every hook comes off
and everything kept is dropped.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from typing import Dict, List, Optional

import torch
from torch import Tensor, nn
from torch.nn.modules import module as module_hooks

from jacmem import hooks
from jacmem.extensions.firstorder import LINEAR_QUANTITIES, FirstOrderExtension, batch_size, compute, derive
from jacmem.extensions.secondorder import SecondOrderExtension
from jacmem.extensions.secondorder.backprop import Engine
from jacmem.strategies import AUTO, StrategyPlan, StrategySpec

_ACTIVE: Optional["extend"] = None
_LOCK = threading.Lock()

#: models registered with track(): model -> Tracker
_TRACKED: "weakref.WeakKeyDictionary[nn.Module, Tracker]" = weakref.WeakKeyDictionary()

DEFAULT_CHUNK_BYTES = 64 * 2**20


def _tracked_name(module: nn.Module) -> Optional[str]:
    for tracker in _TRACKED.values():
        if module in tracker.names:
            return tracker.names[module]
    return None


class Tracker:
    """Forward hooks on one model's modules, for forwards that run outside a block."""

    def __init__(self, model: nn.Module):
        self.names: "weakref.WeakKeyDictionary[nn.Module, str]" = weakref.WeakKeyDictionary()
        self.module_handles: List = []
        self.tensor_handles: List = []
        for name, module in model.named_modules():
            if next(module.parameters(recurse=False), None) is None:
                continue
            self.names[module] = name or type(module).__name__
            self.module_handles.append(module.register_forward_hook(self._on_forward, with_kwargs=True))

    def _on_forward(self, module, args, kwargs, output):
        self.tensor_handles[:] = [h for h in self.tensor_handles if h.hooks_dict_ref() is not None]
        hooks.record(module, args, kwargs, output, self.names[module], _dispatch, self.tensor_handles)

    def close(self):
        hooks.remove(self.module_handles)
        hooks.remove(self.tensor_handles)


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

    __slots__ = ("param", "batch_size", "quantities", "summed")

    def __init__(self, param: nn.Parameter, batch_size: int, summed: bool):
        self.param, self.batch_size, self.summed = param, batch_size, summed
        self.quantities: Dict[str, Tensor] = {}

    def add(self, values: Dict[str, Tensor]) -> None:
        for q, v in values.items():
            self.quantities[q] = v if q not in self.quantities else self.quantities[q] + v


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

    ``as ctx`` gives the block; ``ctx.explain()`` says what each layer chose, and why.
    """

    def __init__(
        self,
        *extensions: FirstOrderExtension,
        strategy: StrategySpec = AUTO,
        strict: bool = False,
        chunk_bytes: float = DEFAULT_CHUNK_BYTES,
    ):
        for ext in extensions:
            if not isinstance(ext, (FirstOrderExtension, SecondOrderExtension)):
                raise TypeError(f"not a jacmem extension: {ext!r}; e.g. jacmem.BatchGrad()")
        extensions = tuple(dict.fromkeys(extensions))
        self.extensions = [e for e in extensions if isinstance(e, FirstOrderExtension)]
        #: second-order extensions, run by their own engine (see jacmem.extensions.secondorder)
        self.second_order = [e for e in extensions if isinstance(e, SecondOrderExtension)]
        self._engine: Optional[Engine] = None
        self.quantities = {q for ext in self.extensions for q in ext.quantities}
        self.plan = StrategyPlan(strategy)
        self.strict = strict
        self.chunk_bytes = chunk_bytes
        self._module_handles: List = []
        self._tensor_handles: List = []
        self._names: "weakref.WeakKeyDictionary[nn.Module, str]" = weakref.WeakKeyDictionary()
        self._depth = 0
        self._staged: Dict[int, _Staged] = {}
        self._partial: List[hooks.Record] = []
        self._queued_task: Optional[int] = None
        self._warned: set = set()

    # -- block -------------------------------------------------------------------

    def __enter__(self) -> "extend":
        global _ACTIVE
        with _LOCK:
            if _ACTIVE is not None:
                raise RuntimeError(
                    "jacmem.extend blocks do not nest: one is active already. "
                    "Pass all extensions to one block: jacmem.extend(BatchGrad(), Variance())."
                )
            _ACTIVE = self
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
        self._staged.clear()
        self._partial.clear()
        self._names = weakref.WeakKeyDictionary()
        self._depth = 0
        self._queued_task = None
        with _LOCK:
            _ACTIVE = None

    def explain(self) -> str:
        """What each layer's quantities were computed with, and why."""
        return self.plan.explain()

    # -- forward -----------------------------------------------------------------

    def _enter_module(self, module, args):
        if self._depth == 0 and module not in self._names:
            for name, sub in module.named_modules():
                self._names.setdefault(sub, name or type(sub).__name__)
        self._depth += 1

    def _leave_module(self, module, args, output):
        self._depth = max(self._depth - 1, 0)

    def name(self, module: nn.Module) -> str:
        return self._names.get(module) or _tracked_name(module) or type(module).__name__

    def _on_forward(self, module, args, kwargs, output):
        if self._engine is not None:
            self._engine.on_forward(module, args, output)
        if _tracked_name(module) is not None or not self.extensions:
            return  # a tracked module, whose tracker records it; or nothing first-order to do
        hooks.record(module, args, kwargs, output, self.name(module), self._on_grad, self._tensor_handles)

    # -- backward ----------------------------------------------------------------

    def _on_grad(self, rec: hooks.Record) -> None:
        if self._engine is not None and rec.module not in self._engine.seen:
            raise RuntimeError(
                f"jacmem: second-order extensions need the forward pass inside the block, but module "
                f"{rec.name!r} ran it outside (with jacmem.track): run the forward inside jacmem.extend(...)"
            )
        task = torch._C._current_graph_task_id()
        if task != self._queued_task:
            self._queued_task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._commit)
        if rec.missing:
            self._partial.append(rec)
            return
        try:
            self._process(rec)
        finally:
            rec.reset()

    def _process(self, rec: hooks.Record) -> None:
        if rec.entry is None:
            return self._unsupported(rec, sorted(rec.params))
        missing = [p for p in rec.params if p not in rec.entry.params]
        if missing:
            self._unsupported(rec, missing)
        self.plan.check(rec.module, rec.name, rec.entry.names())  # a ValueError as it is, not wrapped below
        try:
            self._compute(rec)
        except Exception as err:
            raise RuntimeError(
                f"jacmem: computing {', '.join(map(repr, self.extensions))} for module {rec.name!r} "
                f"({type(rec.module).__name__}) failed: {err}"
            ) from err

    def _compute(self, rec: hooks.Record) -> None:
        entry, g, hp = rec.entry, rec.g, rec.hp
        n = batch_size(g)
        for pname, param in rec.params.items():
            if pname not in entry.params:
                continue
            staged = self._staged.get(id(param))
            summed = rec.shared(param) or (staged is not None and staged.summed)
            if staged is None:
                staged = self._staged[id(param)] = _Staged(param, n, summed)
            elif staged.batch_size != n:
                raise ValueError(
                    f"parameter {pname!r} is used with batch sizes {staged.batch_size} and {n} in one "
                    "backward pass; per-sample quantities need one batch size"
                )
            elif not staged.summed or not all(q in LINEAR_QUANTITIES for q in staged.quantities):
                raise RuntimeError(f"parameter {pname!r} received a second contribution after it was finalised")
            wanted = {"batch_grad"} if summed else self.quantities

            def choose(quantity, options, pname=pname):
                return self.plan.choose(
                    rec.module, rec.name, entry.names(), pname, quantity, options, param.element_size()
                )

            staged.add(compute(entry, hp, rec.x, g, pname, param, wanted, choose, self.chunk_bytes))

    def _commit(self) -> None:
        """End of the backward pass: finish the partial records and the summed
        parameters, then write every result."""
        partial, self._partial = self._partial, []
        for rec in dict.fromkeys(r for r in partial if any(g is not None for g in r.grads)):
            rec.complete()
            self._on_grad(rec)
        staged, self._staged = self._staged, {}
        for s in staged.values():
            q = s.quantities
            if s.summed:
                q = derive(q["batch_grad"], self.quantities)
            for ext in self.extensions:
                setattr(s.param, ext.savefield, ext.finalize(q, s.batch_size))

    def _unsupported(self, rec: hooks.Record, params: List[str]) -> None:
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
