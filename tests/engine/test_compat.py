"""jacmem.compat: each private torch API the engine uses still does what it says, on
the torch installed here (a torch upgrade that moves one fails here first).
``fsdp_parameters`` needs a process group: tests/integration/test_fsdp.py checks it."""

import warnings

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from jacmem import compat


def test_graph_task_callbacks_and_will_execute():
    w, v = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
    seen, done = [], []
    assert compat.current_graph_task_id() == -1
    y = (w * 2).sum() + (v * 3).sum()
    w_node = torch.autograd.graph.get_gradient_edge(w).node
    v_node = torch.autograd.graph.get_gradient_edge(v).node

    def hook(grad):
        seen.append((compat.current_graph_task_id(), compat.will_engine_execute_node(w_node)))
        seen.append(compat.will_engine_execute_node(v_node))
        seen.append(compat.executed({"v": v_node, "w": w_node}))
        compat.queue_callback(lambda: done.append(len(seen)))

    y.grad_fn.register_prehook(lambda grads: hook(grads[0]))
    y.backward(inputs=[w])
    assert seen[0][0] != -1 and seen[0][1] is True and seen[1] is False and seen[2] == ["w"]
    assert done == [3], "the callback runs once, at the end of the pass"


def test_grad_captures():
    """Only the leaves ``torch.autograd.grad`` returns are captured; under ``backward``
    none is, ``inputs=`` or not."""
    w, v = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
    nodes = [torch.autograd.graph.get_gradient_edge(p).node for p in (w, v)]
    seen = []
    y = (w * 2 + v * 3).sum() * 1.0
    y.grad_fn.register_prehook(lambda grads: seen.append([compat.grad_captures(n) for n in nodes]))
    y.grad_fn.register_prehook(lambda grads: seen.append(compat.executed(dict(zip("wv", nodes)))))
    torch.autograd.grad(y, w, retain_graph=True)
    y.backward(retain_graph=True)
    y.backward(inputs=[w])
    # (a captured leaf counts as executed)
    assert seen == [[True, False], ["w"], [False, False], ["w", "v"], [False, False], ["w"]]


def test_functorch_and_backward_hook_nodes():
    assert not compat.functorch_transforms_active()
    assert torch.func.vmap(lambda x: torch.tensor(compat.functorch_transforms_active()) + 0 * x)(torch.zeros(2)).all()
    lin = nn.Linear(2, 2)
    lin.register_full_backward_hook(lambda *args: None)
    out = lin(torch.randn(1, 2, requires_grad=True))
    assert compat.is_backward_hook_node(out.grad_fn) and not compat.is_backward_hook_node(None)


def test_handle_alive():
    x = torch.ones(2, requires_grad=True) * 2
    handle = x.register_hook(lambda g: g)
    assert compat.handle_alive(handle)
    del x
    assert not compat.handle_alive(handle)


def test_assert_on_device_raises_with_its_message():
    compat.assert_on_device(torch.tensor(True), "never seen")
    with pytest.raises(RuntimeError, match="the message"):
        compat.assert_on_device(torch.ones(()) > 2, "the message")


def test_trees_flatten_unflatten_and_map():
    a, b, c = torch.zeros(1), torch.ones(2), torch.full((3,), 2.0)
    tree = ((a, [1, {"k": b}]), {"x": c, "none": None})
    leaves, spec = compat.tree_flatten(tree)
    assert [x is y for x, y in zip(leaves, [a, 1, b, c, None])] == [True] * 5
    assert compat.tree_unflatten([10, 1, 20, 30, None], spec) == ((10, [1, {"k": 20}]), {"x": 30, "none": None})
    doubled = compat.tree_map(lambda t: t * 2 if isinstance(t, torch.Tensor) else t, tree)
    assert torch.equal(doubled[0][1][1]["k"], b * 2) and doubled[0][1][0] == 1 and doubled[1]["none"] is None


@pytest.mark.parametrize("cls,mode", [(nn.RNN, "RNN_TANH"), (nn.RNN, "RNN_RELU"), (nn.GRU, "GRU"), (nn.LSTM, "LSTM")])
def test_fused_recurrence_is_what_the_module_runs(cls, mode):
    torch.manual_seed(0)
    kw = {"nonlinearity": mode[4:].lower()} if cls is nn.RNN else {}
    rnn = cls(3, 4, num_layers=2, batch_first=True, **kw)
    x = torch.randn(5, 6, 3)
    hx = (torch.randn(2, 5, 4),) * (2 if cls is nn.LSTM else 1)
    out, *state = compat.fused_recurrence(mode)(
        x, hx if cls is nn.LSTM else hx[0], list(rnn.parameters()), True, 2, 0.0, False, False, True
    )
    ref_out, ref_state = rnn(x, hx if cls is nn.LSTM else hx[0])
    ref_state = ref_state if cls is nn.LSTM else (ref_state,)
    torch.testing.assert_close(out, ref_out)
    for h, ref in zip(state, ref_state, strict=True):
        torch.testing.assert_close(h, ref)


