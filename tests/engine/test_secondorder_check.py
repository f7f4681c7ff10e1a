"""The chain check's two ways to get each tracked consumer's part of a module's output
gradient: hooks on the consumer's own autograd nodes (the default), and, where the
consumer's graph is too large to search, a row through its Jacobian. Both must leave
exact results exact and catch every operation off the chain."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tests.support.secondorder_models import Block, resnet
from tests.support.secondorder_ref import check_exact, run
from torch import nn

import jacmem
import jacmem.engine.secondorder.engine as backprop
from jacmem import ChainError, DiagGGNExact, DiagHessian
from jacmem.derivatives.jacobians import LOOP_V, vjp_generic

DT = torch.float64


@pytest.fixture(params=["autograd's parts", "rows"])
def parts(request, monkeypatch):
    if request.param == "rows":  # no call's graph can be searched: every consumer sends its row
        monkeypatch.setattr(backprop, "_TAP_NODES", 0)
    return request.param


def test_branches_stay_exact(parts):
    torch.manual_seed(0)
    check_exact(resnet(), nn.CrossEntropyLoss(), torch.randn(3, 4, dtype=DT), torch.randint(0, 3, (3,)))


@pytest.mark.parametrize("op, functional_sum", [(F.relu, False), (nn.Identity(), True)], ids=["F.relu", "x+y"])
def test_functional_op_on_a_branch_stays_exact(parts, op, functional_sum):
    torch.manual_seed(4)
    model = Block(op, functional_sum).to(DT)
    check_exact(model, nn.CrossEntropyLoss(), torch.randn(3, 4, dtype=DT), torch.randint(0, 3, (3,)))


@pytest.mark.parametrize("op", [torch.sin, lambda h: h * h], ids=["torch.sin", "h*h"])
def test_unfollowed_op_on_a_branch_raises(parts, op):
    torch.manual_seed(4)
    model = Block(op).to(DT)
    with pytest.raises(ChainError, match=r"module 'lin0' \(Linear\)"):
        run(model, nn.CrossEntropyLoss(), torch.randn(3, 4, dtype=DT), torch.randint(0, 3, (3,)), DiagHessian())


class Penalised(nn.Module):
    """``head(h)`` with ``h = lin0(x)`` kept, for a penalty on ``h`` added to the loss."""

    def __init__(self):
        super().__init__()
        self.lin0, self.head = nn.Linear(4, 5), nn.Linear(5, 3)

    def forward(self, x):
        self.h = self.lin0(x)
        return self.head(self.h)


def test_a_term_added_to_the_loss_raises(parts):
    """``h`` has one tracked consumer, whose part autograd passes on; a penalty on ``h``
    added after the loss adds to ``h``'s gradient (in either order of the two), and
    the check must see it."""
    torch.manual_seed(9)
    model, lossf = Penalised().to(DT), nn.CrossEntropyLoss()
    X, y = torch.randn(3, 4, dtype=DT), torch.randint(0, 3, (3,))
    for penalty_first in (False, True):
        with pytest.raises(ChainError, match=r"module 'lin0' \(Linear\).*besides the tracked modules 'head'"):
            with jacmem.extend(DiagGGNExact()):
                out = model(X)
                penalty = 1e-3 * model.h.square().sum()
                loss = penalty + lossf(out, y) if penalty_first else lossf(out, y) + penalty
                loss.backward()


@pytest.mark.parametrize("v", [3, LOOP_V + 5], ids=["loop", "vmap"])
def test_generic_vjp_both_ways(v):
    """The generic vjp loops over up to LOOP_V vectors and vmaps beyond: both give
    Jᵀ S per floating input (None for an integer one), as the dense Jacobian does."""
    torch.manual_seed(1)
    a, b, idx = torch.randn(2, 3, dtype=DT), torch.randn(2, 3, dtype=DT), torch.tensor([1, 0])

    def f(a, b, idx):
        return (a * b.sin())[idx]

    S = torch.randn(v, 2, 3, dtype=DT)
    got = vjp_generic(f, (a, b, idx), S)
    J = torch.autograd.functional.jacobian(lambda a, b: f(a, b, idx), (a, b))  # [2, 3, 2, 3] each
    for g, Jx in zip(got[:2], J):
        torch.testing.assert_close(g, torch.einsum("vno,nopq->vpq", S, Jx))
    assert got[2] is None
