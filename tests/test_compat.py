"""jacmem.engine.compat: each private torch API the engine uses still does what it says, on
the torch installed here (a torch upgrade that moves one fails here first)."""

import pytest
import torch
from torch import nn

from jacmem.engine import compat


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
