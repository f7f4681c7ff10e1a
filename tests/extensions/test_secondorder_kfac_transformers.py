"""KFAC/KFLR for transformers (issue 16, item 4): Linear on sequences in both variants of
Eschenhagen et al. (NeurIPS 2023), ``kfac_approx="expand" | "reduce"``, Embedding,
LayerNorm/RMSNorm (their GGN diagonal), convolutions; in float64 against the exact GGN
built with torch.func (tests/support/secondorder_ref.py) and against curvlinops'
``KFACLinearOperator`` (type-2 Fisher = KFLR), the independent implementation of both
variants."""

from __future__ import annotations

import pytest
import torch
from tests.support.secondorder_ref import blocks, dense, diagonals, freeze, run
from torch import nn

from jacmem import KFAC, KFACEF, KFLR, ChainError, DiagGGNMC

DT = torch.float64
APPROX = [None, "expand", "reduce"]


def _seq_model():
    """Embedding -> Linear on [N, T, ·] -> LayerNorm -> GELU -> Linear -> RMSNorm."""
    return nn.Sequential(
        nn.Embedding(7, 4), nn.Linear(4, 5), nn.LayerNorm(5), nn.GELU(), nn.Linear(5, 3), nn.RMSNorm(3)
    ).to(DT)


@pytest.mark.parametrize("approx", APPROX)
@pytest.mark.parametrize("ext", [KFAC, KFLR])
def test_factors_are_symmetric_psd_with_the_right_sizes(ext, approx):
    """Weights ``[G [O, O], A [I, I]]`` (Embedding ``[G [D, D], a [V]]``, a ≥ 0), biases
    ``[G]``, LayerNorm/RMSNorm ``[d]`` (``param.shape``, d ≥ 0): symmetric, PSD."""
    torch.manual_seed(0)
    model = _seq_model()
    if approx == "reduce":  # an Embedding has no reduce factors (test_embedding_refuses_reduce)
        model[0].weight.requires_grad_(False)
    X, y = torch.randint(0, 7, (3, 4)), torch.randn(3, 4, 3, dtype=DT)
    e = ext(kfac_approx=approx)
    run(model, nn.MSELoss(), X, y, e)
    sizes = {
        "0.weight": [(4, 4), (7,)],
        "1.weight": [(5, 5), (4, 4)],
        "1.bias": [(5, 5)],
        "2.weight": [(5,)],
        "2.bias": [(5,)],
        "4.weight": [(3, 3), (5, 5)],
        "4.bias": [(3, 3)],
        "5.weight": [(3,)],
    }
    for name, p in model.named_parameters():
        if not p.requires_grad:
            assert not hasattr(p, e.savefield)
            continue
        factors = getattr(p, e.savefield)
        assert [tuple(f.shape) for f in factors] == sizes[name], name
        for f in factors:
            if f.dim() == 1:
                assert bool((f >= 0).all()), name
            else:
                torch.testing.assert_close(f, f.T, msg=name)
                assert float(torch.linalg.eigvalsh(f).min()) > -1e-12 * float(f.abs().max()), name


def _check_blocks(model, lossf, X, y, ext):
    """G ⊗ A (row-major vec of a weight) and G (a bias) are the exact GGN blocks."""
    run(model, lossf, X, y, ext)
    ref = blocks(model, dense(model, lossf, X, y)[0])
    for name, p in model.named_parameters():
        factors = getattr(p, ext.savefield)
        got = torch.kron(*factors) if name.endswith("weight") else factors[0]
        torch.testing.assert_close(got, ref[name], msg=f"{ext!r} {name}")


@pytest.mark.parametrize("approx", APPROX)
def test_one_sample_one_position_is_the_exact_ggn_block(approx):
    """N = 1, T = 1: every variant gives the exact GGN block of each Linear and conv
    (the Kronecker form of a one-sample GGN w.r.t. a weight is exact)."""
    torch.manual_seed(1)
    seq = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(DT)
    _check_blocks(
        seq, nn.CrossEntropyLoss(), torch.randn(1, 1, 4, dtype=DT).squeeze(1), torch.tensor([2]), KFLR(approx)
    )
    _check_blocks(seq, nn.MSELoss(), torch.randn(1, 1, 4, dtype=DT), torch.randn(1, 1, 3, dtype=DT), KFLR(approx))
    cnn = nn.Sequential(nn.Conv2d(2, 3, 4), nn.Tanh(), nn.Flatten(), nn.Linear(3, 3)).to(DT)  # one output position
    _check_blocks(cnn, nn.CrossEntropyLoss(), torch.randn(1, 2, 4, 4, dtype=DT), torch.tensor([0]), KFLR(approx))


