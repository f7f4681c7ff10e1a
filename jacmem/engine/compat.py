"""The private torch APIs the engine relies on, each behind one function.

Everything here reaches into torch internals that carry no stability promise. Keeping
them in one file means a torch upgrade that moves one of them breaks here, visibly,
and nowhere else. Each function says what it does, which private name it uses and
since which torch release that name exists (jacmem is tested on torch 2.13; the floor
below is from torch's history, not from a test).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.weak import WeakTensorKeyDictionary

__all__ = [
    "WeakTensorKeyDictionary",
    "assert_on_device",
    "current_graph_task_id",
    "functorch_transforms_active",
    "handle_alive",
    "is_backward_hook_node",
    "queue_callback",
    "will_engine_execute_node",
]

#: the class name of the autograd node that ``register_full_backward_hook`` (and
#: BackPACK, Opacus) put around a module's inputs and outputs: an identity
_BACKWARD_HOOK_NODE = "BackwardHookFunctionBackward"


def assert_on_device(condition: torch.Tensor, message: str) -> None:
    """Raise ``RuntimeError(message)`` where the one-element bool ``condition`` is false,
    without the host reading it: on the CPU it raises at once; on CUDA a device-side
    assertion (which prints the message, maybe cut short) fails when the device gets
    there, and the process's CUDA context with it. ``torch._assert_async`` with a
    message, since torch 2.1."""
    torch._assert_async(condition, message)


def current_graph_task_id() -> int:
    """The id of the backward pass (autograd "graph task") running in this thread, or
    -1 outside any backward. ``torch._C._current_graph_task_id``, since torch 2.0."""
    return torch._C._current_graph_task_id()


def queue_callback(callback: Callable[[], None]) -> None:
    """Run ``callback()`` when the running backward pass has finished, on success only:
    a pass that fails drops it. Call only from inside a backward (a hook).
    ``torch.autograd.Variable._execution_engine.queue_callback``, since torch 1.0
    (DistributedDataParallel's reducer uses it)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def will_engine_execute_node(node) -> bool:
    """Whether the running backward pass will execute autograd ``node`` (for an
    AccumulateGrad node: whether it computes that leaf's gradient; ``backward(inputs=...)``
    and ``torch.autograd.grad`` restrict it). A leaf whose gradient
    ``torch.autograd.grad`` captures rather than accumulates counts as executed.
    ``torch._C._will_engine_execute_node``, since torch 2.0 (``register_multi_grad_hook``
    uses it)."""
    try:
        return torch._C._will_engine_execute_node(node)
    except RuntimeError:  # torch.autograd.grad captures this leaf's gradient: it asked for it
        return True


def functorch_transforms_active() -> bool:
    """Whether a torch.func transform (vmap, grad, jvp...) is running: forward calls
    inside one are a derivative's own recomputation, not the user's.
    ``torch._C._are_functorch_transforms_active``, since torch 2.0."""
    return torch._C._are_functorch_transforms_active()


def is_backward_hook_node(fn) -> bool:
    """Whether autograd node ``fn`` is the identity that full backward hooks
    (``register_full_backward_hook``) put around a module's tensors. Matched by the
    class name ``BackwardHookFunctionBackward`` (``torch.utils.hooks.BackwardHook``),
    which torch has used since 1.8; torch exports no type to test against."""
    return fn is not None and type(fn).__name__ == _BACKWARD_HOOK_NODE


def handle_alive(handle) -> bool:
    """Whether the hook of a ``RemovableHandle`` can still run: False once the tensor or
    autograd node it was set on is freed. Reads ``RemovableHandle.hooks_dict_ref``, an
    undocumented attribute (a weak reference to the hooks dict) that torch has had since
    1.0; were it gone, every handle counts as alive (kept until the block ends)."""
    ref = getattr(handle, "hooks_dict_ref", None)
    return ref is None or ref() is not None
