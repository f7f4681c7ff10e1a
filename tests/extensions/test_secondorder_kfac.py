"""KFAC, KFLR and KFRA: their defining formulas at batch size 1 (where the Kronecker
product of a Linear layer's factors is its exact GGN block), BackPACK, and the
Monte-Carlo estimate in expectation."""

from __future__ import annotations

import copy

import pytest
import torch
from tests.support.secondorder_ref import blocks, check_kronecker_blocks, default_dtype, dense, run
from torch import nn

import jacmem
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
    check_kronecker_blocks(mlp(act), make_loss(), torch.randn(1, 4, dtype=DT), target())


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


def _weight_factors(p, field):
    """The factors of a weight, and the number of groups (1 where they are 2d)."""
    G, A = getattr(p, field)
    return (G, A, 1) if G.dim() == 2 else (G, A, G.shape[0])


@pytest.mark.parametrize("d", [1, 2, 3])
def test_conv_transpose_equal_to_backpack(d):
    """ConvTranspose1d/2d/3d, BackPACK's layout (the factors of weight.transpose(0, 1)),
    in float64 (BackPACK's KF* pass there for these layers)."""
    import backpack.extensions as bpe

    torch.manual_seed(4)
    conv_t = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)[d - 1]
    space = (3, 3, 2)[:d]
    model = nn.Sequential(
        conv_t(2, 3, 2, stride=2, padding=1, dilation=(2, 1, 1)[:d]), nn.Tanh(), nn.Flatten(), nn.LazyLinear(3)
    ).to(DT)
    X, y = torch.randn(3, 2, *space, dtype=DT), torch.randint(0, 3, (3,))
    model(X)
    lossf = nn.CrossEntropyLoss()
    run(model, lossf, X, y, KFLR(), KFRA(), KFAC())
    with pytest.warns(UserWarning, match="transpose"):
        ref = _backpack(model, lossf, X, y, bpe.KFLR(), bpe.KFRA())
    for pname, p in model.named_parameters():
        for field in ("kflr", "kfra"):
            for a, b in zip(getattr(p, field), getattr(ref[pname], field), strict=True):
                torch.testing.assert_close(a, b, msg=f"{field} {pname}")
        if pname.endswith("weight"):  # KFAC's G is sampled; its A is KFLR's
            torch.testing.assert_close(p.kfac[1], ref[pname].kflr[1])