def test_expand_is_exact_for_a_linear_layer_with_mse():
    """One Linear on [N, T, I] with MSE: the output GGN is the constant c·I at every
    position, so the exact block Σ_{n,t} c I ⊗ x xᵀ = (N·T·c I) ⊗ (Σ x xᵀ / (N·T)) is
    KFLR-expand's, for any N, T; reduce's is not (its A is of the means)."""
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(4, 3)).to(DT)
    X, y = torch.randn(3, 5, 4, dtype=DT), torch.randn(3, 5, 3, dtype=DT)
    _check_blocks(model, nn.MSELoss(), X, y, KFLR("expand"))
    run(model, nn.MSELoss(), X, y, KFLR("reduce"))
    ref = blocks(model, dense(model, nn.MSELoss(), X, y)[0])["0.weight"]
    assert (torch.kron(*model[0].weight.kflr) - ref).abs().max() > 1e-3


@pytest.mark.parametrize("d", [1, 2, 3])
def test_expand_is_exact_for_a_convolution_with_mse(d):
    """One Conv1d/2d/3d with MSE, as for the Linear: KFLR-expand's G ⊗ A is the exact
    block over the T output positions (Σ_{n,t} c I ⊗ a_t a_tᵀ); the default's
    (BackPACK's) is T times it; with one sample and the same patch everywhere, reduce's
    is exact too (next test)."""
    torch.manual_seed(11)
    conv = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[d - 1]
    model = nn.Sequential(conv(2, 3, 2, stride=1, padding=1)).to(DT)
    X = torch.randn(2, 2, *(3,) * d, dtype=DT)
    y = torch.randn(2, 3, *(4,) * d, dtype=DT)
    _check_blocks(model, nn.MSELoss(), X, y, KFLR("expand"))
    run(model, nn.MSELoss(), X, y, KFLR())
    ref = blocks(model, dense(model, nn.MSELoss(), X, y)[0])["0.weight"]
    torch.testing.assert_close(torch.kron(*model[0].weight.kflr), 4**d * ref)


def test_expand_is_exact_for_a_transposed_convolution_with_mse():
    """ConvTranspose2d alone with MSE: KFLR-expand's G ⊗ A is the exact block of
    weight.transpose(0, 1) (the layout of its factors, as BackPACK's)."""
    torch.manual_seed(12)
    model = nn.Sequential(nn.ConvTranspose2d(2, 3, 2, stride=2)).to(DT)
    X, y = torch.randn(2, 2, 2, 3, dtype=DT), torch.randn(2, 3, 4, 6, dtype=DT)
    run(model, nn.MSELoss(), X, y, KFLR("expand"))
    ref = blocks(model, dense(model, nn.MSELoss(), X, y)[0])["0.weight"]
    idx = torch.arange(24).reshape(2, 3, 2, 2).transpose(0, 1).flatten()
    torch.testing.assert_close(torch.kron(*model[0].weight.kflr), ref[idx][:, idx])


