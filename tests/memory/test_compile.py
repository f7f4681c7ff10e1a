"""Lean layers under torch.compile: inside a compiled region they run the stock
forward, so a lean model compiles with no more graph breaks than the stock one, and
gives the stock outputs and gradients (the compiler decides what is kept there; see
jacmem.memory.lean's docstring). Small models, the "aot_eager" backend (no C++ build)."""

import copy

import pytest
import torch
import torch._dynamo as dynamo
from torch import nn

from jacmem.memory import lean

pytestmark = pytest.mark.usefixtures("float64_default")


def _models():
    torch.manual_seed(0)
    cnn = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2), nn.Dropout(0.0), nn.Conv2d(4, 2, 3)
    ).eval()
    cnn.requires_grad_(False)
    mlp = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8), nn.RMSNorm(8), nn.SiLU())
    return [("cnn", cnn, torch.randn(2, 3, 10, 10)), ("transformer mlp", mlp, torch.randn(2, 5, 8))]


@pytest.mark.heavy  # compiling takes a few seconds per model on CPU
@pytest.mark.parametrize("case", range(2), ids=["cnn", "transformer mlp"])
def test_lean_compiles_without_graph_breaks_and_matches_stock(case):
    name, stock, x = _models()[case]
    leaned = lean(copy.deepcopy(stock))
    leaned(x.clone().requires_grad_())  # eager first: lean layers learn their readers
    dynamo.reset()
    explained = dynamo.explain(leaned)(x.clone().requires_grad_())
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    dynamo.reset()
    compiled = torch.compile(leaned, backend="aot_eager", fullgraph=True)
    xs, xl = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_s, out_l = stock(xs), compiled(xl)
    torch.testing.assert_close(out_l, out_s, rtol=1e-12, atol=1e-12)
    g = torch.randn(out_s.shape)
    out_s.backward(g)
    out_l.backward(g)
    torch.testing.assert_close(xl.grad, xs.grad, rtol=1e-10, atol=1e-12)
    for (n, p), q in zip(stock.named_parameters(), leaned.parameters()):
        if p.requires_grad:
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-10, atol=1e-12, msg=n)
    dynamo.reset()