def unfolded(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The columns ``[g, N, I/g·K, T]`` that a (transposed) convolution's group ``j``
    multiplies its kernel with, read off autograd: d out[n, first channel of group j,
    t] / d (the kernel entries of that output channel), in the layout of ``weight``
    (``weight.transpose(0, 1)`` for a transposed conv)."""
    transposed = isinstance(layer, nn.modules.conv._ConvTransposeNd)
    g = layer.groups
    out_per_group = layer.out_channels // g

    def f(w):
        return torch.func.functional_call(layer, {"weight": w, "bias": layer.bias}, (x,))

    J = torch.func.jacrev(f)(layer.weight.detach()).flatten(2, 1 + x.dim() - 2)  # [N, O, T, *weight]
    cols = []
    for j in range(g):
        o = j * out_per_group
        if transposed:  # weight [I, O/g, *K]: the group's input channels, output channel 0 of the group
            block = J[:, o, :, j * layer.in_channels // g : (j + 1) * layer.in_channels // g, 0]
        else:  # weight [O, I/g, *K]
            block = J[:, o, :, o]
        cols.append(block.flatten(2).transpose(1, 2))  # [N, I/g·K, T]
    return torch.stack(cols)


@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "conv_transpose"])
def test_grouped_convolutions(transposed):
    """Groups: per group, G[j] is the diagonal block j of the bias's G (the exact GGN
    bias block for KFLR), and A[j] the columns' covariance, from autograd; KFRA's G[j]
    the diagonal blocks of its bias factor. BackPACK refuses groups != 1."""
    torch.manual_seed(5)
    layer = (
        nn.ConvTranspose2d(4, 6, 2, stride=2, padding=1, output_padding=1, groups=2)
        if transposed
        else nn.Conv2d(4, 6, 2, padding=1, groups=2)
    )
    model = nn.Sequential(layer, nn.Sigmoid(), nn.Flatten(), nn.LazyLinear(3)).to(DT)
    X, y = torch.randn(3, 4, 3, 3, dtype=DT), torch.randint(0, 3, (3,))
    model(X)
    lossf = nn.CrossEntropyLoss()
    run(model, lossf, X, y, KFLR(), KFRA())
    ggn = blocks(model, dense(model, lossf, X, y)[0])
    torch.testing.assert_close(layer.bias.kflr[0], ggn["0.bias"])
    cols = unfolded(layer, X)
    A_ref = torch.einsum("gnit,gnjt->gij", cols, cols) / X.shape[0]
    for field in ("kflr", "kfra"):
        G, A, g = _weight_factors(layer.weight, field)
        assert g == 2
        torch.testing.assert_close(A, A_ref)
        full = getattr(layer.bias, field)[0]
        for j in range(g):
            torch.testing.assert_close(G[j], full[3 * j : 3 * j + 3, 3 * j : 3 * j + 3])


@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "conv_transpose"])
def test_grouped_convolutions_at_batch_size_one(transposed):
    """With one sample and one output position, G[j] ⊗ A[j] is the exact GGN block of
    group j's kernel (of weight.transpose(0, 1) for a transposed conv), KFLR and KFRA."""
    torch.manual_seed(6)
    layer = nn.ConvTranspose2d(4, 6, 1, groups=2) if transposed else nn.Conv2d(4, 6, 3, groups=2)
    space = 1 if transposed else 3
    model = nn.Sequential(layer, nn.Flatten(), nn.Tanh(), nn.Linear(6, 3)).to(DT)
    X, y = torch.randn(1, 4, space, space, dtype=DT), torch.randint(0, 3, (1,))
    lossf = nn.CrossEntropyLoss()
    run(model, lossf, X, y, KFLR(), KFRA())
    ref = blocks(model, dense(model, lossf, X, y)[0])["0.weight"]
    w = layer.weight
    index = torch.arange(w.numel()).reshape(w.shape)
    for j in range(2):
        if transposed:  # group j of weight.transpose(0, 1), row-major
            idx = index[2 * j : 2 * j + 2].transpose(0, 1).flatten()
        else:
            idx = index[3 * j : 3 * j + 3].flatten()
        for field in ("kflr", "kfra"):
            G, A, _ = _weight_factors(w, field)
            torch.testing.assert_close(torch.kron(G[j], A[j]), ref[idx][:, idx], msg=f"{field} group {j}")