def test_embedding_expand_is_exact_for_an_embedding_with_mse():
    """As for the Linear: an Embedding alone with MSE, [G, a] with G ⊗ diag(a) the exact
    GGN block of weight.T, a = the token counts / (N·T) (0 at padding_idx)."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Embedding(6, 4, padding_idx=1)).to(DT)
    X, y = torch.tensor([[0, 1, 3], [3, 5, 3]]), torch.randn(2, 3, 4, dtype=DT)
    for ext in (KFLR(), KFLR("expand")):
        run(model, nn.MSELoss(), X, y, ext)
        G, a = model[0].weight.kflr
        torch.testing.assert_close(a, torch.tensor([1, 0, 0, 3, 0, 1], dtype=DT) / 6)
        ref = blocks(model, dense(model, nn.MSELoss(), X, y)[0])["0.weight"]
        idx = torch.arange(24).reshape(6, 4).T.flatten()  # weight.T, row-major
        torch.testing.assert_close(torch.kron(G, torch.diag(a)), ref[idx][:, idx])


def test_reduce_is_exact_when_the_positions_share_the_input():
    """N = 1, the same input at every position (Linear: x_t = x; Conv1d/2d/3d: a
    spatially constant input without padding, so every patch is the same): the exact block
    Σ_{t,t'} G_{tt'} ⊗ x xᵀ is KFLR-reduce's (G of the summed roots, A of the mean);
    expand's is not (it drops t ≠ t')."""
    torch.manual_seed(4)
    lin = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Flatten(), nn.Linear(15, 3)).to(DT)
    X = torch.randn(1, 1, 4, dtype=DT).expand(1, 3, 4)
    cases = [(lin, X)]
    for d, conv in enumerate((nn.Conv1d, nn.Conv2d, nn.Conv3d), 1):
        model = nn.Sequential(conv(2, 3, 2), nn.Tanh(), nn.Flatten(), nn.Linear(3 * 2**d, 3)).to(DT)
        cases.append((model, torch.randn(1, 2, *(1,) * d, dtype=DT).expand(1, 2, *(3,) * d)))
    for model, x in cases:
        y, lossf = torch.tensor([1]), nn.CrossEntropyLoss()
        _check_blocks(model, lossf, x, y, KFLR("reduce"))
        run(model, lossf, x, y, KFLR("expand"))
        ref = blocks(model, dense(model, lossf, x, y)[0])["0.weight"]
        assert (torch.kron(*model[0].weight.kflr) - ref).abs().max() > 1e-3


def _curvlinops(model, lossf, X, y, approx):
    """curvlinops' type-2 KFAC (the exact loss Hessian: KFLR) factors, per module name:
    (G, A)."""
    from curvlinops import KFACLinearOperator

    params = [p for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d)) for p in m.parameters()]
    op = KFACLinearOperator(
        model, lossf, params, [(X, y)], fisher_type="type-2", kfac_approx=approx, check_deterministic=False
    )
    op.compute_kronecker_factors()
    return {name: (op._gradient_covariances[name], op._input_covariances.get(name)) for name in op._mapping}


CURVLINOPS = {
    # position-wise net on [N, T, I] with a loss per position (curvlinops' mean over N·T)
    "seq_mse": (
        lambda: nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)),
        lambda: (torch.randn(3, 4, 4, dtype=DT), torch.randn(3, 4, 3, dtype=DT)),
        nn.MSELoss,
    ),
    # positions mixed by Flatten, one loss term per sample
    "seq_ce": (
        lambda: nn.Sequential(nn.Linear(4, 5), nn.GELU(), nn.Flatten(), nn.Linear(15, 3)),
        lambda: (torch.randn(4, 3, 4, dtype=DT), torch.tensor([0, 2, 1, 2])),
        nn.CrossEntropyLoss,
    ),
    "cnn_ce": (
        lambda: nn.Sequential(
            nn.Conv2d(2, 3, 3, padding=1, stride=2), nn.ReLU(), nn.Conv2d(3, 2, 2), nn.Flatten(), nn.Linear(8, 3)
        ),
        lambda: (torch.randn(3, 2, 6, 6, dtype=DT), torch.tensor([0, 2, 1])),
        nn.CrossEntropyLoss,
    ),
}


@pytest.mark.parametrize(
    ("case", "approx"),
    [(c, a) for c in sorted(CURVLINOPS) for a in ("expand", "reduce") if (c, a) != ("seq_mse", "reduce")],
)
def test_kflr_equals_curvlinops(case, approx):
    """KFLR(kfac_approx=a) and curvlinops' KFACLinearOperator(fisher_type="type-2",
    kfac_approx=a): G and A each equal (the same scaling), for Linear on sequences and
    Conv2d; ``seq_mse`` with reduce: the next test."""
    make, data, lossf = CURVLINOPS[case]
    torch.manual_seed(5)
    model, (X, y) = make().to(DT), data()
    ref = _curvlinops(model, lossf(), X, y, approx)
    run(model, lossf(), X, y, KFLR(approx), KFAC(kfac_approx=approx))
    modules = dict(model.named_modules())
    for name, (G, A) in ref.items():
        m = modules[name]
        torch.testing.assert_close(m.weight.kflr[0], G, msg=f"G {name}")
        torch.testing.assert_close(m.weight.kflr[1], A, msg=f"A {name}")
        torch.testing.assert_close(m.bias.kflr[0], G, msg=f"bias G {name}")
        torch.testing.assert_close(m.weight.kfac[1], A, msg=f"KFAC's A {name}")


def test_reduce_with_a_loss_per_position():
    """A loss term per position (MSE on [N, T, C], a position-wise net): the last
    Linear's reduce G is Σ_n Σ_{t,t'} (the loss Hessian's (t, t') block) = Σ_{n,t} 2/(N·T·C)
    I = 2/C I (the blocks t ≠ t' are zero); A equals curvlinops'. curvlinops' G is T
    times that: its type-2 pushes each column of the loss Hessian's root through all
    positions at once, so its roots' outer products have blocks t ≠ t' that the loss
    Hessian has not; they cancel in expand's per-position sums, not in reduce's.
    curvlinops' Monte-Carlo G (independent labels per position: unbiased) and KFAC's
    converge to KFLR's at every layer."""
    from curvlinops import KFACLinearOperator

    make, data, lossf = CURVLINOPS["seq_mse"]
    torch.manual_seed(5)
    model, (X, y) = make().to(DT), data()
    run(model, lossf(), X, y, KFLR("reduce"), KFAC(5000, "reduce"))
    G, A = model[2].weight.kflr
    torch.testing.assert_close(G, 2 / 3 * torch.eye(3, dtype=DT))
    G_ref, A_ref = _curvlinops(model, lossf(), X, y, "reduce")["2"]
    torch.testing.assert_close(A, A_ref)
    torch.testing.assert_close(G_ref, X.shape[1] * G)
    mc = KFACLinearOperator(
        model,
        lossf(),
        list(model.parameters()),
        [(X, y)],
        mc_samples=500,
        kfac_approx="reduce",
        check_deterministic=False,
    )
    mc.compute_kronecker_factors()
    for name in ("0", "2"):
        G = model.get_submodule(name).weight.kflr[0]
        for G_mc in (mc._gradient_covariances[name], model.get_submodule(name).weight.kfac[0]):
            assert float((G_mc - G).abs().max() / G.abs().max()) < 0.1, name


def test_default_is_expand_for_linear_and_backpacks_for_conv():
    """``kfac_approx=None``: Linear on sequences as ``"expand"``; a conv's G as
    ``"reduce"``'s and its A T times ``"expand"``'s (BackPACK's convention)."""
    torch.manual_seed(6)
    make, data, lossf = CURVLINOPS["cnn_ce"]
    model, (X, y) = make().to(DT), data()
    got = {}
    for approx in APPROX:
        run(model, lossf(), X, y, KFLR(approx))
        got[approx] = model[0].weight.kflr
    T = 9  # 3 × 3 output positions of the first conv
    torch.testing.assert_close(got[None][0], got["reduce"][0])
    torch.testing.assert_close(got[None][1], T * got["expand"][1])
    seq = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(DT)
    X, y = torch.randn(3, 4, 4, dtype=DT), torch.randn(3, 4, 3, dtype=DT)
    for approx in (None, "expand"):
        run(seq, nn.MSELoss(), X, y, KFLR(approx))
        got[approx] = seq[0].weight.kflr
    for a, b in zip(got[None], got["expand"], strict=True):
        torch.testing.assert_close(a, b)


def test_norm_layers_get_their_ggn_diagonal():
    """LayerNorm (weight, bias) and RMSNorm (weight), in the middle and at the end of a
    sequence model: KFLR's ``[d]`` is the exact GGN diagonal (torch.func); KFAC's is
    DiagGGNMC's, from the same Monte-Carlo factors."""
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(4, 5), nn.LayerNorm(5), nn.Tanh(), nn.Linear(5, 3), nn.RMSNorm(3)).to(DT)
    X, y = torch.randn(2, 3, 4, dtype=DT), torch.randn(2, 3, 3, dtype=DT)
    run(model, nn.MSELoss(), X, y, KFLR("expand"), KFAC(kfac_approx="expand"), DiagGGNMC())
    ref = diagonals(model, dense(model, nn.MSELoss(), X, y)[0])
    for name in ("1.weight", "1.bias", "4.weight"):
        p = model.get_parameter(name)
        (d,) = p.kflr
        torch.testing.assert_close(d, ref[name], msg=name)
        (d_mc,) = p.kfac
        torch.testing.assert_close(d_mc, p.diag_ggn_mc, msg=name)


