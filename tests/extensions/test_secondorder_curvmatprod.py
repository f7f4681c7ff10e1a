"""SqrtGGNExact/MC and the block curvature-matrix products GGNMP, HMP, PCHMP against
dense references built with autograd (float64, tiny): the GGN ``Jᵀ H_z J`` and the
Hessian by ``torch.func``; the positive-curvature Hessian from each activation's
residual, built by autograd at the activation (BackPACK's, shown to differ, below)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from tests.support.secondorder_ref import blocks, default_dtype, dense, run
from torch import nn
from torch.func import functional_call, jacrev

import jacmem
from jacmem import GGNMP, HMP, PCHMP, BatchGrad, DiagGGNExact, SqrtGGNExact, SqrtGGNMC

DT = torch.float64


def mlp(act=nn.Sigmoid, d_out=3):
    return nn.Sequential(nn.Linear(4, 5), act(), nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, d_out)).to(DT)


def cnn():
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1), nn.ELU(), nn.MaxPool2d(2), nn.Conv2d(3, 2, 2), nn.Flatten(), nn.Linear(2, 3)
    ).to(DT)


def problem(name: str):
    torch.manual_seed(3)
    if name == "cnn":
        return cnn(), nn.CrossEntropyLoss(), torch.randn(3, 2, 4, 4, dtype=DT), torch.randint(0, 3, (3,))
    if name == "mse":
        return mlp(nn.SiLU), nn.MSELoss(reduction="sum"), torch.randn(3, 4, dtype=DT), torch.randn(3, 3, dtype=DT)
    if name == "bce":
        return mlp(nn.GELU, 2), nn.BCEWithLogitsLoss(), torch.randn(3, 4, dtype=DT), torch.rand(3, 2, dtype=DT)
    return mlp(), nn.CrossEntropyLoss(reduction="sum"), torch.randn(3, 4, dtype=DT), torch.randint(0, 3, (3,))


PROBLEMS = ["ce", "mse", "bce", "cnn"]


def squared(model: nn.Module, field: str) -> torch.Tensor:
    """``Σ_{v,n} b bᵀ`` of the roots concatenated over all parameters: ``[P, P]``."""
    roots = torch.cat([getattr(p, field).flatten(2) for p in model.parameters()], dim=2)
    flat = roots.flatten(0, 1)
    return flat.T @ flat


@pytest.mark.parametrize("name", PROBLEMS)
def test_sqrt_ggn_squared_is_the_ggn(name):
    """Concatenated over the parameters, the roots give the whole GGN, off-diagonal blocks
    included; shapes are BackPACK's, ``[C, N, *p.shape]``."""
    model, lossf, X, y = problem(name)
    run(model, lossf, X, y, SqrtGGNExact())
    c = model(X).shape[1:].numel()
    for p in model.parameters():
        assert p.sqrt_ggn_exact.shape == (c, X.shape[0], *p.shape)
    torch.testing.assert_close(squared(model, "sqrt_ggn_exact"), dense(model, lossf, X, y)[0])


@pytest.mark.parametrize("name", ["ce", "cnn"])
def test_sqrt_ggn_in_chunks_of_v(name):
    """With ``chunk_bytes=1`` the roots are computed one vector of ``V`` at a time."""
    model, lossf, X, y = problem(name)
    model.zero_grad()
    with jacmem.extend(SqrtGGNExact(subsampling=[1, 0]), chunk_bytes=1):
        lossf(model(X), y).backward()
    torch.testing.assert_close(
        squared(model, "sqrt_ggn_exact"), dense(model, lossf, X, y, per_sample=True)[0][:2].sum(0)
    )


@pytest.mark.parametrize("subsampling", [[2, 0], [1, 1], [-1]])
def test_sqrt_ggn_subsampling_is_those_samples_terms(subsampling):
    """The GGN of the chosen samples' terms, as the whole batch's loss scales them
    (``1/N`` of the whole batch for ``"mean"``); repeats count twice."""
    model, lossf, X, y = problem("cnn")
    run(model, lossf, X, y, SqrtGGNExact(subsampling=subsampling), SqrtGGNMC(mc_samples=2, subsampling=subsampling))
    per_sample = dense(model, lossf, X, y, per_sample=True)[0]
    for p in model.parameters():
        assert p.sqrt_ggn_exact.shape[1] == p.sqrt_ggn_mc.shape[1] == len(subsampling)
    torch.testing.assert_close(squared(model, "sqrt_ggn_exact"), per_sample[subsampling].sum(0))


