"""The conformance matrix's models: one table, name -> :class:`Model`.

Every model is tiny (width 8-16, one or two layers, vocabulary <= 23, T <= 5,
N = 3-4), float64, random weights, in eval mode (no dropout, BatchNorm on its running
statistics), so that a cell runs in well under a second eagerly. Builders are reused
from ``tests/support`` where one exists. ``Model.build(batch_first)`` returns a fresh
``(module, X, y)``; the loss is a module (``nn.CrossEntropyLoss``), as second order needs.

Attributes:
    batch_first: the model takes ``batch_first`` (its ``X`` is then ``[T, N, ...]`` and
        the oracle slices samples along axis 1).
    dense: the dense float64 GGN and Hessian (``torch.func``) are small enough to build.
    kron_exact: every trainable parameter sits in a Linear of a plain chain (no sequence
        axis, no weight sharing): at one sample, KFLR/KFRA/KFAC/EKFAC's Kronecker product
        is the exact GGN block (the KFAC column's criterion).
    piecewise_linear: the model's activations have zero second derivative, so the
        Hessian's residual terms vanish and PCHMP equals the GGN block's product.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

import jacmem

DT = torch.float64
N = 4


class ZeroDimScale(nn.Module):
    """``y = x * scale`` with a 0-dim ``scale`` (CLIP's ``logit_scale``): [N, *] -> [N, *]."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.3))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.scale


jacmem.layer(ZeroDimScale)


@jacmem.register(ZeroDimScale, "scale", "batch_grad", "direct", cost=lambda xs, gs: jacmem.Cost(flops=0, workspace=0))
def _zero_dim_scale_batch_grad(x: Tensor, g: Tensor) -> Tensor:
    """Σ over every non-batch axis of g ⊙ x: [N, *], [N, *] -> [N]"""
    return (g * x).flatten(1).sum(1)


class LastStep(nn.Module):
    """A recurrent layer, then a Linear on its last step: X [N, T, F] (``batch_first``) or
    [T, N, F] -> [N, 3]."""

    def __init__(self, cell: type, batch_first: bool):
        super().__init__()
        self.batch_first = batch_first
        self.rnn = cell(4, 6, batch_first=batch_first)
        self.head = nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        out, _ = self.rnn(x)
        logits = self.head(out)  # every module takes the layout's batch axis
        return logits[:, -1] if self.batch_first else logits[-1]


class Encoder(nn.Module):
    """``nn.TransformerEncoder`` (one stock layer) with a position ``nn.Parameter`` on the
    root: X [N, T, 4] (``batch_first``) or [T, N, 4] -> [N, 3]."""

    def __init__(self, batch_first: bool):
        super().__init__()
        self.batch_first = batch_first
        self.inp = nn.Linear(4, 8)
        self.pos = nn.Parameter(0.1 * torch.randn(5, 8))  # [T, 8]
        layer = nn.TransformerEncoderLayer(8, 2, 12, dropout=0.0, batch_first=batch_first)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        pos = self.pos if self.batch_first else self.pos.unsqueeze(1)  # [T, 8] or [T, 1, 8]
        h = self.encoder(self.inp(x) + pos)
        return self.head(h).mean(1 if self.batch_first else 0)


class EmbeddedConv(nn.Module):
    """Token embeddings viewed as images, into a grouped strided convolution: ids [N, 6] ->
    [N, 3]. The embedding's output gradient is a view of the convolution's input gradient,
    which inductor lays out channels-last."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 4, padding_idx=0)
        self.conv = nn.Conv2d(2, 4, 3, stride=2, padding=1, groups=2)
        self.head = nn.Linear(16, 3)

    def forward(self, ids: Tensor) -> Tensor:
        h = self.conv(self.emb(ids).view(-1, 2, 3, 4))  # [N, 6, 4] -> [N, 2, 3, 4] -> [N, 4, 2, 2]
        return self.head(torch.tanh(h).flatten(1))


def _classes(n: int = N, c: int = 3) -> Tensor:
    return torch.randint(0, c, (n,))


def mlp(batch_first: bool):
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    return model, torch.randn(N, 6), _classes()


def cnn_bn(batch_first: bool):
    model = nn.Sequential(
        nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(), nn.Linear(27, 3)
    )  # fmt: skip
    with torch.no_grad():  # running statistics that are not the identity
        model[1].running_mean.uniform_(-0.5, 0.5)
        model[1].running_var.uniform_(0.5, 2.0)
    return model, torch.randn(N, 2, 5, 5), _classes()


def resnet18(batch_first: bool):
    import torchvision

    return torchvision.models.resnet18(num_classes=3), torch.randn(3, 3, 16, 16), _classes(3)


def lstm(batch_first: bool):
    return _recurrent(nn.LSTM, batch_first)


def gru(batch_first: bool):
    return _recurrent(nn.GRU, batch_first)


def _recurrent(cell: type, batch_first: bool):
    X = torch.randn(N, 5, 4)
    return LastStep(cell, batch_first), X if batch_first else X.transpose(0, 1).contiguous(), _classes()


def transformer_encoder(batch_first: bool):
    X = torch.randn(N, 5, 4)
    return Encoder(batch_first), X if batch_first else X.transpose(0, 1).contiguous(), _classes()


def _hf(name: str):
    def build(batch_first: bool):
        from tests.support import hf_models  # transformers and timm: only where asked (a rank starts faster)

        model, X, y = hf_models.build(name)
        return model, X, y

    return build


def lora_gpt2(batch_first: bool):
    from tests.support import hf_models

    return hf_models.build_lora("gpt2")


def embedded_conv(batch_first: bool):
    return EmbeddedConv(), torch.randint(0, 11, (N, 6)), _classes()


def zero_dim(batch_first: bool):
    model = nn.Sequential(nn.Linear(6, 5), ZeroDimScale(), nn.Tanh(), nn.Linear(5, 3))
    return model, torch.randn(N, 6), _classes()


@dataclass(frozen=True)
class Model:
    name: str
    builder: Callable
    batch_first: bool = False
    dense: bool = True
    kron_exact: bool = False
    piecewise_linear: bool = False
    token: bool = False
    tolerance: float | None = None  # None: float64 exact

    def build(self, batch_first: bool = True):
        """A fresh ``(module, X, y)``, float64, eval mode, the same weights every call."""
        previous = torch.get_default_dtype()
        torch.set_default_dtype(DT)  # the same numbers in every process (a rank starts in float32)
        try:
            torch.manual_seed(sum(map(ord, self.name)))
            model, X, y = self.builder(batch_first)
        finally:
            torch.set_default_dtype(previous)
        model = model.to(DT).eval()
        return model, X.to(DT) if X.is_floating_point() else X, y

    def loss(self, reduction: str = "mean") -> nn.Module:
        return nn.CrossEntropyLoss(reduction=reduction)


MODELS: dict[str, Model] = {
    m.name: m
    for m in [
        Model("mlp", mlp, kron_exact=True),
        Model("cnn_bn", cnn_bn, piecewise_linear=True),
        Model("resnet18", resnet18, dense=False, piecewise_linear=True),
        Model("lstm", lstm, batch_first=True),
        Model("gru", gru, batch_first=True),
        Model("gpt2", _hf("gpt2"), token=True),
        Model("bert", _hf("bert"), token=True),
        # HF's LlamaRMSNorm computes in float32 whatever the model's dtype: float32's tolerance
        Model("llama", _hf("llama"), token=True, tolerance=1e-6),
        Model("vit", _hf("vit")),
        Model("transformer_encoder", transformer_encoder, batch_first=True),
        Model("lora_gpt2", lora_gpt2, token=True),
        Model("zero_dim", zero_dim, kron_exact=False),
        Model("embedded_conv", embedded_conv, token=True),
    ]
}
