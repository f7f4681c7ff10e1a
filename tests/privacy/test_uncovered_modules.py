"""Trainable modules that no registered derivative covers, under ClipGrad and the
PrivacyEngine, as privacy.rst and from_opacus.rst say: one the generic fallback can
recompute per sample is clipped exactly (with the fallback's warning naming it); one it
refuses (a forward that updates a buffer in training mode) raises in the first backward
pass, naming the module, and writes no ``.grad``."""

from __future__ import annotations

import pytest
import torch
from tests.support.privacy import loader, loop_step, private, train
from torch import nn

from jacmem.privacy import PrivacyEngine

pytestmark = pytest.mark.usefixtures("float64_default")


class Diagonal(nn.Module):
    """x @ diag(weight): a module jacmem has no derivative for (the matrix product hides
    the broadcast, so only a recomputation gives its per-sample gradients)."""

    def __init__(self, counts: bool = False):
        super().__init__()
        self.counts = counts
        self.weight = nn.Parameter(torch.randn(4))
        if counts:
            self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        if self.counts and self.training:
            self.seen += 1  # a buffer updated in training mode: the fallback refuses
        return x @ torch.diag(self.weight)


def model(counts: bool = False) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), Diagonal(counts))


def squares(out, target, reduction: str):
    """Σ over features of the squared error, then the batch's mean or sum (the mean over
    the batch alone, as Opacus's loss_reduction="mean" assumes)."""
    per_sample = (out - target).square().sum(1)
    return per_sample.mean() if reduction == "mean" else per_sample.sum()


def data():
    torch.manual_seed(1)
    return torch.randn(8, 3), torch.randn(8, 4)


def test_a_module_the_fallback_recomputes_is_clipped_exactly():
    X, y = data()
    net = model()
    max_norm = 0.5
    want = loop_step(net, [(X, y)], max_norm, "flat", loss=squares)
    net, opt, _ = private(PrivacyEngine(), net, max_norm, data_loader=loader(X, y, batch_size=len(X)))
    with pytest.warns(UserWarning, match=r"'2' \(Diagonal\).*recomputed one sample at a time"):
        train(net, opt, [(X, y)], loss=squares)
    for p, w in zip(net.parameters(), want):
        torch.testing.assert_close(p.detach(), w, rtol=1e-9, atol=1e-12)


def test_a_module_the_fallback_refuses_raises_in_the_first_backward():
    X, y = data()
    net = model(counts=True)
    net, opt, _ = private(PrivacyEngine(), net, 0.5, data_loader=loader(X, y, batch_size=len(X)))
    with pytest.raises(RuntimeError, match=r"ClipGrad: module '2' \(Diagonal\).*cannot clip them"):
        squares(net(X), y, "mean").backward()
    assert all(p.grad is None for p in net.parameters())
