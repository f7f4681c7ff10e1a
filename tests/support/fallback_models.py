"""Modules with no registered derivative, for the generic fallback's tests
(tests/derivatives/test_generic_fallback.py, tests/engine/test_host_syncs.py)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

F_ = 4


class ScaledLinear(nn.Module):
    """Its own parameters (``scale``, ``shift``) around a registered child (``lin``):
    the fallback covers the first two, the child's record its own."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(F_))
        self.shift = nn.Parameter(torch.randn(2, F_))
        self.lin = nn.Linear(F_, F_)

    def forward(self, x):  # [N, *, F] -> [N, *, F]
        return torch.tanh(self.lin(x) * self.scale + self.shift[0]) * self.shift[1] + x


class Gated(nn.Module):
    """Keyword arguments, batched (``mask [N, F]``) and shared (``temperature [F]``, a
    string), and two outputs, both used."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(F_, F_))

    def forward(self, x, *, mask, temperature, mode="sigmoid"):
        z = x @ self.weight / temperature
        gate = torch.sigmoid(z) if mode == "sigmoid" else torch.tanh(z)
        return gate * mask, (z * z).sum(-1, keepdim=True)


class SquaredLinear(nn.Linear):
    """A Linear subclass with its own forward: Linear's derivative does not apply."""

    def forward(self, x):
        return F.linear(x, self.weight * self.weight, self.bias)


class Model(nn.Module):
    """Conv2d -> ScaledLinear (on rows) -> Gated -> a residual -> SquaredLinear -> Linear."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3)
        self.scaled = ScaledLinear()
        self.gated = Gated()
        self.squared = SquaredLinear(F_, 5)
        self.head = nn.Linear(3 * 4 * 5 + 1, 2)

    def forward(self, x):  # [N, 2, 6, 6] -> [N, 2]
        z = self.scaled(torch.relu(self.conv(x)))  # [N, 3, 4, 4]
        mask = (x[:, 0, :4, :4].mean(1) > 0).double()  # [N, 4], per sample
        gate, energy = self.gated(z.mean((1, 2)), mask=mask, temperature=torch.linspace(1, 2, F_, dtype=x.dtype))
        z = z + gate[:, None, None]  # a residual connection
        out = self.squared(z).flatten(1)
        return self.head(torch.cat([out, energy], 1))