def test_sqrt_ggn_mc_squared_is_the_ggn_in_expectation():
    model, lossf, X, y = problem("ce")
    torch.manual_seed(0)
    run(model, lossf, X, y, SqrtGGNMC(mc_samples=40000))
    for p in model.parameters():
        assert p.sqrt_ggn_mc.shape == (40000, X.shape[0], *p.shape)
    ggn = dense(model, lossf, X, y)[0]
    err = (squared(model, "sqrt_ggn_mc") - ggn).abs().max() / ggn.abs().max()
    assert err < 0.03, f"relative error {err:.3g} of 40000 samples"


@pytest.mark.parametrize("name", PROBLEMS)
def test_ggnmp_and_hmp_are_the_dense_products(name):
    model, lossf, X, y = problem(name)
    run(model, lossf, X, y, GGNMP(), HMP())
    ggn, hess = (blocks(model, M) for M in dense(model, lossf, X, y))
    torch.manual_seed(1)
    for pname, p in model.named_parameters():
        mat = torch.randn(3, *p.shape, dtype=DT)
        for field, ref in (("ggnmp", ggn), ("hmp", hess)):
            got = getattr(p, field)(mat)
            assert got.shape == mat.shape
            torch.testing.assert_close(got.flatten(1), mat.flatten(1) @ ref[pname], msg=f"{field} {pname}")


def test_products_through_lean_layers_are_constants():
    """Lean layers (jacmem.memory.lean) multiply through their stock forward; a product
    holds no graph to the model's parameters."""
    model, lossf, X, y = problem("cnn")
    ggn = blocks(model, dense(model, lossf, X, y)[0])
    model = jacmem.memory.lean(model)
    run(model, lossf, X, y, GGNMP())
    for pname, p in model.named_parameters():
        mat = torch.randn(2, *p.shape, dtype=DT)
        got = p.ggnmp(mat)
        assert not got.requires_grad, pname
        torch.testing.assert_close(got.flatten(1), mat.flatten(1) @ ggn[pname], msg=pname)


