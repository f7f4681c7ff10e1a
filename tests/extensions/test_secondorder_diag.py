"""GGN and Hessian diagonals (exact, Monte-Carlo, per sample) against dense autograd
references (float64), and against BackPACK where it can answer."""

from __future__ import annotations

import copy

import pytest
import torch
from tests.support.secondorder_ref import check_exact, default_dtype, dense, diagonals, run
from torch import nn

from jacmem import BatchDiagGGNExact, BatchDiagGGNMC, BatchDiagHessian, DiagGGNExact, DiagGGNMC, DiagHessian

DT = torch.float64
ACTIVATIONS = [nn.ReLU, nn.Sigmoid, nn.Tanh, nn.LeakyReLU, nn.ELU, nn.SELU, nn.LogSigmoid, nn.GELU, nn.SiLU]


def mlp(act, d_in=4, d_out=3):
    return nn.Sequential(nn.Linear(d_in, 5), act(), nn.Linear(5, 4), act(), nn.Linear(4, d_out)).to(DT)


@pytest.mark.parametrize("act", ACTIVATIONS, ids=lambda a: a.__name__)
def test_mlp_every_activation(act):
    torch.manual_seed(0)
    X, y = torch.randn(5, 4, dtype=DT), torch.randint(0, 3, (5,))
    check_exact(mlp(act), nn.CrossEntropyLoss(), X, y)


def test_gelu_tanh_approximation():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(3, 4), nn.GELU(approximate="tanh"), nn.Linear(4, 2)).to(DT)
    check_exact(model, nn.MSELoss(), torch.randn(4, 3, dtype=DT), torch.randn(4, 2, dtype=DT))


LOSSES = [
    ("ce", lambda r: nn.CrossEntropyLoss(reduction=r), lambda n: torch.randint(0, 3, (n,))),
    ("mse", lambda r: nn.MSELoss(reduction=r), lambda n: torch.randn(n, 3, dtype=DT)),
    ("bce", lambda r: nn.BCEWithLogitsLoss(reduction=r), lambda n: torch.rand(n, 3, dtype=DT).round()),
]


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("loss", LOSSES, ids=lambda t: t[0])
def test_losses_both_reductions(loss, reduction):
    torch.manual_seed(2)
    _, make, target = loss
    check_exact(mlp(nn.Tanh), make(reduction), torch.randn(4, 4, dtype=DT), target(4))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_losses_with_trailing_dims(reduction):
    """Logits [N, C, L] from a Conv1d (cross-entropy per position), regression on
    [N, T, F] from a Linear on a sequence, BCE on [N, T, F]."""
    torch.manual_seed(3)
    conv = nn.Sequential(nn.Conv1d(2, 3, 3, padding=1), nn.Sigmoid(), nn.Conv1d(3, 3, 1)).to(DT)
    check_exact(
        conv, nn.CrossEntropyLoss(reduction=reduction), torch.randn(3, 2, 4, dtype=DT), torch.randint(0, 3, (3, 4))
    )
    seq = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).to(DT)
    X = torch.randn(3, 5, 4, dtype=DT)
    check_exact(seq, nn.MSELoss(reduction=reduction), X, torch.randn(3, 5, 2, dtype=DT))
    check_exact(seq, nn.BCEWithLogitsLoss(reduction=reduction), X, torch.rand(3, 5, 2, dtype=DT).round())


def test_cross_entropy_ignore_index():
    torch.manual_seed(4)
    y = torch.tensor([0, -100, 2, 1])
    check_exact(mlp(nn.Tanh), nn.CrossEntropyLoss(), torch.randn(4, 4, dtype=DT), y)


