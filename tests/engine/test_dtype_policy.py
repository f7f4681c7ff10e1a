"""One dtype policy for both engines (:mod:`jacmem.engine.precision`), autocast included.

Under ``torch.autocast("cpu", dtype=torch.bfloat16)`` the layers run in bf16, so what
the engines keep and the gradients they get are bf16. Both engines compute in float32
and return each result in its parameter's dtype. The references are the same model and
batch without autocast, in float32: the bf16 forward alone moves the results by its
rounding (a few 1e-3 relative, see tests/engine/test_autocast.py), so the tolerance is loose.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import jacmem
from jacmem.engine import precision

BF16 = torch.bfloat16
#: relative, norm-wise: the bf16 forward's rounding (first order measures up to 8e-3)
TOLERANCE = 5e-2


def bf16_autocast_supported() -> bool:
    try:
        with torch.autocast("cpu", dtype=BF16):
            return nn.Linear(2, 2)(torch.randn(1, 2)).dtype == BF16
    except (RuntimeError, AssertionError):
        return False


pytestmark = pytest.mark.skipif(not bf16_autocast_supported(), reason="no CPU autocast to bfloat16 here")


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, stride=2), nn.Tanh(), nn.Flatten(), nn.Linear(36, 3))


def data(net: str, n: int = 16):
    torch.manual_seed(1)
    X = torch.randn(n, 6) if net == "mlp" else torch.randn(n, 3, 8, 8)
    return X, torch.randint(0, 3, (n,))


def run(model, X, y, extensions, autocast: bool):
    """One block; every parameter's results (tuples flattened), cleared after."""
    with jacmem.extend(*extensions):
        with torch.autocast("cpu", dtype=BF16, enabled=autocast):  # the loss too, as usual
            loss = nn.CrossEntropyLoss()(model(X), y)
        loss.backward()
    results = {}
    for name, p in model.named_parameters():
        for ext in extensions:
            value = getattr(p, ext.savefield)
            results[(name, ext.savefield)] = list(value) if isinstance(value, (tuple, list)) else [value]
            delattr(p, ext.savefield)
        p.grad = None
    return results


def relative(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("net", ["mlp", "cnn"])
@pytest.mark.parametrize(
    "extensions",
    [
        lambda: [jacmem.DiagGGNExact()],
        lambda: [jacmem.KFAC(), jacmem.KFLR()],
        lambda: [jacmem.BatchGrad(), jacmem.DiagGGNExact(), jacmem.KFLR()],
    ],
    ids=["diag_ggn", "kfac+kflr", "batch_grad+diag_ggn+kflr"],
)
def test_second_order_under_bf16_autocast_matches_float32(net, extensions):
    model = mlp() if net == "mlp" else cnn()
    X, y = data(net)
    low = run(model, X, y, extensions(), autocast=True)
    full = run(model, X, y, extensions(), autocast=False)
    assert low.keys() == full.keys()
    for key, values in low.items():
        for got, expected in zip(values, full[key], strict=True):
            assert got.dtype == torch.float32, f"{key}: {got.dtype}"
            if key[1] == "kfac":  # sampled: only the input factor is comparable
                continue
            assert relative(got, expected) < TOLERANCE, f"{key}: {relative(got, expected):.2e}"
    for name, _ in model.named_parameters():  # KFAC's input factor is KFLR's
        if name.endswith("weight") and (name, "kfac") in low:
            assert relative(low[(name, "kfac")][1], full[(name, "kflr")][1]) < TOLERANCE


def test_batch_grad_with_second_order_under_autocast_sums_to_grad():
    """The first-order engine under the same policy, beside a second-order extension."""
    model, (X, y) = mlp(), data("mlp")
    with jacmem.extend(jacmem.BatchGrad(), jacmem.DiagGGNExact()):
        with torch.autocast("cpu", dtype=BF16):
            loss = nn.CrossEntropyLoss()(model(X), y)
        loss.backward()
    for p in model.parameters():
        assert p.grad_batch.dtype == p.diag_ggn_exact.dtype == torch.float32
        torch.testing.assert_close(p.grad_batch.sum(0), p.grad, rtol=1e-2, atol=1e-4)


def test_bf16_parameters_get_second_order_results_in_bf16():
    """A model kept in bf16 (no autocast): computed in float32, returned in bf16."""
    model, (X, y) = mlp(), data("mlp")
    full = run(model, X, y, [jacmem.DiagGGNExact()], autocast=False)
    model = model.to(BF16)
    with jacmem.extend(jacmem.DiagGGNExact()):
        nn.CrossEntropyLoss()(model(X.to(BF16)), y).backward()
    for name, p in model.named_parameters():
        assert p.diag_ggn_exact.dtype == BF16
        assert relative(p.diag_ggn_exact, full[(name, "diag_ggn_exact")][0]) < TOLERANCE


def test_the_policy():
    assert precision.compute_dtype([torch.zeros(1, dtype=BF16)]) == torch.float32
    assert precision.compute_dtype([torch.zeros(1, dtype=torch.float16), torch.zeros(1)]) == torch.float32
    assert precision.compute_dtype([torch.zeros(1, dtype=torch.float64), torch.zeros(1)]) == torch.float64
    assert precision.compute_dtype([torch.zeros(1, dtype=torch.long)]) == torch.float32
    p = torch.zeros(2, dtype=BF16)
    assert precision.result(torch.ones(2), p).dtype == BF16
    assert [t.dtype for t in precision.result((torch.ones(2), torch.ones(2)), p)] == [BF16, BF16]