def test_kfra_and_diag_hessian_refuse_norm_layers():
    """KFRA has no diagonal for LayerNorm (KFLR has one): the backward raises before any
    result, naming the module (it used to warn beside the others' results); frozen, the
    others get theirs. DiagHessian raises passing through it (its second derivative is
    not zero)."""
    from jacmem import KFRA, DiagHessian, extend

    torch.manual_seed(8)
    model = nn.Sequential(nn.Linear(4, 5), nn.LayerNorm(5), nn.Linear(5, 3)).to(DT)
    X, y = torch.randn(2, 4, dtype=DT), torch.tensor([0, 2])
    with pytest.raises(NotImplementedError, match=r"KFRA\(\) has no Kronecker factors for LayerNorm \(module '1'\)"):
        run(model, nn.CrossEntropyLoss(), X, y, KFRA())
    assert not any(hasattr(p, "kfra") for p in model.parameters())
    model[1].requires_grad_(False)
    run(model, nn.CrossEntropyLoss(), X, y, KFRA())
    assert not hasattr(model[1].weight, "kfra") and hasattr(model[0].weight, "kfra")
    model[1].requires_grad_(True)
    with pytest.raises(NotImplementedError, match=r"DiagHessian cannot pass curvature through module '1'"):
        with extend(DiagHessian()):
            nn.CrossEntropyLoss()(model(X), y).backward()
    from timm.layers import LayerNorm  # recognised as a LayerNorm: the same

    model[1] = LayerNorm(5).to(DT)
    with pytest.raises(NotImplementedError, match=r"DiagHessian cannot pass curvature through module '1'"):
        with extend(DiagHessian()):
            nn.CrossEntropyLoss()(model(X), y).backward()


def test_embedding_refuses_reduce():
    """Its reduced input factor is a dense [V, V]: the backward raises before any result,
    naming the module and the fix; with the Embedding frozen, the other layers' factors
    as usual."""
    model = nn.Sequential(nn.Embedding(5, 3), nn.Flatten(), nn.Linear(6, 3)).to(DT)
    X, y = torch.tensor([[1, 2], [2, 4]]), torch.tensor([0, 1])
    with pytest.raises(
        NotImplementedError, match=r"Embedding module '0' with kfac_approx='reduce'.*kfac_approx='expand'"
    ):
        run(model, nn.CrossEntropyLoss(), X, y, KFLR("reduce"))
    assert not any(hasattr(p, "kflr") for p in model.parameters())
    model[0].requires_grad_(False)
    run(model, nn.CrossEntropyLoss(), X, y, KFLR("reduce"))
    assert not hasattr(model[0].weight, "kflr") and model[2].weight.kflr[1].shape == (6, 6)


