"""The private torch APIs jacmem relies on, each behind one function.

Everything here reaches into torch internals that carry no stability promise. Keeping
them in one file means a torch upgrade that moves one of them breaks here, visibly,
and nowhere else. It imports torch alone, so every layer (derivatives included) may
use it. Each function says what it does, which private name it uses and
since which torch release that name exists (jacmem is tested on torch 2.13; the floor
below is from torch's history, not from a test).
"""

from __future__ import annotations

import contextlib
import functools
import operator
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree
from torch.utils.hooks import RemovableHandle
from torch.utils.weak import WeakTensorKeyDictionary

__all__ = [
    "WeakTensorKeyDictionary",
    "assert_on_device",
    "autograd_inside_op",
    "buffer_slots",
    "child_slots",
    "current_graph_task_id",
    "dynamo_callback",
    "executed",
    "fsdp_parameters",
    "functorch_transforms_active",
    "fused_recurrence",
    "handle_alive",
    "is_backward_hook_node",
    "global_module_hooks",
    "grad_captures",
    "is_compiled_module",
    "never_compile_alone",
    "node_output_shape",
    "ordered_op",
    "own_slots",
    "parameter_slots",
    "plain_torch_function",
    "queue_callback",
    "saved_names",
    "saved_value",
    "swap_parameters",
    "tensor_version",
    "tree_flatten",
    "tree_map",
    "tree_unflatten",
    "watch_autograd",
    "will_engine_execute_node",
    "without_function_mode",
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


#: the dispatch keys a thread includes and excludes outside any op: those of the import
_DISPATCH_KEYS = (torch._C._dispatch_tls_local_include_set(), torch._C._dispatch_tls_local_exclude_set())


def autograd_inside_op():
    """A context in which autograd records again, inside the kernel of a custom op
    (``torch.library.custom_op``), which torch runs below autograd: the dispatch keys of
    this thread are those outside any op, set by ``torch._C._ForceDispatchKeyGuard``,
    as torch's own ``torch._ops`` does, since torch 2.1."""
    return torch._C._ForceDispatchKeyGuard(*_DISPATCH_KEYS)


#: ``current_graph_task_id() -> int``: the id of the backward pass (autograd "graph task")
#: running in this thread, or -1 outside any backward. ``torch._C._current_graph_task_id``,
#: since torch 2.0, itself: asked at every module call, it costs no Python frame.
current_graph_task_id = torch._C._current_graph_task_id


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
    return bool(executed({None: node}))


def executed(nodes: dict) -> list:
    """The keys of ``nodes`` (key -> autograd node), in order, whose nodes the running
    backward pass will execute, as :func:`will_engine_execute_node` tells of each (in one
    call: asked for the parameters of every recorded call)."""
    keys = []
    for key, node in nodes.items():
        try:
            if torch._C._will_engine_execute_node(node):
                keys.append(key)
        except RuntimeError:  # torch.autograd.grad captures this leaf's gradient: it asked for it
            keys.append(key)
    return keys


def grad_captures(node) -> bool:
    """Whether ``torch.autograd.grad``, running now, returns the gradient of the leaf
    whose AccumulateGrad ``node`` is given (rather than a backward accumulating it, or
    not computing it): ``torch._C._will_engine_execute_node`` refuses such a leaf."""
    try:
        torch._C._will_engine_execute_node(node)
    except RuntimeError:
        return True
    return False


#: ``functorch_transforms_active() -> bool``: whether a torch.func transform (vmap, grad,
#: jvp...) is running: forward calls inside one are a derivative's own recomputation, not
#: the user's. ``torch._C._are_functorch_transforms_active``, since torch 2.0, itself (no
#: Python frame: asked at every recorded call).
functorch_transforms_active = torch._C._are_functorch_transforms_active

#: ``dynamo_callback()``: the frame callback torch.compile has set in this thread, or None
#: where none is (no frame that starts now would be compiled: a module hook may then run
#: without ``torch.compiler.disable`` around it).
#: ``torch._C._dynamo.eval_frame.get_eval_frame_callback``, since torch 2.1, itself (no
#: Python frame: asked at every module hook); where torch lacks it, never None.
dynamo_callback = getattr(
    getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None), "get_eval_frame_callback", lambda: True
)


