"""The registries' own contracts: one class-hierarchy lookup, lean layers that stand for
stock ones without being registered, parameter names checked against the module, and
layer capabilities (Kronecker factors) that a layer file registers for itself.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import jacmem
from jacmem.derivatives import (
    LOSSES,
    PASSTHROUGH,
    REGISTRY,
    Kronecker,
    layer,
    linear,
    lookup,
    lookup_loss,
    lookup_passthrough,
    passthrough,
    register,
    registered_type,
)
from jacmem.memory import LEAN, lean

DT = torch.float64


class Scale(nn.Module):
    """x ⊙ weight, with a parameter named ``weight``."""

    def __init__(self, d: int = 3):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d))

    def forward(self, x):
        return x * self.weight


def register_misspelt():
    register(Scale, "wieght", "batch_grad", "mine")(lambda x, g: g * x)


@pytest.fixture
def registered_scale():
    """``Scale`` registered under a misspelt name; the registry is restored afterwards."""
    register_misspelt()
    yield
    REGISTRY.pop(Scale, None)


def test_misspelt_parameter_name_raises_naming_type_name_and_the_real_names(registered_scale):
    with pytest.raises(ValueError, match=r"Scale has no parameter 'wieght'.*\['weight'\]"):
        lookup(Scale())
    register_misspelt()  # the refusal withdrew it
    model = nn.Sequential(nn.Linear(2, 3), Scale())
    with pytest.raises(ValueError, match="'wieght'"), jacmem.extend(jacmem.BatchGrad()):
        model(torch.randn(4, 2)).sum().backward()


def test_without_the_misspelt_registration_the_fallback_works_again(registered_scale):
    del REGISTRY[Scale]
    model = Scale().to(DT)
    x = torch.randn(4, 3, dtype=DT)
    with jacmem.extend(jacmem.BatchGrad()):
        model(x).sum().backward()
    torch.testing.assert_close(model.weight.grad_batch, x)


def test_names_are_checked_again_after_a_new_registration():
    register(Scale, "weight", "batch_grad", "mine")(lambda x, g: g * x)
    try:
        assert lookup(Scale()) is REGISTRY[Scale]
        register(Scale, "scale", "batch_l2", "mine")(lambda x, g: (g * x).square().sum(1))
        with pytest.raises(ValueError, match="'scale'"):
            lookup(Scale())
    finally:
        del REGISTRY[Scale]


def test_absent_optional_parameters_are_names_the_module_has():
    """``bias=False`` registers ``bias`` as None: not a misspelling."""
    for module in (nn.Linear(2, 3, bias=False), nn.Conv2d(1, 2, 3, bias=False), nn.LayerNorm(3, bias=False)):
        assert lookup(module) is REGISTRY[type(module)]
    assert lookup(nn.MultiheadAttention(4, 2, kdim=3, vdim=3)) is REGISTRY[nn.MultiheadAttention]


@pytest.mark.skipif(not hasattr(nn, "RMSNorm"), reason="nn.RMSNorm came with torch 2.4")
def test_rms_norm_registers_no_bias():
    assert {p for p, _ in REGISTRY[nn.RMSNorm].strategies} == {"weight"}
    assert lookup(nn.RMSNorm(3)) is REGISTRY[nn.RMSNorm]


def test_lean_layers_stand_for_their_stock_types_and_are_registered_nowhere():
    for stock, lean_type in LEAN.items():
        assert lean_type.stands_for is stock
        for table in (REGISTRY, PASSTHROUGH, LOSSES):
            assert lean_type not in table
            assert registered_type(table, lean_type) is registered_type(table, stock)
    conv = lean(nn.Conv2d(1, 2, 3))
    assert lookup(conv) is REGISTRY[nn.Conv2d] and lookup_passthrough(conv) is PASSTHROUGH[nn.Conv2d]


def test_one_hierarchy_rule_for_every_registry():
    """A subclass that keeps the registered class's forward gets its entries, in every
    registry; one that overrides forward gets none (the generic fallback, for first order)."""

    class Kept(nn.Linear):
        pass

    class Overridden(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    class KeptLoss(nn.MSELoss):
        pass

    class LeanOverridden(LEAN[nn.Conv2d]):
        def forward(self, x):
            return super().forward(x)

    assert lookup(Kept(2, 2)) is REGISTRY[nn.Linear] and lookup_passthrough(Kept(2, 2)) is PASSTHROUGH[nn.Linear]
    assert lookup(Overridden(2, 2)) is not REGISTRY[nn.Linear] and lookup_passthrough(Overridden(2, 2)) is None
    assert lookup_loss(KeptLoss()) is LOSSES[nn.MSELoss]
    assert registered_type(REGISTRY, LeanOverridden) is None


class Dense(nn.Module):
    """A layer family of its own (``x @ weight.T``), registered the way a layer file does,
    Kronecker rules included: KFLR then gives what it gives nn.Linear."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out, d_in))

    def forward(self, x):
        return x @ self.weight.T


def test_a_new_layer_brings_its_kronecker_rules_in_its_own_registration():
    layer(Dense, kronecker=Kronecker(linear.kronecker_input, channels_last=True))
    register(Dense, "weight", "batch_grad", "outer")(linear.weight_batch_grad)
    passthrough(Dense, jac_t=linear.jac_t, hyperparams=lambda m: {"weight": m.weight.detach()})
    try:
        torch.manual_seed(0)
        reference = nn.Sequential(nn.Linear(4, 3, bias=False), nn.Tanh(), nn.Linear(3, 2, bias=False)).to(DT)
        model = nn.Sequential(Dense(4, 3), nn.Tanh(), Dense(3, 2)).to(DT)
        for dense, lin in zip(model[::2], reference[::2]):
            dense.weight.data.copy_(lin.weight.data)
        X, y = torch.randn(5, 4, dtype=DT), torch.randint(0, 2, (5,))
        for net in (model, reference):
            with jacmem.extend(jacmem.KFLR(), strict=True):
                nn.CrossEntropyLoss()(net(X), y).backward()
        for dense, lin in zip(model[::2], reference[::2]):
            for mine, theirs in zip(dense.weight.kflr, lin.weight.kflr):
                torch.testing.assert_close(mine, theirs)
    finally:
        del REGISTRY[Dense], PASSTHROUGH[Dense]
