"""``batch_first=False``: a call's batch on axis 1 of its inputs and outputs, moved first.

Under ``jacmem.extend(..., batch_first=False)`` or ``jacmem.track(model,
batch_first=False)`` (Opacus's ``GradSampleModule(batch_first=False)``), a module call
takes its batch on axis 1 of its inputs and outputs, ``[T, N, ...]``, unless its layer
places the batch itself (``own_layout`` in :mod:`jacmem.derivatives`: an RNN's or
attention's own ``batch_first``, a convolution's ``[N, C, *]``). Its record hands the
layer's ``keep`` the call's inputs, and its ``arrange`` the output gradients, with
axis 1 moved first (:func:`inputs_first`, :func:`front`): the derivatives see
``[N, T, ...]``, as for any other call, and stay pure math on batch-first tensors.

Which inputs: every tensor argument (positional or keyword, nested) whose axis 1 has
the size of the first tensor argument's, the batch size; the others (a mask that all
samples share) pass as they are. A call whose batch axis cannot be told apart raises
at the call, before anything is kept (:func:`batch_size`).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from jacmem import compat


def _fix(module: nn.Module, name: str, what: str) -> ValueError:
    return ValueError(
        f"jacmem: under batch_first=False, module {name!r} ({type(module).__name__}) must take the batch on axis 1 "
        f"of its input and its output, but {what}. Keep the batch on axis 1 where it runs (e.g. out[-1:] rather "
        "than out[-1]), run the model batch-first with batch_first=True (the default), or freeze its parameters."
    )


def batch_size(module: nn.Module, name: str, args: tuple, kwargs: dict, outputs: list[Tensor]) -> int:
    """The call's batch size: axis 1 of its first tensor argument, which each output's
    axis 1 must match. Raises ``ValueError``, naming the module and the fix, where an
    input or output has fewer than 2 axes, or an output's axis 1 differs."""
    first = next((t for t in compat.tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)), None)
    if first is None or first.dim() < 2:
        shape = None if first is None else tuple(first.shape)
        raise _fix(module, name, f"its input has shape {shape}, with no axis 1")
    n = first.shape[1]
    for out in outputs:
        if out.dim() < 2 or out.shape[1] != n:
            raise _fix(
                module,
                name,
                f"its input has shape {tuple(first.shape)} and its output {tuple(out.shape)}, whose axis 1 differs",
            )
    return n


def inputs_first(args: tuple, kwargs: dict, n: int) -> tuple[tuple, dict]:
    """``(args, kwargs)`` with axis 1 moved first in every tensor whose axis 1 has size
    ``n`` (views: ``[T, n, ...] -> [n, T, ...]``)."""

    def move(t: Any) -> Any:
        return t.movedim(1, 0) if isinstance(t, Tensor) and t.dim() > 1 and t.shape[1] == n else t

    return compat.tree_map(move, (args, kwargs))


def front(g: Any) -> Any:
    """Output gradient(s), a tensor or a tuple of them ``[T, N, ...]``, as ``[N, T, ...]``
    (views)."""
    if isinstance(g, Tensor):
        return g.movedim(1, 0)
    return None if g is None else tuple(front(t) for t in g)