def is_backward_hook_node(fn) -> bool:
    """Whether autograd node ``fn`` is the identity that full backward hooks
    (``register_full_backward_hook``) put around a module's tensors. Matched by the
    class name ``BackwardHookFunctionBackward`` (``torch.utils.hooks.BackwardHook``),
    which torch has used since 1.8; torch exports no type to test against."""
    return fn is not None and type(fn).__name__ == _BACKWARD_HOOK_NODE


#: (pre-hook, leave hook, forward hook) -> their handles, made once: see global_module_hooks
_GLOBAL_HANDLES: dict[tuple, list[RemovableHandle]] = {}


def global_module_hooks(pre: Callable, leave: Callable, forward: Callable) -> list[RemovableHandle]:
    """Register, for every module, the forward pre-hook ``pre``, the forward hook
    ``leave`` (``always_call=True``) and the forward hook ``forward`` (``with_kwargs=True``),
    as ``register_module_forward_pre_hook`` and ``register_module_forward_hook`` do, but
    under the same ids each time the same three are registered: torch.compile guards on
    the ids of the global hooks, so that a compiled model recompiled at each block
    otherwise. Writes ``torch.nn.modules.module``'s ``_global_forward_pre_hooks``,
    ``_global_forward_hooks``, ``_global_forward_hooks_always_called`` and
    ``_global_forward_hooks_with_kwargs``, since torch 2.0 (2.1 for the last two)."""
    from torch.nn.modules import module as m

    handles = _GLOBAL_HANDLES.get((pre, leave, forward))
    if handles is None:
        handles = _GLOBAL_HANDLES[(pre, leave, forward)] = [
            RemovableHandle(m._global_forward_pre_hooks),
            RemovableHandle(m._global_forward_hooks, extra_dict=m._global_forward_hooks_always_called),
            RemovableHandle(m._global_forward_hooks, extra_dict=m._global_forward_hooks_with_kwargs),
        ]
    m._global_forward_pre_hooks[handles[0].id] = pre
    m._global_forward_hooks[handles[1].id] = leave
    m._global_forward_hooks_always_called[handles[1].id] = True
    m._global_forward_hooks[handles[2].id] = forward
    m._global_forward_hooks_with_kwargs[handles[2].id] = True
    return list(handles)


def is_compiled_module(module) -> bool:
    """Whether ``module`` is the wrapper ``torch.compile(model)`` returns, whose forward
    runs ``model``'s compiled. ``torch._dynamo.eval_frame.OptimizedModule``, since
    torch 2.0 (torch exports no public name for it)."""
    return isinstance(module, torch._dynamo.eval_frame.OptimizedModule)


def compiled_in_place(module) -> bool:
    """Whether ``module.compile()`` compiled ``module`` in place: its calls run a compiled
    ``_call_impl`` (``Module._compiled_call_impl``, since torch 2.2)."""
    return getattr(module, "_compiled_call_impl", None) is not None


def uncompiled(module):
    """The model under the wrappers ``torch.compile`` put around ``module`` (``module``
    itself where there are none): ``OptimizedModule._orig_mod``, since torch 2.0."""
    while isinstance(module, torch._dynamo.eval_frame.OptimizedModule):  # (is_compiled_module, inline)
        module = module._orig_mod
    return module


#: the attributes under which torch's wrappers hold the module they wrap: ``torch.compile``'s
#: ``OptimizedModule``, FSDP1's ``FullyShardedDataParallel`` and activation checkpointing's
#: ``CheckpointWrapper`` (private names, since torch 2.0)
_WRAPPED_ATTRIBUTES = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})


def wraps(parent: nn.Module, child_name: str) -> bool:
    """Whether ``parent``'s child ``child_name`` is the module a wrapper holds (its name is
    the wrapper's, not the user's): those of :data:`_WRAPPED_ATTRIBUTES`, and DDP's and
    DataParallel's ``module``."""
    if child_name in _WRAPPED_ATTRIBUTES:
        return True
    return child_name == "module" and isinstance(parent, (nn.parallel.DistributedDataParallel, nn.DataParallel))


