"""conventions="kronfluence" against kronfluence 1.0.1 itself, run on the same model and
data in float64: its pairwise and self-influence scores (empirical Fisher) on an MLP with
biases, and on a small CNN (nn.Conv2d: strided, padded, dilated, with and without bias)."""

from __future__ import annotations

import pytest
import torch
from tests.support.attribution import summed_cross_entropy as loss_fn
from torch import nn
from torch.utils import data

from jacmem.attribution import Influence

kronfluence = pytest.importorskip("kronfluence")
from kronfluence import Analyzer, FactorArguments, ScoreArguments, prepare_model  # noqa: E402
from kronfluence.task import Task  # noqa: E402
from kronfluence.utils.constants import ALL_MODULE_NAME  # noqa: E402


class _Task(Task):
    def compute_train_loss(self, batch, model, sample=False):
        assert not sample, "the test fits the empirical Fisher"
        return loss_fn(model, batch)

    def compute_measurement(self, batch, model):
        return loss_fn(model, batch)


def _model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 7), nn.Tanh(), nn.Linear(7, 3)).double()


def _dataset(n: int, seed: int) -> data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return data.TensorDataset(
        torch.randn(n, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g)
    )


def _kronfluence(
    tmp_path, strategy: str, damping: float | None, train, queries, make_model=_model
) -> tuple[torch.Tensor, torch.Tensor]:
    """kronfluence's pairwise scores ``[n_query, n_train]`` and self-influence scores ``[n_train]``."""
    model = prepare_model(make_model(), _Task())
    analyzer = Analyzer(
        "jacmem", model=model, task=_Task(), output_dir=str(tmp_path), disable_model_save=True, disable_tqdm=True
    )
    factor_args = FactorArguments(strategy=strategy, use_empirical_fisher=True)
    for name in ("activation_covariance", "gradient_covariance", "per_sample_gradient", "lambda"):
        setattr(factor_args, f"{name}_dtype", torch.float64)
    analyzer.fit_all_factors(
        "f", dataset=train, per_device_batch_size=8, factor_args=factor_args, overwrite_output_dir=True
    )
    score_args = ScoreArguments(
        damping_factor=damping,
        per_sample_gradient_dtype=torch.float64,
        precondition_dtype=torch.float64,
        score_dtype=torch.float64,
    )
    analyzer.compute_pairwise_scores(
        "s",
        factors_name="f",
        query_dataset=queries,
        train_dataset=train,
        per_device_query_batch_size=3,
        per_device_train_batch_size=8,
        score_args=score_args,
        overwrite_output_dir=True,
    )
    analyzer.compute_self_scores(
        "self",
        factors_name="f",
        train_dataset=train,
        per_device_train_batch_size=8,
        score_args=score_args,
        overwrite_output_dir=True,
    )
    return analyzer.load_pairwise_scores("s")[ALL_MODULE_NAME], analyzer.load_self_scores("self")[ALL_MODULE_NAME]


@pytest.mark.parametrize(
    ("strategy", "damping"),
    [("ekfac", None), ("ekfac", 1e-3), ("kfac", None), ("diagonal", 1e-3), ("identity", None)],
)
def test_pairwise_scores_equal_kronfluence(tmp_path, strategy, damping):
    train, queries = _dataset(24, 0), _dataset(5, 1)
    want, want_self = _kronfluence(tmp_path, strategy, damping, train, queries)
    curvature = {"diagonal": "diag"}.get(strategy, strategy)
    inf = Influence(_model(), loss_fn, curvature=curvature, damping=damping, conventions="kronfluence", progress=False)
    train_loader = data.DataLoader(train, batch_size=8)
    inf.fit(train_loader)
    got = inf.scores(data.DataLoader(queries, batch_size=3), train_loader)
    assert got.shape == want.shape == (5, 24)
    err = (got - want).abs().max() / want.abs().max()
    assert err < 1e-8, f"relative error {err:.2e}"
    got_self = inf.self_influence(train_loader)
    err = (got_self - want_self).abs().max() / want_self.abs().max()
    assert err < 1e-8, f"self-influence: relative error {err:.2e}"


