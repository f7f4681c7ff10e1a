"""The parts of a block that :func:`jacmem.extend` and :mod:`jacmem.privacy` share.

A :class:`Block` owns the engines of one set of extensions (:class:`jacmem.engine.base.Engine`:
first order, second order, clipping), their backward passes and their warnings, from
:meth:`Block.open` to :meth:`Block.close`. It sets no hook itself; what shows it the
forward calls is its user's choice:

- ``with jacmem.extend(...)`` calls :meth:`Block.enter`, :meth:`Block.leave` and
  :meth:`Block.forward` from global module hooks, so that every module called inside
  the block is recorded, and takes the calls of models given to :func:`jacmem.track`;
- a private model (:mod:`jacmem.privacy`) has no global hook: its block
  :meth:`Block.track`\\ s the model, whose calls then reach this block, and this block
  only, wherever they run.

Several blocks may be open at once, one per private model and one ``jacmem.extend``;
each sees only the calls routed to it (:mod:`jacmem.engine.recorder`).
"""

from __future__ import annotations

import sys
import threading
import warnings
import weakref
from typing import Any

from torch import Tensor, nn

from jacmem import compat
from jacmem.engine import fsdp, hooks, recorder
from jacmem.engine.base import Context, Engine, Passes
from jacmem.engine.clipping import ClippingEngine
from jacmem.engine.firstorder import FirstOrderEngine
from jacmem.engine.notices import Notices, StrictNotices
from jacmem.engine.secondorder.engine import SecondOrderEngine
from jacmem.engine.strategies import AUTO, StrategyChoices, StrategySpec
from jacmem.extensions.clipping import ClipGrad
from jacmem.extensions.firstorder import FirstOrderExtension
from jacmem.extensions.secondorder import SecondOrderExtension

DEFAULT_CHUNK_BYTES = 64 * 2**20

#: each kind of extension, and the engine that runs it
ENGINES = (
    (FirstOrderExtension, FirstOrderEngine),
    (SecondOrderExtension, SecondOrderEngine),
    (ClipGrad, ClippingEngine),
)

Extension = FirstOrderExtension | SecondOrderExtension | ClipGrad
#: the kinds of extension
_KINDS = tuple(kind for kind, _ in ENGINES)