CNNS = {
    "conv2d_pools": lambda: nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),
        nn.ELU(),
        nn.MaxPool2d(3, stride=2, padding=1, ceil_mode=True),
        nn.ZeroPad2d((1, 0, 0, 1)),
        nn.Conv2d(3, 4, 2, stride=2, dilation=1),
        nn.Sigmoid(),
        nn.AvgPool2d(1),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, 3),
    ),
    "conv1d": lambda: nn.Sequential(
        nn.Conv1d(2, 4, 3, padding="same", padding_mode="circular"),
        nn.Tanh(),
        nn.MaxPool1d(2, dilation=2, padding=1),
        nn.ConstantPad1d(1, 0.5),
        nn.Conv1d(4, 4, 2, groups=2),
        nn.AvgPool1d(2),
        nn.AdaptiveAvgPool1d(2),
        nn.Flatten(),
        nn.Linear(8, 3),
    ),
    "conv3d": lambda: nn.Sequential(
        nn.Conv3d(1, 2, 2),
        nn.SiLU(),
        nn.MaxPool3d(2),
        nn.AvgPool3d(1),
        nn.AdaptiveAvgPool3d(1),
        nn.Flatten(),
        nn.Dropout(0.5),
        nn.Linear(2, 3),
    ),
}
INPUTS = {"conv2d_pools": (2, 6, 6), "conv1d": (2, 8), "conv3d": (1, 5, 5, 5)}


@pytest.mark.parametrize("name", sorted(CNNS))
def test_cnns(name):
    torch.manual_seed(5)
    model = CNNS[name]().to(DT).eval()  # eval: Dropout is the identity, as in the reference
    X = torch.randn(3, *INPUTS[name], dtype=DT)
    check_exact(model, nn.CrossEntropyLoss(), X, torch.randint(0, 3, (3,)))


def test_dropout_in_training_mode_uses_the_forward_mask():
    """The reference: the same net with the mask the forward drew as a constant."""
    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Dropout(0.5), nn.Linear(6, 3)).to(DT)
    X, y = torch.randn(5, 4, dtype=DT), torch.randint(0, 3, (5,))
    masks = []
    handle = model[2].register_forward_hook(lambda m, i, o: masks.append((o != 0) / 0.5))
    run(model, nn.CrossEntropyLoss(), X, y, DiagGGNExact(), DiagHessian())
    handle.remove()
    got = {n: (p.diag_ggn_exact, p.diag_h) for n, p in model.named_parameters()}

    class Mask(nn.Module):
        def forward(self, x):
            return x * masks[0]

    ref_model = nn.Sequential(model[0], model[1], Mask(), model[3])
    ggn, hess = dense(ref_model, nn.CrossEntropyLoss(), X, y)
    dg, dh = diagonals(ref_model, ggn), diagonals(ref_model, hess)
    for (_, (g, h)), (rn, _) in zip(got.items(), ref_model.named_parameters()):
        torch.testing.assert_close(g, dg[rn])
        torch.testing.assert_close(h, dh[rn])


def test_mc_matches_exact_in_expectation():
    """With M samples the estimate's standard error is about σ/√M; M = 20000 puts it
    well under the 5% (of the largest entry) tolerance on this net."""
    torch.manual_seed(7)
    model = mlp(nn.Tanh)
    X, y = torch.randn(4, 4, dtype=DT), torch.randint(0, 3, (4,))
    for lossf in (nn.CrossEntropyLoss(), nn.MSELoss(), nn.BCEWithLogitsLoss()):
        target = y if isinstance(lossf, nn.CrossEntropyLoss) else torch.rand(4, 3, dtype=DT).round()
        run(model, lossf, X, target, DiagGGNExact(), BatchDiagGGNExact(), DiagGGNMC(20000), BatchDiagGGNMC(20000))
        for name, p in model.named_parameters():
            for mc, exact in ((p.diag_ggn_mc, p.diag_ggn_exact), (p.diag_ggn_mc_batch, p.diag_ggn_exact_batch)):
                assert mc.shape == exact.shape
                err = (mc - exact).abs().max() / exact.abs().max()
                assert err < 0.05, (type(lossf).__name__, name, float(err))


def test_mc_single_sample_is_a_rank_one_estimate():
    """DiagGGNMC() (one sample) on one data point: the GGN factor has one column, so the
    bias diagonal is the square of a gradient at a sampled target: non-negative, and
    not the exact value."""
    torch.manual_seed(8)
    model = mlp(nn.Tanh)
    X, y = torch.randn(1, 4, dtype=DT), torch.randint(0, 3, (1,))
    run(model, nn.CrossEntropyLoss(), X, y, DiagGGNMC(), DiagGGNExact())
    b = model[4].bias
    assert (b.diag_ggn_mc >= 0).all() and not torch.allclose(b.diag_ggn_mc, b.diag_ggn_exact)