def test_bad_kfac_approx_raises():
    with pytest.raises(ValueError, match="kfac_approx must be one of"):
        KFAC(kfac_approx="mean")
    with pytest.raises(ValueError, match="kfac_approx must be one of"):
        KFLR("sum")
    assert repr(KFAC(2, "reduce")) == "KFAC(mc_samples=2, kfac_approx='reduce')" and repr(KFLR()) == "KFLR()"


@pytest.mark.parametrize("approx", ["expand", "reduce"])
def test_timm_mlp_block(approx):
    """A timm ViT block's norm2 (timm's ``LayerNorm``, a subclass with its own forward,
    which jacmem recognises) and Mlp (fc1, GELU, dropout, norm, fc2, dropout) as a
    Sequential of its real submodules on [N, T, D] tokens, after a Linear (whose
    factors cross the LayerNorm): the Linears' KFLR equal curvlinops' (reduce: a head
    that flattens the tokens, one loss term per sample), the LayerNorm's ``[d]`` the
    exact GGN diagonal."""
    from timm.models.vision_transformer import Block

    torch.manual_seed(9)
    block = Block(dim=8, num_heads=2, mlp_ratio=2.0).to(DT).eval()
    mlp = block.mlp
    model = nn.Sequential(
        nn.Linear(8, 8).to(DT), block.norm2, mlp.fc1, mlp.act, mlp.drop1, mlp.norm, mlp.fc2, mlp.drop2
    )
    assert type(block.norm2) is not nn.LayerNorm
    X = torch.randn(2, 3, 8, dtype=DT)
    if approx == "expand":
        lossf, y = nn.MSELoss(), torch.randn(2, 3, 8, dtype=DT)
    else:
        model.append(nn.Flatten()).append(nn.Linear(24, 3).to(DT))
        lossf, y = nn.CrossEntropyLoss(), torch.tensor([2, 0])
    ref = _curvlinops(model, lossf, X, y, approx)
    run(model, lossf, X, y, KFLR(approx))
    modules = dict(model.named_modules())
    assert {"0", "2", "6"} <= set(ref)
    for name, (G, A) in ref.items():
        torch.testing.assert_close(modules[name].weight.kflr[0], G, msg=name)
        torch.testing.assert_close(modules[name].weight.kflr[1], A, msg=name)
    exact = diagonals(model, dense(model, lossf, X, y)[0])
    for name in ("1.weight", "1.bias"):
        torch.testing.assert_close(model.get_parameter(name).kflr[0], exact[name], msg=name)


@pytest.mark.parametrize("approx", ["expand", "reduce"])
def test_hf_conv1d_has_the_linears_factors(approx):
    """GPT-2's ``Conv1D`` (weight [I, O]) on [N, T, I]: the factors of a Linear with
    weight = Conv1D's weight.T, hence curvlinops' for that Linear."""
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(10)
    conv1d = Conv1D(5, 4).to(DT)
    lin = nn.Linear(4, 5).to(DT)
    with torch.no_grad():
        lin.weight.copy_(conv1d.weight.T)
        lin.bias.copy_(conv1d.bias)
    head = nn.Sequential(nn.Tanh(), nn.Flatten(), nn.Linear(15, 3)).to(DT)
    X, y = torch.randn(3, 3, 4, dtype=DT), torch.tensor([0, 2, 1])
    run(nn.Sequential(conv1d, head), nn.CrossEntropyLoss(), X, y, KFLR(approx))
    G, A = _curvlinops(nn.Sequential(lin, head), nn.CrossEntropyLoss(), X, y, approx)["0"]
    torch.testing.assert_close(conv1d.weight.kflr[0], G)
    torch.testing.assert_close(conv1d.weight.kflr[1], A)
    torch.testing.assert_close(conv1d.bias.kflr[0], G)


class _OneHot(nn.Module):
    """An HF model whose token embedding is a bias-free Linear on one-hot ids (fed as
    ``inputs_embeds``): the Embedding as curvlinops sees it, whose ``A`` is the dense
    ``[V, V]`` of which jacmem keeps the diagonal."""

    def __init__(self, logits: nn.Module, embedding: nn.Embedding):
        super().__init__()
        self.logits = logits
        self.emb = nn.Linear(*embedding.weight.shape, bias=False).to(DT)
        with torch.no_grad():
            self.emb.weight.copy_(embedding.weight.T)
        self.emb.weight.requires_grad_(embedding.weight.requires_grad)

    def forward(self, ids):
        embeds = self.emb(nn.functional.one_hot(ids, self.emb.in_features).to(DT))
        logits = self.logits.model(inputs_embeds=embeds).logits
        return logits.transpose(1, 2) if self.logits.per_token else logits


