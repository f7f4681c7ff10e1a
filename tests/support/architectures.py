"""Whole architectures for the first-order tests (tests/engine/test_architectures.py,
tests/extensions/test_backpack_agreement.py): residual connections, functional ops
between modules, nested containers, weight tying, loops and frozen parameters."""

from __future__ import annotations

import copy

import torch
from tests.support.reference import cross_entropy, mse
from torch import nn
from torch.nn import functional as F


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
