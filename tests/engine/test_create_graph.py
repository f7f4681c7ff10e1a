"""``create_graph=True`` inside a block: what a second backward through the first one's
graph gets, and what differentiating a quantity gets.

- BackPACK's "gradient of variance" example (``backward(create_graph=True)`` in the block,
  then the gradient of the summed ``variance`` w.r.t. the parameters): jacmem's quantities
  are constants, so it raises, naming jacmem (it raised torch's "does not require grad").
- A gradient penalty (or a Hessian-vector product) inside the block: its "loss" is a
  function of gradients, not a sum over samples, so it has no per-sample quantities; it
  raises, and the first backward's quantities stay (it overwrote ``grad_batch`` with
  numbers that summed to the penalty's gradient). After the block it is autograd's own.

Float64, against the per-sample autograd loop of ``tests/support/reference.py`` and plain
autograd on a copy.
"""

from __future__ import annotations

import copy

import pytest
import torch
from tests.support.reference import FIRST_ORDER, REFERENCE, mse, per_sample_grads
from torch import nn

import jacmem

FIELDS = list(FIRST_ORDER)
NOT_DIFFERENTIABLE = r"jacmem: '\w+' is not differentiable"
SECOND_BACKWARD = r"jacmem: this backward differentiates the gradients of a backward\(create_graph=True\)"


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()


def data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(5, 3, generator=g, dtype=torch.float64), torch.randn(5, 2, generator=g, dtype=torch.float64)


def first_backward(model, X, y):
    """Every first-order extension, ``backward(create_graph=True)``; the quantities, cloned."""
    with jacmem.extend(*[e() for e in FIRST_ORDER.values()]):
        mse(model(X), y, "sum").backward(retain_graph=True, create_graph=True)
    return {(p, f): getattr(p, f).detach().clone() for p in model.parameters() for f in FIELDS}


def assert_reference(model, X, y):
    for p, gb in per_sample_grads(model, X, y, mse, "sum").items():
        for field in FIELDS:
            torch.testing.assert_close(getattr(p, field).detach(), REFERENCE[field](gb), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("field", FIELDS)
def test_gradient_of_a_quantity_raises_naming_jacmem(field):
    """BackPACK's gradient-of-variance example, ported: the values are right, and the
    gradient of their sum raises jacmem's error, not torch's "does not require grad"."""
    model = mlp()
    X, y = data()
    first_backward(model, X, y)
    assert_reference(model, X, y)
    total = sum(getattr(p, field).sum() for p in model.parameters())
    with pytest.raises(RuntimeError, match=NOT_DIFFERENTIABLE):
        torch.autograd.grad(total, list(model.parameters()))


def penalty(model):
    return sum(p.grad.square().sum() for p in model.parameters())


def test_gradient_penalty_inside_the_block_raises_and_keeps_the_first_quantities():
    model = mlp()
    X, y = data()
    with jacmem.extend(jacmem.BatchGrad(), jacmem.Variance()):
        mse(model(X), y, "sum").backward(create_graph=True)
        first = {p: (p.grad_batch, p.variance) for p in model.parameters()}
        with pytest.raises(RuntimeError, match=SECOND_BACKWARD):
            penalty(model).backward()
    for p, (grad_batch, variance) in first.items():
        assert p.grad_batch is grad_batch and p.variance is variance
    for p, gb in per_sample_grads(model, X, y, mse, "sum").items():
        torch.testing.assert_close(p.grad_batch.detach(), gb, rtol=1e-10, atol=1e-12)


def test_hessian_vector_product_inside_the_block_raises():
    model = mlp()
    X, y = data()
    params = list(model.parameters())
    with jacmem.extend(jacmem.BatchGrad()):
        grads = torch.autograd.grad(mse(model(X), y, "sum"), params, create_graph=True)
        with pytest.raises(RuntimeError, match=SECOND_BACKWARD):
            torch.autograd.grad(grads, params, [torch.ones_like(p) for p in params])


def test_gradient_penalty_after_the_block_is_autograds():
    """The fix the error names: the penalty's backward after the block gives autograd's
    ``.grad``, and the first backward's quantities stay."""
    model = mlp()
    twin = copy.deepcopy(model)
    X, y = data()
    first = first_backward(model, X, y)
    penalty(model).backward()
    mse(twin(X), y, "sum").backward(create_graph=True)
    penalty(twin).backward()
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12)
        for field in FIELDS:
            assert torch.equal(getattr(p, field).detach(), first[p, field])
