"""``extend()``: the block. It owns the engines and their hooks, and removes them on exit.

Inside ``with jacmem.extend(*extensions):`` global forward hooks show every module call
of the block's thread to the engines (:class:`jacmem.passes.Engine`): the first-order
one (:mod:`jacmem.firstorder_engine`) and the second-order one
(:mod:`jacmem.extensions.secondorder.backprop`), each for the extensions of its kind.
What they compute in a backward pass is written when the pass ends
(:mod:`jacmem.passes`). Calls of models given to :func:`track` come from their
recorder (:mod:`jacmem.recorder`). On exit, however the block ends, every hook comes
off and everything kept is dropped.
"""

from __future__ import annotations

import sys
import threading
import warnings
import weakref
from typing import Any

from torch import Tensor, nn
from torch.nn.modules import module as module_hooks

from jacmem import distributed, hooks, recorder
from jacmem.clipping_engine import Clipping
from jacmem.extensions.clipping import ClipGrad
from jacmem.extensions.firstorder import FirstOrderExtension
from jacmem.extensions.secondorder import SecondOrderExtension
from jacmem.extensions.secondorder.backprop import Engine as SecondOrder
from jacmem.firstorder_engine import FirstOrder
from jacmem.notices import Notices
from jacmem.passes import Passes, Setup
from jacmem.recorder import track, untrack  # noqa: F401  (jacmem.context.track, as before)
from jacmem.strategies import AUTO, StrategyPlan, StrategySpec

_ACTIVE: extend | None = None
_LOCK = threading.Lock()

DEFAULT_CHUNK_BYTES = 64 * 2**20

