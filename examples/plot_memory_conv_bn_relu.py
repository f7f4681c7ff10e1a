"""Lean layers on a conv-bn-relu stack
===================================

A conv-bn-relu stack: each op saves its own tensor. What :func:`jacmem.memory.report`
sees, and the two fixes it suggests.

1. Training (BatchNorm in train mode, every parameter trainable). Each block keeps
   the BN's input and the ReLU's output (which the next conv keeps too): two tensors
   of the activations' size per block. The report suggests fusing BN and the
   activation into ``jacmem.memory.BatchNormAct`` (InPlace-ABN), which keeps only its
   output: one tensor per block. The activation becomes LeakyReLU(0.01), a change of
   model (ReLU cannot be inverted); the state_dict stays the same.
2. Fine-tuning the head of a pretrained stack (BatchNorm in eval mode, everything but
   the classifier frozen, and gradients wanted for the input too, as for saliency
   maps or adversarial examples). PyTorch's conv and eval-mode BN keep their inputs
   for weight gradients that are not computed; the report marks them wasted and
   suggests ``jacmem.memory.lean(model)``, which keeps none of them and packs
   ReLU's mask to 1 bit per element. Outputs and gradients do not change.

The figures count the bytes autograd keeps, exactly, at any size. The peak resident
memory is measured only at full size: with ``--quick`` (or ``JACMEM_QUICK=1``, as the
docs build runs it) the tensors are too small to show in the resident set, and the
peak lines read n/a.

``python examples/plot_memory_conv_bn_relu.py [--quick]``
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from jacmem.memory import BatchNormAct, lean, peak_memory, report
from jacmem.memory.report import fmt_bytes

# sphinx-gallery runs an example without __file__, in the example's folder
sys.path.insert(0, str(Path(globals().get("__file__", "plot_memory_conv_bn_relu.py")).resolve().parent))
from _plotting import saved_by_module, small_run  # noqa: E402


def stack(depth: int, width: int, classes: int = 10) -> nn.Sequential:
    """[N, 3, H, W] -> [N, classes]: depth x (conv 3x3, BatchNorm, ReLU), pooling, linear."""
    layers, c_in = [], 3
    for _ in range(depth):
        layers += [nn.Conv2d(c_in, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()]
        c_in = width
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, classes))


def fuse(model: nn.Sequential, negative_slope: float = 0.01) -> nn.Sequential:
    """Each BatchNorm followed by ReLU -> BatchNormAct (LeakyReLU) and Identity, in place."""
    for i in range(len(model) - 1):
        if isinstance(model[i], nn.BatchNorm2d) and isinstance(model[i + 1], nn.ReLU):
            model[i] = BatchNormAct.from_batchnorm(model[i], negative_slope)
            model[i + 1] = nn.Identity()
    return model


def measure(model, x, y, quick):
    """Peak memory of forward + backward, after a warm-up; None with --quick (its tensors
    are too small to show in the resident set, and measuring tunes malloc process-wide)."""

    def step():
        model.zero_grad(set_to_none=True)
        if x.grad is not None:
            x.grad = None
        F.cross_entropy(model(x), y).backward()

    step()
    return None if quick else peak_memory(step)


def compare(title, before_model, after_model, x, y, quick):
    before = report(before_model, x)
    print(before)
    after = report(after_model, x)
    print(f"\nAfter the fix:\n{after}")
    print(f"\nMeasured ({title}):")
    print(
        f"  saved for backward (report): before {fmt_bytes(before.saved_bytes)}, after {fmt_bytes(after.saved_bytes)}"
        f" ({before.saved_bytes / max(after.saved_bytes, 1):.1f}x less)"
    )
    print(
        f"  forward + backward, peak RSS: before {fmt_bytes(measure(before_model, x, y, quick))}, "
        f"after {fmt_bytes(measure(after_model, x, y, quick))}\n"
    )
    return before, after


def main(argv=None):
    small = small_run(argv, __doc__)
    torch.manual_seed(0)
    depth, width, n, size = (3, 8, 4, 16) if small else (8, 64, 32, 64)
    x, y = torch.randn(n, 3, size, size), torch.randint(0, 10, (n,))
    model = stack(depth, width)

    print(f"=== 1. Training a {depth}-block conv-bn-relu stack, batch {n}x3x{size}x{size} ===\n")
    fused = fuse(copy.deepcopy(model))
    assert fused.state_dict().keys() == model.state_dict().keys()
    training = compare("training", model, fused, x, y, small)

    print("=== 2. Fine-tuning the head, frozen BatchNorm statistics, input gradients ===\n")
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    for p in model[-1].parameters():
        p.requires_grad_(True)
    x.requires_grad_(True)
    leaned = lean(copy.deepcopy(model))
    tuning = compare("fine-tuning", model, leaned, x, y, small)
    gx = torch.autograd.grad(F.cross_entropy(model(x), y), x)[0]
    gx_lean = torch.autograd.grad(F.cross_entropy(leaned(x), y), x)[0]
    diff = (gx - gx_lean).abs().max().item()
    print(f"  largest difference of the input gradients, stock vs lean: {diff:.2e}")
    saved_by_module({"training": training[0], "BatchNormAct": training[1]}, "1. training: saved tensors")
    saved_by_module({"fine-tuning": tuning[0], "lean": tuning[1]}, "2. fine-tuning the head: saved tensors")
    return {"training": training, "tuning": tuning, "grad_diff": diff, "shape": (depth, width, n, size)}


if __name__ == "__main__":
    main()
