"""What Influence cannot do raises before it computes, naming the module and the fix."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import jacmem
from jacmem.attribution import Influence


def loss_fn(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y, reduction="sum")


def _batches(shape=(4,), n=6):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(n, *shape, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g))]


def test_kronfluence_conventions_name_a_module_kronfluence_does_not_track():
    model = nn.Sequential(nn.Linear(4, 5), nn.LayerNorm(5), nn.Linear(5, 3)).double()
    inf = Influence(model, loss_fn, curvature="ekfac", conventions="kronfluence", progress=False)
    with pytest.raises(ValueError, match=r"module '1' is a LayerNorm.*freeze its parameters.*conventions='jacmem'"):
        inf.fit(_batches())
    model[1].requires_grad_(False)
    inf = Influence(model, loss_fn, curvature="ekfac", conventions="kronfluence", progress=False).fit(_batches())
    assert inf.self_influence(_batches()).shape == (6,)


@pytest.mark.parametrize(
    ("conv", "why"),
    [
        (nn.Conv2d(2, 4, 3, groups=2), "Conv2d with groups=2; kronfluence averages"),
        (nn.Conv2d(2, 4, 3, padding=1, padding_mode="circular"), "Conv2d with padding_mode='circular'"),
        (nn.Conv1d(2, 4, 3), "Conv1d; kronfluence's conventions cover nn.Linear and nn.Conv2d only"),
    ],
)
def test_kronfluence_conventions_name_a_convolution_kronfluence_does_not_differentiate(conv, why):
    """kronfluence unfolds a Conv2d's input with zero padding after averaging its channels over
    groups (not the layer's gradient otherwise), and tracks no Conv1d."""
    model = nn.Sequential(conv, nn.Flatten(), nn.LazyLinear(3)).double()
    shape = (2, 4) if isinstance(conv, nn.Conv1d) else (2, 4, 4)
    model(_batches(shape)[0][0])
    for curvature in ("ekfac", "diag"):
        inf = Influence(model, loss_fn, curvature=curvature, conventions="kronfluence", progress=False)
        with pytest.raises(ValueError, match=rf"module '0' is a {why}.*freeze its parameters.*conventions='jacmem'"):
            inf.fit(_batches(shape))


def test_a_grouped_convolution_is_named_with_the_fix():
    model = nn.Sequential(nn.Conv2d(2, 4, 3, groups=2), nn.Flatten(), nn.Linear(16, 3)).double()
    inf = Influence(model, loss_fn, curvature="kfac", progress=False)
    with pytest.raises(ValueError, match=r"'0.weight' is a grouped convolution's weight.*curvature='diag'"):
        inf.fit(_batches((2, 4, 4)))


class _Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared, self.head = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.shared(torch.tanh(self.shared(x)))))


def test_a_tied_weight_names_the_curvature_that_serves_it():
    inf = Influence(_Twice().double(), loss_fn, curvature="ekfac", progress=False)
    with pytest.raises(NotImplementedError, match=r"module .shared.*curvature=.diag. or .identity."):
        inf.fit(_batches())
    inf = Influence(_Twice().double(), loss_fn, curvature="diag", progress=False).fit(_batches())
    assert inf.self_influence(_batches()).shape == (6,)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"curvature": "full"}, ValueError, r"curvature must be one of \('ekfac', 'kfac', 'diag', 'identity'\)"),
        ({"fisher": "exact"}, ValueError, r"fisher must be one of \('empirical', 'mc'\)"),
        ({"conventions": "trak"}, ValueError, r"conventions must be one of"),
        ({"curvature": "identity", "damping": 0.1}, ValueError, r"'identity' has no damping"),
        ({"damping": -1.0}, ValueError, r"damping must be >= 0"),
    ],
)
def test_bad_settings_raise_at_construction(kwargs, error, match):
    model = nn.Sequential(nn.Linear(4, 3)).double()
    with pytest.raises(error, match=match):
        Influence(model, loss_fn, **kwargs)


@pytest.mark.skipif(hasattr(jacmem, "BatchGradProjection"), reason="this build has the projection")
def test_projection_without_batch_grad_projection_names_the_fix():
    with pytest.raises(NotImplementedError, match=r"projection=None"):
        Influence(nn.Sequential(nn.Linear(4, 3)).double(), loss_fn, projection=64)


def test_scores_before_fit_raise():
    inf = Influence(nn.Sequential(nn.Linear(4, 3)).double(), loss_fn, progress=False)
    with pytest.raises(RuntimeError, match=r"call fit\(train_loader\) first"):
        inf.scores(_batches(), _batches())


@pytest.mark.parametrize("which", ["training", "query"])
def test_a_shuffling_loader_names_the_fix(which):
    """Rows are stored and scored by position: a shuffling loader would put the scores'
    columns (or rows) in an order drawn at random, which the caller cannot know."""
    data = torch.utils.data.TensorDataset(torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,)))
    fixed = torch.utils.data.DataLoader(data, batch_size=3)
    shuffled = torch.utils.data.DataLoader(data, batch_size=3, shuffle=True)
    inf = Influence(nn.Sequential(nn.Linear(4, 3)).double(), loss_fn, progress=False).fit(shuffled)
    train, queries = (shuffled, fixed) if which == "training" else (fixed, shuffled)
    with pytest.raises(ValueError, match=rf"the {which} loader shuffles.*shuffle=False"):
        inf.scores(queries, train)