def _twin(model: nn.Module, embedding: str) -> nn.Module:
    """``model`` for curvlinops: each HF ``Conv1D`` a Linear with its weight transposed,
    the token embedding a Linear on one-hot ids (:class:`_OneHot`)."""
    import copy

    from transformers.pytorch_utils import Conv1D

    twin = copy.deepcopy(model)
    for module in list(twin.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, Conv1D):
                lin = nn.Linear(*child.weight.shape).to(DT)
                with torch.no_grad():
                    lin.weight.copy_(child.weight.T)
                    lin.bias.copy_(child.bias)
                setattr(module, name, lin)
    return _OneHot(twin, twin.get_submodule(embedding))


def _lm(name: str):
    """Untied one- or two-layer HF models (tests/support/hf_models.py), float64, and a
    batch: GPT-2 and LLaMA with a loss per token, BERT a sequence classifier."""
    import transformers
    from tests.support import hf_models

    torch.manual_seed(13)
    if name == "gpt2":
        config = transformers.GPT2Config(
            n_layer=1, n_embd=8, n_head=2, vocab_size=hf_models.V, n_positions=8, tie_word_embeddings=False,
            bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        model = hf_models.Logits(transformers.GPT2LMHeadModel(config), per_token=True)
    else:
        model = getattr(hf_models, name)()
    model = model.to(DT).eval()
    X, y = hf_models.tokens(3 if name == "bert" else None)
    return model, X, y


#: each model's token embedding, and the layers whose output at a position reaches the loss
#: only at that position (with a loss per token), or all (BERT: one loss term per sample)
LM_CASES = {
    "gpt2": ("model.transformer.wte", ("attn.c_proj", "mlp.", "lm_head")),
    "bert": ("model.bert.embeddings.word_embeddings", ("",)),
    "llama": ("model.model.embed_tokens", ("o_proj", "mlp.", "lm_head")),
}


@pytest.mark.parametrize(("name", "approx"), [(n, "expand") for n in sorted(LM_CASES)] + [("bert", "reduce")])
def test_kflr_on_language_models_equals_curvlinops(name, approx):
    """KFLR on untied GPT-2 (HF Conv1D), BERT and LLaMA: every Linear's and Conv1D's
    ``A`` equals curvlinops' type-2 ``A``, and the token Embedding's ``a`` the diagonal of
    curvlinops' ``A`` for the one-hot Linear it is (:class:`_OneHot`; the rest of that
    ``A`` is zero; 0 at ``padding_idx``, whose row has no gradient). ``G``: equal at every
    layer whose output at a position reaches the loss only at that position (all of
    BERT's: one loss term per sample, also with ``"reduce"``, the embeddings frozen).
    Before the attention, with a loss per token, they part by convention: curvlinops'
    type-2 pushes each class's Hessian column through all positions at once (its roots'
    outer products have position cross terms that the loss Hessian has not, as in
    :func:`test_reduce_with_a_loss_per_position`); jacmem's roots are each position's own."""
    from curvlinops import KFACLinearOperator

    embedding, positionwise = LM_CASES[name]
    model, X, y = _lm(name)
    if approx == "reduce":  # an Embedding has no reduce factors
        for m in model.modules():
            if isinstance(m, nn.Embedding):
                m.weight.requires_grad_(False)
    lossf = nn.CrossEntropyLoss()
    twin = _twin(model, embedding)
    params = [p for m in twin.modules() if isinstance(m, nn.Linear) for p in m.parameters() if p.requires_grad]
    op = KFACLinearOperator(
        twin, lossf, params, [(X, y)], fisher_type="type-2", kfac_approx=approx, check_deterministic=False
    )
    op.compute_kronecker_factors()
    freeze(model, "LlamaRMSNorm")
    run(model, lossf, X, y, KFLR(approx))
    scale = max(float(G.abs().max()) for G in op._gradient_covariances.values())
    compared = 0
    for twin_name in op._mapping:
        G_ref, A_ref = op._gradient_covariances[twin_name], op._input_covariances[twin_name]
        ours = embedding if twin_name == "emb" else twin_name[len("logits.") :]
        G, A = model.get_submodule(ours).weight.kflr
        if A.dim() == 1:
            pad = model.get_submodule(ours).padding_idx  # BERT's: its row gets no gradient, and 0 in a
            if pad is not None:
                A_ref[pad, pad] = 0
            torch.testing.assert_close(torch.diag(A), A_ref, msg=ours)
        else:
            torch.testing.assert_close(A, A_ref, msg=ours)
        if twin_name != "emb" and any(key in ours for key in positionwise):
            # up to rounding relative to the largest G (BERT's key projections' reduce G is
            # zero but for rounding: the softmax's gradient sums to zero over the keys);
            # LLaMA's RMSNorm computes in float32
            rtol = 1e-6 if name == "llama" else 1e-10
            torch.testing.assert_close(G, G_ref, atol=rtol * scale, rtol=rtol, msg=ours)
            compared += 1
    assert compared >= 4


def _curvlinops_ef(twin, lossf, X, y, approx):
    """curvlinops' empirical-Fisher KFAC factors of ``twin``'s Linears: {name: (G, A)}."""
    from curvlinops import KFACLinearOperator

    params = [p for m in twin.modules() if isinstance(m, nn.Linear) for p in m.parameters() if p.requires_grad]
    op = KFACLinearOperator(
        twin, lossf, params, [(X, y)], fisher_type="empirical", kfac_approx=approx, check_deterministic=False
    )
    op.compute_kronecker_factors()
    return {name: (op._gradient_covariances[name], op._input_covariances[name]) for name in op._mapping}


def _close(got, want, msg):
    """Equal, up to rounding relative to the factor's scale (a key projection's reduce
    ``G`` is zero but for rounding: the softmax's gradient sums to zero over the keys)."""
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-10 * float(want.abs().max()), msg=msg)


