"""0-dim parameters (CLIP's ``logit_scale``): every first-order extension and ClipGrad,
for a scalar parameter used directly in the root module's forward and for a registered
custom layer whose parameter is a scalar, against a per-sample autograd loop in float64.
A scalar's per-sample gradients are ``[N]``; its norms are their absolute values."""

from __future__ import annotations

import pytest
import torch
from tests.conformance.models import ZeroDimScale
from tests.support.clipping import assert_grads, expected, median_norm, per_sample
from tests.support.reference import check_against, mse, per_sample_grads, run_jacmem
from torch import Tensor, nn

import jacmem

pytestmark = pytest.mark.usefixtures("float64_default")


class LogitScale(nn.Module):
    """CLIP's head: a Linear whose output is scaled by exp(logit_scale), a 0-dim parameter
    of the root used in its own forward; then a registered layer with a scalar parameter."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 3)
        self.logit_scale = nn.Parameter(torch.tensor(0.2))
        self.gain = ZeroDimScale()

    def forward(self, x: Tensor) -> Tensor:
        return self.gain(self.proj(x) * self.logit_scale.exp())


FIRST_ORDER = [jacmem.BatchGrad, jacmem.BatchL2Grad, jacmem.SumGradSquared, jacmem.Variance]


@pytest.mark.parametrize("flow", ["inside", "track"])
@pytest.mark.parametrize("extension", FIRST_ORDER, ids=lambda e: e.__name__)
def test_first_order(extension, flow):
    model, X, y = LogitScale(), torch.randn(6, 4), torch.randn(6, 3)
    reference = per_sample_grads(model, X, y, mse)
    assert {p.dim() for p in reference} == {0, 1, 2}
    run_jacmem(model, X, y, mse, "mean", [extension()], flow)
    check_against(model, reference, [extension().savefield], f"{extension.__name__} {flow}")


@pytest.mark.parametrize("chunk_bytes", [None, 1])
def test_all_first_order_at_once(chunk_bytes):
    """Summed loss; in one-sample chunks too."""
    model, X, y = LogitScale(), torch.randn(6, 4), torch.randn(6, 3)
    reference = per_sample_grads(model, X, y, mse, "sum")
    kwargs = {} if chunk_bytes is None else {"chunk_bytes": chunk_bytes}
    run_jacmem(model, X, y, mse, "sum", [e() for e in FIRST_ORDER], **kwargs)
    check_against(model, reference, [e().savefield for e in FIRST_ORDER])


def test_clip_grad(path):
    model, X, y = LogitScale(), torch.randn(6, 4), torch.randn(6, 3)
    grads = per_sample(model, X, y, mse, "mean")
    max_norm = median_norm(grads)
    with jacmem.extend(jacmem.ClipGrad(max_norm)):
        mse(model(X), y, "mean").backward()
    assert_grads(model, expected(grads, max_norm), path)
