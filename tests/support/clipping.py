"""The clipping tests' reference (tests/extensions/test_clipping.py, whose docstring gives
the formulas): per-sample norms, the clipped sums, and both of the engine's ways to them."""

from __future__ import annotations

import pytest
import torch
from tests.support.reference import per_sample_grads, trainable
from torch import Tensor

import jacmem.engine.clipping


def per_sample(model, X, y, loss, reduction) -> dict:
    """{param: [N, *shape]}: the gradients of each sample's own loss term (the mean's
    ``1/N`` undone, as Opacus defines them)."""
    grads = per_sample_grads(model, X, y, loss, reduction)
    scale = X.shape[0] if reduction == "mean" else 1
    return {p: g * scale for p, g in grads.items()}


def norms(grads: dict) -> Tensor:
    return torch.stack([g.reshape(len(g), -1).square().sum(1) for g in grads.values()]).sum(0).sqrt()


def expected(grads: dict, max_norm, clipping: str = "flat", stability: float = 0.01) -> dict:
    """{param: Σ_n c_n g_n} by test_clipping's formulas."""
    total = norms(grads)
    out = {}
    for i, (p, g) in enumerate(grads.items()):
        if clipping == "flat":
            c = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        elif clipping == "automatic":
            c = max_norm / (total + stability)
        else:
            c = torch.clamp(max_norm[i] / (g.reshape(len(g), -1).norm(dim=1) + 1e-6), max=1.0)
        out[p] = (c.view(-1, *[1] * (g.dim() - 1)) * g).sum(0)
    return out


def assert_grads(model, want: dict, what: str = "") -> None:
    for i, p in enumerate(trainable(model)):
        torch.testing.assert_close(p.grad, want[p], rtol=1e-9, atol=1e-12, msg=lambda m: f"{what} param {i}: {m}")


def median_norm(grads: dict) -> float:
    """A threshold that clips some samples and not others."""
    total = norms(grads)
    c = total.median().item()
    assert (total > c).any() and (total < c).any()
    return c


@pytest.fixture(params=["bookkeeping", "per_sample"])
def path(request, monkeypatch):
    """Both ways to the clipped sum: from each call's x and c-scaled g, or from staged
    per-sample gradients (the engine picks by memory; here each is forced in turn)."""
    monkeypatch.setattr(
        jacmem.engine.clipping.ClippingEngine, "_per_sample", lambda *args: request.param == "per_sample"
    )
    return request.param
