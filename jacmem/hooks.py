"""Forward hook: keep what the extensions will need; backward: hand it over, then free it.

A forward hook turns one call of one module into a :class:`Record`: the module, what
its derivatives need of the inputs, and its trainable parameters. It registers a hook
on each output tensor; once every output's gradient has arrived, the record goes to
``on_grad(record)``, and drops what it kept.

The record lives in the hooks' closures, and so in the autograd graph: when the graph
is freed, so is everything kept. Whoever installs the hooks keeps their handles, to
take them off (and so free the records) when it is done.
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter
from typing import Any, Callable, Dict, List, Optional

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from jacmem.derivatives import LayerDerivatives, detached, lookup

#: id(parameter) -> number of records alive that will contribute to it. A parameter
#: with more than one (a module called twice, tied weights) needs its per-sample
#: gradients summed over calls before any norm or square is taken.
_LIVE: Counter = Counter()


def _release(keys: List[int]) -> None:
    for key in keys:
        _LIVE[key] -= 1
        if _LIVE[key] <= 0:
            del _LIVE[key]


def trainable(module: nn.Module, entry: Optional[LayerDerivatives] = None) -> Dict[str, nn.Parameter]:
    """The module's own parameters that require a gradient, and the submodule parameters
    that ``entry`` declares by dotted name (those its forward uses itself)."""
    params = {n: p for n, p in module.named_parameters(recurse=False) if p.requires_grad}
    for name in entry.params if entry is not None else ():
        owner, _, leaf = name.rpartition(".")
        p = getattr(module.get_submodule(owner), leaf, None) if owner else None
        if isinstance(p, nn.Parameter) and p.requires_grad:
            params[name] = p
    return params


class Record:
    """One call of one module, from its forward to its backward."""

    __slots__ = (
        "module", "name", "entry", "hp", "params", "nodes", "x", "outputs", "grads", "missing", "task", "thread",
        "release", "__weakref__",
    )  # fmt: skip

    def __init__(self, module, name, entry, params, x, outputs: List[Tensor]):
        self.module: nn.Module = module
        self.name: str = name
        self.entry: Optional[LayerDerivatives] = entry
        #: the derivatives' keyword arguments, read off the module at forward time
        self.hp: Dict[str, Any] = {} if entry is None else entry.hyperparams(module)
        self.params: Dict[str, nn.Parameter] = params
        #: each parameter's AccumulateGrad node: the backward pass tells, through it,
        #: whether it computes that parameter's gradient (``backward(inputs=...)``)
        self.nodes = {n: torch.autograd.graph.get_gradient_edge(p).node for n, p in params.items()}
        self.x: Any = x if entry is None or x is None else entry.arrange_input(x, **self.hp)
        #: (shape, dtype, device) of each hooked output, to stand in zeros for a
        #: gradient that never arrives (an RNN's unused final state, say)
        self.outputs = [(t.shape, t.dtype, t.device) for t in outputs]
        self.grads: List[Optional[Tensor]] = [None] * len(outputs)
        self.missing = len(outputs)
        #: the backward pass (graph task id) that the gradients in ``grads`` come from
        self.task: Optional[int] = None
        #: the thread that ran the forward: a block extends only its own thread's graphs
        self.thread = threading.get_ident()
        keys = [id(p) for p in params.values()]
        _LIVE.update(keys)
        #: take this record out of ``_LIVE`` now (it happens anyway when it is freed);
        #: whoever removes the hooks calls it, in case something else still holds it
        self.release = weakref.finalize(self, _release, keys)

    def shared(self, param: nn.Parameter) -> bool:
        """Whether another live record will also contribute to ``param``."""
        return _LIVE[id(param)] > 1

    def complete(self) -> None:
        """Zeros for the gradients that did not arrive."""
        for i, (shape, dtype, device) in enumerate(self.outputs):
            if self.grads[i] is None:
                self.grads[i] = torch.zeros(shape, dtype=dtype, device=device)
        self.missing = 0

    def reset(self) -> None:
        """Ready for the next backward pass through the same graph."""
        self.grads = [None] * len(self.grads)
        self.missing = len(self.grads)

    @property
    def g(self):
        """The output gradient(s), batch axis first, as the derivatives take them."""
        g = self.grads[0] if len(self.grads) == 1 else tuple(self.grads)
        return g if self.entry is None else self.entry.arrange(g, **self.hp)


def _output_tensors(entry: Optional[LayerDerivatives], output) -> List[Tensor]:
    out = output if entry is None else entry.outputs(output)
    if isinstance(out, Tensor):
        return [out]
    return [t for t in out if isinstance(t, Tensor)]


def record(
    module: nn.Module,
    args: tuple,
    kwargs: dict,
    output,
    name: str,
    on_grad: Callable[[Record], None],
    handles: List[RemovableHandle],
) -> Optional[Record]:
    """The forward-hook body: record this call if it has trainable parameters; returns
    the record, or None.

    Calls inside a torch.func transform are not recorded: they are a derivative's own
    recomputation (see :mod:`jacmem.derivatives.generic`), or the user's.
    """
    if not torch.is_grad_enabled() or torch._C._are_functorch_transforms_active():
        return None
    entry = lookup(module)
    params = trainable(module, entry)
    if not params:
        return None
    outputs = [t for t in _output_tensors(entry, output) if t.requires_grad]
    if not outputs:
        return None
    needs_input = entry is None or any(p not in entry.input_free for p in params)
    x = entry.keep(args, kwargs) if entry is not None and needs_input else None
    x = detached(x)
    rec = Record(module, name, entry, params, x, outputs)

    for i, out in enumerate(outputs):
        handles.append(out.register_hook(_make_hook(rec, i, on_grad)))
    return rec



def _make_hook(rec: Record, index: int, on_grad: Callable[[Record], None]):
    def hook(grad: Tensor) -> None:
        task = torch._C._current_graph_task_id()
        if rec.task != task:  # what an earlier, failed backward left is stale
            rec.reset()
            rec.task = task
        if rec.grads[index] is None:
            rec.missing -= 1
        rec.grads[index] = grad
        on_grad(rec)

    return hook


def remove(handles: List[RemovableHandle]) -> None:
    """Take every hook off, freeing what their records kept."""
    for handle in handles:
        handle.remove()
    handles.clear()
