"""KFAC, KFLR and KFRA: their defining formulas at batch size 1 (where the Kronecker
product of a Linear layer's factors is its exact GGN block), BackPACK, and the
Monte-Carlo estimate in expectation."""

from __future__ import annotations

import copy

import pytest
import torch
from secondorder_ref import blocks, default_dtype, dense, run
from torch import nn

from jacmem import KFAC, KFLR, KFRA

DT = torch.float64
ACTIVATIONS = [nn.ReLU, nn.Sigmoid, nn.Tanh, nn.LeakyReLU, nn.ELU, nn.SELU, nn.LogSigmoid, nn.GELU, nn.SiLU]


def mlp(act, d_out=3):
    return nn.Sequential(nn.Linear(4, 5), act(), nn.Linear(5, 4), act(), nn.Linear(4, d_out)).to(DT)


TARGETS = {
    "ce": (nn.CrossEntropyLoss, lambda: torch.randint(0, 3, (1,))),
    "mse": (nn.MSELoss, lambda: torch.randn(1, 3, dtype=DT)),
    "bce": (nn.BCEWithLogitsLoss, lambda: torch.rand(1, 3, dtype=DT).round()),
}


@pytest.mark.parametrize("loss", sorted(TARGETS))
@pytest.mark.parametrize("act", ACTIVATIONS, ids=lambda a: a.__name__)
def test_kflr_kfra_at_batch_size_one_are_the_ggn_blocks(act, loss):
    """With one sample, G ⊗ A = (Jᵀ H J)_W for W [O, I] (row-major vec) and G = the bias
    block, for KFLR and KFRA alike (KFRA's averages are over one sample); every
    activation, including those BackPACK refuses, in float64."""
    torch.manual_seed(0)
    make_loss, target = TARGETS[loss]
    model, lossf = mlp(act), make_loss()
    X, y = torch.randn(1, 4, dtype=DT), target()
    run(model, lossf, X, y, KFLR(), KFRA())
    ref = blocks(model, dense(model, lossf, X, y)[0])
    for name, p in model.named_parameters():
        for field in ("kflr", "kfra"):
            factors = getattr(p, field)
            got = torch.kron(*factors) if name.endswith("weight") else factors[0]
            assert len(factors) == (2 if name.endswith("weight") else 1)
            torch.testing.assert_close(got, ref[name], msg=f"{field} {name}")


def test_kfac_matches_kflr_in_expectation():
    """KFAC's G with M = 20000 samples is within 5% (of its largest entry) of KFLR's;
    A is the same deterministic factor."""
    torch.manual_seed(1)
    model = mlp(nn.Tanh)
    X, y = torch.randn(4, 4, dtype=DT), torch.randint(0, 3, (4,))
    run(model, nn.CrossEntropyLoss(), X, y, KFAC(mc_samples=20000), KFLR())
    for name, p in model.named_parameters():
        G_mc, G = p.kfac[0], p.kflr[0]
        assert ((G_mc - G).abs().max() / G.abs().max()) < 0.05, name
        if name.endswith("weight"):
            torch.testing.assert_close(p.kfac[1], p.kflr[1])


def _backpack(model, lossf, X, y, *exts):
    from backpack import backpack, extend

    model, lossf = extend(copy.deepcopy(model)), extend(copy.deepcopy(lossf))
    with backpack(*exts), default_dtype(X.dtype):
        lossf(model(X), y).backward()
    return dict(model.named_parameters())


MODELS = {
    "mlp": (lambda: mlp(nn.Sigmoid), (5, 4)),
    "mlp_relu": (lambda: mlp(nn.ReLU), (5, 4)),
    "cnn": (
        lambda: nn.Sequential(
            nn.Conv2d(2, 3, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(3, 2, 2, stride=1),
            nn.Tanh(),
            nn.Flatten(),
            nn.Linear(8, 3),
        ),
        (3, 2, 6, 6),
    ),
}


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_kflr_kfra_equal_to_backpack(name, reduction):
    """The MLPs in float64; the CNN in float32, since BackPACK 1.7.1's KFRA through max
    pooling raises a dtype error in float64 (it scatters into a float32 buffer)."""
    import backpack.extensions as bpe

    torch.manual_seed(2)
    make, shape = MODELS[name]
    dtype = torch.float32 if name == "cnn" else DT
    model, lossf = make().to(dtype), nn.CrossEntropyLoss(reduction=reduction)
    X, y = torch.randn(*shape, dtype=dtype), torch.randint(0, 3, (shape[0],))
    run(model, lossf, X, y, KFLR(), KFRA())
    ref = _backpack(model, lossf, X, y, bpe.KFLR(), bpe.KFRA())
    for pname, p in model.named_parameters():
        for field in ("kflr", "kfra"):
            got, want = getattr(p, field), getattr(ref[pname], field)
            assert len(got) == len(want)
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, msg=f"{field} {pname}")


def test_kflr_mse_equal_to_backpack():
    """In float32: BackPACK 1.7.1's KFRA on MSELoss raises a dtype error in float64 (its
    summed loss Hessian is built in float32)."""
    import backpack.extensions as bpe

    torch.manual_seed(3)
    model, lossf = mlp(nn.Tanh).float(), nn.MSELoss()
    X, y = torch.randn(5, 4, dtype=torch.float32), torch.randn(5, 3, dtype=torch.float32)
    run(model, lossf, X, y, KFLR(), KFRA())
    ref = _backpack(model, lossf, X, y, bpe.KFLR(), bpe.KFRA())
    for pname, p in model.named_parameters():
        for a, b in zip(p.kflr + p.kfra, ref[pname].kflr + ref[pname].kfra):
            torch.testing.assert_close(a, b)


def test_unsupported_settings_raise_naming_the_module():
    model = nn.Sequential(nn.Conv2d(2, 4, 3, groups=2), nn.Flatten(), nn.Linear(16, 3)).to(DT)
    with pytest.raises(NotImplementedError, match="grouped convolutions.*'0'"):
        run(model, nn.CrossEntropyLoss(), torch.randn(2, 2, 4, 4, dtype=DT), torch.randint(0, 3, (2,)), KFLR())
    seq = nn.Sequential(nn.Linear(4, 3)).to(DT)
    with pytest.raises(NotImplementedError, match="2d inputs.*'0'"):
        run(seq, nn.MSELoss(), torch.randn(2, 5, 4, dtype=DT), torch.randn(2, 5, 3, dtype=DT), KFAC())