class Block:
    """The engines of ``extensions``, open in one thread from :meth:`open` to :meth:`close`.

    Args: those of :class:`jacmem.extend` (which documents them).
    """

    def __init__(
        self,
        *extensions: Extension,
        strategy: StrategySpec = AUTO,
        strict: bool = False,
        chunk_bytes: float = DEFAULT_CHUNK_BYTES,
        process_group: Any = None,
        autotune: bool = False,
        batch_first: bool = True,
    ):
        for ext in extensions:  # (checked here, the error's words apart: a block is made at every step)
            if not isinstance(ext, _KINDS):
                raise _not_an_extension(ext)
        extensions = tuple(dict.fromkeys(extensions))  # without repeats
        #: the extensions of each engine, in :data:`ENGINES` order (those it has)
        self.kinds = []
        for kind, cls in ENGINES:  # (loops, not comprehensions: a block is made at every step)
            exts = []
            for e in extensions:
                if isinstance(e, kind):
                    exts.append(e)
            if exts:
                self.kinds.append((cls, exts))
        alone, self._second_order = [], False
        #: whether every engine lets the calls of a module with no parameter and no
        #: submodule pass inside a forward (:attr:`jacmem.engine.base.Engine.skips_leaves`)
        self._leaves_pass = bool(self.kinds)
        for cls, exts in self.kinds:
            self._leaves_pass = self._leaves_pass and cls.skips_leaves
            if getattr(cls, "exclusive", False):
                alone.append(exts)
            self._second_order = self._second_order or issubclass(cls, SecondOrderEngine)
        if alone and len(self.kinds) > 1:
            raise ValueError(
                f"jacmem: {', '.join(map(repr, alone[0]))} takes over the parameters' .grad and runs alone in its "
                "block; put the other extensions in a block of their own."
            )
        second_order = [e for e in extensions if isinstance(e, SecondOrderExtension)] if not batch_first else None
        if second_order:
            raise ValueError(
                f"jacmem: batch_first=False applies to first-order extensions and ClipGrad, not to "
                f"{', '.join(map(repr, second_order))}: second-order extensions need the batch on axis 0. "
                "Feed the model [N, T, ...] (e.g. nn.LSTM(..., batch_first=True)) and leave batch_first=True."
            )
        self.plan = StrategyChoices(strategy, autotune=autotune)
        self.engines: list[Engine] = []
        #: name -> type of the modules of a compiled model that ran eagerly, from the
        #: engines' recorders (:mod:`jacmem.engine.recorder`), kept past close for explain()
        self.eager: dict[str, str] = {}
        #: the engines' notes (:attr:`jacmem.engine.base.Engine.notes`), kept past close for explain()
        self.notes: list[str] = []
        self.notices = (StrictNotices if strict else Notices)()
        self.passes = Passes(self._ended)
        #: what the engines know of the block, handed down to them
        self.context = Context(self.plan, chunk_bytes, self.passes, self.notices, batch_first, process_group, self)
        self._depth = 0
        #: True while the block's outermost forward runs, where leaves pass
        #: (:attr:`_leaves_pass`): the global hooks then let their calls go at once
        #: (:func:`jacmem.engine.hooks.eager`); the user of the block gives the list
        self.inside: list = [False, None]
        #: warns of a backward through the block's forward after it closed (made in :meth:`open`)
        self._late: hooks.LateBackward | None = None
        #: whether the outermost module whose forward runs is a leaf the engines have not heard of (:meth:`enter`)
        self._lone = False
        #: the outermost module whose forward runs, and the model under torch.compile's wrappers
        #: (:meth:`enter` to :meth:`forward`)
        self._root: tuple[nn.Module, nn.Module] | None = None
        #: the models :meth:`_check_fsdp` passed
        self._fsdp_checked: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        #: the parameter attributes the extensions write (not ClipGrad's: ``.grad`` is autograd's)
        self.savefields = set()
        for e in extensions:
            if not isinstance(e, ClipGrad) and e.savefield:
                self.savefields.add(e.savefield)
        #: the models whose forward ran since the last pass ended (:meth:`_ended`)
        self._ran: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        #: the tracked models whose forward may have run before the block, once each
        self._tracked: weakref.WeakSet[nn.Module] = weakref.WeakSet()

    # -- lifetime ------------------------------------------------------------------

    def open(self) -> Block:
        """Start the engines, in the calling thread."""
        self.context.owner = threading.get_ident()
        self._late = hooks.LateBackward()
        self.eager, self.notes = {}, []
        try:
            self.engines = []
            for cls, exts in self.kinds:  # (a loop, not a comprehension: a block opens at every step)
                self.engines.append(cls(exts, self.context))
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Untrack the models this block tracked, drop every engine's hooks and
        everything kept; a pass still running writes nothing. Then the pending warnings."""
        try:
            for model in recorder.tracked_models() if recorder.TRACKED else ():  # (none tracked: no call)
                if recorder.owner(model) is self:
                    recorder.untrack(model, owner=self)
            notes = []  # (what explain() keeps past close, in the engines' loop: _eager and _notes, no call)
            for engine in self.engines:
                self.eager.update(getattr(getattr(engine, "recorder", None), "eager", {}))
                notes.extend(engine.notes)
            self.notes = notes if self.engines else self.notes
            for engine in self.engines:
                engine.close()
        finally:
            if self._late is not None:
                self._late.open = False  # (its backward hooks warn from now on)
            self.engines = []
            self._fsdp_checked = weakref.WeakSet()
            self._ran, self._tracked = weakref.WeakSet(), weakref.WeakSet()
            self._depth = 0
            self.inside[0] = False
            self.context.clear()
        if self.notices.pending:
            self.notices.flush()

    def _ended(self, written: set[int]) -> None:
        """A pass ended, having written results to the objects ``written`` (ids): the
        models whose forward ran since the last pass lose the results left on their
        trainable parameters that it did not write (a branch this batch skipped, say): an
        earlier batch's, which would read as this one's."""
        ran, self._ran = list(self._ran), weakref.WeakSet()
        for model in ran if self.savefields else ():
            for module in model.modules():  # (each module's own slots: no walk of parameters, no tensor hashed)
                for p in compat.own_slots(module)[0].values():
                    if p is not None and p.requires_grad and id(p) not in written:
                        for field in self.savefields.intersection(vars(p)):
                            delattr(p, field)
        if self.notices.pending:
            self.notices.flush()

    @property
    def owner(self) -> int | None:
        """The thread that opened the block (None while it is closed)."""
        return self.context.owner

    @property
    def once(self) -> bool:
        """Whether a recorded layer may run through :class:`jacmem.engine.hooks.ComputeOnce`."""
        return any(getattr(getattr(e, "recorder", None), "once", False) for e in self.engines)

    @property
    def handles(self) -> list:
        """The hooks the engines hold on tensors and autograd nodes now."""
        return [h for engine in self.engines for h in engine.handles]

    def explain(self) -> str:
        """What each layer's quantities were computed with, and why; first, the modules of a
        compiled model that ran eagerly (:mod:`jacmem.engine.recorder`), then the engines'
        notes (where the autograd path splits the GGN)."""
        eager = self._eager().items()
        lines = [f"{n} ({t}) ran eagerly in a compiled forward: torch.compile traced no call of it" for n, t in eager]
        return "\n".join([*lines, *self._notes(), self.plan.explain()])

    def _notes(self) -> list[str]:
        """:attr:`notes`, from the engines while the block is open."""
        if not self.engines:
            return self.notes
        lines = []
        for engine in self.engines:  # (a loop, not a comprehension: a block closes at every step)
            lines.extend(engine.notes)
        return lines

    def _eager(self) -> dict[str, str]:
        """:attr:`eager`, with what the engines' recorders saw so far."""
        for engine in self.engines:
            self.eager.update(getattr(getattr(engine, "recorder", None), "eager", {}))
        return self.eager

    # -- models ----------------------------------------------------------------------

    def track(self, model: nn.Module) -> None:
        """Record ``model``'s calls for this block alone, wherever they run, until
        :meth:`untrack` or :meth:`close`; the engines see the model at once."""
        self._check_fsdp(model)
        recorder.track(model, self.context.batch_first, owner=self)
        for engine in self.engines:
            engine.on_track(model)

    def untrack(self, model: nn.Module) -> None:
        recorder.untrack(model, owner=self)

    @staticmethod
    def unwrapped(module: nn.Module) -> nn.Module:
        """The model under the wrappers ``torch.compile`` put around ``module`` (itself
        where there are none): what a user of the block (privacy) asks of a model's type."""
        return compat.uncompiled(module)

    @staticmethod
    def tracked() -> list[tuple[nn.Module, bool]]:
        """Every tracked model, whichever block takes its calls, and whether a block owns
        its tracking (a private model's) rather than :func:`jacmem.track`."""
        return [(model, recorder.owner(model) is not None) for model in recorder.tracked_models()]

    def parameter_name(self, param: nn.Parameter) -> str:
        """``param``'s qualified name in a model called in the block or tracked, or its shape."""
        for model in self.context.roots_and_models():
            for n, p in model.named_parameters():
                if p is param:
                    return repr(f"{self.context.name(model)}.{n}")
        return f"a parameter of shape {list(param.shape)}"

    def shards(self) -> dict[int, nn.Parameter]:
        """``id(unsharded) -> sharded`` for the FSDP2 parameters of the context's shardings."""
        if not self.context.sharded:  # (no FSDP2 model called: none, asked without a call)
            return {}
        return {key: p for sharding in self.context.shardings() for key, p in sharding.sharded.items()}

    def _check_fsdp(self, model: nn.Module) -> None:
        """Raise where ``model`` is sharded by FSDP in a way the block cannot follow; once
        per model and block."""
        if model not in self._fsdp_checked:
            self.context.sharded = fsdp.check(model, self.context.name, self._second_order) or self.context.sharded
            self._fsdp_checked.add(model)

    # -- forward (from module hooks) ------------------------------------------------

    def enter(self, module: nn.Module, args: tuple) -> None:
        """A module's forward is about to run."""
        if threading.get_ident() != self.context.owner:
            return
        if self._depth == 0:
            own, children = compat.own_slots(module)
            # A leaf called alone (a loss) is an outermost call, whose enter and leave mean
            # nothing to engines that let leaves pass, unless its forward calls a module (then
            # they hear of its enter first, below). (Not in a compiled forward: the recorder
            # learns there that it is one.)
            self._lone = self._leaves_pass and not own and not children and not (hooks.COMPILED and hooks.COMPILED[-1])
            # (the model under torch.compile's wrapper, which may be gone by the backward:
            # ``torch.compile(ddp)(x)``, and with it the DDP group the backward sums over; a leaf
            # is no wrapper)
            wrapped = not self._lone and hooks.WRAPPERS.get(type(module)) is not False  # (known per type: no call)
            self._root = (module, compat.uncompiled(module) if wrapped else module)
            if module not in self.context.names:
                sharded = False
                for name, sub in module.named_modules():
                    self.context.names.setdefault(sub, name or type(sub).__name__)
                    sharded = sharded or isinstance(sub, fsdp.KINDS)
                if sharded:  # (no FSDP module: nothing to check, asked without a call)
                    self._check_fsdp(module)
                self.context.roots.append(weakref.ref(self._root[1]))
            if self._leaves_pass:  # (a leaf called alone is the outermost call: not passed)
                # (an FSDP2 layer's enter unshards its parameters: none passes; a module with no
                # submodule, a layer called alone, is the outermost call whose hooks must not pass)
                self.inside[0] = bool(children) and not self.context.sharded
                # the calls inside go straight to a lone engine (a stager's on_forward checks the thread itself)
                self.inside[1] = self.engines[0].on_forward if len(self.engines) == 1 else None
        elif self._lone:  # a lone leaf's forward calls a module: the engines hear of the leaf's enter now
            self._lone = False
            for engine in self.engines:
                engine.on_enter(self._root[0])
        self._depth += 1
        if self.context.sharded:  # (no FSDP2 model called: nothing to unshard, and nothing to ask per call)
            fsdp.unshard_own(module)
        if self._lone:
            return
        for engine in self.engines:
            engine.on_enter(module)

    def leave(self, module: nn.Module, args: tuple, output) -> None:
        """A module's forward ended, returning or raising."""
        if threading.get_ident() != self.context.owner:
            return
        err = sys.exc_info()[1]
        if output is None and err is not None:  # the forward raised: say why, where we can
            _explain_dtype(self.context.name(module), module, args, err)
            if self.inside[0] and hooks.passes_inside(module):
                return  # its enter passed (:func:`jacmem.engine.hooks.eager`): nothing to undo
        self._depth = max(self._depth - 1, 0)
        if self._depth == 0:
            self.inside[0], self.inside[1] = False, None
        # (a lone leaf whose forward called no module: unheard of; its forward ends that, :meth:`forward`)
        for engine in () if self._lone else self.engines:
            engine.on_leave(module, self._depth == 0)
        if self._depth == 0 and self.notices.pending:
            self.notices.flush()  # the forward's warnings, one per kind

    def forward(self, module: nn.Module, args: tuple, kwargs: dict, output) -> Any:
        """A module's forward returned: each engine sees the call, in order; one may
        replace the output (ComputeOnce), and the engines after it see the replacement."""
        if threading.get_ident() != self.context.owner:
            return None  # another thread's forward
        if compat.current_graph_task_id() != -1:  # (:meth:`recomputing`, without the call)
            self.passes.current()
        replaced = None
        lone, self._lone = self._lone and self._depth == 0, False
        for engine in () if lone else self.engines:  # (a lone leaf: unheard of, and it records nothing)
            new = engine.on_forward(module, args, kwargs, output if replaced is None else replaced)
            if new is not None:
                replaced = new
        if self._depth == 0:
            output = output if replaced is None else replaced
            self._late.watch(output)
            root, self._root = self._root, None
            # (called(), inline: at every outermost call)
            self._ran.add(root[1] if root is not None and root[0] is module else compat.uncompiled(module))
            for engine in self.engines:
                engine.on_call(module, args, kwargs, output)
        return replaced

    def called(self, model: nn.Module, args: tuple, kwargs: dict, output) -> None:
        """A model's outermost forward returned (called in the block, or tracked): its
        inputs and output, to every engine; the next pass's end drops its stale results
        (:meth:`_ended`)."""
        if threading.get_ident() != self.context.owner:
            return
        self._ran.add(compat.uncompiled(model))
        for engine in self.engines:
            engine.on_call(model, args, kwargs, output)

    def recomputing(self) -> None:
        """Where a module's forward runs inside a backward (a reentrant checkpoint
        recomputes its segment in the outer backward, then backpropagates through it with
        a backward of its own): the outer backward's pass begins now, so that the nested
        backward's calls join it (:meth:`Passes.current`) rather than begin a pass that
        commits at the nested backward's end, before the outer one's calls are in."""
        if compat.current_graph_task_id() != -1:
            self.passes.current()

    # -- backward --------------------------------------------------------------------

    def backward(self, tensors, grad_tensors, reached: list[nn.Parameter]) -> None:
        """A backward of the block's thread is about to begin, reaching the trainable
        parameters ``reached``: to every engine."""
        for model in self.context.models() if recorder.TRACKED else ():  # tracked: their forwards may have run before
            self._check_fsdp(model)
            if model not in self._tracked:
                self._tracked.add(model)
                self._ran.add(model)
        for engine in self.engines:
            engine.on_backward(tensors, grad_tensors, len(self.engines) == 1, reached)

    def record(self, rec: hooks.Record) -> dict[str, Tensor] | None:
        """A tracked call's output gradients arrived: to every engine. Returns the summed
        gradients where an engine computed them."""
        if rec.thread != self.context.owner:
            return None  # a graph another thread built: not this block's
        if rec.batch_first != self.context.batch_first:
            raise ValueError(
                f"jacmem: module {rec.name!r} ({type(rec.module).__name__}) was recorded by jacmem.track with "
                f"batch_first={rec.batch_first}, but the block has batch_first={self.context.batch_first}: one of them "
                f"misreads the batch axis. Pass the same value to both: jacmem.track(model, batch_first=...) and "
                "jacmem.extend(..., batch_first=...)."
            )
        grads = None
        for engine in self.engines:
            out = engine.on_record(rec)
            if out is not None:
                grads = out
        return grads


