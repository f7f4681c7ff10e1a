"""Residual and branching architectures through jacmem.nn, and the chain check: an
operation jacmem cannot backpropagate curvature through raises, naming the module."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tests.support.secondorder_models import Block, resnet
from tests.support.secondorder_ref import check_exact, check_kronecker_blocks, dense, diagonals, run
from torch import nn

import jacmem
from jacmem import KFLR, KFRA, BatchGrad, ChainError, DiagGGNExact, DiagHessian

DT = torch.float64


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_residual_net_diagonals(reduction):
    """GGN and Hessian diagonals (BackPACK's DiagHessian cannot do ResNets) through skip
    connections, a three-way branch and a scaled branch."""
    torch.manual_seed(0)
    check_exact(
        resnet(), nn.CrossEntropyLoss(reduction=reduction), torch.randn(4, 4, dtype=DT), torch.randint(0, 3, (4,))
    )


def residual_cnn():
    """[N, 1, 4, 4] -> [N, 3], a residual block between convolutions"""
    return nn.Sequential(
        nn.Conv2d(1, 2, 3, padding=1),
        nn.ReLU(),
        jacmem.nn.Residual(nn.Conv2d(2, 2, 3, padding=1), nn.Tanh(), nn.Conv2d(2, 2, 1)),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(8, 3),
    ).to(DT)


def test_residual_cnn_diagonals():
    torch.manual_seed(1)
    model = residual_cnn()
    check_exact(model, nn.MSELoss(), torch.randn(3, 1, 4, 4, dtype=DT), torch.randn(3, 3, dtype=DT))


def test_residual_net_kflr_kfra_at_batch_size_one():
    """KFLR's factors add where paths meet, and KFRA's roots do (kfac.py): with one
    sample, G ⊗ A is the GGN block for both, through a skip connection, a three-way
    branch and a scaled branch."""
    torch.manual_seed(2)
    check_kronecker_blocks(resnet(), nn.CrossEntropyLoss(), torch.randn(1, 4, dtype=DT), torch.randint(0, 3, (1,)))


def _averaged(f, xs, G):
    """1/N Σ_n J_nᵀ G J_n, J_n the Jacobian of ``f`` at ``xs[n]`` (torch.func)."""
    J = torch.vmap(torch.func.jacrev(f))(xs)  # [N, D_out, D_in]
    return torch.einsum("nij,ik,nkl->jl", J, G, J) / xs.shape[0]


def test_kfra_through_a_residual_block_follows_its_rule():
    """Batch of 3: KFRA's G at each Linear equals the rule of kfac.py written out with
    per-sample Jacobians from torch.func: the average at every step of the chain, the
    block's Jacobian I + J_f whole at the fork, per-sample roots (no average) inside the
    branch. BackPACK 1.7.1 cannot answer: its KFRA refuses branches."""
    torch.manual_seed(3)
    lin_b, lin_c = nn.Linear(5, 5), nn.Linear(5, 5)
    model = nn.Sequential(
        nn.Linear(4, 5), nn.Tanh(), jacmem.nn.Residual(lin_b, nn.Sigmoid(), lin_c), nn.Linear(5, 3)
    ).to(DT)
    lossf, N = nn.CrossEntropyLoss(), 3
    X, y = torch.randn(N, 4, dtype=DT), torch.randint(0, 3, (N,))
    run(model, lossf, X, y, KFRA())
    with torch.no_grad():
        h0 = model[0](X)
        h1 = model[1](h0)
        zb = lin_b(h1)
        h2 = model[2](h1)
        z = model[3](h2)
    Hz = torch.func.hessian(lambda t: lossf(t, y))(z)
    G3 = torch.einsum("ninj->ij", Hz)  # the batch-summed loss Hessian
    G2 = _averaged(model[3], h2, G3)  # the block's output
    G_c = G2  # the mean of the roots' outer products at the branch's end is Ḡ itself
    G_b = _averaged(lambda t: lin_c(torch.sigmoid(t)), zb, G2)
    G_fork = _averaged(model[2], h1, G2)  # (I + J_f)ᵀ Ḡ (I + J_f), cross terms included
    G_0 = _averaged(torch.tanh, h0, G_fork)
    for layer, G in ((model[3], G3), (lin_c, G_c), (lin_b, G_b), (model[0], G_0)):
        torch.testing.assert_close(layer.weight.kfra[0], G)
        torch.testing.assert_close(layer.bias.kfra[0], G)


def test_kfra_paths_that_meet_at_once_are_a_chain():
    """Parallel(Identity, Identity) doubles its input: KFRA through it equals KFRA
    through Scale(2), batch of 4 (the roots of both paths meet at once and collapse)."""
    torch.manual_seed(4)

    def make(mid):
        return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), mid, nn.Sigmoid(), nn.Linear(5, 3)).to(DT)

    branched, chain = make(jacmem.nn.Parallel(nn.Identity(), nn.Identity())), make(jacmem.nn.Scale(2.0))
    chain.load_state_dict(branched.state_dict())
    X, y = torch.randn(4, 4, dtype=DT), torch.randint(0, 3, (4,))
    for model in (branched, chain):
        run(model, nn.CrossEntropyLoss(), X, y, KFRA())
    for (name, p), q in zip(branched.named_parameters(), chain.parameters()):
        for a, b in zip(p.kfra, q.kfra, strict=True):
            torch.testing.assert_close(a, b, msg=name)


@pytest.mark.parametrize(
    "op, functional_sum",
    [(F.relu, False), (lambda h: h * 2, False), (torch.tanh, False), (nn.Identity(), True)],
    ids=["F.relu", "times2", "torch.tanh", "x+y"],
)
def test_functional_op_on_a_branch_is_followed(op, functional_sum):
    """Functional ops of jacmem.derivatives.functional's table on a branch (where
    BackPACK returns a wrong DiagGGNExact) are links of the chain: exact diagonals."""
    torch.manual_seed(4)
    model = Block(op, functional_sum).to(DT)
    check_exact(model, nn.CrossEntropyLoss(), torch.randn(3, 4, dtype=DT), torch.randint(0, 3, (3,)))


@pytest.mark.parametrize(
    "op, grad_fn", [(torch.sin, "SinBackward0"), (lambda h: h * h, "MulBackward0")], ids=["torch.sin", "h*h"]
)
def test_unfollowed_op_on_a_branch_raises(op, grad_fn):
    """For DiagHessian, jacmem names the first module (in backward order) whose output
    leaves the chain, the op that took it (its grad_fn), and the module it reaches
    untracked (the GGN-type extensions take the autograd path there:
    test_secondorder_autograd.py)."""
    torch.manual_seed(4)
    model = Block(op).to(DT)
    with pytest.raises(
        ChainError, match=rf"module 'lin0' \(Linear\).*on its way to 'lin1' \(through the operation {grad_fn}\)"
    ):
        run(model, nn.CrossEntropyLoss(), torch.randn(3, 4, dtype=DT), torch.randint(0, 3, (3,)), DiagHessian())


def test_the_errors_page_chain_error_case():
    """docs/guide/errors.rst's ChainError row, as it says: a torch.sin between two modules
    stops DiagHessian and KFRA, naming SinBackward0; the GGN-type extensions follow
    autograd through it, and DiagGGNExact equals the dense GGN's diagonal."""
    torch.manual_seed(4)
    model, lossf = Block(torch.sin).to(DT), nn.CrossEntropyLoss()
    X, y = torch.randn(3, 4, dtype=DT), torch.randint(0, 3, (3,))
    for ext in (DiagHessian(), KFRA()):
        with pytest.raises(ChainError, match="SinBackward0"):
            run(model, lossf, X, y, ext)
    run(model, lossf, X, y, DiagGGNExact())
    ggn, _ = dense(model, lossf, X, y)
    for name, ref in diagonals(model, ggn).items():
        torch.testing.assert_close(model.get_parameter(name).diag_ggn_exact, ref, atol=1e-10, rtol=1e-7)