def never_compile_alone(fn: Callable) -> None:
    """torch.compile never compiles ``fn``'s frame on its own (where eager code calls it),
    while it still traces ``fn`` inline where a compiled frame calls it.
    ``torch._dynamo.eval_frame.skip_code``, since torch 2.0."""
    torch._dynamo.eval_frame.skip_code(fn.__code__)


def ordered_op(op: torch._ops.OpOverload) -> None:
    """Declare the custom op ``op`` (one that returns nothing) as having a side effect
    that torch.compile keeps, in order: a graph never drops it, and threads a token
    through its calls. ``torch._higher_order_ops.effects._register_effectful_op``, since
    torch 2.4 (an op in a compiled backward: tested on torch 2.13)."""
    from torch._higher_order_ops import effects

    effects._register_effectful_op(op, effects._EffectType.ORDERED)


def handle_alive(handle) -> bool:
    """Whether the hook of a ``RemovableHandle`` can still run: False once the tensor or
    autograd node it was set on is freed. Reads ``RemovableHandle.hooks_dict_ref``, an
    undocumented attribute (a weak reference to the hooks dict) that torch has had since
    1.0; were it gone, every handle counts as alive (kept until the block ends)."""
    ref = getattr(handle, "hooks_dict_ref", None)
    return ref is None or ref() is not None


def tree_flatten(tree) -> tuple[list, _pytree.TreeSpec]:
    """The leaves of nested tuples, lists and dicts (and the containers torch registers),
    in order, and the spec :func:`tree_unflatten` rebuilds the tree from.
    ``torch.utils._pytree.tree_flatten``, since torch 1.8."""
    return _pytree.tree_flatten(tree)


def tree_unflatten(leaves: list, spec: _pytree.TreeSpec):
    """The tree of ``spec`` (from :func:`tree_flatten`) with ``leaves`` in its places.
    ``torch.utils._pytree.tree_unflatten``, since torch 1.8."""
    return _pytree.tree_unflatten(leaves, spec)


def tree_map(fn: Callable, tree):
    """The tree with ``fn(leaf)`` for each leaf. ``torch.utils._pytree.tree_map``,
    since torch 1.10."""
    return _pytree.tree_map(fn, tree)


def fused_recurrence(mode: str) -> Callable:
    """torch's fused multi-layer recurrence for ``nn.RNNBase.mode`` (``RNN_TANH``,
    ``RNN_RELU``, ``GRU``, ``LSTM``): ``(input, hx, weights, has_biases, num_layers,
    dropout, train, bidirectional, batch_first) -> (output, h_n[, c_n])``, the call
    ``nn.RNN``/``GRU``/``LSTM`` make themselves. ``torch._VF``, since torch 1.0."""
    name = {"RNN_TANH": "rnn_tanh", "RNN_RELU": "rnn_relu", "GRU": "gru", "LSTM": "lstm"}[mode]
    return getattr(torch._VF, name)


def plain_torch_function() -> contextlib.AbstractContextManager:
    """Inside ``__torch_function__`` of a tensor subclass: calls in the block run as on
    plain tensors (they do not dispatch to the subclass again), what
    ``Tensor.__torch_function__`` itself does. ``torch._C.DisableTorchFunctionSubclass``,
    since torch 2.0."""
    return torch._C.DisableTorchFunctionSubclass()


@contextlib.contextmanager
def without_function_mode(mode: TorchFunctionMode | None) -> Iterator[None]:
    """Run the block without ``mode`` where it is the innermost torch-function mode
    (popped for the block, pushed back after, also on an exception); otherwise as it is.
    The mode stack: ``torch._C._len_torch_function_stack``, ``_get_function_stack_at``,
    ``_pop_torch_function_stack`` and ``_push_on_torch_function_stack``, since torch 2.0."""
    n = torch._C._len_torch_function_stack()
    if mode is None or not n or torch._C._get_function_stack_at(n - 1) is not mode:
        yield
        return
    torch._C._pop_torch_function_stack()
    try:
        yield
    finally:
        torch._C._push_on_torch_function_stack(mode)


