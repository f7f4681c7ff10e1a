"""BackPACK 1.7.1's shared second-order test settings (``SECONDORDER_SETTINGS`` of its
``test/extensions/secondorder/secondorder_settings.py``, MIT licence), transcribed: its
test tree is not installed with the package. Each setting is built in float64 from its
seed (BackPACK's default: 0) in BackPACK's order: model, input, target.

``SETTINGS``: ``{id: make}``, ``make() -> (model, loss, X, y)``. ``SQRT_GGN_SETTINGS``:
the settings its SqrtGGN tests add (``sqrt_ggn_settings.py``) that use no BackPACK
container (``Parallel``, its ResNet converter): Embedding, BatchNorm in eval mode.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from backpack.custom_module.pad import Pad
from backpack.custom_module.slicing import Slicing
from tests.support.secondorder_ref import default_dtype
from torch import nn

DT = torch.float64


def classification_targets(size: tuple[int, ...], num_classes: int) -> torch.Tensor:
    return torch.randint(size=size, low=0, high=num_classes)


def regression_targets(size: tuple[int, ...]) -> torch.Tensor:
    return torch.rand(size=size)


def _frozen_linear(d_in: int) -> nn.Linear:
    """BackPACK's automated settings end in a Linear(·, 5) without trainable parameters."""
    linear = nn.Linear(d_in, 5)
    linear.requires_grad_(False)
    return linear


def _out_dim(layers: list[nn.Module], input_size: tuple[int, ...]) -> int:
    return nn.Sequential(*layers)(torch.rand(input_size))[0].numel()


def _act(act: type, bias: bool):
    """``make_simple_act_setting``."""
    return (
        lambda: torch.rand(3, 3, 7, 7),
        lambda: nn.Sequential(nn.Conv2d(3, 2, 2, bias=bias), act(), nn.Flatten(), _frozen_linear(72)),
        lambda: nn.CrossEntropyLoss(),
        lambda: classification_targets((3,), 5),
    )


def _cnn(input_size, conv, params, pool=None, pool_params=()):
    """``make_simple_cnn_setting`` (``pool=None``) and ``make_simple_pooling_setting``."""

    def layers():
        if pool is None:
            return [conv(*params), nn.ReLU()]
        return [conv(3, 2, 2), nn.ReLU(), pool(*pool_params)]

    def model():
        body = layers()
        return nn.Sequential(*body, nn.Flatten(), _frozen_linear(_out_dim(body, input_size)))

    return (
        lambda: torch.rand(input_size),
        model,
        lambda: nn.CrossEntropyLoss(reduction="sum"),
        lambda: classification_targets((3,), 5),
    )


def _plain(x, model, loss, y):
    return (x, model, loss, y)


C1, C2, C3 = nn.Conv1d, nn.Conv2d, nn.Conv3d
T1, T2, T3 = nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d
CE, MSE, BCE = nn.CrossEntropyLoss, nn.MSELoss, nn.BCEWithLogitsLoss
Seq, Lin = nn.Sequential, nn.Linear

_RAW: list[tuple[str, tuple]] = [
    (
        "example",
        _plain(lambda: torch.rand(3, 10), lambda: Seq(Lin(10, 5)), CE, lambda: classification_targets((3,), 5)),
    ),
    (
        "linear-linear",
        _plain(
            lambda: torch.rand(3, 10),
            lambda: Seq(Lin(10, 7), Lin(7, 5)),
            lambda: CE(reduction="mean"),
            lambda: classification_targets((3,), 5),
        ),
    ),
    (
        "linear-relu",
        _plain(
            lambda: torch.rand(3, 10),
            lambda: Seq(Lin(10, 7), nn.ReLU(), Lin(7, 5)),
            lambda: CE(reduction="sum"),
            lambda: classification_targets((3,), 5),
        ),
    ),
    (
        "linear-sigmoid-mse",
        _plain(
            lambda: torch.rand(3, 10),
            lambda: Seq(Lin(10, 7), nn.Sigmoid(), Lin(7, 5)),
            lambda: MSE(reduction="mean"),
            lambda: regression_targets((3, 5)),
        ),
    ),
]
for _a in (nn.ReLU, nn.Sigmoid, nn.Tanh, nn.LeakyReLU, nn.LogSigmoid, nn.ELU, nn.SELU):
    for _bias in (True, False):
        _RAW.append((f"act-{_a.__name__}-bias={_bias}", _act(_a, _bias)))
