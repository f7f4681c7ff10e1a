"""Registrations are atomic: a registration refused at the first lookup (a parameter name
the module does not have) is withdrawn, so the registry's tables are exactly as they
were before it, and a corrected registration then works, in the same process.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from tests.support.reference import assert_close, mse, per_sample_grads
from torch import nn

import jacmem
from jacmem.derivatives import REGISTRY, lookup

pytestmark = pytest.mark.usefixtures("float64_default")


class Gain(nn.Module):
    """x ⊙ weight + bias: [N, d] -> [N, d]."""

    def __init__(self, d: int = 4):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d))
        self.bias = nn.Parameter(torch.randn(d))

    def forward(self, x):
        return x * self.weight + self.bias


@pytest.fixture(autouse=True)
def _restore_registry():
    yield
    REGISTRY.pop(Gain, None)


def tables() -> tuple[list, dict]:
    """The registry's keys in order, and a copy of each entry with its strategy tables copied."""
    copies = {
        key: replace(
            entry, strategies={k: dict(t) for k, t in entry.strategies.items()}, input_free=set(entry.input_free)
        )
        for key, entry in REGISTRY.items()
    }
    return list(REGISTRY), copies


def model():
    return nn.Sequential(nn.Linear(3, 4), Gain(4), nn.Tanh(), nn.Linear(4, 2))


def weight_grad(calls: list):
    def fn(x, g):
        """x, g: [N, d] -> [N, d]"""
        calls.append("weight")
        return g * x

    return fn


def bias_grad(x, g):
    """g: [N, d] -> [N, d]"""
    return g


def step(net, X, y):
    with jacmem.extend(jacmem.BatchGrad()):
        mse(net(X), y, "mean").backward()


def test_a_misspelt_registration_raises_naming_the_parameter_and_the_fix_and_is_withdrawn():
    net, X, y = model(), torch.randn(5, 3), torch.randn(5, 2)
    before = tables()
    jacmem.register(Gain, "wieght")(weight_grad([]))
    assert tables() != before
    match = r"Gain has no parameter 'wieght'.*\['weight', 'bias'\].*Register the derivative under one of those names.*withdrawn"
    with pytest.raises(ValueError, match=match):
        step(net, X, y)
    assert tables() == before
    assert Gain not in REGISTRY
    assert not any(hasattr(p, "grad_batch") for p in net.parameters())


def test_the_corrected_registration_then_works():
    net, X, y = model(), torch.randn(5, 3), torch.randn(5, 2)
    jacmem.register(Gain, "wieght")(weight_grad([]))
    with pytest.raises(ValueError, match="'wieght'"):
        step(net, X, y)
    calls: list = []
    jacmem.register(Gain, "weight")(weight_grad(calls))
    jacmem.register(Gain, "bias")(bias_grad)
    reference = per_sample_grads(net, X, y, mse)
    step(net, X, y)
    assert calls, "the corrected registration was not used"
    for name, p in net.named_parameters():
        assert_close(p.grad_batch, reference[p], name)


def test_a_refusal_leaves_earlier_declarations_and_confirmed_strategies_as_they_were():
    """``layer()``, a strategy confirmed on an instance, and a strategy that the refused
    registration replaced: each is back as it was; two refused registrations under the
    same name are both withdrawn."""
    net, X, y = model(), torch.randn(5, 3), torch.randn(5, 2)
    calls: list = []
    jacmem.layer(Gain, hyperparams=lambda m: {})
    jacmem.register(Gain, "weight")(weight_grad(calls))
    jacmem.register(Gain, "bias")(bias_grad)
    assert lookup(Gain()) is REGISTRY[Gain]
    before = tables()
    jacmem.register(Gain, "wieght")(weight_grad([]))
    jacmem.register(Gain, "wieght")(weight_grad([]))
    with pytest.raises(ValueError, match="'wieght'.*withdrawn"):
        lookup(Gain())
    assert tables() == before
    reference = per_sample_grads(net, X, y, mse)
    step(net, X, y)
    assert calls
    for name, p in net.named_parameters():
        assert_close(p.grad_batch, reference[p], name)
