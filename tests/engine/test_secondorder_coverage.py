"""Every trainable parameter the loss reaches gets its second-order result, or the
backward raises before any is written (issue 36, item 3): stock attention
(``nn.MultiheadAttention`` inside ``nn.TransformerEncoderLayer``: a module with children
and parameters of its own) and parameters read directly in a module's forward (a
position embedding on the root), against the dense GGN of torch.func (float64).
"""

from __future__ import annotations

import pytest
import torch
from tests.support.secondorder_ref import dense, diagonals
from torch import nn

import jacmem
from jacmem import BatchDiagGGNExact, DiagGGNExact, DiagHessian

pytestmark = pytest.mark.usefixtures("float64_default")

N, T, D, C = 3, 3, 4, 3


class Encoder(nn.Module):
    """A position parameter added to the input on the root, a stock encoder layer, a head."""

    def __init__(self):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(1, T, D) / 2)
        self.enc = nn.TransformerEncoderLayer(D, 2, dim_feedforward=6, dropout=0.0, batch_first=True)
        self.head = nn.Linear(T * D, C)

    def forward(self, x):
        return self.head(self.enc(x + self.pos).flatten(1))


class Shifted(nn.Module):
    """Modules jacmem has Jacobians for, and a position parameter on the root."""

    def __init__(self):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(T, D) / 2)
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(T * D, 5), nn.Tanh(), nn.Linear(5, C))

    def forward(self, x):
        return self.net(x + self.pos)


def _data():
    torch.manual_seed(0)
    return torch.randn(N, T, D), torch.randint(0, C, (N,))


def test_a_parameter_no_call_covers_raises_before_any_result():
    """DiagHessian follows module Jacobians only: the root's ``pos`` has none, so the
    backward raises, naming it and its module, and nothing is written (it used to give
    every other parameter its result, ``pos`` nothing, and a warning with the wrong cause)."""
    model, (X, y) = Shifted(), _data()
    with pytest.raises(NotImplementedError, match=r"'pos' of module 'Shifted' \(Shifted\)"):
        with jacmem.extend(DiagHessian()):
            nn.CrossEntropyLoss()(model(X), y).backward()
    assert not any(hasattr(p, "diag_h") for p in model.parameters())


@pytest.mark.filterwarnings("ignore:.*recomputed with torch.func")  # exact, slow where vmap runs attention by sample
def test_stock_encoder_layer_and_a_root_position_parameter_are_exact():
    """MultiheadAttention's in_proj_weight, in_proj_bias and out_proj (a module with
    children and parameters of its own) and the root's ``pos`` (read in the root's
    forward: the generic recomputation, as first order) get their GGN diagonals, whole
    and per sample, through the autograd path: they used to get nothing (the second-order
    engine skipped every module with children)."""
    model, (X, y) = Encoder().eval(), _data()
    lossf = nn.CrossEntropyLoss()
    with jacmem.extend(DiagGGNExact(), BatchDiagGGNExact()):
        lossf(model(X), y).backward()
    ggn, _ = dense(model, lossf, X, y, hess=False)
    ggn_n, _ = dense(model, lossf, X, y, per_sample=True, hess=False)
    want, want_n = diagonals(model, ggn), diagonals(model, ggn_n)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.diag_ggn_exact, want[name], rtol=1e-9, atol=1e-12, msg=name)
        torch.testing.assert_close(p.diag_ggn_exact_batch, want_n[name], rtol=1e-9, atol=1e-12, msg=name)


def test_a_parameter_read_outside_every_module_raises():
    """A parameter the loss reads outside every module's forward (``logits * scale``)
    has no call to follow: the backward raises before any result, naming it by its shape."""
    model, (X, y) = Shifted(), _data()
    scale = nn.Parameter(torch.tensor(2.0))
    with pytest.raises(NotImplementedError, match=r"a parameter of shape \[\] read outside every module"):
        with jacmem.extend(DiagGGNExact()):
            nn.CrossEntropyLoss()(model(X) * scale, y).backward()
    assert not any(hasattr(p, "diag_ggn_exact") for p in model.parameters())