_POOLS = [
    ((3, 3, 7), C1, nn.MaxPool1d, (2, 1)),
    ((3, 3, 7), C1, nn.MaxPool1d, (2, 1, 0, 2)),
    ((3, 3, 7), C1, nn.MaxPool1d, (2, 1, 0, 2, False, True)),
    ((3, 3, 11, 11), C2, nn.MaxPool2d, (2, 1)),
    ((3, 3, 7, 7), C2, nn.MaxPool2d, (2, 1, 0, 2)),
    ((3, 3, 7, 7), C2, nn.MaxPool2d, (2, 1, 0, 2, False, True)),
    ((3, 3, 7, 7, 7), C3, nn.MaxPool3d, (2, 1)),
    ((3, 3, 7, 7, 7), C3, nn.MaxPool3d, (2, 1, 0, 2)),
    ((3, 3, 7, 7, 7), C3, nn.MaxPool3d, (2, 1, 0, 2, False, True)),
    ((3, 3, 7), C1, nn.AvgPool1d, (2, 1)),
    ((3, 3, 7), C1, nn.AvgPool1d, (2, 1, 0, True)),
    ((3, 3, 7), C1, nn.AvgPool1d, (2, 1, 0, False)),
    ((3, 3, 11, 11), C2, nn.AvgPool2d, (2, 1)),
    ((3, 3, 7, 7), C2, nn.AvgPool2d, (2, 1, 0, True)),
    ((3, 3, 7, 7), C2, nn.AvgPool2d, (2, 1, 0, False)),
    ((3, 3, 7, 7, 7), C3, nn.AvgPool3d, (2, 1)),
    ((3, 3, 7, 7, 7), C3, nn.AvgPool3d, (2, 1, 0, True)),
    ((3, 3, 7, 7, 7), C3, nn.AvgPool3d, (2, 1, 0, False)),
]
for _size, _conv, _pool, _pp in _POOLS:
    _RAW.append((f"pool-{_pool.__name__}-{_size}-{_pp}", _cnn(_size, _conv, None, _pool, _pp)))
_CONVS = [
    ((3, 3, 7), C1, (3, 2, 2)),
    ((3, 2, 7), C1, (2, 3, 2, 2, 0, 2)),
    ((3, 3, 7), C1, (3, 2, 2, 2, 1)),
    ((3, 3, 8), C1, (3, 6, 2, 4, 2, 3)),
    ((3, 3, 7), C1, (3, 2, 2, 4, 2, 1, 1, False)),
    ((3, 3, 7, 7), C2, (3, 2, 2)),
    ((3, 2, 7, 7), C2, (2, 3, 2, 2, 0, 2)),
    ((3, 3, 7, 7), C2, (3, 2, 2, 2, 1)),
    ((3, 3, 8, 8), C2, (3, 6, 2, 4, 2, 3)),
    ((3, 3, 7, 7), C2, (3, 2, 2, 4, 2, 1, 1, False)),
    ((3, 3, 2, 7, 7), C3, (3, 2, 2)),
    ((3, 2, 3, 7, 7), C3, (2, 3, 2, 2, 0, 2)),
    ((3, 3, 2, 7, 7), C3, (3, 2, 2, 3, 2)),
    ((3, 3, 4, 8, 8), C3, (3, 6, 2, 4, 2, 3)),
    ((3, 3, 2, 7, 7), C3, (3, 2, 2, 4, 2, 1, 1, False)),
    ((3, 3, 7), T1, (3, 2, 2)),
    ((3, 2, 7), T1, (2, 3, 2, 2, 0, 0, 1, True, 2)),
    ((3, 3, 7), T1, (3, 2, 2, 2, 1)),
    ((3, 3, 8), T1, (3, 6, 2, 4, 2, 0, 1, True, 3)),
    ((3, 3, 7), T1, (3, 2, 2, 4, 2, 0, 1, False)),
    ((3, 3, 7, 7), T2, (3, 2, 2)),
    ((3, 2, 9, 9), T2, (2, 4, 2, 1, 0, 0, 1, True, 2)),
    ((3, 3, 7, 7), T2, (3, 2, 2, 2, 1)),
    ((3, 3, 7, 7), T2, (3, 2, 2, 4, 2, 0, 1, False)),
    ((3, 3, 2, 7, 7), T3, (3, 2, 2)),
    ((3, 2, 3, 5, 5), T3, (2, 3, 2, 2, 2, 0, 1, True, 2)),
    ((3, 3, 2, 7, 7), T3, (3, 2, 2, 4, 2, 0, 1, False)),
]
_GROUPED = [
    ((3, 6, 7), C1, (6, 4, 2, 1, 0, 1, 2)),
    ((3, 6, 7, 5), C2, (6, 3, 2, 1, 0, 1, 3)),
    ((3, 4, 7, 5, 6), C3, (4, 2, 2, 1, 0, 2, 2)),
    ((3, 6, 8), T1, (6, 3, 2, 4, 2, 0, 3, True, 3)),
    ((3, 4, 9, 9), T2, (4, 2, 2, 1, 0, 0, 2, True, 2)),
    ((3, 4, 3, 5, 5), T3, (4, 2, (2, 2, 1), 2, 2, 0, 2, True, 2)),
]
for _size, _conv, _params in _CONVS + _GROUPED:
    _RAW.append((f"conv-{_conv.__name__}-{_size}-{_params}", _cnn(_size, _conv, _params)))