def test_the_same_block_with_modules_is_exact():
    torch.manual_seed(5)
    model = Block(nn.ReLU()).to(DT)
    check_exact(model, nn.CrossEntropyLoss(), torch.randn(3, 4, dtype=DT), torch.randint(0, 3, (3,)))


def test_unsupported_module_raises():
    """A trainable module with no derivatives: the backward raises before any result,
    naming its parameter (no warning beside a missing result); frozen, the chain error
    names the gap."""
    torch.manual_seed(6)
    X, y = torch.randn(2, 4, dtype=DT), torch.randint(0, 3, (2,))
    model = nn.Sequential(nn.Linear(4, 3), nn.PReLU(), nn.Linear(3, 3)).to(DT)
    with pytest.raises(NotImplementedError, match=r"'weight' of module '1' \(PReLU\)"):
        run(model, nn.CrossEntropyLoss(), X, y, DiagHessian())
    assert not any(hasattr(p, "diag_h") for p in model.parameters())
    model[1].weight.requires_grad_(False)
    with pytest.raises(ChainError, match=r"module '0'.*on its way to '2' \(through module '1' \(PReLU\)\)"):
        run(model, nn.CrossEntropyLoss(), X, y, DiagHessian())


def test_scaled_loss_and_full_backward_hooks():
    """backward on 2·loss doubles the curvature; identities that full backward hooks
    put around modules are seen through; first-order extensions run alongside."""
    torch.manual_seed(7)
    model, lossf = resnet(), nn.CrossEntropyLoss()
    X, y = torch.randn(3, 4, dtype=DT), torch.randint(0, 3, (3,))
    ggn, hess = dense(model, lossf, X, y)  # before the hooks: torch.func cannot pass them
    dg, dh = diagonals(model, ggn), diagonals(model, hess)
    for m in model.modules():
        m.register_full_backward_hook(lambda *args: None)
    with jacmem.extend(DiagGGNExact(), DiagHessian(), BatchGrad()):
        (2 * lossf(model(X), y)).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.diag_ggn_exact, 2 * dg[name])
        torch.testing.assert_close(p.diag_h, 2 * dh[name])
        torch.testing.assert_close(p.grad_batch.sum(0), p.grad)


