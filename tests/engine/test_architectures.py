"""First-order extensions through whole architectures, against a per-sample autograd loop.

Residual connections, functional ops between modules, nested custom containers,
modules called several times (weight tying, loops: per-sample quantities are those of
the *summed* per-sample gradient) and frozen parameters (they get nothing and keep no
input). Every model runs every extension alone and all together, both flows, under
"auto" and every strategy name its layers' registry entries offer.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from tests.support.reference import (
    FLOWS,
    SAVEFIELDS,
    check_against,
    cross_entropy,
    mse,
    per_sample_grads,
    recorded,
    run_jacmem,
)
from torch import nn
from torch.nn import functional as F

import jacmem
from jacmem.derivatives import REGISTRY

EXTENSIONS = [jacmem.BatchGrad, jacmem.BatchL2Grad, jacmem.SumGradSquared, jacmem.Variance]
EXTENSION_SETS = [[e] for e in EXTENSIONS] + [EXTENSIONS]


# -- models -------------------------------------------------------------------------


class Block(nn.Module):
    """A residual block: x + conv_b(relu(conv_a(x))), [N, C, H, W] -> [N, C, H, W]."""

    def __init__(self, c: int):
        super().__init__()
        self.convs = nn.ModuleDict({"a": nn.Conv2d(c, c, 3, padding=1), "b": nn.Conv2d(c, c, 3, padding="same")})

    def forward(self, x):
        return x + self.convs["b"](F.relu(self.convs["a"](x)))


class Stage(nn.Module):
    """A nested container: a list of blocks, then a strided conv."""

    def __init__(self, c: int):
        super().__init__()
        self.blocks = nn.ModuleList([Block(c), nn.Sequential(Block(c))])
        self.down = nn.Conv2d(c, 2 * c, 2, stride=2, bias=False)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.down(x)


class ResidualNet(nn.Module):
    """[N, 2, 6, 6] -> [N, 3], with functional ops between modules."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(2, 3, 3, padding=1, padding_mode="reflect")
        self.stage = Stage(3)
        self.head = nn.Sequential(nn.Linear(6 * 3 * 3, 5), nn.Tanh(), nn.Linear(5, 3))

    def forward(self, x):
        h = F.relu(self.stem(x))
        h = self.stage(h) * 2
        h = torch.flatten(h, 1)
        return self.head(h) + h[:, :3]


class TiedNet(nn.Module):
    """One Linear called twice, a weight shared by two Linears, a conv called twice:
    [N, 2, 5] -> [N, 3]. ``untied=True`` gives each call its own copy of the same values,
    so its per-sample gradients are the tied net's, call by call."""

    def __init__(self, untied: bool = False):
        super().__init__()
        self.conv = nn.Conv1d(2, 2, 3, padding=1)
        self.square = nn.Linear(10, 10)
        self.a = nn.Linear(10, 4)
        self.b = nn.Linear(10, 4)
        self.b.weight = self.a.weight  # tied; the biases stay apart
        self.out = nn.Linear(4, 3)
        if untied:
            self.conv2, self.square2 = copy.deepcopy(self.conv), copy.deepcopy(self.square)
            self.b.weight = nn.Parameter(self.a.weight.detach().clone())

    def forward(self, x):
        conv2, square2 = getattr(self, "conv2", self.conv), getattr(self, "square2", self.square)
        h = conv2(torch.tanh(self.conv(x)))
        h = torch.flatten(h, 1)
        h = square2(torch.tanh(self.square(h)))
        return self.out(torch.tanh(self.a(h)) * self.b(h.flip(1)))


class LoopNet(nn.Module):
    """A module called in a loop, a recurrent cell: [N, T, 4] -> [N, 3]."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 6)
        self.cell = nn.Linear(6, 6)
        self.out = nn.Linear(6, 3)

    def forward(self, x):
        h = torch.zeros(x.shape[0], 6, dtype=x.dtype)
        for t in range(x.shape[1]):
            h = torch.tanh(self.cell(h) + self.inp(x[:, t]))
        return self.out(h)


class FrozenNet(nn.Module):
    """A frozen first layer, a frozen conv in the middle, a layer with a frozen weight but
    a trainable bias, and a first layer with only its bias trainable: [N, 2, 6] -> [N, 3]."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(6, 6)  # only its bias trains: keeps no input
        self.frozen = nn.Conv1d(2, 2, 3, padding=1)  # no trainable parameter at all
        self.conv = nn.Conv1d(2, 3, 3)
        self.bias_only = nn.Linear(12, 4)
        self.out = nn.Linear(4, 3)
        for p in [self.first.weight, *self.frozen.parameters(), self.bias_only.weight]:
            p.requires_grad_(False)

    def forward(self, x):
        h = self.conv(F.relu(self.frozen(self.first(x))))
        return self.out(torch.tanh(self.bias_only(torch.flatten(h, 1))))


def residual():
    return ResidualNet().double(), torch.randn(3, 2, 6, 6), torch.randint(0, 3, (3,)), cross_entropy


def tied():
    return TiedNet().double(), torch.randn(3, 2, 5), torch.randn(3, 3), mse


def loop():
    return LoopNet().double(), torch.randn(3, 4, 4), torch.randint(0, 3, (3,)), cross_entropy


def frozen():
    return FrozenNet().double(), torch.randn(3, 2, 6), torch.randn(3, 3), mse


MODELS = {"residual": residual, "tied": tied, "loop": loop, "frozen": frozen}


def make(name: str):
    torch.manual_seed(sum(map(ord, name)))
    model, X, y, loss = MODELS[name]()
    return model, X.double(), y.double() if y.is_floating_point() else y, loss


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