#: BackPACK's LINEAR_ADDITIONAL_DIMENSIONS_SETTINGS
LINEAR_ADDITIONAL = {
    "one-additional-mse": _plain(
        lambda: torch.rand(3, 4, 5),
        lambda: Seq(Lin(5, 3), Lin(3, 2), nn.Flatten()),
        lambda: MSE(reduction="mean"),
        lambda: regression_targets((3, 8)),
    ),
    "two-additional-mse": _plain(
        lambda: torch.rand(3, 4, 2, 5),
        lambda: Seq(Lin(5, 3), nn.Sigmoid(), Lin(3, 2), nn.Flatten()),
        lambda: MSE(reduction="mean"),
        lambda: regression_targets((3, 16)),
    ),
    "three-additional-mse": _plain(
        lambda: torch.rand(3, 4, 2, 3, 5),
        lambda: Seq(Lin(5, 3), Lin(3, 2), nn.Flatten()),
        lambda: MSE(reduction="sum"),
        lambda: regression_targets((3, 48)),
    ),
    "one-additional-ce": _plain(
        lambda: torch.rand(3, 4, 5),
        lambda: Seq(Lin(5, 3), Lin(3, 2), nn.Flatten()),
        lambda: CE(reduction="mean"),
        lambda: classification_targets((3,), 8),
    ),
    "two-additional-ce": _plain(
        lambda: torch.rand(3, 4, 2, 5),
        lambda: Seq(Lin(5, 3), nn.Sigmoid(), Lin(3, 2), nn.Flatten()),
        lambda: CE(reduction="mean"),
        lambda: classification_targets((3,), 16),
    ),
    "three-additional-ce": _plain(
        lambda: torch.rand(3, 4, 2, 3, 5),
        lambda: Seq(Lin(5, 3), nn.ReLU(), Lin(3, 2), nn.Flatten()),
        lambda: CE(reduction="sum"),
        lambda: classification_targets((3,), 48),
    ),
}
_RAW += list(LINEAR_ADDITIONAL.items())
_RAW += [
    (
        "multi-d-CrossEntropyLoss",
        _plain(
            lambda: torch.rand(3, 4, 2, 3, 5),
            lambda: Seq(Lin(5, 3), nn.ReLU(), Lin(3, 2)),
            lambda: CE(reduction="sum"),
            lambda: classification_targets((3, 2, 3, 2), 4),
        ),
    ),
    (
        "pad-constant-0",
        _plain(
            lambda: torch.rand(5, 3, 4, 4),
            lambda: Seq(
                C2(3, 2, 2),
                Pad((1, 1, 0, 2), mode="constant", value=0.0),
                C2(2, 2, 3, stride=2),
                nn.Flatten(),
                Lin(8, 2),
            ),
            lambda: MSE(reduction="mean"),
            lambda: regression_targets((5, 2)),
        ),
    ),
    (
        "pad-constant-1-channels",
        _plain(
            lambda: torch.rand(5, 3, 4, 4),
            lambda: Seq(
                C2(3, 2, 3, padding=1),
                nn.ReLU(),
                Pad((1, 1, 2, 0, 1, 2), mode="constant", value=1.0),
                C2(5, 2, 3, stride=2),
                nn.ReLU(),
                nn.Flatten(),
                Lin(8, 3),
            ),
            lambda: CE(reduction="mean"),
            lambda: classification_targets((5,), 3),
        ),
    ),
    (
        "slicing-steps",
        _plain(
            lambda: torch.rand(3, 3, 4, 5),
            lambda: Seq(
                C2(3, 2, 2, padding=1),
                Slicing((slice(None), 0, slice(None, None, 2), slice(0, 2))),
                nn.ReLU(),
                nn.Flatten(),
                Lin(6, 4),
            ),
            lambda: CE(reduction="mean"),
            lambda: classification_targets((3,), 4),
        ),
    ),
    (
        "slicing-twice",
        _plain(
            lambda: torch.rand(3, 3, 4, 5),
            lambda: Seq(
                C2(3, 2, 2, padding=1),
                Slicing((slice(None), slice(None), 2)),
                nn.ReLU(),
                Slicing((slice(None), 1)),
                Lin(6, 4),
            ),
            lambda: MSE(reduction="mean"),
            lambda: regression_targets((3, 4)),
        ),
    ),
    (
        "bce-non-binary-labels",
        _plain(
            lambda: torch.rand(3, 6),
            lambda: Seq(Lin(6, 4), nn.ReLU(), Lin(4, 1)),
            lambda: BCE(reduction="mean"),
            lambda: torch.rand(3, 1),
        ),
    ),
    (
        "bce-binary-labels",
        _plain(
            lambda: torch.rand(3, 6),
            lambda: Seq(Lin(6, 4), nn.ReLU(), Lin(4, 1)),
            lambda: BCE(reduction="sum"),
            lambda: classification_targets((3, 1), 2).double(),
        ),
    ),
]


