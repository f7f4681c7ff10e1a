"""First-order extensions on the normalisation layers, against a per-sample autograd
loop, and against BackPACK where it can answer.

BatchNorm1d/2d/3d in eval mode (running statistics); InstanceNorm1d/2d/3d (affine), with
and without running statistics, in train and eval mode; GroupNorm; LayerNorm with a
``normalized_shape`` of rank 1 to 3 and without bias; RMSNorm with ``eps=None`` and
given. Every case runs, in float64, every registered strategy and ``"auto"``; each
extension alone and all four together; both flows; and with ``chunk_bytes=1``.

BatchNorm with batch statistics (training mode, or eval without running statistics)
raises for every extension (see :mod:`jacmem.derivatives.normalization` for why), and
the mode that counts is the forward's: both are tested.

BackPACK 1.7.1 answers for BatchNorm in eval mode only; it has no extension for
LayerNorm, GroupNorm, InstanceNorm or RMSNorm (it warns and computes nothing):
:func:`test_backpack_cannot` pins that.
"""

from __future__ import annotations

import copy
import itertools
import warnings
from collections.abc import Callable

import pytest
import torch
from backpack import backpack, extend, extensions
from tests.support.reference import (
    FLOWS,
    assert_close,
    check_against,
    cross_entropy,
    mse,
    per_sample_grads,
    run_backpack,
    run_grid,
    run_jacmem,
)
from torch import nn

import jacmem
from jacmem.derivatives import REGISTRY

EXTENSIONS = [jacmem.BatchGrad, jacmem.BatchL2Grad, jacmem.SumGradSquared, jacmem.Variance]
EXTENSION_SETS = [[e] for e in EXTENSIONS] + [EXTENSIONS]
N = 4

#: id -> (layer factory, input shape without the batch axis, train mode?)
CASES: dict[str, tuple] = {
    "bn1d-flat": (lambda: nn.BatchNorm1d(3), (3,), False),
    "bn1d-seq": (lambda: nn.BatchNorm1d(3), (3, 5), False),
    "bn2d": (lambda: nn.BatchNorm2d(3), (3, 4, 3), False),
    "bn3d": (lambda: nn.BatchNorm3d(2), (2, 3, 2, 3), False),
    "in1d-train": (lambda: nn.InstanceNorm1d(3, affine=True), (3, 6), True),
    "in2d-eval-no-running": (lambda: nn.InstanceNorm2d(3, affine=True), (3, 4, 3), False),
    "in2d-eval-running": (lambda: nn.InstanceNorm2d(3, affine=True, track_running_stats=True), (3, 4, 3), False),
    "in3d-train-running": (lambda: nn.InstanceNorm3d(2, affine=True, track_running_stats=True), (2, 3, 2, 3), True),
    "gn": (lambda: nn.GroupNorm(2, 4), (4, 3, 3), True),
    "gn-flat": (lambda: nn.GroupNorm(3, 6), (6,), True),
    "gn-one-group": (lambda: nn.GroupNorm(1, 3), (3, 5), True),
    "ln": (lambda: nn.LayerNorm(5), (3, 5), True),
    "ln-rank2": (lambda: nn.LayerNorm((3, 5)), (2, 3, 5), True),
    "ln-rank3-nobias": (lambda: nn.LayerNorm((2, 3, 4), bias=False), (2, 3, 4), True),
    "ln-flat-nobias": (lambda: nn.LayerNorm(4, bias=False), (4,), True),
    "rms-eps-none": (lambda: nn.RMSNorm(5), (3, 5), True),
    "rms-rank2-eps": (lambda: nn.RMSNorm((3, 5), eps=1e-3), (2, 3, 5), True),
    # inputs ~1e-8, so that eps=None (the dtype's eps, 2.2e-16 in float64) matters
    "rms-eps-none-tiny": (lambda: nn.RMSNorm(5), (3, 5), True),
}


def randomise(module: nn.Module) -> nn.Module:
    """Parameters and running statistics away from their defaults (1, 0), so that a
    formula that drops them fails."""
    with torch.no_grad():
        for p in module.parameters():
            p.normal_()
        if getattr(module, "running_mean", None) is not None:
            module.running_mean.normal_()
            module.running_var.uniform_(0.5, 2.0)
    return module


def build(case_id: str):
    torch.manual_seed(sum(map(ord, case_id)))
    factory, shape, train = CASES[case_id]
    model = randomise(factory().double()).train(train)
    X = 2 * torch.randn(N, *shape, dtype=torch.float64) + 1
    if case_id.endswith("-tiny"):
        X = X * 1e-8
    with torch.no_grad():
        y = torch.randn_like(model(X))
    return model, X, y


GRID = [(c, s) for c, (factory, _, _) in CASES.items() for s in sorted(REGISTRY[type(factory())].names() | {"auto"})]


@pytest.mark.parametrize("case_id,strategy", GRID, ids=[f"{c}-{s}" for c, s in GRID])
def test_norm(case_id, strategy):
    model, X, y = build(case_id)
    reference = per_sample_grads(model, X, y, mse, "mean")
    run_grid(model, X, y, mse, "mean", reference, EXTENSION_SETS, strategy, case_id)


# -- BatchNorm with batch statistics -------------------------------------------------