@pytest.mark.parametrize(
    "ext",
    [DiagGGNExact(), DiagHessian(), jacmem.KFAC(), KFLR(), jacmem.SqrtGGNExact(), jacmem.BatchDiagGGNMC()],
    ids=repr,
)
def test_forward_outside_the_block_raises(ext):
    """track() covers first order and clipping; a second-order extension after a tracked
    forward raises naming the fix (README and from_backpack.rst say so), not nothing."""
    model = nn.Sequential(nn.Linear(4, 3)).to(DT)
    jacmem.track(model)
    try:
        loss = nn.CrossEntropyLoss()(model(torch.randn(2, 4, dtype=DT)), torch.randint(0, 3, (2,)))
        with pytest.raises(RuntimeError, match=r"forward pass inside the block.*inside jacmem.extend"):
            with jacmem.extend(ext):
                loss.backward()
    finally:
        jacmem.untrack(model)
    assert not [k for p in model.parameters() for k in vars(p) if k not in ("grad",)]


@pytest.mark.parametrize("ext", [KFLR(), KFRA()], ids=repr)
def test_a_module_called_twice_raises(ext):
    """A shared parameter's curvature has cross terms between its calls (the GGN of
    W in W·tanh(W·x) is not the sum of two per-call blocks): the Kronecker kinds do not
    form it, and say so (the diagonal kinds do: tests/integration/test_tied_curvature.py)."""
    torch.manual_seed(8)
    lin = nn.Linear(4, 4).to(DT)
    model = nn.Sequential(lin, nn.Tanh(), lin, nn.Linear(4, 3)).to(DT)
    with pytest.raises(NotImplementedError, match=r"'weight' of module .*called twice.*give each call"):
        with jacmem.extend(ext):
            nn.CrossEntropyLoss()(model(torch.randn(2, 4, dtype=DT)), torch.randint(0, 3, (2,))).backward()


def test_residual_cnn_kfra_is_kflr_at_batch_size_one():
    """Convolutions inside and around a residual block: with one sample KFRA's Ḡ is the
    exact output GGN wherever it is read, so every factor equals KFLR's (conv factors
    are not the GGN block itself: the positions share the kernel)."""
    torch.manual_seed(9)
    model = residual_cnn()
    run(model, nn.CrossEntropyLoss(), torch.randn(1, 1, 4, 4, dtype=DT), torch.randint(0, 3, (1,)), KFLR(), KFRA())
    for name, p in model.named_parameters():
        for a, b in zip(p.kfra, p.kflr, strict=True):
            torch.testing.assert_close(a, b, msg=name)


def test_kfra_block_on_the_input_is_kflr_at_batch_size_one():
    """A residual block applied to the model's input: the skip's share ends there, so
    the branch's roots never collapse (kfac.py); with one sample, still KFLR's factors."""
    torch.manual_seed(10)
    model = nn.Sequential(jacmem.nn.Residual(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)), nn.Linear(4, 3)).to(DT)
    run(model, nn.CrossEntropyLoss(), torch.randn(1, 4, dtype=DT), torch.randint(0, 3, (1,)), KFLR(), KFRA())
    for name, p in model.named_parameters():
        for a, b in zip(p.kfra, p.kflr, strict=True):
            torch.testing.assert_close(a, b, msg=name)


@pytest.mark.parametrize("norm", ["LayerNorm", "RMSNorm"])
def test_norms_ggn_and_hessian_diagonals_over_middle_axes(norm):
    """The norms over trailing axes take their diagonals directly (x̂ once, no per-sample
    gradients), with a middle axis and two normalised axes: against the dense float64
    GGN and Hessian, per sample too."""
    torch.manual_seed(0)
    layer = {"LayerNorm": nn.LayerNorm((3, 4)), "RMSNorm": nn.RMSNorm((3, 4))}[norm]
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    model = nn.Sequential(layer, nn.Flatten(), nn.Linear(24, 3)).to(DT)
    check_exact(model, nn.CrossEntropyLoss(), torch.randn(5, 2, 3, 4, dtype=DT), torch.randint(0, 3, (5,)))