#: each kind of extension, and the engine that runs it
ENGINES = ((FirstOrderExtension, FirstOrder), (SecondOrderExtension, SecondOrder), (ClipGrad, Clipping))


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
        autotune: choose each layer's strategies by timing them, once per call shape,
            on the real tensors, rather than by the cost model (see
            :mod:`jacmem.strategies`); ``explain()`` then says "timed".

    ``as ctx`` gives the block; ``ctx.explain()`` says what each layer chose, and why.

    Which parameters: those whose gradient the backward pass computes, in every call
    of their module that the pass goes through (``backward(inputs=[...])`` and
    ``torch.autograd.grad(loss, [...])`` get their ``inputs``' quantities only). Each
    backward pass writes its own results at its end, replacing the last ones (they do
    not accumulate as ``.grad`` does); a pass that fails writes nothing. The quantities
    are computed in float32 at least (float64 for float64 parameters), without a graph
    (``create_graph=True`` works; the quantities are constants), and returned in each
    parameter's dtype.

    Engines: the extensions of each kind run in their engine (first order:
    :mod:`jacmem.firstorder_engine`; second order:
    :mod:`jacmem.extensions.secondorder.backprop`), which all implement
    :class:`jacmem.passes.Engine`; the block only owns them.

    Threads: one block is active at a time, in the whole process. It extends the
    graphs built by the thread that entered it, inside the block or with
    :func:`track`; the forward passes of other threads are not recorded, and their
    backward passes get nothing.
    """

    def __init__(
        self,
        *extensions: FirstOrderExtension | SecondOrderExtension | ClipGrad,
        strategy: StrategySpec = AUTO,
        strict: bool = False,
        chunk_bytes: float = DEFAULT_CHUNK_BYTES,
        process_group: Any = None,
        autotune: bool = False,
    ):
        kinds = tuple(kind for kind, _ in ENGINES)
        for ext in extensions:
            if isinstance(ext, nn.Module):
                raise TypeError(
                    f"jacmem.extend takes extensions, not a model ({type(ext).__name__}): jacmem.extend is the "
                    "block (BackPACK's `with backpack(...)`), and BackPACK's extend(model) is jacmem.track(model), "
                    "needed only where the forward runs before the block. Write "
                    "`with jacmem.extend(jacmem.BatchGrad()): loss = lossfunc(model(X), y); loss.backward()`."
                )
            if not isinstance(ext, kinds):
                raise TypeError(f"not a jacmem extension: {ext!r}; e.g. jacmem.BatchGrad()")
        extensions = tuple(dict.fromkeys(extensions))
        #: the extensions of each engine, in :data:`ENGINES` order (those it has)
        self._kinds = [(cls, [e for e in extensions if isinstance(e, kind)]) for kind, cls in ENGINES]
        self._kinds = [(cls, exts) for cls, exts in self._kinds if exts]
        alone = [exts for cls, exts in self._kinds if getattr(cls, "exclusive", False)]
        if alone and len(self._kinds) > 1:
            raise ValueError(
                f"jacmem: {', '.join(map(repr, alone[0]))} takes over the parameters' .grad and runs alone in its "
                "block; put the other extensions in a block of their own."
            )
        self.extensions = [e for e in extensions if isinstance(e, FirstOrderExtension)]
        self.second_order = [e for e in extensions if isinstance(e, SecondOrderExtension)]
        self.plan = StrategyPlan(strategy, autotune=autotune)
        self.strict = strict
        self.chunk_bytes = chunk_bytes
        self.process_group = process_group
        self._engines: list = []
        self._module_handles: list = []
        self._names: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
        self._depth = 0
        #: the models called at depth 0 in the block, as weak references, in order
        self._roots: list[weakref.ref] = []
        self._owner: int | None = None
        self._notices = Notices(strict)
        self._passes = Passes(self._notices.flush)
        self._watch = recorder.UntrackedWatch(self._passes)
        self._late = hooks.LateBackward()

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
        self._late = hooks.LateBackward()
        try:
            setup = Setup(
                self.plan, self.chunk_bytes, self._passes, self._notices, self.name, self._groups, self._owner
            )
            self._engines = [cls(exts, setup) for cls, exts in self._kinds]
            self._module_handles = [
                module_hooks.register_module_forward_pre_hook(self._enter_module),
                module_hooks.register_module_forward_hook(self._leave_module, always_call=True),
                module_hooks.register_module_forward_hook(self._on_forward, with_kwargs=True),
            ]
            once = any(getattr(getattr(e, "recorder", None), "once", False) for e in self._engines)
            recorder.sink(self._on_record, once)
            self._watch.on_backward = self._on_backward
            self._watch.open(self._owner)
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    def __exit__(self, *exc) -> None:
        global _ACTIVE
        try:
            hooks.remove(self._module_handles)
            recorder.sink(None)
            self._watch.close()
            for engine in self._engines:
                engine.close()
            self._passes.close()
        finally:
            self._late.close()
            self._engines = []
            self._roots = []
            self._names = weakref.WeakKeyDictionary()
            self._depth = 0
            self._owner = None
            with _LOCK:
                _ACTIVE = None
        self._notices.flush()

    @property
    def _tensor_handles(self) -> list:
        """The hooks the engines hold on tensors and autograd nodes now."""
        return [h for engine in self._engines for h in engine.handles]

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
        for engine in self._engines:
            engine.on_enter(module)

    def _leave_module(self, module, args, output):
        if threading.get_ident() != self._owner:
            return
        self._depth = max(self._depth - 1, 0)
        for engine in self._engines:
            engine.on_leave(module, self._depth == 0)
        err = sys.exc_info()[1]
        if output is None and err is not None:  # the forward raised: say why, where we can
            self._explain_dtype(module, args, err)
        if self._depth == 0 and self._notices.pending:
            self._notices.flush()  # the forward's warnings, one per kind

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
        return self._names.get(module) or recorder.tracked_name(module) or type(module).__name__

    def _on_forward(self, module, args, kwargs, output):
        """Each engine sees the call, in order; one may replace the output (ComputeOnce),
        and the engines after it see the replacement."""
        if threading.get_ident() != self._owner:
            return None  # another thread's forward
        replaced = None
        for engine in self._engines:
            new = engine.on_forward(module, args, kwargs, output if replaced is None else replaced)
            if new is not None:
                replaced = new
        if self._depth == 0:
            self._late.watch(output if replaced is None else replaced)
        return replaced

    def _on_backward(self, tensors, grad_tensors) -> None:
        """A backward of the block's thread is about to begin: to every engine."""
        for engine in self._engines:
            engine.on_backward(tensors, grad_tensors, len(self._engines) == 1)

    def _on_record(self, rec: hooks.Record) -> dict[str, Tensor] | None:
        """A tracked call's output gradients arrived: to every engine. Returns the summed
        gradients where an engine computed them."""
        if rec.thread != self._owner:
            return None  # a graph another thread built: not this block's
        grads = None
        for engine in self._engines:
            out = engine.on_record(rec)
            if out is not None:
                grads = out
        return grads

    def _groups(self) -> list[tuple[Any, list[nn.Parameter]]]:
        """(process group, its parameters in model order) for the models called in the
        block and the tracked ones: the ``process_group`` argument, or that of a
        ``DistributedDataParallel`` model."""
        models = [m for m in (ref() for ref in self._roots) if m is not None] + recorder.tracked_models()
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
