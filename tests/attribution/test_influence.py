"""jacmem.attribution.Influence against a dense float64 reference: per-sample gradients by
a loop of autograd calls, the damped curvature built as an explicit matrix and inverted."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tests.support.attribution import folded_order, kronecker_block, layer_stats_of, tiny_mlp, unfold_order, with_ones
from tests.support.attribution import summed_cross_entropy as loss_fn
from torch import nn

from jacmem.attribution import Influence

#: the references build their matrices in float64 (restored after each test)
pytestmark = pytest.mark.usefixtures("float64_default")


def _data(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g)


def _loader(x, y, size):
    return [(x[i : i + size], y[i : i + size]) for i in range(0, len(x), size)]


def _per_sample(model, x, y) -> torch.Tensor:
    """``[n, P]`` by one autograd call per sample."""
    rows = []
    for i in range(len(x)):
        params = [p for p in model.parameters() if p.requires_grad]
        grads = torch.autograd.grad(loss_fn(model, (x[i : i + 1], y[i : i + 1])), params)
        rows.append(torch.cat([g.flatten() for g in grads]))
    return torch.stack(rows)


def _dense_curvature(model, x, y, curvature: str, damping: float | None) -> torch.Tensor:
    """The damped curvature ``[P, P]`` (jacmem's conventions), block-diagonal: per Linear,
    EK-FAC/KFAC of ``[W | b]`` (the bias a column of ones in the activations, ``A = Σ [a; 1]
    [a; 1]ᵀ / n``, ``G = Σ g gᵀ``); the diagonal and the identity per parameter."""
    grads = _per_sample(model, x, y)
    blocks, at = [], 0
    for linear in [m for m in model if isinstance(m, nn.Linear)]:
        a, g = layer_stats_of(model, loss_fn, x, y, linear)
        O, I = linear.weight.shape
        rows = grads[:, at : at + O * I + O]
        at += O * I + O
        if curvature in ("ekfac", "kfac"):
            order = folded_order(O, I)
            A = with_ones(a).T @ with_ones(a) / len(a)
            blocks.append(unfold_order(kronecker_block(rows[:, order], g.T @ g, A, curvature, damping), order))
            continue
        for vecs in (rows[:, : O * I], rows[:, O * I :]):
            if curvature == "identity":
                blocks.append(torch.eye(vecs.shape[1]))
                continue
            lam = vecs.square().sum(0)
            blocks.append(torch.diag(lam) + (0.1 * lam.mean() if damping is None else damping) * torch.eye(len(lam)))
    return torch.block_diag(*blocks)


@pytest.mark.parametrize("curvature", ["ekfac", "kfac", "diag", "identity"])
@pytest.mark.parametrize("damping", [0.05, None])
def test_scores_equal_the_dense_damped_inverse(curvature, damping):
    if curvature == "identity" and damping is not None:
        pytest.skip("identity has no damping")
    model = tiny_mlp()
    x, y = _data(12, 0)
    xq, yq = _data(5, 1)
    inf = Influence(model, loss_fn, curvature=curvature, damping=damping, progress=False)
    inf.fit(_loader(x, y, 4))
    got = inf.scores(_loader(xq, yq, 2), _loader(x, y, 4))
    C = _dense_curvature(model, x, y, curvature, damping)
    want = _per_sample(model, xq, yq) @ torch.linalg.inv(C) @ _per_sample(model, x, y).T
    assert got.shape == (5, 12)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("curvature", ["ekfac", "diag"])
def test_self_influence_is_the_diagonal_of_train_train_scores(curvature):
    model = tiny_mlp()
    x, y = _data(10, 0)
    inf = Influence(model, loss_fn, curvature=curvature, progress=False).fit(_loader(x, y, 4))
    scores = inf.scores(_loader(x, y, 3), _loader(x, y, 4))
    torch.testing.assert_close(inf.self_influence(_loader(x, y, 4)), torch.diagonal(scores), rtol=1e-10, atol=1e-13)


class _TinyLM(nn.Module):
    """Token ids ``[N, T]`` -> logits ``[N, T, V]``: an Embedding (its factors of
    ``weight.T``), a LayerNorm (a diagonal) and a Linear over the positions."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.embed, self.norm, self.head = nn.Embedding(6, 4), nn.LayerNorm(4), nn.Linear(4, 6)

    def forward(self, ids):
        return self.head(torch.tanh(self.norm(self.embed(ids))))


def lm_loss(model, batch):
    ids, targets = batch
    return F.cross_entropy(model(ids).flatten(0, 1), targets.flatten(), reduction="sum")


def _lm_reference(model, ids, targets, curvature, damping):
    """The damped EK-FAC/KFAC of the tiny LM as a dense ``[P, P]``, by per-sample autograd:
    Embedding ``G = Σ g gᵀ`` over all positions, ``A`` the counts ``/ (N·T)`` (diagonal:
    the identity basis), gradients of ``weight.T``; the head's ``[W | b]`` one block, ``A =
    Σ [x; 1][x; 1]ᵀ / (N·T)``; the LayerNorm's parameters the diagonal ``Σ_n g_n²`` (EK-FAC)."""
    params = [p for p in model.parameters() if p.requires_grad]
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    N, T = ids.shape
    per = [torch.autograd.grad(lm_loss(model, (ids[i : i + 1], targets[i : i + 1])), params) for i in range(N)]
    rows = {name: torch.stack([g[k].flatten() for g in per]) for k, name in enumerate(names)}
    _, g_embed = layer_stats_of(model, lm_loss, ids, targets, model.embed)
    x_head, g_head = layer_stats_of(model, lm_loss, ids, targets, model.head)
    g_embed, x_head, g_head = g_embed.flatten(0, 1), with_ones(x_head.flatten(0, 1)), g_head.flatten(0, 1)
    counts = torch.bincount(ids.flatten(), minlength=6).double() / (N * T)
    vecs = rows["embed.weight"].reshape(N, 6, 4).transpose(1, 2).flatten(1)  # of weight.T [D, V]
    C = kronecker_block(vecs, g_embed.T @ g_embed, counts, curvature, damping)
    perm = torch.arange(24).reshape(4, 6).T.flatten()  # back to the layout of weight [V, D]
    blocks = [C[perm][:, perm]]
    for name in names:
        if name.startswith("norm"):
            lam = rows[name].square().sum(0)
            blocks.append(torch.diag(lam) + (0.1 * lam.mean() if damping is None else damping) * torch.eye(len(lam)))
    order = folded_order(6, 4)
    head = torch.cat([rows["head.weight"], rows["head.bias"]], 1)[:, order]
    A = x_head.T @ x_head / (N * T)
    blocks.append(unfold_order(kronecker_block(head, g_head.T @ g_head, A, curvature, damping), order))
    return torch.block_diag(*blocks), torch.cat([rows[name] for name in names], 1)


@pytest.mark.parametrize("curvature", ["ekfac", "kfac"])
def test_embedding_layernorm_and_positions_equal_the_dense_reference(curvature):
    model = _TinyLM().double()
    if curvature == "kfac":  # (KFAC's own diagonal for a LayerNorm; the reference has EK-FAC's)
        model.norm.requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    ids, targets = torch.randint(0, 6, (9, 3), generator=g), torch.randint(0, 6, (9, 3), generator=g)
    train = [(ids[i : i + 3], targets[i : i + 3]) for i in range(0, 9, 3)]
    qids, qt = torch.randint(0, 6, (2, 3), generator=g), torch.randint(0, 6, (2, 3), generator=g)
    inf = Influence(model, lm_loss, curvature=curvature, progress=False).fit(train)
    got = inf.scores([(qids, qt)], train)
    C, train_rows = _lm_reference(model, ids, targets, curvature, None)
    _, query_rows = _lm_reference(model, qids, qt, curvature, None)
    torch.testing.assert_close(got, query_rows @ torch.linalg.inv(C) @ train_rows.T, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("curvature", ["diag", "ekfac"])
def test_the_mc_fisher_is_the_ggn_in_expectation(curvature):
    """A linear regression, MSE summed: the GGN is ``Σ_n 2 x_n x_nᵀ`` per output. The
    Monte-Carlo curvature of many fits averages to its diagonal (``"diag"``), and to its
    EK-FAC eigenvalues (``"ekfac"``, whose basis is exact here: the GGN is ``2 I ⊗ Σ x xᵀ``)."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2, bias=False).double()
    x, y = torch.randn(32, 3, dtype=torch.float64), torch.randn(32, 2, dtype=torch.float64)
    train = [(x[:16], y[:16]), (x[16:], y[16:])]

    def mse(model, batch):
        return F.mse_loss(model(batch[0]), batch[1], reduction="sum")

    fits = [Influence(model, mse, curvature=curvature, fisher="mc", progress=False).fit(train) for _ in range(200)]
    mean = torch.stack([f.preconditioners[0].lam.flatten() for f in fits]).mean(0)
    if curvature == "diag":
        want = 2 * x.square().sum(0).repeat(2)
    else:
        la = torch.linalg.eigvalsh(x.T @ x)
        want = 2 * la.repeat(2)
        mean = mean.reshape(2, 3).sort(dim=1).values.flatten()
    torch.testing.assert_close(mean, want, rtol=0.1, atol=0)


#: a convolution, its input ``[C_in, *S]`` and its unfolded patches ``[N, C_in·K, T]`` by
#: F.unfold (after the layer's padding, by F.pad)
CONVS = {
    "conv2d": (lambda: nn.Conv2d(2, 3, 2), (2, 3, 3), lambda x: F.unfold(x, 2)),
    "conv2d_reflect_strided": (
        lambda: nn.Conv2d(2, 3, 2, stride=2, padding=1, padding_mode="reflect"),
        (2, 3, 3),
        lambda x: F.unfold(F.pad(x, (1, 1, 1, 1), mode="reflect"), 2, stride=2),
    ),
    "conv1d_dilated": (
        lambda: nn.Conv1d(2, 3, 2, dilation=2),
        (2, 5),
        lambda x: F.unfold(x[:, :, None], (1, 2), dilation=(1, 2)),
    ),
}


@pytest.mark.parametrize("conv", sorted(CONVS))
@pytest.mark.parametrize("curvature", ["ekfac", "kfac"])
def test_a_convolution_equals_the_dense_reference(curvature, conv):
    """A convolution's block as jacmem's KFAC gives its factors (BackPACK's convention),
    its bias folded in as a one appended to each patch (KFC's homogeneous coordinates):
    ``G = Σ_n (Σ_t g_t)(Σ_t g_t)ᵀ``, the per-sample bias gradients' second moment, and
    ``A = Σ_{n,t} [a_t; 1][a_t; 1]ᵀ / N`` over the unfolded patches; the block of
    ``[C_out, C_in·prod(k) + 1]``, the weight's columns then the bias's."""
    make, shape, patches_of = CONVS[conv]
    torch.manual_seed(5)
    layer = make().double()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, *shape, generator=g, dtype=torch.float64), torch.randint(0, 3, (8,), generator=g)
    xq, yq = torch.randn(3, *shape, generator=g, dtype=torch.float64), torch.randint(0, 3, (3,), generator=g)
    width = layer(x[:1]).numel()
    model = nn.Sequential(layer, nn.Tanh(), nn.Flatten(), nn.Linear(width, 3, bias=False)).double()
    model[3].requires_grad_(False)
    train = _loader(x, y, 4)
    inf = Influence(model, loss_fn, curvature=curvature, damping=0.01, progress=False).fit(train)
    got = inf.scores([(xq, yq)], train)
    rows = _per_sample(model, x, y)
    O, I = layer.weight.shape[0], layer.weight[0].numel()
    bias = rows[:, O * I :]
    patches = with_ones(patches_of(x).transpose(1, 2))  # [N, T, C_in·K + 1]
    A = torch.einsum("nti,ntj->ij", patches, patches) / len(x)
    order = folded_order(O, I)
    C = unfold_order(kronecker_block(rows[:, order], bias.T @ bias, A, curvature, 0.01), order)
    want = _per_sample(model, xq, yq) @ torch.linalg.inv(C) @ rows.T
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize(
    ("curvature", "bias"),
    [("ekfac", False), ("kfac", False), ("diag", False), ("identity", False), ("ekfac", True), ("kfac", True)],
)
def test_kronfluence_conventions_are_n_train_times_jacmem(curvature, bias):
    """One row per example: kronfluence's curvature is the mean's, jacmem's the sum's, and
    the default damping scales with it, so its scores are ``n_train`` times. With biases,
    both fold a Linear's bias into its weight's block (a column of ones in the activations);
    the diagonal's default damping is per block, a parameter's in jacmem's conventions, a
    module's in kronfluence's, so it is compared without biases."""
    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(4, 5, bias=bias), nn.Tanh(), nn.Linear(5, 3, bias=bias)).double()
    x, y = _data(12, 0)
    xq, yq = _data(3, 1)
    scores = [
        Influence(model, loss_fn, curvature=curvature, conventions=c, progress=False)
        .fit(_loader(x, y, 4))
        .scores([(xq, yq)], _loader(x, y, 4))
        for c in ("jacmem", "kronfluence")
    ]
    factor = 1 if curvature == "identity" else 12
    torch.testing.assert_close(scores[1], factor * scores[0], rtol=1e-9, atol=1e-12)


class _Unused(nn.Module):
    """An MLP with a Linear the forward never calls: no gradient, no curvature."""

    def __init__(self):
        super().__init__()
        self.mlp, self.spare = tiny_mlp(), nn.Linear(2, 2).double()

    def forward(self, x):
        return self.mlp(x)


@pytest.mark.parametrize("curvature", ["ekfac", "kfac", "diag"])
def test_a_parameter_the_loss_never_uses_scores_nothing(curvature):
    x, y = _data(8, 0)
    xq, yq = _data(3, 1)
    want = Influence(tiny_mlp(), loss_fn, curvature=curvature, progress=False).fit(_loader(x, y, 4))
    got = Influence(_Unused(), loss_fn, curvature=curvature, progress=False).fit(_loader(x, y, 4))
    torch.testing.assert_close(
        got.scores([(xq, yq)], _loader(x, y, 4)), want.scores([(xq, yq)], _loader(x, y, 4)), rtol=1e-12, atol=0
    )


@pytest.mark.parametrize("curvature", ["ekfac", "kfac"])
def test_hf_conv1d_is_scored_as_its_transposed_weight(curvature):
    """HF's Conv1D (GPT-2's linear layer, ``weight [I, O]``): its factors are of
    ``weight.T``, so its block is ``[O, I]``; the reference builds it so and permutes back."""
    pytorch_utils = pytest.importorskip("transformers.pytorch_utils")
    torch.manual_seed(9)
    model = nn.Sequential(pytorch_utils.Conv1D(5, 4), nn.Tanh(), nn.Linear(5, 3, bias=False)).double()
    model[2].requires_grad_(False)
    x, y = _data(10, 0)
    xq, yq = _data(3, 1)
    inf = Influence(model, loss_fn, curvature=curvature, damping=0.01, progress=False).fit(_loader(x, y, 5))
    got = inf.scores([(xq, yq)], _loader(x, y, 5))
    a, g = layer_stats_of(model, loss_fn, x, y, model[0])
    rows = _per_sample(model, x, y)
    order = folded_order(5, 4, transposed=True)  # [O, I + 1] of weight.T and the bias -> the stored [I, O], [O]
    A = with_ones(a).T @ with_ones(a) / len(a)
    C = unfold_order(kronecker_block(rows[:, order], g.T @ g, A, curvature, 0.01), order)
    want = _per_sample(model, xq, yq) @ torch.linalg.inv(C) @ rows.T
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("curvature", ["ekfac", "kfac"])
def test_a_transposed_convolution_equals_the_dense_reference(curvature):
    """nn.ConvTranspose2d (stride 1, no padding): its weight ``[C_in, C_out, k, k]`` is
    scored as the ``[C_out, C_in·k·k]`` its factors are of (the Influence took it as
    stored and failed in a shape mismatch), its bias in a block of its own. The patch at
    output position ``p`` is ``x[p - κ]`` over kernel entries ``κ``: the unfold of ``x``
    padded by ``k - 1``, its kernel axes flipped. ``G = Σ_n (Σ_t g_t)(Σ_t g_t)ᵀ``, ``A =
    Σ_{n,t} a_t a_tᵀ / N``."""
    torch.manual_seed(5)
    C_in, C_out, k = 2, 3, 2
    layer = nn.ConvTranspose2d(C_in, C_out, k).double()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, C_in, 3, 3, generator=g), torch.randint(0, 3, (8,), generator=g)
    xq, yq = torch.randn(3, C_in, 3, 3, generator=g), torch.randint(0, 3, (3,), generator=g)
    model = nn.Sequential(layer, nn.Tanh(), nn.Flatten(), nn.Linear(C_out * 16, 3, bias=False)).double()
    model[3].requires_grad_(False)
    train = _loader(x, y, 4)
    got = Influence(model, loss_fn, curvature=curvature, damping=0.01, progress=False).fit(train)
    got = got.scores([(xq, yq)], train)

    def as_matrix(rows):  # weight [C_in, C_out, k, k] -> [C_out, C_in·k·k] (row-major), then the bias
        w = rows[:, : C_in * C_out * k * k].reshape(-1, C_in, C_out, k * k).transpose(1, 2).flatten(1)
        return w, rows[:, C_in * C_out * k * k :]

    weight, bias = as_matrix(_per_sample(model, x, y))
    patches = F.unfold(F.pad(x, (k - 1,) * 4), k).unflatten(1, (C_in, k, k)).flip(2, 3).flatten(1, 3)
    A = torch.einsum("nit,njt->ij", patches, patches) / len(x)
    G = bias.T @ bias
    C = torch.block_diag(
        kronecker_block(weight, G, A, curvature, 0.01), kronecker_block(bias, G, torch.ones(1), curvature, 0.01)
    )
    wq, bq = as_matrix(_per_sample(model, xq, yq))
    want = torch.cat([wq, bq], 1) @ torch.linalg.inv(C) @ torch.cat([weight, bias], 1).T
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("curvature", ["ekfac", "kfac"])
def test_under_bf16_autocast_the_folded_factor_is_in_the_weights_dtype(curvature):
    """A float32 model whose ``loss_fn`` runs under ``torch.autocast`` (bfloat16): the
    folded input factor (the bias as a column of ones), computed in a forward hook under
    autocast, came in bfloat16, on which ``eigh`` does not run (the fit raised
    ``"linalg_eigh_cpu" not implemented for 'BFloat16'``). It is computed in the weight's
    dtype; the scores are the float64 dense reference's, to bfloat16's precision."""
    model = tiny_mlp().float()
    x, y = _data(12, 0)

    def amp_loss(model, batch):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(batch[0].float())
        return F.cross_entropy(logits.float(), batch[1], reduction="sum")

    inf = Influence(model, amp_loss, curvature=curvature, damping=0.05, progress=False).fit(_loader(x, y, 4))
    got = inf.scores(_loader(x[:3], y[:3], 3), _loader(x, y, 4))
    assert got.dtype == torch.float32
    reference = tiny_mlp()  # the same weights, float64, no autocast
    C = _dense_curvature(reference, x, y, curvature, 0.05)
    rows = _per_sample(reference, x, y)
    want = rows[:3] @ torch.linalg.inv(C) @ rows.T
    assert ((got.double() - want).norm() / want.norm()) < 3e-2
