"""``extend()``: the block. It owns the engines and their hooks, and removes them on exit.

Inside ``with jacmem.extend(*extensions):`` global forward hooks show every module call
of the block's thread to its :class:`jacmem.engine.block.Block`, whose engines
(:class:`jacmem.engine.base.Engine`) are the first-order one (:mod:`jacmem.engine.firstorder`),
the second-order one (:mod:`jacmem.engine.secondorder.engine`) and the clipping
one, each for the extensions of its kind. What they compute in a backward pass is
written when the pass ends (:mod:`jacmem.engine.base`). Calls of models given to
:func:`track` come from their recorder (:mod:`jacmem.engine.recorder`). On exit, however the
block ends, every hook comes off and everything kept is dropped.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

from jacmem import compat
from jacmem.engine import hooks, recorder
from jacmem.engine.block import DEFAULT_CHUNK_BYTES, Block, Extension
from jacmem.engine.recorder import track, untrack  # noqa: F401  (jacmem.context.track, as before)
from jacmem.engine.strategies import AUTO, StrategySpec

_ACTIVE: extend | None = None
_LOCK = threading.Lock()


class extend:
    """Switch extensions on for the backward passes inside the block.

    Args:
        *extensions: e.g. ``BatchGrad(), Variance()``.
        strategy: one strategy name for every layer (``"auto"``, ``"unfold"``,
            ``"save_memory"``, ...), or a dict from module type or qualified module name
            to a name; see :mod:`jacmem.engine.strategies`.
        strict: raise, rather than warn, on a trainable module no extension can handle, and on one
            that the generic fallback recomputes one sample at a time (exact, but slow).
        chunk_bytes: temporary memory a strategy may use at once; larger batches are
            processed in chunks.
        process_group: a ``torch.distributed`` process group over which to sum
            ``sum_grad_squared`` and the gradient of ``variance``, for every model
            called in the block; by default, that of a ``DistributedDataParallel``
            model, none for any other (see :mod:`jacmem.engine.distributed`).
        autotune: choose each layer's strategies by timing them, once per call shape,
            on the real tensors, rather than by the cost model (see
            :mod:`jacmem.engine.strategies`); ``explain()`` then says "timed".
        batch_first: ``False`` for a model fed ``[T, N, ...]`` (nn.LSTM's default layout):
            each module call takes its batch on axis 1 of its inputs and outputs, as
            Opacus's ``GradSampleModule(batch_first=False)``, except where the module
            places it itself: RNNs and ``nn.MultiheadAttention`` by their own
            ``batch_first``, convolutions, GroupNorm, InstanceNorm and EmbeddingBag on
            axis 0 (their layout, ``[N, C, *]``). A call whose batch axis cannot be
            told apart raises (see :mod:`jacmem.engine.layout`). A model given to
            :func:`track` must be tracked with the same value. First-order extensions
            and ``ClipGrad`` only.

    ``as ctx`` gives the block; ``ctx.explain()`` says what each layer chose, and why.

    Which parameters: those whose gradient the backward pass computes, in every call
    of their module that the pass goes through (``backward(inputs=[...])`` and
    ``torch.autograd.grad(loss, [...])`` get their ``inputs``' quantities only). Each
    backward pass writes its own results at its end, replacing the last ones (they do
    not accumulate as ``.grad`` does); a pass that fails writes nothing. The quantities
    are computed in float32 at least (float64 for float64 parameters), without a graph
    (``create_graph=True`` works; the quantities are constants, and differentiating one
    raises, naming jacmem), and returned in each parameter's dtype. A second backward in
    the block through a ``create_graph=True`` backward's gradients (a gradient penalty)
    raises: its per-sample quantities are not defined; run it after the block.

    Engines: the extensions of each kind run in their engine (first order:
    :mod:`jacmem.engine.firstorder`; second order:
    :mod:`jacmem.engine.secondorder.engine`), which all implement
    :class:`jacmem.engine.base.Engine`; its :class:`jacmem.engine.block.Block` (``ctx.block``)
    owns them.

    Threads: one ``jacmem.extend`` block is active at a time, in the whole process;
    private models (:mod:`jacmem.privacy`) have blocks of their own beside it, and
    their calls go to those, not to this one. It extends the graphs built by the
    thread that entered it, inside the block or with :func:`track`; the forward passes
    of other threads are not recorded, and their backward passes get nothing.
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
        self.block = Block(
            *extensions,
            strategy=strategy,
            strict=strict,
            chunk_bytes=chunk_bytes,
            process_group=process_group,
            autotune=autotune,
            batch_first=batch_first,
        )
        self.plan = self.block.plan
        self._module_handles: list = []
        #: made, watching, on the first entry (:meth:`__enter__`)
        self._watch: recorder.BackwardWatch | None = None

    # -- block -------------------------------------------------------------------

    def __enter__(self) -> extend:
        global _ACTIVE
        with _LOCK:
            if _ACTIVE is not None:
                elsewhere = _ACTIVE.block.owner != threading.get_ident()
                raise RuntimeError(
                    "jacmem.extend blocks do not nest: one is active already"
                    + (" in another thread (one block at a time per process)" if elsewhere else "")
                    + ". Pass all extensions to one block: jacmem.extend(BatchGrad(), Variance())."
                )
            _ACTIVE = self
        try:
            block = self.block.open()
            self._module_handles = compat.global_module_hooks(_enter, _leave, _forward)
            for slot, method in zip(_DIRECT, (block.enter, block.leave, block.forward)):
                slot[0] = method
            block.inside = _INSIDE  # (the block sets it while its outermost forward runs)
            recorder.SINK[0] = block
            if self._watch is None:  # (the first entry, most blocks' only one: made watching, no call more)
                self._watch = recorder.BackwardWatch(
                    block.passes, block.parameter_name, block.shards, block.backward, block.context.owner
                )
            else:
                self._watch.open(block.context.owner)
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    def __exit__(self, *exc) -> None:
        global _ACTIVE
        try:
            for slot in _DIRECT:
                slot[0] = None
            _INSIDE[0] = False
            for handle in self._module_handles:  # (hooks.remove, without the call: a block closes at every step)
                handle.remove()
            self._module_handles = []
            recorder.SINK[0] = None
            if self._watch is not None:
                self._watch.close()
        finally:
            try:
                self.block.close()
            finally:
                with _LOCK:
                    _ACTIVE = None

    @property
    def _tensor_handles(self) -> list:
        """The hooks the engines hold on tensors and autograd nodes now."""
        return self.block.handles

    def explain(self) -> str:
        """What each layer's quantities were computed with, and why."""
        return self.block.explain()


# The global module hooks: the same three functions for every block (they dispatch to
# the active one), so that a compiled model's guards on its hooks hold from one block
# to the next; a compiled forward traces them (:func:`jacmem.engine.hooks.eager`). An
# eager call goes straight to the active block's method, in ``_DIRECT``.

#: the active block's ``enter``, ``leave`` and ``forward`` (None: no block active)
_DIRECT: tuple[list, list, list] = ([None], [None], [None])
#: whether the active block's outermost forward runs, and its engines let the calls of a
#: module with no parameter and no submodule pass (:func:`jacmem.engine.hooks.eager`)
_INSIDE: list[bool] = [False]


def _enter(module, args):
    active = _ACTIVE
    return None if active is None else active.block.enter(module, args)


def _leave(module, args, output):
    active = _ACTIVE
    return None if active is None else active.block.leave(module, args, output)


def _forward(module, args, kwargs, output):
    active = _ACTIVE
    return None if active is None else active.block.forward(module, args, kwargs, output)


_enter = hooks.eager(_enter, _DIRECT[0], _INSIDE)
_leave = hooks.eager(_leave, _DIRECT[1], _INSIDE)
_forward = hooks.eager(_forward, _DIRECT[2], _INSIDE)
