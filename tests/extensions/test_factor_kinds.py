"""Second-order factor kinds are registered objects, read from their names once.

``factor_kind`` is the one place a kind's name is read (``"mc3"`` -> ``MonteCarlo(3)``,
its sample count an attribute the engines ask); an extension of one's own may still name
its kinds as strings, and gets the same factors as the built-in extension of that kind.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import jacmem
from jacmem.derivatives import MonteCarlo, factor_kind
from jacmem.derivatives.quantities import DENSE, EMPIRICAL, EXACT, RESIDUAL


def test_names_read_once_into_kinds():
    assert factor_kind("mc3") == MonteCarlo(3) and factor_kind("mc3").samples == 3
    assert [factor_kind(k) for k in ("exact", "empirical", "residual", "dense")] == [EXACT, EMPIRICAL, RESIDUAL, DENSE]
    assert factor_kind(EXACT) is EXACT and EXACT.samples == 0 and EXACT.ggn and not EMPIRICAL.ggn
    with pytest.raises(ValueError, match="unknown factor kind 'mc'.*mc<M>"):
        factor_kind("mc")


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_a_sample_count_is_checked_where_it_is_given(bad):
    """``mc_samples=True`` made the kind ``"mcTrue"``, which failed only in the backward."""
    with pytest.raises(ValueError, match="mc_samples must be a positive integer"):
        jacmem.DiagGGNMC(mc_samples=bad)
    with pytest.raises(ValueError, match="mc_samples must be a positive integer"):
        jacmem.KFAC(mc_samples=bad)


class NamedKinds(jacmem.DiagGGNMC):
    """A GGN diagonal whose kinds are given by name, as an extension of one's own may."""

    savefield = "named_diag"

    def __init__(self):
        self.mc_samples, self.kinds = 2, ("mc2",)


def test_kinds_given_by_name_get_the_same_factors():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    X, y = torch.randn(5, 3, dtype=torch.float64), torch.randint(0, 3, (5,))
    results = []
    for ext in (NamedKinds(), jacmem.DiagGGNMC(mc_samples=2)):
        torch.manual_seed(1)
        with jacmem.extend(ext):
            nn.functional.cross_entropy(model(X), y).backward()
        results.append([getattr(p, ext.savefield) for p in model.parameters()])
        model.zero_grad()
    for named, builtin in zip(*results):
        torch.testing.assert_close(named, builtin, rtol=0, atol=0)