def swap_parameters(module: nn.Module, tensors: dict[str, Tensor]) -> Callable[[], None]:
    """Put ``tensors`` (any tensors, not only ``nn.Parameter``) in place of ``module``'s
    own parameters of those names, so that its forward uses them; returns the function
    that puts the parameters back. Writes ``nn.Module._parameters`` (``setattr`` refuses
    a tensor that is not a Parameter), which every torch release has had."""
    saved = {name: module._parameters[name] for name in tensors}
    module._parameters.update(tensors)

    def restore() -> None:
        module._parameters.update(saved)

    return restore


def parameter_slots(module: nn.Module) -> dict[str, nn.Parameter | None]:
    """``module``'s own parameters by name, the dict its forward reads them from (None for a
    name registered empty); writing it changes what the forward uses. Faster than
    ``named_parameters(recurse=False)``, which walks the module tree to list it.
    ``nn.Module._parameters``, which every torch release has had."""
    return module._parameters


def buffer_slots(module: nn.Module) -> dict[str, Tensor | None]:
    """``module``'s own buffers by name, the dict its forward reads them from (None for a
    name registered empty); writing it changes what the forward uses.
    ``nn.Module._buffers``, which every torch release has had."""
    return module._buffers


#: ``own_slots(module) -> (parameters, children)``: ``module``'s own parameter and submodule
#: slots (``nn.Module._parameters`` and ``_modules``, which every torch release has had),
#: read with no Python frame (``operator.attrgetter``): a global module hook asks it at every
#: call, to let a module with neither (an activation, a loss) pass at once.
own_slots = operator.attrgetter("_parameters", "_modules")


def holds_parameters(module: nn.Module, containers: tuple[type, ...]) -> bool:
    """Whether ``module`` holds a parameter itself (a :func:`parameter_slots` entry that is
    not None) or a direct child of a type in ``containers``, asked in one call, without
    walking the module tree (a module hook asks it at every call)."""
    for p in module._parameters.values():
        if p is not None:
            return True
    for child in module._modules.values():
        if isinstance(child, containers):
            return True
    return False


def child_slots(module: nn.Module) -> dict[str, nn.Module | None]:
    """``module``'s direct submodules by name, in registration order (None for a name
    registered empty). ``nn.Module._modules``, which every torch release has had."""
    return module._modules


def tensor_version(t: Tensor) -> int:
    """``t``'s version counter: it grows with each in-place write to ``t`` (or to a view
    of its storage), which is how autograd tells that a saved tensor changed.
    ``Tensor._version``, since torch 0.4."""
    return t._version


#: the prefix of the attributes through which an autograd node of a built-in op shows what
#: it saved for its backward (``MulBackward0._saved_other``)
_SAVED = "_saved_"


def saved_names(node) -> list[str]:
    """The names of what the autograd ``node`` of a built-in op saved for its backward
    (``["self", "other"]`` for ``MulBackward0``), for :func:`saved_value`; none for a
    custom Function's node (its ``saved_tensors`` holds them). The ``_saved_<name>``
    attributes of autograd's generated nodes, since torch 1.10."""
    return [a[len(_SAVED) :] for a in dir(node) if a.startswith(_SAVED)]


def saved_value(node, name: str, default: Any = None) -> Any:
    """What the autograd ``node`` of a built-in op saved under ``name`` for its backward
    (a tensor, unpacked as its backward would: a saved-tensor hook's unpack runs; or a
    number, as ``AddBackward0``'s ``alpha``), ``default`` where it saved nothing of that
    name. Its attribute ``_saved_<name>``, since torch 1.10."""
    return getattr(node, _SAVED + name, default)


def node_output_shape(node, index: int) -> tuple[int, ...] | None:
    """The shape of output ``index`` of the forward op whose autograd node is ``node``,
    the gradient it takes there (None where torch keeps none). The node's
    ``_input_metadata``, since torch 2.1."""
    meta = getattr(node, "_input_metadata", None)
    return tuple(meta[index].shape) if meta is not None and index < len(meta) else None