@pytest.mark.parametrize(("case", "approx"), [(c, a) for c in sorted(CURVLINOPS) for a in ("expand", "reduce")])
def test_kfacef_equals_curvlinops(case, approx):
    """KFACEF(kfac_approx=a) and curvlinops' KFACLinearOperator(fisher_type="empirical",
    kfac_approx=a): G and A equal for Linear on sequences and Conv2d (the module chain),
    MSE and cross-entropy, reduce with a loss per position included (one root per sample
    at every position, the gradient, in both)."""
    make, data, lossf = CURVLINOPS[case]
    torch.manual_seed(5)
    model, (X, y) = make().to(DT), data()
    ref = _curvlinops_ef(model, lossf(), X, y, approx)
    run(model, lossf(), X, y, KFACEF(approx))
    for name, (G, A) in ref.items():
        m = model.get_submodule(name)
        _close(m.weight.kfac_ef[0], G, f"G {name}")
        _close(m.weight.kfac_ef[1], A, f"A {name}")
        _close(m.bias.kfac_ef[0], G, f"bias G {name}")


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_kfacef_with_label_smoothing_equals_curvlinops(reduction):
    """``CrossEntropyLoss(label_smoothing=0.1)``: the empirical Fisher's roots are the
    gradients at the smoothed targets, ``p - (1-ε) onehot(y) - ε/C``; G and A equal
    curvlinops' empirical KFAC (they were the unsmoothed gradients', 22% off)."""
    make, data, _ = CURVLINOPS["seq_ce"]
    torch.manual_seed(5)
    model, (X, y) = make().to(DT), data()
    lossf = nn.CrossEntropyLoss(label_smoothing=0.1, reduction=reduction)
    ref = _curvlinops_ef(model, lossf, X, y, "expand")
    run(model, lossf, X, y, KFACEF())
    for name, (G, A) in ref.items():
        m = model.get_submodule(name)
        _close(m.weight.kfac_ef[0], G, f"G {name}")
        _close(m.weight.kfac_ef[1], A, f"A {name}")


@pytest.mark.parametrize("path", ["chain", "autograd"])
def test_kfacef_refuses_a_sum_of_losses_and_a_loss_it_does_not_know(path):
    """The empirical Fisher's root is one loss's gradient: a sum of two losses (its
    gradient is not the sum of their roots, which the chain added as two factors, a G
    silently off the gradients') raises on both paths, naming the losses; a loss with no
    root (HuberLoss) names itself and the fix instead of asking for one call."""
    make, data, _ = CURVLINOPS["seq_ce"]
    torch.manual_seed(5)
    model, (X, y) = make().to(DT), data()
    ce, mse = nn.CrossEntropyLoss(), nn.MSELoss()
    head = (lambda z: z) if path == "chain" else (lambda z: z.cumsum(1))  # an untracked op: the autograd path
    with pytest.raises(ChainError, match=r"one loss call per backward; this one has 2 .*Loss.*Loss.*KFLR"):
        run(model, lambda z, t: ce(head(z), t) + mse(head(z), torch.zeros_like(z)), X, y, KFACEF())
    with pytest.raises(
        ChainError, match=r"no loss that has an empirical Fisher \(MSELoss, CrossEntropyLoss, BCEWithLogitsLoss,.*KFLR"
    ):
        run(model, lambda z, t: nn.HuberLoss()(z, torch.zeros_like(z)), X, y, KFACEF())