# -- BackPACK ------------------------------------------------------------------------


def _backpack(model, lossf, X, y, *exts):
    from backpack import backpack, extend

    model, lossf = extend(copy.deepcopy(model)), extend(copy.deepcopy(lossf))
    with backpack(*exts), default_dtype(X.dtype):
        lossf(model(X), y).backward()
    return dict(model.named_parameters())


@pytest.mark.parametrize(
    "make",
    [
        lambda: mlp(nn.Sigmoid),
        # BackPACK's average pooling fails in float64, so the CNN here uses max pooling only
        lambda: nn.Sequential(
            nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(3, 2, 2), nn.Flatten(), nn.Linear(8, 3)
        ).to(DT),
    ],
    ids=["mlp", "cnn"],
)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_equal_to_backpack(make, reduction):
    import backpack.extensions as bpe

    torch.manual_seed(9)
    model = make()
    X = torch.randn(4, 4, dtype=DT) if isinstance(model[0], nn.Linear) else torch.randn(4, 2, 6, 6, dtype=DT)
    y = torch.randint(0, 3, (4,))
    lossf = nn.CrossEntropyLoss(reduction=reduction)
    run(model, lossf, X, y, DiagGGNExact(), BatchDiagGGNExact(), DiagHessian(), BatchDiagHessian())
    ref = _backpack(
        model, lossf, X, y, bpe.DiagGGNExact(), bpe.BatchDiagGGNExact(), bpe.DiagHessian(), bpe.BatchDiagHessian()
    )
    for name, p in model.named_parameters():
        for field in ("diag_ggn_exact", "diag_ggn_exact_batch", "diag_h", "diag_h_batch"):
            torch.testing.assert_close(getattr(p, field), getattr(ref[name], field), msg=f"{field} {name}")


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_conv_transpose_batchnorm_embedding(reduction):
    """ConvTranspose1d/2d/3d (output_padding, groups, dilation), BatchNorm in eval mode
    (running statistics set to non-trivial values) and Embedding, through the generic
    vjp of their forward and their first-order derivatives."""
    torch.manual_seed(10)
    bn2, bn1, bn3 = nn.BatchNorm2d(4), nn.BatchNorm1d(3), nn.BatchNorm3d(2)
    for bn in (bn2, bn1, bn3):
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
    model = (
        nn.Sequential(
            nn.ConvTranspose2d(2, 4, 3, stride=2, output_padding=1, groups=2),
            bn2,
            nn.Tanh(),
            nn.ConvTranspose2d(4, 2, 2, dilation=2),
            nn.AdaptiveAvgPool2d(2),
            nn.Flatten(),
            nn.Linear(8, 3),
            bn1,
        )
        .to(DT)
        .eval()
    )
    check_exact(
        model, nn.CrossEntropyLoss(reduction=reduction), torch.randn(3, 2, 3, 3, dtype=DT), torch.randint(0, 3, (3,))
    )
    vol = (
        nn.Sequential(nn.ConvTranspose3d(1, 2, 2), bn3, nn.Sigmoid(), nn.Flatten(), nn.Linear(2 * 27, 2)).to(DT).eval()
    )
    check_exact(vol, nn.MSELoss(reduction=reduction), torch.randn(2, 1, 2, 2, 2, dtype=DT), torch.randn(2, 2, dtype=DT))
    seq = nn.Sequential(nn.ConvTranspose1d(3, 2, 2), nn.Flatten(), nn.Linear(8, 2)).to(DT)
    check_exact(seq, nn.MSELoss(reduction=reduction), torch.randn(2, 3, 3, dtype=DT), torch.randn(2, 2, dtype=DT))
    emb = nn.Sequential(nn.Embedding(7, 3), nn.Tanh(), nn.Flatten(), nn.Linear(6, 3)).to(DT)
    check_exact(emb, nn.CrossEntropyLoss(reduction=reduction), torch.randint(0, 7, (4, 2)), torch.randint(0, 3, (4,)))


def test_batchnorm_in_training_mode_raises():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).to(DT)
    with pytest.raises(NotImplementedError, match="BatchNorm1d in eval mode"):
        run(model, nn.MSELoss(), torch.randn(3, 3, dtype=DT), torch.randn(3, 2, dtype=DT), DiagGGNExact())
