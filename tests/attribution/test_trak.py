"""TRAK's scores against a dense float64 reference: per-sample margin gradients by a loop
of autograd calls, the kernel ``ΦᵀΦ + λ`` built and inverted."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from jacmem.attribution import TRAK, margin


def _model():
    torch.manual_seed(4)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).double()


def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g)


def output_fn(model, batch):
    x, y = batch
    return margin(model(x), y)


def test_margin_is_the_log_odds_of_the_correct_class():
    logits, y = torch.randn(5, 4, dtype=torch.float64), torch.tensor([0, 3, 1, 1, 2])
    p = logits.softmax(1).gather(1, y[:, None])[:, 0]
    torch.testing.assert_close(margin(logits, y), torch.log(p / (1 - p)))


def _phi(model, x, y):
    rows = []
    for i in range(len(x)):
        grads = torch.autograd.grad(output_fn(model, (x[i : i + 1], y[i : i + 1])).sum(), list(model.parameters()))
        rows.append(torch.cat([g.flatten() for g in grads]))
    return torch.stack(rows)


def test_scores_equal_the_dense_kernel_reference():
    model = _model()
    x, y = _data(10, 0)
    xq, yq = _data(4, 1)
    train = [(x[i : i + 4], y[i : i + 4]) for i in range(0, 10, 4)]
    trak = TRAK(model, output_fn, damping=0.01, progress=False).fit(train)
    got = trak.scores([(xq[:2], yq[:2]), (xq[2:], yq[2:])], train)
    phi, phi_q = _phi(model, x, y), _phi(model, xq, yq)
    K = phi.T @ phi + 0.01 * torch.eye(phi.shape[1], dtype=torch.float64)
    Q = 1 - model(x).softmax(1).gather(1, y[:, None])[:, 0]
    want = phi_q @ torch.linalg.inv(K) @ phi.T * Q[None, :].detach()
    torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-12)


def test_a_singular_kernel_names_the_fix():
    x, y = _data(4, 0)
    with pytest.raises(ValueError, match="give a damping > 0"):
        TRAK(_model(), output_fn, progress=False).fit([(x, y)])
