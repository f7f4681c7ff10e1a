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
        compat.queue_callback(lambda: done.append(len(seen)))

    y.grad_fn.register_prehook(lambda grads: hook(grads[0]))
    y.backward(inputs=[w])
    assert seen[0][0] != -1 and seen[0][1] is True and seen[1] is False
    assert done == [2], "the callback runs once, at the end of the pass"


def test_grad_captures():
    """Only the leaves ``torch.autograd.grad`` returns are captured; under ``backward``
    none is, ``inputs=`` or not."""
    w, v = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
    nodes = [torch.autograd.graph.get_gradient_edge(p).node for p in (w, v)]
    seen = []
    y = (w * 2 + v * 3).sum() * 1.0
    y.grad_fn.register_prehook(lambda grads: seen.append([compat.grad_captures(n) for n in nodes]))
    torch.autograd.grad(y, w, retain_graph=True)
    y.backward(retain_graph=True)
    y.backward(inputs=[w])
    assert seen == [[True, False], [False, False], [False, False]]


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
