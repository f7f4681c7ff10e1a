"""The Linear and ConvNd case bank of the first-order tests (tests/derivatives/test_linear_conv.py,
tests/extensions/test_backpack_agreement.py), each case with its float64 reference."""

from __future__ import annotations

import torch
from tests.support.reference import cross_entropy, mse, per_sample_grads
from torch import nn

from jacmem.derivatives import REGISTRY


def strategies(module_type: type) -> list[str]:
    """Every strategy name the registry has for this module type, and "auto"."""
    return sorted(REGISTRY[module_type].names() | {"auto"})


CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}


SPATIAL = {1: (11,), 2: (7, 6), 3: (5, 4, 5)}


#: id -> (dimension, C_in, C_out, keyword arguments of the conv)
CONV_CASES: dict[str, tuple] = {
    # Conv1d
    "1d-plain": (1, 2, 3, dict(kernel_size=3)),
    "1d-stride2-pad1-nobias": (1, 2, 3, dict(kernel_size=3, stride=2, padding=1, bias=False)),
    "1d-same-dil2-evenk-circular": (1, 2, 3, dict(kernel_size=4, padding="same", dilation=2, padding_mode="circular")),
    "1d-depthwise-reflect-stride2": (
        1,
        3,
        6,
        dict(kernel_size=3, groups=3, padding=2, stride=2, padding_mode="reflect"),
    ),
    "1d-valid-groups2-dil3": (1, 4, 2, dict(kernel_size=2, padding="valid", groups=2, dilation=3)),
    # Conv2d
    "2d-plain": (2, 2, 3, dict(kernel_size=3)),
    "2d-stride2-pad1-nobias": (2, 3, 2, dict(kernel_size=3, stride=2, padding=1, bias=False)),
    "2d-tuple-stride-dil-pad": (2, 2, 3, dict(kernel_size=(2, 3), stride=(1, 2), dilation=(2, 1), padding=(1, 2))),
    "2d-same-dil2": (2, 2, 3, dict(kernel_size=3, padding="same", dilation=2)),
    "2d-same-evenk-dil-tuple": (2, 2, 2, dict(kernel_size=(4, 2), padding="same", dilation=(1, 2), bias=False)),
    "2d-valid-stride2": (2, 2, 3, dict(kernel_size=2, padding="valid", stride=2)),
    "2d-groups2": (2, 4, 6, dict(kernel_size=3, groups=2, padding=1)),
    "2d-depthwise": (2, 3, 3, dict(kernel_size=3, groups=3, stride=(2, 1))),
    "2d-reflect-pad1": (2, 2, 3, dict(kernel_size=3, padding=1, padding_mode="reflect", dilation=(1, 2))),
    "2d-replicate-tuple-stride2": (2, 2, 2, dict(kernel_size=3, padding=(1, 2), stride=2, padding_mode="replicate")),
    "2d-circular-same-evenk": (2, 2, 3, dict(kernel_size=(2, 4), padding="same", padding_mode="circular")),
    "2d-groups3-replicate-same-dil-nobias": (
        2,
        6,
        3,
        dict(kernel_size=3, padding="same", dilation=(2, 1), groups=3, padding_mode="replicate", bias=False),
    ),
    # Conv3d
    "3d-plain": (3, 2, 2, dict(kernel_size=2)),
    "3d-stride2-pad-tuple-groups2": (
        3,
        4,
        2,
        dict(kernel_size=(2, 3, 2), stride=(2, 1, 2), padding=(1, 0, 1), groups=2),
    ),
    "3d-same-dil2-replicate": (
        3,
        2,
        2,
        dict(kernel_size=(3, 2, 2), padding="same", dilation=(2, 1, 2), padding_mode="replicate"),
    ),
    "3d-depthwise-circular-nobias": (
        3,
        2,
        4,
        dict(kernel_size=2, groups=2, padding=1, padding_mode="circular", bias=False),
    ),
    "3d-valid-reflect-dil": (3, 2, 2, dict(kernel_size=2, padding="valid", dilation=2, padding_mode="reflect")),
}


#: id -> (input shape without the batch axis, out_features, bias)
LINEAR_CASES: dict[str, tuple] = {
    "rank2": ((5,), 4, True),
    "rank2-nobias": ((5,), 3, False),
    "rank3": ((4, 5), 3, True),
    "rank4": ((2, 3, 4), 3, True),
    "rank4-nobias": ((3, 1, 4), 2, False),
}


N = 3


def build(case_id: str):
    """(model, X, y, loss, reduction) for a case, from a seed of its own."""
    torch.manual_seed(sum(map(ord, case_id)))
    reduction = ("mean", "sum")[len(case_id) % 2]
    if case_id in LINEAR_CASES:
        shape, out_features, bias = LINEAR_CASES[case_id]
        model = nn.Linear(shape[-1], out_features, bias=bias).double()
        X = torch.randn(N, *shape, dtype=torch.float64)
        if len(shape) == 1:  # a classifier: cross-entropy over the outputs
            return model, X, torch.randint(0, out_features, (N,)), cross_entropy, reduction
    else:
        d, c_in, c_out, kwargs = CONV_CASES[case_id]
        model = CONV[d](c_in, c_out, **kwargs).double()
        X = torch.randn(N, c_in, *SPATIAL[d], dtype=torch.float64)
    with torch.no_grad():
        y = torch.randn_like(model(X))
    return model, X, y, mse, reduction


_REFERENCES: dict = {}


def case(case_id: str):
    """The case and its reference per-sample gradients, computed once."""
    if case_id not in _REFERENCES:
        model, X, y, loss, reduction = build(case_id)
        _REFERENCES[case_id] = (model, X, y, loss, reduction, per_sample_grads(model, X, y, loss, reduction))
    return _REFERENCES[case_id]


def module_type(case_id: str) -> type:
    return nn.Linear if case_id in LINEAR_CASES else CONV[CONV_CASES[case_id][0]]