@pytest.mark.parametrize("approx", ["expand", "reduce"])
@pytest.mark.parametrize("name", sorted(LM_CASES))
def test_kfacef_on_language_models_equals_curvlinops(name, approx):
    """KFACEF on untied GPT-2 (HF Conv1D), BERT and LLaMA (the autograd path): G and A
    of every Linear and Conv1D equal curvlinops' empirical KFAC, and with ``"expand"`` the
    token Embedding's (as in :func:`test_kflr_on_language_models_equals_curvlinops`; its
    reduce is refused, so the embeddings are frozen there). LLaMA's RMSNorm computes in
    float32: equal to its rounding."""
    embedding, _ = LM_CASES[name]
    model, X, y = _lm(name)
    if approx == "reduce":
        for m in model.modules():
            if isinstance(m, nn.Embedding):
                m.weight.requires_grad_(False)
    lossf = nn.CrossEntropyLoss()
    ref = _curvlinops_ef(_twin(model, embedding), lossf, X, y, approx)
    freeze(model, "LlamaRMSNorm")
    run(model, lossf, X, y, KFACEF(approx))
    assert len(ref) >= 5
    rtol = 1e-6 if name == "llama" else 1e-10
    # up to rounding relative to the largest G: BERT's key projections' reduce G is zero but
    # for rounding (the softmax's gradient sums to zero over the keys)
    scale = max(float(G.abs().max()) for G, _ in ref.values())
    for twin_name, (G_ref, A_ref) in ref.items():
        ours = embedding if twin_name == "emb" else twin_name[len("logits.") :]
        m = model.get_submodule(ours)
        G, A = m.weight.kfac_ef
        if A.dim() == 1:
            if m.padding_idx is not None:
                A_ref[m.padding_idx, m.padding_idx] = 0
            A = torch.diag(A)
        torch.testing.assert_close(G, G_ref, rtol=rtol, atol=rtol * scale, msg=ours)
        torch.testing.assert_close(A, A_ref, msg=ours)


def _ef_reference(model, lossf, X, y, names, terms):
    """``G = K Σ_{n,t} g_t g_tᵀ`` of each named module (expand), from autograd's own
    gradient ``g`` at its output, ``K`` the loss's number of terms."""
    grads = {}

    def keep(name):
        def hook(module, inputs, out):
            out.register_hook(lambda g: grads.__setitem__(name, g))

        return hook

    handles = [model.get_submodule(n).register_forward_hook(keep(n)) for n in names]
    model.zero_grad()
    lossf(model(X), y).backward()
    for h in handles:
        h.remove()
    return {n: terms * grads[n].flatten(0, -2).T @ grads[n].flatten(0, -2) for n in names}


def test_kfacef_with_ignore_index_on_merged_tokens():
    """A per-token model whose loss reads ``logits.flatten(0, 1)`` with ``ignore_index``
    (the module chain, through the merged-batch stand-in loss): ``G = K Σ g gᵀ`` with
    ``K`` the tokens not ignored, the ignored ones adding nothing; the Embedding's ``a`` the
    token counts ``/ (N·T)``."""
    torch.manual_seed(14)
    model = nn.Sequential(nn.Embedding(6, 4), nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 6)).to(DT)
    X, y = torch.randint(0, 6, (3, 4)), torch.randint(0, 6, (3, 4))
    y[0, 1] = y[2, 3] = -100
    ce = nn.CrossEntropyLoss()

    def lossf(out, y):
        return ce(out.flatten(0, 1), y.flatten())

    ref = _ef_reference(model, lossf, X, y, ["0", "1", "3"], terms=10)
    run(model, lossf, X, y, KFACEF())
    for name, G in ref.items():
        torch.testing.assert_close(model.get_submodule(name).weight.kfac_ef[0], G, msg=name)
    counts = torch.bincount(X.flatten(), minlength=6).to(DT)
    torch.testing.assert_close(model[0].weight.kfac_ef[1], counts / 12)


def test_kfacef_at_gpt2s_real_vocabulary():
    """Untied GPT-2 at its real vocabulary (50257; d = 16, N = 2, T = 4), its LM head frozen
    (its ``G`` would be ``[V, V]``): every Conv1D's and the token Embedding's ``G`` equal
    ``K Σ g gᵀ`` from autograd's output gradients, the Embedding's ``a`` the token counts;
    no loss Hessian over the ``T·V`` outputs is formed (it would not fit)."""
    import transformers
    from tests.support import hf_models
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(15)
    v = hf_models.VOCAB["gpt2"]
    config = transformers.GPT2Config(
        n_layer=1, n_embd=16, n_head=2, vocab_size=v, n_positions=4, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model = hf_models.Logits(transformers.GPT2LMHeadModel(config), per_token=True).to(DT).eval()
    model.model.lm_head.weight.requires_grad_(False)
    X, y = torch.randint(0, v, (2, 4)), torch.randint(0, v, (2, 4))
    names = ["model.transformer.wte"] + [n for n, m in model.named_modules() if isinstance(m, Conv1D)]
    ref = _ef_reference(model, nn.CrossEntropyLoss(), X, y, names, terms=8)
    run(model, nn.CrossEntropyLoss(), X, y, KFACEF())
    for name, G in ref.items():
        torch.testing.assert_close(model.get_submodule(name).weight.kfac_ef[0], G, msg=name)
    a = model.model.transformer.wte.weight.kfac_ef[1]
    torch.testing.assert_close(a, torch.bincount(X.flatten(), minlength=v).to(DT) / 8)