def _columns_with_bias(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``[g, N, I/g·K + 1, T]``: what group ``j``'s first output channel multiplies its
    kernel row and its bias with, from autograd (d out[n, o, t] / d (weight[o], bias[o]))."""
    o_per_group = layer.out_channels // layer.groups

    def f(w, b):
        return torch.func.functional_call(layer, {"weight": w, "bias": b}, (x,)).flatten(2)  # [N, O, T]

    Jw, Jb = torch.func.jacrev(f, argnums=(0, 1))(layer.weight.detach(), layer.bias.detach())
    cols = []
    for j in range(layer.groups):
        o = j * o_per_group
        cols.append(torch.cat([Jw[:, o, :, o].flatten(2), Jb[:, o, :, o, None]], dim=2).transpose(1, 2))
    return torch.stack(cols)


@pytest.mark.parametrize(
    "layer",
    [
        nn.Conv1d(3, 4, 3, stride=2, padding=2, dilation=2),
        nn.Conv2d(2, 4, (2, 3), padding="same", padding_mode="reflect"),
        nn.Conv2d(4, 6, 2, stride=(1, 2), padding=1, groups=2),
        nn.Conv3d(2, 2, 2, padding=1, padding_mode="circular"),
    ],
    ids=["conv1d", "conv2d_reflect", "conv2d_groups", "conv3d_circular"],
)
@pytest.mark.parametrize("approx", [None, "expand", "reduce"])
def test_a_convolutions_bias_joins_its_input_factor_as_a_column_of_ones(layer, approx):
    """``Kronecker.with_bias``: the input factor of the patches ``[a_t; 1]``, a one per
    output position (the bias as a column of ones), by the rule of ``input_factor``:
    ``Σ_{n,t} / N`` (BackPACK's), ``/ (N·T)`` (expand), of the means over ``t`` (reduce);
    and ``positions`` the rows ``N·T``."""
    torch.manual_seed(2)
    layer = layer.to(DT)
    x = torch.randn(3, layer.in_channels, *[5] * (layer.weight.dim() - 2), dtype=DT)
    out = layer(x)
    cols = _columns_with_bias(layer, x)  # [g, N, I/g·K + 1, T]
    n, t = cols.shape[1], cols.shape[3]
    if approx == "reduce":
        cols, t = cols.mean(3, keepdim=True), 1
    ref = torch.einsum("gnit,gnjt->gij", cols, cols) / (n * t if approx == "expand" else n)
    entry = jacmem.derivatives.REGISTRY[type(layer)]
    got = entry.kronecker.with_bias(x, out.shape, DT, approx, **entry.hyperparams(layer))
    torch.testing.assert_close(got, ref[0] if layer.groups == 1 else ref)
    assert entry.kronecker.positions(out.shape) == n * out[0, 0].numel()


def _positionwise(d_in=4):
    return nn.Sequential(nn.Linear(d_in, 5), nn.Tanh(), nn.Linear(5, 3)).to(DT)


def test_linear_with_middle_axes_is_the_flattened_batch():
    """Linear on [N, T, I] (MSE, position-wise net): KFLR's factors are those of the
    same net on the batch [N·T, I], which BackPACK computes (it raises on [N, T, I]);
    KFRA's too at the last layer (before it, KFRA averages over N, not N·T)."""
    import backpack.extensions as bpe

    torch.manual_seed(7)
    model, lossf = _positionwise(), nn.MSELoss()
    X, y = torch.randn(2, 3, 4, dtype=DT), torch.randn(2, 3, 3, dtype=DT)
    run(model, lossf, X, y, KFLR(), KFRA())
    ref = _backpack(model, lossf, X.flatten(0, 1), y.flatten(0, 1), bpe.KFLR(), bpe.KFRA())
    for pname, p in model.named_parameters():
        fields = ("kflr", "kfra") if pname.startswith("2.") else ("kflr",)
        for field in fields:
            for a, b in zip(getattr(p, field), getattr(ref[pname], field), strict=True):
                torch.testing.assert_close(a, b, msg=f"{field} {pname}")
        if pname.endswith("weight"):
            torch.testing.assert_close(p.kfra[1], ref[pname].kflr[1])


def test_linear_with_middle_axes_kfra_is_kflr_at_batch_size_one():
    """With one sample, KFRA's Ḡ is the exact output GGN, so its G (the sum of the
    diagonal position blocks) is KFLR's, also where a later layer mixes positions."""
    torch.manual_seed(8)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Flatten(), nn.Linear(15, 3)).to(DT)
    X, y = torch.randn(1, 3, 4, dtype=DT), torch.randint(0, 3, (1,))
    run(model, nn.CrossEntropyLoss(), X, y, KFLR(), KFRA())
    for pname, p in model.named_parameters():
        for a, b in zip(p.kflr, p.kfra, strict=True):
            torch.testing.assert_close(a, b, msg=pname)


def test_embedding_is_a_linear_on_one_hot_inputs():
    """Embedding [N, T] with padding_idx: [G, a] equal to a bias-free Linear's [G, A] on
    the one-hot inputs (padding positions zero), a = diag(A), for KFLR and KFRA;
    BackPACK has no KF* for Embedding."""
    torch.manual_seed(9)
    emb = nn.Embedding(6, 4, padding_idx=0).to(DT)
    lin = nn.Linear(6, 4, bias=False).to(DT)
    lin.weight.data.copy_(emb.weight.data.T)
    head = nn.Sequential(nn.Tanh(), nn.Linear(4, 3)).to(DT)
    idx = torch.tensor([[1, 0, 3], [3, 5, 3]])
    onehot = torch.nn.functional.one_hot(idx, 6).to(DT) * (idx != 0)[..., None]
    y = torch.randn(2, 3, 3, dtype=DT)
    results = []
    for first, X in ((emb, idx), (lin, onehot)):
        run(nn.Sequential(first, head), nn.MSELoss(), X, y, KFLR(), KFRA())
        results.append({f: getattr(first.weight, f) for f in ("kflr", "kfra")})
    for field in ("kflr", "kfra"):
        (G, a), (G_lin, A_lin) = results[0][field], results[1][field]
        torch.testing.assert_close(G, G_lin, msg=field)
        torch.testing.assert_close(torch.diag(a), A_lin, msg=field)


def test_embedding_at_batch_size_one():
    """One sample, one index: G ⊗ diag(a) is the exact GGN block of weight.T."""
    torch.manual_seed(10)
    model = nn.Sequential(nn.Embedding(5, 4), nn.Tanh(), nn.Linear(4, 3)).to(DT)
    X, y, lossf = torch.tensor([2]), torch.randint(0, 3, (1,)), nn.CrossEntropyLoss()
    run(model, lossf, X, y, KFLR(), KFRA())
    ref = blocks(model, dense(model, lossf, X, y)[0])["0.weight"]
    idx = torch.arange(20).reshape(5, 4).T.flatten()  # weight.T, row-major
    for field in ("kflr", "kfra"):
        G, a = getattr(model[0].weight, field)
        torch.testing.assert_close(torch.kron(G, torch.diag(a)), ref[idx][:, idx], msg=field)


def test_unsupported_settings_raise_before_any_result_naming_the_module():
    """As for first order (DESIGN: clear failure; issue 36, item 3): a backward that
    reaches a parameter the extension has no factors for raises before it begins,
    naming the parameter, its module and the fix, and nothing is written, not even
    ``.grad`` (it used to warn and give the other modules theirs). Frozen, or left out
    of ``backward(inputs=...)``, the other parameters get theirs."""
    X, y = torch.randn(2, 3, 4, dtype=DT), torch.randint(0, 3, (2,))
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Flatten(), nn.Linear(9, 3)).to(DT).eval()
    bn_msg = (
        r"KFLR\(\) has no result for '(weight|bias)' of module '1' \(BatchNorm1d\), '(weight|bias)' of mo.*per-channel"
    )
    with pytest.raises(jacmem.UnsupportedCurvatureError, match=bn_msg), jacmem.extend(KFLR()):
        nn.CrossEntropyLoss()(model(X), y).backward()
    assert not any(hasattr(p, "kflr") or p.grad is not None for p in model.parameters())
    others = [p for n, p in model.named_parameters() if not n.startswith("1.")]
    with jacmem.extend(KFLR()):
        nn.CrossEntropyLoss()(model(X), y).backward(inputs=others)
    assert not hasattr(model[1].weight, "kflr") and model[1].weight.grad is None
    assert model[0].weight.kflr[0].shape == (3, 3) and model[3].weight.kflr[0].shape == (3, 3)
    model[1].requires_grad_(False)
    run(model, nn.CrossEntropyLoss(), X, y, KFLR())
    assert model[0].weight.kflr[0].shape == (3, 3) and model[3].weight.kflr[0].shape == (3, 3)
    model = nn.Sequential(nn.Embedding(5, 3, scale_grad_by_freq=True), nn.Flatten(), nn.Linear(6, 3)).to(DT)
    with pytest.raises(NotImplementedError, match="'weight' of module '0' .*'0' with scale_grad_by_freq=True"):
        run(model, nn.CrossEntropyLoss(), torch.tensor([[1, 2], [2, 2]]), y, KFAC())
    assert not any(hasattr(p, "kfac") for p in model.parameters())
