"""The recorder of forward calls, inside a block and for :func:`track`.

A :class:`Recorder` turns each forward call of a module with trainable parameters into
a :class:`jacmem.hooks.Record` whose output hooks call ``on_grad(record)`` in backward,
and keeps the hooks' handles so that :meth:`Recorder.close` takes them all off. The
first-order engine owns one for the calls inside its block; :func:`track` gives a
model one (a :class:`Tracker`) for forwards run before a block, whose records go to
whichever block is active when their gradients arrive.
"""

from __future__ import annotations

import functools
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from jacmem import compat, hooks


class Recorder:
    """Records forward calls; ``close()`` removes every hook it set and frees the records.

    ``once``: let a layer run through :class:`jacmem.hooks.ComputeOnce` where the layer
    allows it (``on_grad`` then returns its parameters' summed gradients)."""

    def __init__(self, on_grad: hooks.OnGrad, once: bool = False):
        self.on_grad = on_grad
        self.once = once
        self.tensor_handles = hooks.Handles()
        self.records: weakref.WeakSet[hooks.Record] = weakref.WeakSet()

    def record(self, module: nn.Module, args: tuple, kwargs: dict, output, name: str) -> Any:
        """Record one call; returns the output to use (new where it runs through
        ComputeOnce), or None to keep it."""
        rec, new = hooks.record(module, args, kwargs, output, name, self.on_grad, self.tensor_handles, self.once)
        if rec is None:
            return None
        self.records.add(rec)
        return None if new is output else new

    def close(self) -> None:
        hooks.remove(self.tensor_handles)
        for rec in list(self.records):
            rec.release()  # a traceback may still hold it; its hooks are off
            rec.x = None  # a ComputeOnce call left in a graph then backpropagates as autograd would
        self.records = weakref.WeakSet()


class Tracker(Recorder):
    """Forward hooks on one model's modules, for forwards that run outside a block."""

    def __init__(self, model: nn.Module, on_grad: hooks.OnGrad):
        super().__init__(on_grad)
        self.names: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
        self.model = weakref.ref(model)
        self.module_handles: list = []
        for name, module in model.named_modules():
            if next(module.parameters(recurse=False), None) is None:
                continue
            self.names[module] = name or type(module).__name__
            self.module_handles.append(module.register_forward_hook(self._on_forward, with_kwargs=True))

    def _on_forward(self, module, args, kwargs, output):
        self.record(module, args, kwargs, output, self.names[module])

    def close(self) -> None:
        hooks.remove(self.module_handles)
        super().close()


#: models registered with track(): model -> Tracker
_TRACKED: weakref.WeakKeyDictionary[nn.Module, Tracker] = weakref.WeakKeyDictionary()
#: where tracked calls' gradients go: set by the active block (None outside blocks)
_sink: list[Callable[[hooks.Record], dict | None] | None] = [None]


def sink(on_record: Callable[[hooks.Record], dict | None] | None) -> None:
    """Where tracked calls' gradients go from now on: the active block's ``on_record``
    (None: nowhere)."""
    _sink[0] = on_record


def _dispatch(rec: hooks.Record) -> dict | None:
    """A tracked call's gradient arrived: to the active block, if there is one."""
    sink = _sink[0]
    return None if sink is None else sink(rec)


def tracked_name(module: nn.Module) -> str | None:
    """The name of ``module`` in a tracked model, or None where it is tracked nowhere."""
    if not _TRACKED:
        return None
    for tracker in _TRACKED.values():
        if module in tracker.names:
            return tracker.names[module]
    return None


def tracked_models() -> list[nn.Module]:
    return list(_TRACKED.keys())


def track(model: nn.Module) -> nn.Module:
    """Keep, from now on, what the extensions need from ``model``'s forward passes,
    so that a backward inside :func:`jacmem.extend` can use a forward run before it
    (BackPACK's ``extend(model)``). Returns the model. Undo with :func:`untrack`."""
    if model not in _TRACKED:
        _TRACKED[model] = Tracker(model, _dispatch)
    return model


def untrack(model: nn.Module) -> nn.Module:
    """Remove the hooks of :func:`track`, and everything they kept."""
    tracker = _TRACKED.pop(model, None)
    if tracker is not None:
        tracker.close()
    return model


class UntrackedWatch:
    """BackPACK's habit: the forward ran before the block on a model nobody tracked,
    then ``loss.backward()`` inside it. No hook of the block runs in that backward, and
    the parameters silently get nothing.

    While the block is open, ``torch.autograd.backward`` and ``torch.autograd.grad``
    (which ``Tensor.backward`` calls) are wrapped: after a backward of the block's
    thread that began outside any other backward and in which no pass of the block
    began, the graph is searched (at most :data:`_SEARCH_NODES` nodes) for a parameter's
    AccumulateGrad; if one is there, the block warns, once, naming ``jacmem.track``. A
    backward the block took part in costs one comparison; the wrappers go at exit."""

    _SEARCH_NODES = 10_000

    def __init__(self, passes):
        self.passes = passes
        self.owner: int | None = None
        self.warned = False
        self.originals: tuple | None = None

    def open(self, owner: int) -> None:
        self.owner = owner
        self.originals = (torch.autograd.backward, torch.autograd.grad)
        torch.autograd.backward = self._wrap(self.originals[0])
        torch.autograd.grad = self._wrap(self.originals[1])

    def close(self) -> None:
        if self.originals is None:
            return
        for attr, original in zip(("backward", "grad"), self.originals):
            if getattr(getattr(torch.autograd, attr), "__wrapped__", None) is original:
                setattr(torch.autograd, attr, original)
        self.originals, self.owner = None, None

    def _wrap(self, original):
        @functools.wraps(original)
        def watched(tensors, *args, **kwargs):
            if self.warned or threading.get_ident() != self.owner or compat.current_graph_task_id() != -1:
                return original(tensors, *args, **kwargs)
            started = self.passes.started
            out = original(tensors, *args, **kwargs)
            if self.passes.started == started and _reaches_parameter(tensors, self._SEARCH_NODES):
                self.warned = True
                warnings.warn(
                    "jacmem: a backward pass inside jacmem.extend(...) computed parameter gradients, but none of "
                    "the module calls it went through was recorded: their forward ran before the block, on a "
                    "model jacmem does not track, so no extension gets anything. Call jacmem.track(model) before "
                    "that forward (BackPACK's extend(model)), or run the forward inside the block.",
                    UserWarning,
                    stacklevel=3,
                )
            return out

        return watched


def _reaches_parameter(tensors, limit: int) -> bool:
    """Whether the graph of ``tensors`` (a tensor or a sequence of them) reaches the
    AccumulateGrad node of an ``nn.Parameter``, within ``limit`` nodes."""
    roots = (
        [tensors] if isinstance(tensors, torch.Tensor) else list(tensors) if isinstance(tensors, (tuple, list)) else []
    )
    todo = [t.grad_fn for t in roots if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen: set = set()
    while todo and len(seen) < limit:
        fn = todo.pop()
        if fn in seen:
            continue
        seen.add(fn)
        if isinstance(getattr(fn, "variable", None), nn.Parameter):
            return True
        todo.extend(f for f, _ in fn.next_functions if f is not None)
    return False