def test_embedding_products_give_the_padding_row_no_curvature():
    """An Embedding's ``padding_idx`` row gets zero gradient from autograd, so its rows and
    columns of the GGN (as ``.grad`` and DiagGGNExact have it) are zero. The product's
    ``J_θ m`` is therefore autograd's, not forward mode's (which reads the padding row of
    ``m`` where a sample looks it up): a direction's padding row changes nothing. It did
    (the conformance matrix's BERT GGNMP on word_embeddings, 1.3e-2 relative). No
    activation: PCHMP's block is the GGN's too (and a ReLU would hide the padding row: its
    zero output has zero derivative)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(6, 3, padding_idx=0), nn.Flatten(), nn.Linear(12, 3)).to(DT)
    X, y = torch.tensor([[1, 0, 2, 1], [0, 4, 4, 5], [3, 2, 0, 0]]), torch.tensor([0, 2, 1])
    lossf = nn.CrossEntropyLoss()
    run(model, lossf, X, y, GGNMP(), PCHMP())
    ggn = blocks(model, dense(model, lossf, X, y, hess=False)[0])
    mat = torch.randn(2, 6, 3, dtype=DT)
    assert ggn["0.weight"][:3].abs().max() == 0  # the reference: row 0 gets nothing
    for field in ("ggnmp", "pchmp"):
        got = getattr(model[0].weight, field)(mat)
        torch.testing.assert_close(got.flatten(1), mat.flatten(1) @ ggn["0.weight"], msg=field)


def test_embedding_hmp_with_the_padding_id_in_the_batch_is_the_hessian():
    """HMP of an Embedding whose padding id is in the batch, viewed into a convolution that
    mixes positions (the conformance matrix's ``embedded_conv``): the Hessian of the loss
    with the padding row held constant, as autograd holds it; built here over the other
    rows alone, the padding row spliced in as a constant (no padding convention involved).
    ``torch.func.hessian`` of the whole weight is not that: forward mode reads the padding
    row that reverse mode gives no gradient, so its block had non-zero padding columns under
    zero padding rows (not symmetric; the matrix's HMP cells 0.006 off of 0.012 against it). The shared
    reference, ``secondorder_ref.dense``, holds the row constant; this failed before it did."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Embedding(11, 4, padding_idx=0), nn.Unflatten(1, (2, 3)), nn.Conv2d(2, 4, 3, stride=2, padding=1, groups=2),
        nn.Tanh(), nn.Flatten(), nn.Linear(16, 3),
    ).to(DT)  # fmt: skip
    X, y = torch.tensor([[1, 0, 2, 7, 0, 5], [0, 4, 4, 10, 3, 9], [8, 2, 6, 0, 1, 3]]), torch.tensor([0, 2, 1])
    lossf = nn.CrossEntropyLoss()
    run(model, lossf, X, y, HMP())
    weight = model[0].weight.detach()

    def loss_of_rows(rows):  # [10, 4]: every row but the padding one
        return lossf(functional_call(model, {"0.weight": torch.cat([weight[:1], rows])}, (X,)), y)

    inner = torch.func.hessian(loss_of_rows)(weight[1:]).reshape(40, 40)
    want = torch.zeros(44, 44, dtype=DT)
    want[4:, 4:] = inner
    shared = blocks(model, dense(model, lossf, X, y)[1])["0.weight"]
    torch.testing.assert_close(shared, want, msg="the shared reference holds the padding row constant")
    mat = torch.randn(2, 11, 4, dtype=DT)
    torch.testing.assert_close(model[0].weight.hmp(mat).flatten(1), mat.flatten(1) @ want)


ACTIVATIONS = (nn.Sigmoid, nn.Tanh, nn.ELU, nn.SiLU, nn.GELU)


def activations_io(model: nn.Sequential, X: torch.Tensor) -> tuple[dict[int, tuple], torch.Tensor]:
    """{position of each activation: (its input, its output)}, and the model's output, from
    one forward (the hooks go after it)."""
    io: dict[int, tuple] = {}
    handles = [
        m.register_forward_hook(lambda m, i, o, k=k: io.__setitem__(k, (i[0], o)))
        for k, m in enumerate(model)
        if isinstance(m, ACTIVATIONS)
    ]
    try:
        out = model(X)
    finally:
        for h in handles:
            h.remove()
    return io, out


def pch_blocks(model, lossf, X, y, residual) -> dict[str, torch.Tensor]:
    """The blocks of ``GGN + Σ_a Σ_n J_{a,n}ᵀ diag(r_{a,n}) J_{a,n}``: ``J_a`` the Jacobian
    of activation ``a``'s input w.r.t. the parameters, ``r_a = residual(f''(x_a), ∂L/∂a)``
    (autograd's second derivative of ``f``, and gradient of the loss w.r.t. ``a``'s output;
    ``f'' ⊙ ∂L/∂a`` gives the Hessian)."""
    params = {n: p.detach() for n, p in model.named_parameters()}
    n = X.shape[0]
    total = dense(model, lossf, X, y)[0]
    io, out = activations_io(model, X)
    for k, (x, a) in io.items():
        g = torch.autograd.grad(lossf(out, y), a, retain_graph=True)[0]
        xr = x.detach().requires_grad_()
        d1 = torch.autograd.grad(model[k](xr).sum(), xr, create_graph=True)[0]
        r = residual(torch.autograd.grad(d1.sum(), xr)[0], g).reshape(n, -1)  # [N, D_a]
        upstream = model[:k]
        mine = dict(upstream.named_parameters())
        J = jacrev(lambda theta: functional_call(upstream, theta, (X,)))({m: params[m] for m in mine})
        J = torch.cat(
            [
                J[m].reshape(n, r.shape[1], -1) if m in mine else x.new_zeros(n, r.shape[1], p.numel())
                for m, p in params.items()
            ],
            dim=2,
        )  # [N, D_a, P]
        total = total + torch.einsum("ndp,nd,ndq->pq", J, r, J)
    return blocks(model, total)


MODIFY = {"clip": lambda r: r.clamp(min=0), "abs": torch.abs}


@pytest.mark.parametrize("modify", ["clip", "abs"])
@pytest.mark.parametrize("name", ["ce", "mse", "bce"])
def test_pchmp_is_the_modified_residuals_product(name, modify):
    model, lossf, X, y = problem(name)
    run(model, lossf, X, y, PCHMP(modify=modify))
    ref = pch_blocks(model, lossf, X, y, lambda d2, g: MODIFY[modify](d2 * g))
    hess = blocks(model, dense(model, lossf, X, y)[1])
    ref_hess = pch_blocks(model, lossf, X, y, lambda d2, g: d2 * g)
    torch.manual_seed(2)
    for pname, p in model.named_parameters():
        torch.testing.assert_close(
            ref_hess[pname], hess[pname], msg=f"the reference, unmodified, is the Hessian: {pname}"
        )
        mat = torch.randn(2, *p.shape, dtype=DT)
        torch.testing.assert_close(p.pchmp(mat).flatten(1), mat.flatten(1) @ ref[pname], msg=f"pchmp {pname}")
    assert not torch.allclose(ref["0.weight"], hess["0.weight"]), "the modification changes nothing here"


def test_curvmatprod_against_backpack():
    """GGNMP and HMP equal BackPACK's. BackPACK's PCHMP multiplies each activation's
    residual by the output gradient twice (``hessian_diagonal``, already ``f'' ⊙ g``,
    times ``g`` in ``PCHMPBase.modified_residual_mat_prod``): it is the product with
    ``clip(f'' ⊙ g ⊙ g)``, not ``clip(f'' ⊙ g)``; ours is checked against the latter above."""
    import backpack.extensions as bpe
    from backpack import backpack, extend

    model, lossf, X, y = problem("ce")
    run(model, lossf, X, y, GGNMP(), HMP(), PCHMP())
    bp_model, bp_loss = extend(copy.deepcopy(model)), extend(copy.deepcopy(lossf))
    with warnings.catch_warnings(), default_dtype(DT), backpack(bpe.GGNMP(), bpe.HMP(), bpe.PCHMP(modify="clip")):
        warnings.simplefilter("ignore")
        bp_loss(bp_model(X), y).backward()
    squared_g = pch_blocks(model, lossf, X, y, lambda d2, g: (d2 * g * g).clamp(min=0))
    torch.manual_seed(4)
    for (pname, p), q in zip(model.named_parameters(), bp_model.parameters()):
        mat = torch.randn(2, *p.shape, dtype=DT)
        torch.testing.assert_close(p.ggnmp(mat), q.ggnmp(mat), msg=f"ggnmp {pname}")
        torch.testing.assert_close(p.hmp(mat), q.hmp(mat), msg=f"hmp {pname}")
        torch.testing.assert_close(q.pchmp(mat).flatten(1), mat.flatten(1) @ squared_g[pname], msg=f"BackPACK {pname}")
    mat = torch.randn(2, *model[0].weight.shape, dtype=DT)
    assert not torch.allclose(model[0].weight.pchmp(mat), bp_model[0].weight.pchmp(mat))


def test_bad_input_names_the_fix():
    model, lossf, X, y = problem("ce")
    run(model, lossf, X, y, GGNMP())
    with pytest.raises(ValueError, match=r"'weight'.*\[K, \*\(5, 4\)\].*unsqueeze"):
        model[0].weight.ggnmp(torch.randn(5, 4, dtype=DT))
    with pytest.raises(ValueError, match="'clip' or 'abs'"):
        PCHMP(modify="square")
    with pytest.raises(ValueError, match="list of sample indices"):
        SqrtGGNExact(subsampling=[0.5])
    with pytest.raises(ValueError, match="BatchGrad: subsampling must be a non-empty list"):
        BatchGrad(subsampling=[])
    with pytest.raises(RuntimeError, match=r"SqrtGGNExact.*module '4'.*subsampling index 3 .*\[0, 3\)"):
        run(model, lossf, X, y, SqrtGGNExact(subsampling=[0, 3]))
    hooks = [m._forward_hooks or m._backward_hooks or m._forward_pre_hooks for m in model.modules()]
    assert not any(hooks), "hooks left behind"
    run(model, lossf, X, y, SqrtGGNExact(subsampling=[0, 2]))  # the model still works


class KeywordCall(nn.Module):
    """Calls its Linear with a keyword argument: a product cannot repeat the call."""

    def __init__(self):
        super().__init__()
        self.lin, self.act, self.out = nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)

    def forward(self, x):
        return self.out(self.act(self.lin(input=x)))