def _not_an_extension(ext: Any) -> TypeError:
    """The error for ``ext``, given to a block as an extension: a model names the fix."""
    if isinstance(ext, nn.Module):
        return TypeError(
            f"jacmem.extend takes extensions, not a model ({type(ext).__name__}): jacmem.extend is the "
            "block (BackPACK's `with backpack(...)`), and BackPACK's extend(model) is jacmem.track(model), "
            "needed only where the forward runs before the block. Write "
            "`with jacmem.extend(jacmem.BatchGrad()): loss = lossfunc(model(X), y); loss.backward()`."
        )
    return TypeError(f"not a jacmem extension: {ext!r}; e.g. jacmem.BatchGrad()")


def _explain_dtype(name: str, module: nn.Module, args: tuple, err: BaseException) -> None:
    """An integer or bool input where the module needs floats: name the module and the
    fix, in a note on the forward's exception (a warning before Python 3.11)."""
    floating = [p for p in hooks.trainable(module).values() if p.is_floating_point()]
    wrong = [t for t in args if isinstance(t, Tensor) and not (t.is_floating_point() or t.is_complex())]
    if not floating or not wrong or getattr(err, "_jacmem_explained", False):
        return
    msg = (
        f"jacmem: module {name!r} ({type(module).__name__}) got an input of dtype "
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