def fsdp_parameters(module: nn.Module) -> list[tuple[nn.Parameter, nn.Parameter | None]]:
    """The parameters an FSDP2 module (``fully_shard``) manages itself, not those of
    the FSDP2 modules inside it: (sharded parameter, the user's ``DTensor``; unsharded
    parameter that forward and backward run on, one object kept across steps, None
    before the first forward). The module's ``_get_fsdp_state()._fsdp_param_group``,
    its ``fsdp_params`` and their ``sharded_param`` and ``_unsharded_param``
    (torch/distributed/fsdp/_fully_shard), since torch 2.4."""
    group = module._get_fsdp_state()._fsdp_param_group
    if group is None:
        return []
    return [(fp.sharded_param, getattr(fp, "_unsharded_param", None)) for fp in group.fsdp_params]


#: the functions of ``torch.autograd`` that :func:`watch_autograd` replaces -> where their
#: arguments are, by (position, counting the tensors first; name): the tensors the pass
#: starts from, their gradients, ``inputs`` and ``create_graph`` (torch's signatures)
_AUTOGRAD_CALLS = {
    "backward": ((0, "tensors"), (1, "grad_tensors"), (5, "inputs"), (3, "create_graph")),
    "grad": ((0, "outputs"), (2, "grad_outputs"), (1, "inputs"), (4, "create_graph")),
}

#: the attribute that marks a replacement of :func:`watch_autograd` taken off
_OFF = "_jacmem_off"

#: ``around(run, tensors, grad_tensors, inputs, create_graph)``: see :func:`watch_autograd`
Around = Callable[[Callable[[], Any], Any, Any, Any, bool], Any]


def watch_autograd(around: Around) -> Callable[[], None]:
    """Route each call of ``torch.autograd.backward`` and ``torch.autograd.grad``
    (``Tensor.backward`` calls the former) through ``around(run, tensors, grad_tensors,
    inputs, create_graph)``, which returns what ``run()``, the call itself, returns
    (``grad_tensors``: ``grad``'s ``grad_outputs``; None where not given); returns the
    function that ends it. Replaces the two attributes of ``torch.autograd``, which every
    torch release has had.

    Watches nest, and end in any order: an ended watch whose replacement another
    one (or anyone's) wraps stays there as a plain call of what it wrapped, and is taken
    out when the one over it ends; once every watch has ended, torch's own functions are
    back."""
    off = [False]  # (set when the watch ends: its replacements then call what they wrapped)
    replacements = []
    for name in ("backward", "grad"):  # (partials of :func:`_watched`: a block watches at every step, with no call)
        original = getattr(torch.autograd, name)
        replacement = functools.partial(_watched, off, original, _AUTOGRAD_CALLS[name], around)
        replacements.append((name, functools.update_wrapper(replacement, original)))
    torch.autograd.backward, torch.autograd.grad = replacements[0][1], replacements[1][1]

    def end() -> None:
        off[0] = True
        for name, watched in replacements:
            setattr(watched, _OFF, True)
            if getattr(torch.autograd, name) is watched:
                target = watched.__wrapped__
                while getattr(target, _OFF, False):  # an ended watch under this one
                    target = target.__wrapped__
                setattr(torch.autograd, name, target)

    return end


def _watched(off: list[bool], original: Callable, where: tuple, around: Around, *args, **kwargs):
    """A call of ``original``, ``torch.autograd``'s function as it was when the watch began,
    through ``around`` (:func:`watch_autograd`); ``where``: its arguments' places
    (:data:`_AUTOGRAD_CALLS`); straight to ``original`` once the watch has ended (``off``)."""
    if off[0]:
        return original(*args, **kwargs)
    n, ((i, a), (j, b), (k, c), (m, d)) = len(args), where  # (no comprehension: a call per backward)
    tensors, grads = args[i] if n > i else kwargs.get(a), args[j] if n > j else kwargs.get(b)
    inputs, create_graph = args[k] if n > k else kwargs.get(c), args[m] if n > m else kwargs.get(d)
    return around(functools.partial(original, *args, **kwargs), tensors, grads, inputs, bool(create_graph))