def test_products_refuse_a_module_called_by_keyword():
    """The backward raises before any result, naming the parameters and the fix (issue
    36, item 3: it used to warn and write the other parameters' results); frozen, the
    other parameters get theirs, and the other extensions take it (the first-order
    input found by keyword)."""
    torch.manual_seed(0)
    model, X, y = KeywordCall().to(DT), torch.randn(3, 4, dtype=DT), torch.randint(0, 3, (3,))
    msg = r"GGNMP\(\) has no result for '(weight|bias)' of module 'lin' \(Linear\).*called with keyword.*by position"
    with pytest.raises(jacmem.UnsupportedCurvatureError, match=msg):
        run(model, nn.CrossEntropyLoss(), X, y, GGNMP(), DiagGGNExact())
    assert not any(hasattr(p, "ggnmp") or hasattr(p, "diag_ggn_exact") for p in model.parameters())
    ggn = blocks(model, dense(model, nn.CrossEntropyLoss(), X, y)[0])
    run(model, nn.CrossEntropyLoss(), X, y, DiagGGNExact())
    torch.testing.assert_close(model.lin.weight.diag_ggn_exact.flatten(), torch.diagonal(ggn["lin.weight"]))
    model.lin.requires_grad_(False)
    run(model, nn.CrossEntropyLoss(), X, y, GGNMP())
    assert not hasattr(model.lin.weight, "ggnmp")
    mat = torch.randn(1, 3, 5, dtype=DT)
    torch.testing.assert_close(model.out.weight.ggnmp(mat).flatten(1), mat.flatten(1) @ ggn["out.weight"])
