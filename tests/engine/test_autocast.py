"""Mixed precision on CPU: ``torch.autocast("cpu", dtype=bfloat16 / float16)``.

Under autocast the layers run in 16 bits, so a layer's output gradient ``g`` (and the
input of every layer but the first) is a 16-bit tensor. jacmem computes the quantities
from them in float32 (float64 for float64 parameters) and returns them in each
parameter's dtype. Two checks:

1. *Computed in float32*: the test keeps every layer's input ``x`` and output gradient
   ``g`` of the autocast pass and computes each quantity from them in float64, by a
   per-sample loop of its own. jacmem's results must agree to float32 precision
   (``FLOAT32_RTOL`` relative to the largest entry); a computation in 16 bits would be off by
   ~1e-3 (bf16 keeps 8 significant bits).
2. *Tolerance against float32*: the same model and batch without autocast, against
   which the autocast quantities differ by the 16-bit rounding of the forward and
   backward passes. Measured norm-wise relative error (``‖a - b‖ / ‖b‖``, per
   parameter and quantity) on these models (tanh activations) over 20 seeds: at most
   8e-3 (bfloat16) and 8e-4 (float16); the documented bounds, ``AGAINST_FLOAT32``
   below and in docs/guide/distributed.rst (mixed precision), are 2e-2 and
   3e-3. With ReLU instead, a pre-activation whose sign flips under 16-bit rounding
   changes that sample's gradient outright: up to ~1e-1 on the same models, a property
   of the 16-bit forward, not of jacmem (check 1 holds either way).

CUDA's float16 autocast is covered in ``test_cuda.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from tests.support.precision import FLOAT32_RTOL, Capture, per_sample
from tests.support.reference import REFERENCE
from torch import nn

import jacmem

FIELDS = ("grad_batch", "batch_l2", "sum_grad_squared", "variance")
AGAINST_FLOAT32 = {torch.bfloat16: 2e-2, torch.float16: 3e-3}


def extensions():
    return [jacmem.BatchGrad(), jacmem.BatchL2Grad(), jacmem.SumGradSquared(), jacmem.Variance()]


def mlp():
    """[N, 6] -> [N, 3]"""
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).float()


def cnn():
    """[N, 3, 8, 8] -> [N, 3]"""
    return nn.Sequential(nn.Conv2d(3, 4, 3, stride=2), nn.Tanh(), nn.Flatten(), nn.Linear(36, 3)).float()


def data(name, n=32):
    """float32 whatever the default dtype (autocast casts float32 only)."""
    X = torch.randn(n, 6, dtype=torch.float32) if name == "mlp" else torch.randn(n, 3, 8, 8, dtype=torch.float32)
    return X, torch.randn(n, 3, dtype=torch.float32)


def autocast_supported(dtype) -> bool:
    try:
        with torch.autocast("cpu", dtype=dtype):
            return nn.Linear(2, 2).float()(torch.randn(1, 2).float()).dtype == dtype
    except (RuntimeError, AssertionError):
        return False


def run(model, X, y, dtype=None):
    with jacmem.extend(*extensions()):
        if dtype is None:
            out = model(X)
        else:
            with torch.autocast("cpu", dtype=dtype):
                out = model(X)
        torch.nn.functional.mse_loss(out.float(), y).backward()
    results = {p: {f: getattr(p, f).clone() for f in FIELDS} for p in model.parameters()}
    for p in model.parameters():
        p.grad = None
    return results


def relative(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


DTYPES = [
    pytest.param(d, marks=pytest.mark.skipif(not autocast_supported(d), reason=f"no CPU autocast to {d} here"))
    for d in (torch.bfloat16, torch.float16)
]


@pytest.mark.parametrize("net", ["mlp", "cnn"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantities_are_computed_in_float32_and_returned_in_the_parameter_dtype(net, dtype):
    model = mlp() if net == "mlp" else cnn()
    X, y = data(net)
    capture = Capture(model)
    results = run(model, X, y, dtype)
    capture.remove()
    assert any(g.dtype == dtype for g in capture.g.values()), "autocast did not run the layers in 16 bits"
    for module in capture.x:
        for p, gb in per_sample(module, capture.x[module], capture.g[module]).items():
            for field in FIELDS:
                got, expected = results[p][field], REFERENCE[field](gb)
                assert got.dtype == p.dtype == torch.float32
                scale = expected.abs().max().item()
                torch.testing.assert_close(
                    got.double(), expected, rtol=FLOAT32_RTOL, atol=FLOAT32_RTOL * scale,
                    msg=lambda m: f"{type(module).__name__} {tuple(p.shape)} {field}: {m}",
                )  # fmt: skip


@pytest.mark.parametrize("net", ["mlp", "cnn"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_tolerance_against_float32(net, dtype):
    model = mlp() if net == "mlp" else cnn()
    X, y = data(net)
    low, full = run(model, X, y, dtype), run(model, X, y)
    for p in model.parameters():
        for field in FIELDS:
            err = relative(low[p][field], full[p][field])
            assert err < AGAINST_FLOAT32[dtype], f"{tuple(p.shape)} {field}: relative error {err:.2e}"


def test_low_precision_parameters_get_results_in_their_dtype():
    """A model kept in bfloat16 (no autocast): computed in float32, returned in bfloat16."""
    model = mlp().to(torch.bfloat16)
    X, y = data("mlp")
    capture = Capture(model)
    with jacmem.extend(*extensions()):
        torch.nn.functional.mse_loss(model(X.to(torch.bfloat16)).float(), y).backward()
    capture.remove()
    for module in capture.x:
        for p, gb in per_sample(module, capture.x[module], capture.g[module]).items():
            for field in FIELDS:
                got, expected = getattr(p, field), REFERENCE[field](gb)
                assert got.dtype == torch.bfloat16
                # only the final rounding to bfloat16 (8 significant bits) separates them
                assert relative(got, expected) < 2**-7, f"{tuple(p.shape)} {field}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_curvature_matrix_products_are_computed_in_float32_wherever_called(dtype):
    """GGNMP's function, from an autocast backward, multiplies in float32 whether it is
    called inside the autocast region or outside (inside, it used to multiply in 16 bits:
    ~1e-3 apart); and it is the dense float64 GGN block's product to the forward's 16-bit
    rounding (``AGAINST_FLOAT32``)."""
    from tests.support.secondorder_ref import blocks, dense

    torch.manual_seed(0)
    model = mlp()
    X, y = data("mlp")
    ggn = blocks(model, dense(copy.deepcopy(model).double(), nn.MSELoss(), X.double(), y.double(), hess=False)[0])
    with jacmem.extend(jacmem.GGNMP()):
        with torch.autocast("cpu", dtype=dtype):
            out = model(X)
        nn.MSELoss()(out.float(), y).backward()
    for name, p in model.named_parameters():
        mat = torch.randn(3, *p.shape)
        outside = p.ggnmp(mat)
        with torch.autocast("cpu", dtype=dtype):
            inside = p.ggnmp(mat)
        assert outside.dtype == inside.dtype == torch.float32
        scale = outside.abs().max().item()
        torch.testing.assert_close(inside, outside, rtol=FLOAT32_RTOL, atol=FLOAT32_RTOL * scale, msg=name)
        exact = (mat.double().flatten(1) @ ggn[name]).reshape(mat.shape)
        assert relative(outside, exact) < AGAINST_FLOAT32[dtype], name


@pytest.mark.skipif(not autocast_supported(torch.bfloat16), reason="no CPU autocast to bfloat16 here")
def test_ggn_diagonal_of_a_transformer_layer_under_bfloat16_autocast():
    """The autograd path recomputes nn.MultiheadAttention's per-sample gradients from the
    kept inputs: under a bf16 autocast backward that recomputation ran partly in bf16 and
    failed ("expected scalar type BFloat16 but found Float"). Against the float64 GGN
    diagonal of the same model without autocast, within the bf16 rounding of the pass."""
    from tests.engine.test_secondorder_autograd import ggn_reference

    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
    model = nn.Sequential(nn.Linear(4, 8), layer, nn.Flatten(), nn.Linear(24, 3)).float()
    X, y = torch.randn(4, 3, 4, dtype=torch.float32), torch.tensor([1, 2, 0, 1])
    with jacmem.extend(jacmem.DiagGGNExact()):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(X)
        nn.functional.cross_entropy(out.float(), y).backward()
    exact = copy.deepcopy(model).double()
    diag, _ = ggn_reference(exact, lambda: exact(X.double()), lambda z: nn.functional.cross_entropy(z, y))
    for (name, p), want in zip(model.named_parameters(), diag.values()):
        assert relative(p.diag_ggn_exact, want) < 5e-2, name
