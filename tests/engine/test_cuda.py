"""CUDA: the first-order extensions on a GPU equal those on the CPU; float16 and
bfloat16 autocast compute in float32; 100 steps keep CUDA memory flat.

Skipped where there is no CUDA device (``-m cuda`` selects these alone). On CUDA,
autograd runs backward hooks on the device's own thread: these tests also cover that
a block extends the graphs its thread built whichever thread runs their backward.

References: the CPU results in float64 (themselves tested against the per-sample loop in
the other test files, and here against it once more), and, for autocast, float64
quantities computed from the pass's own 16-bit inputs and output gradients (see
``test_autocast.py``, whose helpers these tests reuse).
"""

from __future__ import annotations

import pytest
import torch
from tests.support.precision import FLOAT32_RTOL, Capture, per_sample
from tests.support.reference import REFERENCE, check_against, clear, mse, per_sample_grads, run_jacmem
from torch import nn

import jacmem
from jacmem.derivatives import REGISTRY

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]

FIELDS = ("grad_batch", "batch_l2", "sum_grad_squared", "variance")
#: the growth of torch.cuda.memory_allocated() allowed over 100 steps, after a warm-up
CUDA_BOUND = 2**20


def extensions():
    return [jacmem.BatchGrad(), jacmem.BatchL2Grad(), jacmem.SumGradSquared(), jacmem.Variance()]


def cnn():
    """[N, 3, 8, 8] -> [N, 4]: two Conv2d (padding; stride and groups) and a Linear."""
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, stride=2, groups=2), nn.Tanh(), nn.Flatten(),
        nn.Linear(36, 4),
    ).float()  # fmt: skip


def results(model):
    return {n: {f: getattr(p, f).detach().cpu() for f in FIELDS} for n, p in model.named_parameters()}


@pytest.mark.parametrize("strategy", sorted(REGISTRY[nn.Conv2d].names() | {"auto"}))
@pytest.mark.parametrize("flow", ["inside", "track"])
def test_cuda_equals_cpu(strategy, flow, device="cuda"):
    torch.manual_seed(0)
    model = cnn().double()
    X, y = torch.randn(6, 3, 8, 8, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    run_jacmem(model, X, y, mse, "mean", extensions(), flow, strategy=strategy)
    check_against(model, per_sample_grads(model, X, y, mse), FIELDS, "cpu")
    cpu = results(model)
    model.to(device)
    run_jacmem(model, X.to(device), y.to(device), mse, "mean", extensions(), flow, strategy=strategy)
    for name, p in model.named_parameters():
        for field in FIELDS:
            assert getattr(p, field).device == p.device
            torch.testing.assert_close(
                getattr(p, field).cpu(), cpu[name][field], rtol=1e-9, atol=1e-12, msg=lambda m: f"{name} {field}: {m}"
            )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_autocast_computes_in_float32(dtype, monkeypatch, device="cuda"):
    # TF32 would round jacmem's float32 contractions (and the reference's) to 10 bits
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    torch.manual_seed(0)
    model = cnn().to(device)
    X, y = torch.randn(16, 3, 8, 8, device=device).float(), torch.randn(16, 4, device=device).float()
    capture = Capture(model)
    with jacmem.extend(*extensions()):
        with torch.autocast(device, dtype=dtype):
            out = model(X)
        torch.nn.functional.mse_loss(out.float(), y).backward()
    capture.remove()
    assert any(g.dtype == dtype for g in capture.g.values()), "autocast did not run the layers in 16 bits"
    for module in capture.x:
        for p, gb in per_sample(module, capture.x[module].cpu(), capture.g[module].cpu()).items():
            for field in FIELDS:
                got, expected = getattr(p, field), REFERENCE[field](gb)
                assert got.dtype == p.dtype == torch.float32 and got.device == p.device
                scale = expected.abs().max().item()
                torch.testing.assert_close(
                    got.double().cpu(), expected, rtol=FLOAT32_RTOL, atol=FLOAT32_RTOL * scale,
                    msg=lambda m: f"{type(module).__name__} {field}: {m}",
                )  # fmt: skip


def test_memory_stays_flat_over_100_steps(device="cuda"):
    torch.manual_seed(0)
    model = cnn().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    X, y = torch.randn(16, 3, 8, 8, device=device).float(), torch.randn(16, 4, device=device).float()

    def steps(k):
        for _ in range(k):
            with jacmem.extend(*extensions()):
                opt.zero_grad()
                mse(model(X), y, "mean").backward()
            opt.step()

    steps(20)
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    steps(100)
    torch.cuda.synchronize()
    growth = torch.cuda.memory_allocated() - start
    assert growth <= CUDA_BOUND, f"CUDA memory grew by {growth} bytes over 100 steps"
    clear(model)