def test_plain_torch_function_runs_ops_as_on_plain_tensors():
    seen = []

    class Sub(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            seen.append(func)
            with compat.plain_torch_function():
                return func(*args, **(kwargs or {}))

    out = torch.ones(2).as_subclass(Sub) * 3
    assert type(out) is torch.Tensor and torch.equal(out, torch.full((2,), 3.0))
    assert len(seen) == 1, "the op inside the block does not dispatch to the subclass again"


class _Counting(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def test_without_function_mode_pops_only_the_innermost_mode():
    outer, inner, x = _Counting(), _Counting(), torch.ones(2)
    with outer:
        with compat.without_function_mode(outer):
            x + 1
        assert outer.calls == 0
        x + 1
        assert outer.calls == 1, "pushed back after the block"
        with pytest.raises(KeyError), compat.without_function_mode(outer):
            raise KeyError
        x + 1
        assert outer.calls == 2, "pushed back after an exception too"
        with inner, compat.without_function_mode(outer):
            x + 1
        assert inner.calls == 1, "a mode that is not the innermost stays"
        with compat.without_function_mode(None):
            x + 1
        assert outer.calls == 4


def test_swap_parameters_puts_tensors_in_for_the_forward_and_back():
    lin = nn.Linear(2, 2)
    weight = lin.weight
    view = torch.zeros(2, 2, requires_grad=True) * 1  # not a Parameter
    restore = compat.swap_parameters(lin, {"weight": view})
    torch.testing.assert_close(lin(torch.ones(1, 2)), lin.bias[None].detach())
    lin(torch.ones(1, 2)).sum().backward()
    restore()
    assert lin.weight is weight and [n for n, _ in lin.named_parameters()] == ["weight", "bias"]
    assert weight.grad is None and lin.bias.grad is not None


def test_dynamo_callback_is_none_but_where_a_compiled_frame_runs():
    """``dynamo_callback()``: None in eager code (a module hook may then run without
    ``torch.compiler.disable``), set in the eager part of a frame torch.compile runs (where
    a new frame would be compiled)."""
    seen = []

    def probe():
        seen.append(compat.dynamo_callback())

    @torch.compile(backend="eager")
    def f(x):
        probe()  # (an unknown C function: a graph break, run eagerly in the compiled frame)
        return x * 2

    probe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        f(torch.ones(2))
    assert seen[0] is None and seen[1] is not None


def _originals():
    return torch.autograd.backward, torch.autograd.grad


def test_watch_autograd_hands_over_each_call_normalised():
    """``around`` gets the tensors, their gradients, ``inputs`` and ``create_graph``
    of each call, however they were passed, and returns what the call returns."""
    seen = []

    def around(run, tensors, grads, inputs, create_graph):
        seen.append((tensors, grads, inputs, create_graph))
        return run()

    w = nn.Parameter(torch.ones(2))
    end = compat.watch_autograd(around)
    try:
        y = (w * 3).sum()
        v = torch.ones(())
        y.backward(v, retain_graph=True, inputs=[w])  # Tensor.backward goes through torch.autograd.backward
        torch.autograd.backward([y], None, True, False, None, [w])
        (g,) = torch.autograd.grad(y, [w], v, create_graph=True)
        (h,) = torch.autograd.grad(outputs=y, inputs=w, grad_outputs=v, retain_graph=True)
    finally:
        end()
    assert [s[0] is y or s[0] == [y] for s in seen] == [True] * 4
    assert [s[1] is v for s in seen] == [True, False, True, True] and seen[1][1] is None
    assert seen[0][2] == [w] and seen[1][2] == [w] and seen[2][2] == [w] and seen[3][2] is w
    assert [s[3] for s in seen] == [False, False, True, False]
    torch.testing.assert_close(g, torch.full((2,), 3.0))
    torch.testing.assert_close(h, torch.full((2,), 3.0))
    torch.testing.assert_close(w.grad, torch.full((2,), 6.0))


def test_watch_autograd_ends_with_torchs_own_functions_after_an_error():
    originals = _originals()

    def around(run, *args):
        raise KeyError("from around")

    end = compat.watch_autograd(around)
    try:
        assert _originals() != originals
        with pytest.raises(KeyError, match="from around"):
            (nn.Parameter(torch.ones(2)) * 2).sum().backward()
    finally:
        end()
    assert _originals() == originals
    end()  # a second end changes nothing
    assert _originals() == originals


def test_a_block_that_raises_leaves_torchs_autograd_functions():
    import jacmem

    originals = _originals()
    with pytest.raises(KeyError), jacmem.extend(jacmem.BatchGrad()):
        assert _originals() != originals
        raise KeyError
    assert _originals() == originals


@pytest.mark.parametrize("order", ["inner first", "outer first"])
def test_watch_autograd_nests_and_ends_in_any_order(order):
    originals, calls = _originals(), []

    def watching(tag):
        def around(run, *args):
            calls.append(tag)
            return run()

        return around

    w = nn.Parameter(torch.ones(2))
    outer = compat.watch_autograd(watching("outer"))
    inner = compat.watch_autograd(watching("inner"))
    (w * 2).sum().backward()
    assert calls == ["inner", "outer"], "the later watch runs around the earlier"
    first, second = (inner, outer) if order == "inner first" else (outer, inner)
    first()
    calls.clear()
    (w * 2).sum().backward()
    assert calls == ["outer" if order == "inner first" else "inner"], "an ended watch is not called"
    second()
    calls.clear()
    (w * 2).sum().backward()
    assert calls == [] and _originals() == originals


def test_module_slots_are_the_dicts_the_forward_reads():
    lin, seq = nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    assert list(compat.parameter_slots(lin)) == ["weight", "bias"] and compat.parameter_slots(lin)["bias"] is lin.bias
    assert list(compat.child_slots(seq)) == ["0", "1"] and compat.child_slots(seq)["1"] is seq[1]
    assert set(compat.buffer_slots(seq[1])) == {"running_mean", "running_var", "num_batches_tracked"}
    compat.parameter_slots(lin)["bias"] = nn.Parameter(torch.full((2,), 5.0))
    compat.buffer_slots(seq[1])["running_mean"] = torch.ones(2)
    torch.testing.assert_close(lin(torch.zeros(1, 2)), torch.full((1, 2), 5.0))
    assert torch.equal(seq[1].running_mean, torch.ones(2)), "writing them changes what the module holds"


def test_tensor_version_counts_in_place_writes():
    t = torch.zeros(3)
    before = compat.tensor_version(t)
    t.add_(1)
    t[0:1].mul_(2)  # through a view
    assert compat.tensor_version(t) == before + 2
    t + 1
    assert compat.tensor_version(t) == before + 2


def test_saved_names_and_values_of_a_built_in_ops_node():
    a, b = torch.randn(3, requires_grad=True), torch.randn(3)
    mul = (a * b).grad_fn
    assert {"self", "other"} <= set(compat.saved_names(mul))
    assert torch.equal(compat.saved_value(mul, "other"), b) and compat.saved_value(mul, "nothing", 7) == 7
    assert compat.saved_value(torch.add(a, b, alpha=1).grad_fn, "alpha") == 1
    assert compat.saved_value(torch.add(a, b, alpha=2).grad_fn, "alpha") == 2

    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return 2 * x

        @staticmethod
        def backward(ctx, g):
            return 2 * g

    assert compat.saved_names(Double.apply(a).grad_fn) == [], "a custom Function's are in saved_tensors"


def test_node_output_shape_is_the_shape_of_the_forward_ops_output():
    x = torch.randn(4, 3, requires_grad=True)
    node = x.sum(0).grad_fn
    assert compat.node_output_shape(node, 0) == (3,) and compat.node_output_shape(node, 1) is None
    first, second = x.split([1, 3])
    assert compat.node_output_shape(first.grad_fn, 0) == (1, 3)
    assert compat.node_output_shape(second.grad_fn, 1) == (3, 3)


def test_autograd_records_inside_a_custom_ops_kernel_only_where_asked():
    seen = []

    @torch.library.custom_op("jacmem_test::probe", mutates_args=())
    def probe(x: torch.Tensor) -> torch.Tensor:
        y = x.detach().requires_grad_()
        plain = (y * 2).grad_fn is not None
        with compat.autograd_inside_op(), torch.enable_grad():
            inside = (y * 2).grad_fn is not None
        seen.append((plain, inside))
        return x.clone()

    probe(torch.ones(2))
    assert seen == [(False, True)]


def test_global_module_hooks_run_for_every_module_under_the_same_ids():
    calls = []

    def pre(module, args):
        calls.append(("pre", type(module).__name__))

    def leave(module, args, output):
        calls.append(("leave", type(module).__name__))

    def forward(module, args, kwargs, output):
        calls.append(("forward", type(module).__name__, kwargs))

    handles = compat.global_module_hooks(pre, leave, forward)
    try:
        nn.Linear(2, 2)(torch.ones(1, 2))
        with pytest.raises(RuntimeError):
            nn.Linear(2, 2)(torch.ones(1, 3))
    finally:
        for handle in handles:
            handle.remove()
    nn.Linear(2, 2)(torch.ones(1, 2))
    assert calls == [
        ("pre", "Linear"),
        ("leave", "Linear"),
        ("forward", "Linear", {}),
        ("pre", "Linear"),
        ("leave", "Linear"),
    ]
    again = compat.global_module_hooks(pre, leave, forward)
    for handle in again:
        handle.remove()
    assert [h.id for h in again] == [h.id for h in handles], "torch.compile guards on the ids"


def test_compiled_modules_are_told_apart_and_unwrapped():
    lin, other = nn.Linear(2, 2), nn.Linear(2, 2)
    wrapped = torch.compile(lin)
    assert compat.is_compiled_module(wrapped) and not compat.is_compiled_module(lin)
    assert compat.uncompiled(wrapped) is lin and compat.uncompiled(lin) is lin
    assert not compat.compiled_in_place(lin) and not compat.compiled_in_place(wrapped)
    other.compile()
    assert compat.compiled_in_place(other) and not compat.is_compiled_module(other)


def test_never_compile_alone_still_traces_inline():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append([n.target for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward

    def inner(x):
        return torch.sin(x) + 1

    def outer(x):
        return inner(x) * 2

    compat.never_compile_alone(inner)
    x = torch.ones(3)
    torch.testing.assert_close(torch.compile(inner, backend=backend)(x), torch.sin(x) + 1)
    assert graphs == [], "where eager code calls it, its frame is not compiled"
    torch.testing.assert_close(torch.compile(outer, backend=backend)(x), (torch.sin(x) + 1) * 2)
    assert len(graphs) == 1 and torch.sin in graphs[0], "a compiled frame traces it inline"


@torch.library.custom_op("jacmem_test::noted", mutates_args=())
def _noted(grad: torch.Tensor) -> None:
    _NOTED.append(grad.clone())


@_noted.register_fake
def _(grad):
    return None


_NOTED: list[torch.Tensor] = []
compat.ordered_op(torch.ops.jacmem_test.noted.default)


class _NoteGrad(torch.autograd.Function):
    """The identity, whose backward hands the output's gradient to ``jacmem_test::noted``."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        torch.ops.jacmem_test.noted(grad)
        return grad


def test_ordered_op_keeps_an_op_that_returns_nothing_in_a_compiled_backward():
    """Without the declaration, the compiled backward drops the op: nothing is noted."""
    _NOTED.clear()
    x = torch.ones(3, requires_grad=True)
    compiled = torch.compile(lambda x: _NoteGrad.apply(x * 2).sum(), backend="aot_eager", fullgraph=True)
    compiled(x).backward()
    assert len(_NOTED) == 1
    torch.testing.assert_close(_NOTED[0], torch.ones(3))


def test_holds_parameters_asks_the_own_slots_and_the_children_of_the_given_types():
    lin, act = nn.Linear(2, 2), nn.ReLU()
    assert compat.holds_parameters(lin, ()) and not compat.holds_parameters(act, (nn.ParameterList,))
    empty = nn.Module()
    empty.register_parameter("weight", None)  # a slot registered empty holds nothing
    assert not compat.holds_parameters(empty, (nn.ParameterList,))
    empty.store = nn.ParameterList([nn.Parameter(torch.ones(1))])
    assert compat.holds_parameters(empty, (nn.ParameterList,)) and not compat.holds_parameters(empty, ())
    assert not compat.holds_parameters(nn.Sequential(nn.Linear(2, 2)), (nn.ParameterList,)), "its own only"


def test_own_slots_reads_a_modules_own_parameter_and_submodule_slots_without_a_frame():
    lin, act, seq = nn.Linear(2, 2), nn.ReLU(), nn.Sequential(nn.ReLU())
    own, children = compat.own_slots(lin)
    assert list(own) == ["weight", "bias"] and not children
    assert compat.own_slots(act) == ({}, {}) and list(compat.own_slots(seq)[1]) == ["0"]
    assert not hasattr(compat.own_slots, "__code__"), "no Python frame: a hook asks it at every call"
