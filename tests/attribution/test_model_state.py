"""Influence leaves the model as it found it: a model in training mode is scored in eval
mode (dropout off, batch norm on its running statistics, as kronfluence's
``prepare_model``), its running statistics, torch's random state and every module's
training flag unchanged. Before, dropout drew a new mask on every forward (two calls of
``scores`` on the same data disagreed, torch's random state moved) and batch norm's
running statistics moved on every fit."""

from __future__ import annotations

import torch
from tests.support.attribution import summed_cross_entropy as loss_fn
from torch import nn

from jacmem.attribution import TRAK, Influence, margin


def _model() -> nn.Module:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5), nn.Tanh(), nn.Dropout(0.5), nn.Linear(5, 3)).double()
    with torch.no_grad():  # running statistics other than the initial ones, so that eval mode uses them
        model[1].running_mean.uniform_(-0.5, 0.5)
        model[1].running_var.uniform_(0.5, 2.0)
    return model


def _data(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g)


def _per_sample(model, x, y) -> torch.Tensor:
    """``[n, P]`` of the model in eval mode, one autograd call per sample."""
    model.eval()
    rows = [
        torch.cat([g.flatten() for g in torch.autograd.grad(loss_fn(model, (x[i : i + 1], y[i : i + 1])), list(model.parameters()))])
        for i in range(len(x))
    ]  # fmt: skip
    return torch.stack(rows)


def test_a_model_in_training_mode_is_scored_in_eval_mode_and_left_as_it_was():
    model = _model().train()
    model[3].eval()  # a mixed state, restored module by module
    flags = [m.training for m in model.modules()]
    stats = [b.clone() for b in model.buffers()]
    x, y = _data(8, 0)
    xq, yq = _data(3, 1)
    train = [(x[:4], y[:4]), (x[4:], y[4:])]
    rng = torch.get_rng_state()
    inf = Influence(model, loss_fn, curvature="diag", damping=0.1, progress=False).fit(train)
    got = inf.scores([(xq, yq)], train)
    again = inf.scores([(xq, yq)], [(x, y)])  # a new query pass; the training rows from the store
    own = inf.self_influence(train)
    assert torch.equal(torch.get_rng_state(), rng)
    assert [m.training for m in model.modules()] == flags
    assert all(torch.equal(b, s) for b, s in zip(model.buffers(), stats))
    G, Gq = _per_sample(model, x, y), _per_sample(model, xq, yq)
    want = Gq / (G.square().sum(0) + 0.1) @ G.T
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(again, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(own, (G / (G.square().sum(0) + 0.1) * G).sum(1), rtol=1e-10, atol=1e-12)


def test_trak_on_a_model_in_training_mode_is_trak_in_eval_mode():
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Dropout(0.5), nn.Linear(5, 3)).double().train()
    x, y = _data(8, 0)
    rng = torch.get_rng_state()
    got = TRAK(model, lambda m, b: margin(m(b[0]), b[1]), damping=0.1, progress=False).fit([(x, y)])
    scores = got.scores([(x[:2], y[:2])], [(x, y)])
    assert torch.equal(torch.get_rng_state(), rng) and model.training
    model.eval()
    phi = torch.stack(
        [torch.cat([g.flatten() for g in torch.autograd.grad(margin(model(x[i : i + 1]), y[i : i + 1]).sum(), list(model.parameters()))]) for i in range(8)]
    )  # fmt: skip
    Q = torch.sigmoid(-margin(model(x), y)).detach()
    want = phi[:2] @ torch.linalg.solve(
        phi.T @ phi + 0.1 * torch.eye(phi.shape[1], dtype=torch.float64), (phi * Q[:, None]).T
    )
    torch.testing.assert_close(scores, want, rtol=1e-9, atol=1e-12)