class _Tokens(nn.Module):
    """A Linear over the positions of ``[N, T, 6]`` (``N·T`` rows for kronfluence's
    covariances), mean-pooled, then a Linear head (``N`` rows)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.token, self.head = nn.Linear(6, 5), nn.Linear(5, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.token(x)).mean(1))


@pytest.mark.parametrize("strategy", ["ekfac", "kfac"])
def test_positions_are_rows_of_the_covariances_as_in_kronfluence(tmp_path, strategy):
    g = torch.Generator().manual_seed(0)
    train = data.TensorDataset(
        torch.randn(16, 4, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (16,), generator=g)
    )
    queries = data.TensorDataset(
        torch.randn(3, 4, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (3,), generator=g)
    )
    want, _ = _kronfluence(tmp_path, strategy, None, train, queries, lambda: _Tokens().double())
    inf = Influence(_Tokens().double(), loss_fn, curvature=strategy, conventions="kronfluence", progress=False)
    train_loader = data.DataLoader(train, batch_size=8)
    got = inf.fit(train_loader).scores(data.DataLoader(queries, batch_size=3), train_loader)
    err = (got - want).abs().max() / want.abs().max()
    assert err < 1e-8, f"relative error {err:.2e}"


class _CNN(nn.Module):
    """Conv2d -> ReLU -> Conv2d -> flatten -> Linear on ``[N, 2, 7, 7]``: kronfluence's
    covariances have a row per output pixel of each convolution."""

    def __init__(self, first: dict, second: dict):
        super().__init__()
        torch.manual_seed(5)
        self.conv1, self.conv2 = nn.Conv2d(2, 3, **first), nn.Conv2d(3, 4, **second)
        with torch.no_grad():
            width = self.conv2(self.conv1(torch.zeros(1, 2, 7, 7))).numel()
        self.head = nn.Linear(width, 3)

    def forward(self, x):
        return self.head(self.conv2(torch.relu(self.conv1(x))).flatten(1))


#: (first conv, second conv): strided and padded with a bias, then dilated without; a
#: rectangular dilated kernel with "same" padding (symmetric: kronfluence refuses the
#: other) without a bias, then strided unevenly with one
CNNS = {
    "strided": (dict(kernel_size=3, stride=2, padding=1), dict(kernel_size=2, dilation=2, bias=False)),
    "same": (
        dict(kernel_size=(3, 1), dilation=(2, 1), padding="same", bias=False),
        dict(kernel_size=3, stride=(2, 1), padding=(1, 0)),
    ),
}


def _images(n: int, seed: int) -> data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return data.TensorDataset(
        torch.randn(n, 2, 7, 7, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g)
    )


@pytest.mark.parametrize("cnn", sorted(CNNS))
@pytest.mark.parametrize(
    ("strategy", "damping"),
    [("ekfac", None), ("ekfac", 1e-3), ("kfac", None), ("diagonal", 1e-3), ("identity", None)],
)
def test_conv2d_scores_equal_kronfluence(tmp_path, strategy, damping, cnn):
    train, queries = _images(16, 0), _images(3, 1)
    make = lambda: _CNN(*CNNS[cnn]).double()  # noqa: E731
    want, want_self = _kronfluence(tmp_path, strategy, damping, train, queries, make)
    curvature = {"diagonal": "diag"}.get(strategy, strategy)
    inf = Influence(make(), loss_fn, curvature=curvature, damping=damping, conventions="kronfluence", progress=False)
    train_loader = data.DataLoader(train, batch_size=8)
    got = inf.fit(train_loader).scores(data.DataLoader(queries, batch_size=3), train_loader)
    assert got.shape == want.shape == (3, 16)
    err = (got - want).abs().max() / want.abs().max()
    assert err < 1e-8, f"relative error {err:.2e}"
    got_self = inf.self_influence(train_loader)
    err = (got_self - want_self).abs().max() / want_self.abs().max()
    assert err < 1e-8, f"self-influence: relative error {err:.2e}"
