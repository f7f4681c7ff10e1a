"""The memory report on an NNGP kernel
===================================

NNGP-style covariance propagation with trainable variances: why it eats memory
under autograd, and the fix :func:`jacmem.memory.report` suggests.

A user on the PyTorch forum computes the covariance (kernel) matrix of a
convolutional neural-network Gaussian process: each Conv layer maps the covariances
of all pairs of images, ``xy [N, N, H, W]``, and the variances ``xx, yy [N, 1, H, W]``,
through a convolution with a constant kernel scaled by a trainable ``var_weight``
(plus ``var_bias``); each ReLU layer applies the arc-cosine formula
``(sqrt(xx·yy - xy²) + (π - θ)·xy) / 2π`` elementwise. Training the variances needs
2 GB for 100 images, and grows with N², while ``no_grad`` is tiny.

The report shows why: every elementwise op of the ReLU layers saves a tensor of the
size of ``xy``; the conv layers save their input, which the variance's gradient
needs. The fix it suggests, checkpointing the ReLU layers, keeps only each ReLU
layer's input and recomputes the rest during backward.

The figures count the bytes autograd keeps, exactly, at any size. The peak resident
memory is measured only at full size: with ``--quick`` (or ``JACMEM_QUICK=1``, as the
docs build runs it) the tensors are too small to show in the resident set, and the
peak lines read n/a.

``python examples/plot_memory_nngp_kernel.py [--quick]``
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from jacmem.memory import peak_memory, report
from jacmem.memory.report import fmt_bytes

# sphinx-gallery runs an example without __file__, in the example's folder
sys.path.insert(0, str(Path(globals().get("__file__", "plot_memory_nngp_kernel.py")).resolve().parent))
from _plotting import saved_by_module, small_run  # noqa: E402


class Conv(nn.Module):
    """Covariances through a conv layer with kernel ``var_weight / k² · ones``:
    xy [N, N, H, W], xx [N, 1, H, W], yy [1, N, H, W] -> the same shapes (H, W may shrink)."""

    def __init__(self, kernel_size: int, padding: int, var_weight: float = 1.0, var_bias: float = 0.1):
        super().__init__()
        self.kernel_size, self.padding = kernel_size, padding
        self.var_weight = nn.Parameter(torch.tensor(var_weight))
        self.var_bias = nn.Parameter(torch.tensor(var_bias))

    def _f(self, cov: torch.Tensor) -> torch.Tensor:
        a, b, h, w = cov.shape
        kernel = torch.ones(1, 1, self.kernel_size, self.kernel_size) * (self.var_weight / self.kernel_size**2)
        out = F.conv2d(cov.reshape(a * b, 1, h, w), kernel, padding=self.padding) + self.var_bias
        return out.reshape(a, b, *out.shape[-2:])

    def forward(self, xy, xx, yy):
        return self._f(xy), self._f(xx), self._f(yy)


class ReLU(nn.Module):
    """The arc-cosine kernel of ReLU, elementwise (numerically clamped, as in the post)."""

    eps = 1e-6

    def forward(self, xy, xx, yy):
        xx_yy = xx * yy + torch.finfo(torch.float32).tiny
        inverse_sqrt = 1 / (torch.sqrt(xx_yy) + self.eps)
        cos_theta = (xy * inverse_sqrt).clamp(-1 + self.eps, 1 - self.eps)
        sin_theta = torch.sqrt((xx_yy - xy**2).clamp(min=self.eps))
        theta = torch.acos(cos_theta)
        xy = (sin_theta + (math.pi - theta) * xy) / (2 * math.pi)
        return xy, xx / 2, yy / 2


class Checkpointed(nn.Module):
    """Runs ``layer`` under torch.utils.checkpoint: keeps its inputs, recomputes the rest."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, *covs):
        return checkpoint(self.layer, *covs, use_reentrant=False)


class NNGP(nn.Module):
    """Images [N, 1, H, W] -> kernel matrix [N, N]."""

    def __init__(self, depth: int, size: int):
        super().__init__()
        layers = []
        for _ in range(depth):
            layers += [Conv(7, 3, var_weight=2.0), ReLU()]
        self.layers = nn.Sequential(*layers)
        self.readout = Conv(size, 0)  # a "dense" layer: the kernel covers the whole image

    def forward(self, x):
        xy = torch.einsum("ichw,jchw->ijhw", x, x) / x.shape[1]
        xx = (x * x).mean(1, keepdim=True)
        covs = (xy, xx, xx.transpose(0, 1))
        for layer in self.layers:
            covs = layer(*covs)
        return self.readout(*covs)[0][:, :, 0, 0]


def gp_loss(kernel: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """GP negative log marginal likelihood of targets y [N] (up to a constant)."""
    k = kernel + 1e-2 * torch.eye(len(y))
    chol = torch.linalg.cholesky(k)
    alpha = torch.cholesky_solve(y[:, None], chol)
    return 0.5 * (y[:, None] * alpha).sum() + torch.log(torch.diagonal(chol)).sum()


def main(argv=None):
    small = small_run(argv, __doc__)
    torch.manual_seed(0)
    n, size, depth = (8, 12, 2) if small else (48, 28, 4)
    x, y = torch.randn(n, 1, size, size), torch.randn(n)
    model = NNGP(depth, size)

    def train_step():
        model.zero_grad(set_to_none=True)
        gp_loss(model(x), y).backward()

    print(f"NNGP kernel of {n} images of {size}x{size}, {depth} conv+ReLU layers, trainable variances\n")

    def peak(fn):
        """Peak RSS of fn(); None with --quick (tensors too small to show in the resident
        set, and measuring tunes malloc for the whole process)."""
        return None if small else peak_memory(fn)

    with torch.no_grad():
        model(x)  # warm-up
        no_grad_peak = peak(lambda: model(x))
    before = report(model, x)
    print(before)
    train_step()  # warm-up
    peak_before = peak(train_step)
    grads_before = [p.grad.clone() for p in model.parameters()]

    print("\nApplying the suggestion: torch.utils.checkpoint around each ReLU layer.\n")
    for i, layer in enumerate(model.layers):
        if isinstance(layer, ReLU):
            model.layers[i] = Checkpointed(layer)
    after = report(model, x)
    print(after)
    train_step()
    peak_after = peak(train_step)
    diff = max((p.grad - g).abs().max().item() for p, g in zip(model.parameters(), grads_before))

    print("\nMeasured:")
    print(f"  forward under no_grad, peak RSS:           {fmt_bytes(no_grad_peak)}")
    print(
        f"  saved for backward (report): before {fmt_bytes(before.saved_bytes)}, after {fmt_bytes(after.saved_bytes)}"
        f"  ({before.saved_bytes / max(after.saved_bytes, 1):.1f}x less)"
    )
    print(f"  forward + backward, peak RSS: before {fmt_bytes(peak_before)}, after {fmt_bytes(peak_after)}")
    print(f"  largest difference of the variances' gradients: {diff:.2e}")
    saved_by_module({"stock": before, "checkpointed ReLU layers": after}, f"NNGP kernel of {n} images: saved tensors")
    return {"before": before, "after": after, "grad_diff": diff, "shape": (n, size, depth)}


if __name__ == "__main__":
    main()
