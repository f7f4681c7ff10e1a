"""The private step's parts benchmark takes out what it says (a check that its figures
measure something): under ``without("gram")`` a Linear's ghost norm on a sequence is no
longer the norm, under ``without("noise")`` two private steps from the same state agree,
and afterwards jacmem is whole again."""

import copy

import torch
from torch import nn

import jacmem
import jacmem.derivatives.linear as linear
import jacmem.privacy as privacy
from benchmarks import dp, dp_floor


def ghost_norms() -> torch.Tensor:
    torch.manual_seed(0)
    layer, x = nn.Linear(64, 64), torch.randn(4, 3, 64)  # the ghost norm: T² (I + O) < T I O
    with jacmem.extend(jacmem.BatchL2Grad()):
        layer(x).square().sum().backward()
    return layer.weight.batch_l2


def private_step(model, X, y) -> list[torch.Tensor]:
    model = copy.deepcopy(model)
    dp.prepare("jacmem", model, X, y)()
    return [p.detach().clone() for p in model.parameters()]


def test_the_parts_taken_out_are_out_and_come_back():
    exact = ghost_norms()
    with dp_floor.without(("gram",)):
        assert not torch.allclose(ghost_norms(), exact)
    torch.testing.assert_close(ghost_norms(), exact)

    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    X, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
    with dp_floor.without(("noise",)):
        torch.testing.assert_close(private_step(model, X, y), private_step(model, X, y), rtol=0, atol=0)
    assert not torch.equal(private_step(model, X, y)[0], private_step(model, X, y)[0])
    assert linear.torch is torch and privacy.torch is torch


def test_the_table_has_every_variant(capsys):
    dp_floor.main(["seed-cnn-64", "--quick", "--rounds", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert [" ".join(line.split()[1:-4]) for line in lines] == list(dp_floor.VARIANTS), lines
