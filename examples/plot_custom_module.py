"""A module of your own: jacmem.layer and jacmem.register
======================================================

Teaching jacmem a module of your own: ``jacmem.layer`` and ``@jacmem.register``.

``ScaleShift`` below is a trainable per-feature affine map, ``y = x * weight + bias``
on the last axis, that jacmem does not know. Without registration, jacmem would
recompute it one sample at a time (its generic ``vmap`` fallback). Two steps give it a
closed form instead:

1. ``jacmem.layer(ScaleShift, ...)`` declares how to read the module: here only that
   the bias's derivative never reads the input, so no input is kept when the weight
   is frozen. (``hyperparams=`` would pass module attributes to the derivatives as
   keyword arguments, ``keep=`` choose what of the forward inputs to keep.)
2. ``@jacmem.register(ScaleShift, param, "batch_grad", name, cost=...)`` gives, per
   parameter, the per-sample gradients as a function of the kept input ``x`` and the
   output gradient ``g``, both batch axis first. ``cost`` estimates FLOPs and temporary
   memory from the shapes, for ``auto`` and for chunking over the batch.

``BatchL2Grad``, ``SumGradSquared`` and ``Variance`` are derived from ``batch_grad``;
register ``"batch_l2"``, ``"sum_grad_squared"`` or ``"grad"`` strategies as well where
you can compute them more cheaply. The script then checks every parameter's
``grad_batch`` and ``batch_l2`` in float64 against a per-sample autograd loop, and plots
one against the other.

Run: ``python examples/plot_custom_module.py``
"""

from __future__ import annotations

from math import prod

import torch
from einops import reduce
from torch import Tensor, nn

import jacmem


class ScaleShift(nn.Module):
    """``y = x * weight + bias``: ``[N, *, F] -> [N, *, F]``, with ``weight, bias [F]``."""

    def __init__(self, features: int):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(features))
        self.bias = nn.Parameter(0.1 * torch.randn(features))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.weight + self.bias


jacmem.layer(ScaleShift, input_free=("bias",))


def _elementwise_cost(xs, gs) -> jacmem.Cost:
    """Shapes of x and g -> a multiply and a sum per element, no workspace."""
    return jacmem.Cost(flops=2 * prod(xs), workspace=0)


@jacmem.register(ScaleShift, "weight", "batch_grad", "elementwise", cost=_elementwise_cost)
def scale_shift_weight_batch_grad(x: Tensor, g: Tensor) -> Tensor:
    """Σ over the middle axes of g ⊙ x: [N, *, F], [N, *, F] -> [N, F]"""
    return reduce(g * x, "n ... f -> n f", "sum")


@jacmem.register(ScaleShift, "bias", "batch_grad", "elementwise", cost=_elementwise_cost)
def scale_shift_bias_batch_grad(x, g: Tensor) -> Tensor:
    """Σ over the middle axes of g; ignores x (None when only the bias is trainable):
    [N, *, F] -> [N, F]"""
    return reduce(g, "n ... f -> n f", "sum")


def per_sample_reference(model: nn.Module, lossfunc: nn.Module, X: Tensor, Y: Tensor) -> dict:
    """Per-sample gradients by one autograd call per sample: name -> [N, *param.shape].

    With ``reduction="mean"``, sample n's share of the loss is its own loss over N."""
    rows = []
    for x, y in zip(X, Y):
        loss = lossfunc(model(x[None]), y[None]) / len(X)
        rows.append(torch.autograd.grad(loss, list(model.parameters())))
    return {name: torch.stack(gs) for (name, _), gs in zip(model.named_parameters(), zip(*rows))}


def main() -> None:
    torch.manual_seed(0)
    N, T, D = 5, 4, 6
    model = nn.Sequential(nn.Linear(D, 8), ScaleShift(8), nn.Tanh(), nn.Linear(8, 3)).double()
    lossfunc = nn.MSELoss()
    X, Y = torch.randn(N, T, D, dtype=torch.float64), torch.randn(N, T, 3, dtype=torch.float64)

    # strict=True: an error, not a warning, if any trainable module were not handled, or were
    # recomputed one sample at a time by the vmap fallback (as ScaleShift would be unregistered).
    # The name "elementwise" is valid because it was registered above.
    with jacmem.extend(
        jacmem.BatchGrad(), jacmem.BatchL2Grad(), strategy={ScaleShift: "elementwise"}, strict=True
    ) as ctx:
        lossfunc(model(X), Y).backward()
    print(ctx.explain())

    reference = per_sample_reference(model, lossfunc, X, Y)
    for name, p in model.named_parameters():
        expected = reference[name]
        torch.testing.assert_close(p.grad_batch, expected, msg=lambda m: f"{name} grad_batch: {m}")
        torch.testing.assert_close(p.batch_l2, expected.flatten(1).square().sum(1), msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(p.grad_batch.sum(0), p.grad, msg=lambda m: f"{name} .grad: {m}")
        print(f"{name:<9} grad_batch {tuple(p.grad_batch.shape)} and batch_l2 match the per-sample loop")
    plot(model, reference)


def plot(model: nn.Module, reference: dict):
    """Each sample's squared gradient norm, jacmem's ``batch_l2`` against the loop's."""
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 4.5))
    for name, p in model.named_parameters():
        loop = reference[name].flatten(1).square().sum(1)
        ax.loglog(loop.detach(), p.batch_l2.detach(), "o", label=name, alpha=0.7)
    ax.axline((1e-3, 1e-3), (1.0, 1.0), color="k", lw=0.5)  # y = x
    ax.set(xlabel="per-sample loop: squared norm", ylabel="jacmem: batch_l2", title="per-sample squared gradient norms")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    main()