def _batch_statistics_cases() -> dict[str, Callable[[], nn.Module]]:
    frozen_weight = nn.BatchNorm2d(3)
    frozen_weight.weight.requires_grad_(False)
    return {
        "train": lambda: nn.BatchNorm2d(3),
        "eval-without-running-stats": lambda: nn.BatchNorm2d(3, track_running_stats=False).eval(),
        "train-bias-only": lambda: copy.deepcopy(frozen_weight),
    }


@pytest.mark.parametrize("case", list(_batch_statistics_cases()))
@pytest.mark.parametrize("flow", FLOWS)
def test_batch_statistics_raise(case, flow):
    """Samples interact through the batch statistics: every extension raises, naming the
    module and the fix."""
    model = nn.Sequential(nn.Conv2d(2, 3, 3), _batch_statistics_cases()[case]()).double()
    X = torch.randn(N, 2, 5, 5, dtype=torch.float64)
    y = torch.randn(N, 3, 3, 3, dtype=torch.float64)
    for exts in EXTENSION_SETS:
        with pytest.raises(RuntimeError, match=r"'1' \(BatchNorm2d\).*per-sample gradients are not defined.*eval"):
            run_jacmem(model, X, y, mse, "mean", [e() for e in exts], flow)


def test_mode_is_the_forwards():
    """Forward in eval mode, then train() before the backward: the eval-mode answer. And
    the other way round: forward in train mode, then eval(): it raises."""
    model, X, y = build("bn2d")
    reference = per_sample_grads(model, X, y, mse, "mean")
    jacmem.track(model)
    try:
        value = mse(model(X), y, "mean")
        model.train()
        with jacmem.extend(*[e() for e in EXTENSIONS]):
            value.backward()
        check_against(model, reference, [e.savefield for e in EXTENSIONS], "eval forward, train backward")
        value = mse(model(X), y, "mean")
        model.eval()
        with pytest.raises(RuntimeError, match="per-sample gradients are not defined"):
            with jacmem.extend(jacmem.BatchGrad()):
                value.backward()
    finally:
        jacmem.untrack(model)


# -- BackPACK ------------------------------------------------------------------------


@pytest.mark.parametrize("case_id", ["bn1d-flat", "bn1d-seq", "bn2d", "bn3d"])
def test_against_backpack(case_id):
    """BatchNorm in eval mode: all four quantities agree with BackPACK 1.7.1."""
    model, X, y = build(case_id)
    bp_model = run_backpack(model, X, y)
    run_jacmem(model, X, y, mse, "mean", [e() for e in EXTENSIONS])
    for (name, p), bp in zip(model.named_parameters(), bp_model.parameters()):
        for field in ("grad_batch", "batch_l2", "sum_grad_squared", "variance"):
            assert_close(getattr(p, field), getattr(bp, field), f"{case_id} {name} {field} vs BackPACK")


@pytest.mark.parametrize("case_id", ["in2d-eval-running", "gn", "ln-rank2", "rms-eps-none"])
def test_backpack_cannot(case_id):
    """BackPACK 1.7.1 has no extension for these: it computes nothing for them, so the
    loop is the only reference above."""
    model, X, y = build(case_id)
    bp_model = extend(nn.Sequential(model))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with backpack(extensions.BatchGrad()):
            mse(bp_model(X), y, "mean").backward()
    assert not any(hasattr(p, "grad_batch") for p in model.parameters())


# -- in a model ----------------------------------------------------------------------


class NormNet(nn.Module):
    """Conv, every normalisation and Linear, with residual connections; run in eval
    mode (BatchNorm and the tracked InstanceNorm on running statistics)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.gn = nn.GroupNorm(2, 4)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
        self.inorm = nn.InstanceNorm2d(4, affine=True, track_running_stats=True)
        self.ln3 = nn.LayerNorm((4, 5, 5))
        self.lin = nn.Linear(100, 8)
        self.ln = nn.LayerNorm(8, bias=False)
        self.lin2 = nn.Linear(8, 8)
        self.rms = nn.RMSNorm(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):  # [N, 3, 5, 5]
        h = self.conv(x)
        h = h + self.gn(torch.relu(self.bn(h)))
        h = h + self.inorm(self.conv2(h))
        z = self.lin(self.ln3(h).flatten(1))
        z = z + self.lin2(self.ln(z))
        return self.head(self.rms(z))


MODEL_STRATEGIES = sorted(
    set().union(*(REGISTRY[type(m)].names() for m in NormNet().modules() if type(m) in REGISTRY)) | {"auto"}
)


@pytest.mark.parametrize("strategy", MODEL_STRATEGIES)
def test_model_with_residual(strategy):
    torch.manual_seed(0)
    model = NormNet().double()
    for module in model.modules():
        if isinstance(module, (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm, nn.RMSNorm)):
            randomise(module)
    model.eval()
    X = torch.randn(N, 3, 5, 5, dtype=torch.float64)
    y = torch.randint(0, 3, (N,))
    reference = per_sample_grads(model, X, y, cross_entropy, "mean")
    for exts, flow in itertools.product(EXTENSION_SETS, FLOWS):
        run_jacmem(model, X, y, cross_entropy, "mean", [e() for e in exts], flow, strategy=strategy)
        check_against(model, reference, [e.savefield for e in exts], f"[NormNet {strategy} {exts} {flow}]")
