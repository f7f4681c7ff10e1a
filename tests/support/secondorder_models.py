"""Small residual and branching models that several second-order test files build
(tests/engine/test_secondorder_*.py)."""

from __future__ import annotations

import torch
from torch import nn

import jacmem

DT = torch.float64


def resnet():
    """[N, 4] -> [N, 3], float64: a residual block and a parallel one between Linears."""
    return nn.Sequential(
        nn.Linear(4, 5),
        nn.Tanh(),
        jacmem.nn.Residual(nn.Linear(5, 5), nn.Sigmoid(), nn.Linear(5, 5)),
        jacmem.nn.Parallel(nn.Identity(), nn.Sequential(nn.ELU(), nn.Linear(5, 5)), jacmem.nn.Scale(0.5)),
        nn.SiLU(),
        nn.Linear(5, 3),
    ).to(DT)


class Block(nn.Module):
    """[N, 4] -> [N, 3]: h = lin0(x); out = head(Sum(h, lin1(op(h)))) with ``op`` on the branch."""

    def __init__(self, op, functional_sum=False):
        super().__init__()
        self.lin0, self.lin1, self.head = nn.Linear(4, 5), nn.Linear(5, 5), nn.Linear(5, 3)
        self.sum, self.op, self.functional_sum = jacmem.nn.Sum(), op, functional_sum

    def forward(self, x):
        h = self.lin0(x)
        branch = self.lin1(self.op(h))
        return self.head(h + branch if self.functional_sum else self.sum(h, branch))
