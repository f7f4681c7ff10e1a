"""A wrapped model (``nn.DataParallel``, ``torch.compile``) scores as the bare one with a
projection: the curvature's projection matrices are drawn from the parameters' stable
names (without the wrappers' ``module.`` and ``_orig_mod.``), as
``BatchGradProjection`` draws the gradients'. Before, Influence drew the curvature's
from the wrapped names: scores 13% (DataParallel) and 65% (torch.compile) off the bare
model's, relative to their largest."""

from __future__ import annotations

import pytest
import torch
from tests.support.attribution import summed_cross_entropy as loss_fn
from tests.support.attribution import tiny_mlp
from torch import nn

from jacmem.attribution import Influence


def _scores(model) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(10, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (10,), generator=g)
    train = [(x[:6], y[:6]), (x[6:], y[6:])]
    inf = Influence(model, loss_fn, curvature="ekfac", projection=4, damping=0.1, progress=False).fit(train)
    return inf.scores([(x[:3], y[:3])], train)


def test_a_data_parallel_model_scores_as_the_bare_one():
    inf = Influence(nn.DataParallel(tiny_mlp()), loss_fn, projection=4, progress=False)
    assert inf.names == ("0.weight", "0.bias", "2.weight", "2.bias")
    torch.testing.assert_close(_scores(nn.DataParallel(tiny_mlp())), _scores(tiny_mlp()), rtol=1e-12, atol=1e-14)


@pytest.mark.slow
def test_a_compiled_model_scores_as_the_bare_one():
    torch.testing.assert_close(_scores(torch.compile(tiny_mlp())), _scores(tiny_mlp()), rtol=1e-10, atol=1e-12)