def _eval_batchnorm(model: nn.Module) -> nn.Module:
    """``initialize_training_false_recursive``: random statistics and affine parameters."""
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.running_mean, m.running_var = torch.rand_like(m.running_mean), torch.rand_like(m.running_var)
            m.weight.data, m.bias.data = torch.rand_like(m.weight), torch.rand_like(m.bias)
    return model.train(False)


BN1, BN2, BN3 = nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d
_SQRT_RAW = [
    (
        "embedding-linear",
        _plain(
            lambda: torch.randint(0, 5, (6,)),
            lambda: Seq(nn.Embedding(5, 3), Lin(3, 4)),
            lambda: CE(reduction="mean"),
            lambda: classification_targets((6,), 4),
        ),
        0,
    ),
    (
        "embedding-flatten",
        _plain(
            lambda: torch.randint(0, 3, (3, 2, 2)),
            lambda: Seq(nn.Embedding(3, 2), nn.Flatten()),
            lambda: CE(reduction="mean"),
            lambda: classification_targets((3,), 2 * 2),
        ),
        1,
    ),
    (
        "batchnorm1d-eval",
        _plain(
            lambda: torch.rand(2, 3, 4),
            lambda: _eval_batchnorm(Seq(BN1(3), nn.Flatten())),
            MSE,
            lambda: regression_targets((2, 4 * 3)),
        ),
        0,
    ),
    (
        "batchnorm2d-eval",
        _plain(
            lambda: torch.rand(3, 2, 4, 3),
            lambda: _eval_batchnorm(Seq(BN2(2), nn.Flatten())),
            MSE,
            lambda: regression_targets((3, 2 * 4 * 3)),
        ),
        0,
    ),
    (
        "batchnorm3d-eval",
        _plain(
            lambda: torch.rand(3, 3, 4, 1, 2),
            lambda: _eval_batchnorm(Seq(BN3(3), nn.Flatten())),
            MSE,
            lambda: regression_targets((3, 3 * 4 * 1 * 2)),
        ),
        0,
    ),
    (
        "batchnorm3d-linear-eval",
        _plain(
            lambda: torch.rand(3, 3, 4, 1, 2),
            lambda: _eval_batchnorm(Seq(BN3(3), Lin(2, 3), BN3(3), nn.ReLU(), BN3(3), nn.Flatten())),
            MSE,
            lambda: regression_targets((3, 4 * 1 * 3 * 3)),
        ),
        0,
    ),
]


def _maker(fns: tuple, seed: int = 0) -> Callable[[], tuple]:
    input_fn, module_fn, loss_fn, target_fn = fns

    def make():
        with default_dtype(DT):
            torch.manual_seed(seed)
            model = module_fn()
            X = input_fn()
            y = target_fn()
        return model, loss_fn(), X, y

    return make


SETTINGS: dict[str, Callable[[], tuple]] = {name: _maker(fns) for name, fns in _RAW}
assert len(SETTINGS) == len(_RAW) == 82  # BackPACK's 82, no id repeated
SQRT_GGN_SETTINGS: dict[str, Callable[[], tuple]] = {name: _maker(fns, seed) for name, fns, seed in _SQRT_RAW}
