"""First-order extensions through whole architectures, against a per-sample autograd loop.

Residual connections, functional ops between modules, nested custom containers,
modules called several times (weight tying, loops: per-sample quantities are those of
the *summed* per-sample gradient) and frozen parameters (they get nothing and keep no
input). Every model runs every extension alone and all together, both flows, under
"auto" and every strategy name its layers' registry entries offer.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from tests.support.architectures import MODELS, TiedNet, make
from tests.support.reference import (
    FLOWS,
    SAVEFIELDS,
    check_against,
    per_sample_grads,
    recorded,
    run_jacmem,
)
from torch import nn

import jacmem
from jacmem.derivatives import REGISTRY

EXTENSIONS = [jacmem.BatchGrad, jacmem.BatchL2Grad, jacmem.SumGradSquared, jacmem.Variance]
EXTENSION_SETS = [[e] for e in EXTENSIONS] + [EXTENSIONS]


def check_frozen(model: nn.Module) -> None:
    for name, p in model.named_parameters():
        if not p.requires_grad:
            assert p.grad is None
            for field in SAVEFIELDS:
                assert not hasattr(p, field), f"frozen {name} got {field}"


def strategies(name: str):
    """ "auto" and every strategy name offered by a layer type of the model."""
    model = make(name)[0]
    offered = set().union(*(REGISTRY[type(m)].names() for m in model.modules() if type(m) in REGISTRY))
    return sorted(offered | {"auto"})


GRID = [(name, strategy) for name in MODELS for strategy in strategies(name)]


@pytest.mark.parametrize("name,strategy", GRID, ids=[f"{n}-{s}" for n, s in GRID])
def test_architecture(name, strategy):
    """Every extension alone and all together, both flows; both reductions under "auto"."""
    model, X, y, loss = make(name)
    for reduction in ("mean", "sum") if strategy == "auto" else ("mean",):
        reference = per_sample_grads(model, X, y, loss, reduction)
        for extensions, flow in itertools.product(EXTENSION_SETS, FLOWS):
            run_jacmem(model, X, y, loss, reduction, [e() for e in extensions], flow, strategy=strategy)
            what = f"[{name} {strategy} {reduction} {[e.__name__ for e in extensions]} {flow}]"
            check_against(model, reference, [e.savefield for e in extensions], what)
            check_frozen(model)
        for flow in FLOWS:  # every quantity in chunks of one sample
            run_jacmem(model, X, y, loss, reduction, [e() for e in EXTENSIONS], flow, strategy=strategy, chunk_bytes=1)
            check_against(model, reference, [e.savefield for e in EXTENSIONS], f"[{name} {strategy} {flow} chunked]")


def test_tied_weights_norms_are_of_the_summed_gradient():
    """A shared parameter's batch_l2 and sum_grad_squared are those of Σ_calls g_n, not
    Σ_calls of each call's: the two differ here, so a per-call answer cannot pass."""
    model, X, y, loss = make("tied")
    torch.manual_seed(sum(map(ord, "tied")))
    untied = TiedNet(untied=True).double()
    reference = per_sample_grads(model, X, y, loss, "mean")
    per_call = per_sample_grads(untied, X, y, loss, "mean")
    run_jacmem(model, X, y, loss, "mean", [jacmem.BatchL2Grad(), jacmem.SumGradSquared()])
    for tied_p, calls in [
        (model.conv.weight, (untied.conv.weight, untied.conv2.weight)),
        (model.square.weight, (untied.square.weight, untied.square2.weight)),
        (model.a.weight, (untied.a.weight, untied.b.weight)),
    ]:
        first, second = (per_call[p] for p in calls)
        torch.testing.assert_close(first + second, reference[tied_p])  # the untied copy is the same net
        summed_norms = (first + second).flatten(1).square().sum(1)
        per_call_norms = first.flatten(1).square().sum(1) + second.flatten(1).square().sum(1)
        assert not torch.allclose(summed_norms, per_call_norms)
        torch.testing.assert_close(tied_p.batch_l2, summed_norms)
        torch.testing.assert_close(tied_p.sum_grad_squared, (first + second).square().sum(0))


def test_frozen_layers_keep_no_input():
    """A module without trainable parameters gets no record; one whose only trainable
    parameter is its bias keeps no input. Checked while the records are alive, between
    forward and backward, in both flows."""
    model, X, y, loss = make("frozen")

    def inspect(records, flow):
        alive = [r() for r in records if r() is not None]
        modules = [rec.module for rec in alive]
        assert model.frozen not in modules, f"{flow}: the frozen conv was recorded"
        assert model.first in modules and model.bias_only in modules and model.conv in modules
        for rec in alive:
            if rec.module in (model.first, model.bias_only):
                assert rec.x is None, f"{flow}: {rec.name} kept its input though only its bias trains"
            else:
                assert rec.x is not None

    with recorded() as records:
        with jacmem.extend(jacmem.BatchGrad(), jacmem.Variance()):
            value = loss(model(X), y, "mean")
            inspect(records, "inside")
            value.backward()
    with recorded() as records:
        jacmem.track(model)
        try:
            value = loss(model(X), y, "mean")
            inspect(records, "track")
            with jacmem.extend(jacmem.BatchGrad(), jacmem.Variance()):
                value.backward()
        finally:
            jacmem.untrack(model)
    assert model.bias_only.bias.grad_batch.shape == (3, 4)


@pytest.mark.parametrize("flow", FLOWS)
def test_training_loop(flow):
    """Several steps in a row, with fresh data each step: each step's attributes are that
    step's, and nothing of an earlier step (or its still-referenced graph) leaks in."""
    model, _, _, loss = make("tied")
    extensions = [jacmem.BatchGrad(), jacmem.BatchL2Grad(), jacmem.Variance()]
    fields = [e.savefield for e in extensions]
    if flow == "track":
        jacmem.track(model)
    try:
        for step in range(3):
            X, y = (
                torch.randn(4 - step % 2, 2, 5, dtype=torch.float64),
                torch.randn(4 - step % 2, 3, dtype=torch.float64),
            )
            reference = per_sample_grads(model, X, y, loss, "sum")
            for p in model.parameters():
                p.grad = None
            if flow == "inside":
                with jacmem.extend(*extensions):
                    value = loss(model(X), y, "sum")
                    value.backward()
            else:
                value = loss(model(X), y, "sum")
                with jacmem.extend(*extensions):
                    value.backward()
            check_against(model, reference, fields, f"[step {step} {flow}]")
    finally:
        jacmem.untrack(model)


@pytest.mark.parametrize("name", ["tied", "residual"])
def test_two_backward_passes_through_one_graph(name):
    """backward(retain_graph=True) then backward() in one block: .grad accumulates, but
    each pass writes its own quantities, so they are those of one pass."""
    model, X, y, loss = make(name)
    reference = per_sample_grads(model, X, y, loss, "mean")
    with jacmem.extend(jacmem.BatchGrad(), jacmem.BatchL2Grad(), jacmem.Variance()):
        value = loss(model(X), y, "mean")
        value.backward(retain_graph=True)
        value.backward()
    for p in model.parameters():
        p.grad = p.grad / 2
    check_against(model, reference, ["grad_batch", "batch_l2", "variance"], f"[{name}]")
