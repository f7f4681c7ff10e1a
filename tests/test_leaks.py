"""No leaks: 100 training steps with every extension keep the process's memory flat.

Two loops, each with every first-order and every second-order extension at once, SGD
steps on a small CNN: a new ``extend`` block per step, and one block around all the
steps (a block a lab leaves open for a week). After a warm-up of 20 steps (allocator
pools, lazy imports, autograd caches), 100 more steps may grow the resident set size
by less than ``BOUND`` bytes (4 MB). Each step keeps the extensions' results alive until the
next one replaces them, as training does. Afterwards no record, hook or block remains.

An honest leak is well above the bound: the inputs kept for one step of this model
are ~2 kB, but keeping each step's loss (so its graph) and results grows RSS by ~7 MB
over 100 steps, where clean steps grow it by ~0.5 MB (measured on this model).
"""

from __future__ import annotations

import gc

import psutil
import pytest
import torch
from torch import nn
from torch.nn.modules import module as module_hooks

import jacmem
import jacmem.context
from jacmem.engine import hooks

BOUND = 4 * 2**20
WARMUP, STEPS = 20, 100


def extensions():
    return [
        jacmem.BatchGrad(), jacmem.BatchL2Grad(), jacmem.SumGradSquared(), jacmem.Variance(),
        jacmem.DiagGGNExact(), jacmem.DiagGGNMC(), jacmem.BatchDiagGGNExact(), jacmem.DiagHessian(),
        jacmem.BatchDiagHessian(), jacmem.KFAC(), jacmem.KFLR(), jacmem.KFRA(),
    ]  # fmt: skip


def net():
    """[N, 2, 6, 6] -> [N, 3]"""
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, stride=2), nn.ReLU(), nn.Flatten(),
        nn.Linear(4 * 2 * 2, 3),
    )  # fmt: skip


def rss() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


def step(model, lossf, opt, X, y):
    opt.zero_grad()
    lossf(model(X), y).backward()
    for p in model.parameters():  # use the results, as training would
        assert p.grad_batch.shape[0] == X.shape[0] and p.diag_ggn_exact.shape == p.shape
    opt.step()


@pytest.mark.heavy
@pytest.mark.parametrize("blocks", ["one per step", "one for all steps"])
def test_rss_stays_flat_over_100_steps(blocks):
    torch.manual_seed(0)
    model, lossf = net(), nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    X, y = torch.randn(8, 2, 6, 6), torch.randint(0, 3, (8,))
    hooks_before = (len(module_hooks._global_forward_pre_hooks), len(module_hooks._global_forward_hooks))
    live_before = dict(hooks._LIVE)

    def run(steps):
        if blocks == "one per step":
            for _ in range(steps):
                with jacmem.extend(*extensions()):
                    step(model, lossf, opt, X, y)
        else:
            with jacmem.extend(*extensions()) as block:
                for _ in range(steps):
                    step(model, lossf, opt, X, y)
                assert len(block._tensor_handles) < 100, "the block keeps the hook handles of every step"

    run(WARMUP)
    start = rss()
    run(STEPS)
    growth = rss() - start
    assert growth < BOUND, f"RSS grew by {growth / 2**20:.1f} MB over {STEPS} steps ({blocks})"
    assert jacmem.context._ACTIVE is None
    assert (len(module_hooks._global_forward_pre_hooks), len(module_hooks._global_forward_hooks)) == hooks_before
    assert dict(hooks._LIVE) == live_before
