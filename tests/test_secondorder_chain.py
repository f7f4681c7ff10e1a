"""Residual and branching architectures through jacmem.nn, and the chain check: an
operation jacmem cannot backpropagate curvature through raises, naming the module."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from secondorder_ref import blocks, check_exact, dense, diagonals, run
from torch import nn

import jacmem
from jacmem import KFLR, KFRA, BatchGrad, ChainError, DiagGGNExact, DiagHessian

DT = torch.float64


def resnet():
    return nn.Sequential(
        nn.Linear(4, 5),
        nn.Tanh(),
        jacmem.nn.Residual(nn.Linear(5, 5), nn.Sigmoid(), nn.Linear(5, 5)),
        jacmem.nn.Parallel(nn.Identity(), nn.Sequential(nn.ELU(), nn.Linear(5, 5)), jacmem.nn.Scale(0.5)),
        nn.SiLU(),
        nn.Linear(5, 3),
    ).to(DT)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_residual_net_diagonals(reduction):
    """GGN and Hessian diagonals (BackPACK's DiagHessian cannot do ResNets) through skip
    connections, a three-way branch and a scaled branch."""
    torch.manual_seed(0)
    check_exact(resnet(), nn.CrossEntropyLoss(reduction=reduction), torch.randn(4, 4, dtype=DT), torch.randint(0, 3, (4,)))


def test_residual_cnn_diagonals():
    torch.manual_seed(1)
    model = nn.Sequential(
        nn.Conv2d(1, 2, 3, padding=1),
        nn.ReLU(),
        jacmem.nn.Residual(nn.Conv2d(2, 2, 3, padding=1), nn.Tanh(), nn.Conv2d(2, 2, 1)),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(8, 3),
    ).to(DT)
    check_exact(model, nn.MSELoss(), torch.randn(3, 1, 4, 4, dtype=DT), torch.randn(3, 3, dtype=DT))


def test_residual_net_kflr_at_batch_size_one():
    """KFLR's factors add where paths meet: with one sample, G ⊗ A is the GGN block."""
    torch.manual_seed(2)
    model, lossf = resnet(), nn.CrossEntropyLoss()
    X, y = torch.randn(1, 4, dtype=DT), torch.randint(0, 3, (1,))
    run(model, lossf, X, y, KFLR())
    ref = blocks(model, dense(model, lossf, X, y)[0])
    for name, p in model.named_parameters():
        got = torch.kron(*p.kflr) if name.endswith("weight") else p.kflr[0]
        torch.testing.assert_close(got, ref[name], msg=name)


def test_kfra_through_a_branch_raises():
    """KFRA's batch average at every step is not defined where paths meet (its cross
    terms need both paths at once): not implemented, and said so."""
    torch.manual_seed(3)
    with pytest.raises(NotImplementedError, match="KFRA through branches"):
        run(resnet(), nn.CrossEntropyLoss(), torch.randn(2, 4, dtype=DT), torch.randint(0, 3, (2,)), KFRA())


class Block(nn.Module):
    """h = lin0(x); out = head(Sum(h, lin1(op(h)))) with ``op`` on the branch."""

    def __init__(self, op, functional_sum=False):
        super().__init__()
        self.lin0, self.lin1, self.head = nn.Linear(4, 5), nn.Linear(5, 5), nn.Linear(5, 3)
        self.sum, self.op, self.functional_sum = jacmem.nn.Sum(), op, functional_sum

    def forward(self, x):
        h = self.lin0(x)
        branch = self.lin1(self.op(h))
        return self.head(h + branch if self.functional_sum else self.sum(h, branch))


@pytest.mark.parametrize(
    "op, functional_sum",
    [(F.relu, False), (lambda h: h * 2, False), (torch.tanh, False), (nn.Identity(), True)],
    ids=["F.relu", "times2", "torch.tanh", "x+y"],
)
def test_functional_op_on_a_branch_raises(op, functional_sum):
    """Where BackPACK returns a wrong DiagGGNExact, jacmem names the first module (in
    backward order) whose output leaves the chain ('lin0'; 'lin1' for the functional
    sum) and the module it reaches untracked ('lin1' or 'head')."""
    torch.manual_seed(4)
    model = Block(op, functional_sum).to(DT)
    with pytest.raises(ChainError, match=r"module 'lin(0|1)' \(Linear\).*on its way to '(lin1|head)'"):
        run(model, nn.CrossEntropyLoss(), torch.randn(3, 4, dtype=DT), torch.randint(0, 3, (3,)), DiagGGNExact())


def test_the_same_block_with_modules_is_exact():
    torch.manual_seed(5)
    model = Block(nn.ReLU()).to(DT)
    check_exact(model, nn.CrossEntropyLoss(), torch.randn(3, 4, dtype=DT), torch.randint(0, 3, (3,)))


def test_functional_loss_and_unsupported_module_raise():
    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(4, 3)).to(DT)
    X, y = torch.randn(2, 4, dtype=DT), torch.randint(0, 3, (2,))
    with pytest.raises(ChainError, match="module '0'.*loss module"):
        with jacmem.extend(DiagGGNExact()):
            F.cross_entropy(model(X), y).backward()
    model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3), nn.Linear(3, 3)).to(DT)
    with pytest.warns(UserWarning, match="'1' \\(LayerNorm\\) is not supported"):
        with pytest.raises(ChainError, match=r"module '0'.*on its way to '2' \(through module '1' \(LayerNorm\)\)"):
            run(model, nn.CrossEntropyLoss(), X, y, DiagGGNExact())


def test_inplace_activation_raises():
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(inplace=True), nn.Linear(3, 3)).to(DT)
    with pytest.raises(NotImplementedError, match="'1'.*inplace=False"):
        run(model, nn.CrossEntropyLoss(), torch.randn(2, 4, dtype=DT), torch.randint(0, 3, (2,)), DiagGGNExact())


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


def test_forward_outside_the_block_raises():
    model = nn.Sequential(nn.Linear(4, 3)).to(DT)
    jacmem.track(model)
    try:
        loss = nn.CrossEntropyLoss()(model(torch.randn(2, 4, dtype=DT)), torch.randint(0, 3, (2,)))
        with pytest.raises(RuntimeError, match="forward pass inside the block"):
            with jacmem.extend(DiagGGNExact()):
                loss.backward()
    finally:
        jacmem.untrack(model)
