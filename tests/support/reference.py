"""Independent references for the first-order quantities, and a runner for jacmem.

The reference is a per-sample autograd loop: sample ``n`` alone goes through the
model, its loss term is scaled as the batch loss's reduction scales it (``1/numel`` of
the unreduced loss for ``"mean"``), and ``torch.autograd.grad`` gives its gradient
for every trainable parameter. From those per-sample gradients ``[N, *p.shape]``
follow BackPACK 1.7.1's quantities:

- ``grad_batch``: the per-sample gradients themselves; they sum to ``.grad``;
- ``batch_l2``: ``‖g_n‖²``, ``[N]``;
- ``sum_grad_squared``: ``Σ_n g_n²``, ``p.shape``;
- ``variance``: ``sum_grad_squared / N - (grad / N)²``, ``p.shape``.

A parameter used several times in one forward (a module called twice, tied weights)
has one per-sample gradient per sample: the sum of its contributions. The norms and
squares are those of that sum, and so they are here.

Nothing here imports jacmem but :func:`run_jacmem`, which drives jacmem's two flows,
and the checks built on it; :func:`run_backpack` gives BackPACK's answers beside them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor, nn
from torch.nn import functional as F

import jacmem

#: (out, target, reduction) -> loss
LossFn = Callable[[Tensor, Tensor, str], Tensor]

SAVEFIELDS = ("grad_batch", "batch_l2", "sum_grad_squared", "variance")
FLOWS = ("inside", "track")


def mse(out: Tensor, target: Tensor, reduction: str) -> Tensor:
    """Mean squared error over every entry; any output shape."""
    return F.mse_loss(out, target, reduction=reduction)


def cross_entropy(out: Tensor, target: Tensor, reduction: str) -> Tensor:
    """Cross-entropy: out [N, C, *], target [N, *] class indices."""
    return F.cross_entropy(out, target, reduction=reduction)


def trainable(model: nn.Module) -> list[nn.Parameter]:
    """The model's trainable parameters, each once (tied weights appear once)."""
    return [p for p in model.parameters() if p.requires_grad]


def per_sample_grads(
    model: nn.Module, X: Tensor, y: Tensor, loss: LossFn, reduction: str = "mean"
) -> dict[nn.Parameter, Tensor]:
    """Per-sample gradients by a loop, one backward per sample:
    X [N, *], y [N, *] -> {param: [N, *param.shape]}, for every trainable parameter.

    The loss term of sample ``n`` is ``loss(model(X[n:n+1]), y[n:n+1], "sum")``, times
    ``1 / numel`` of the unreduced batch loss when ``reduction == "mean"``, so the
    per-sample gradients sum to the gradient of the batch loss.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', not {reduction!r}")
    params = trainable(model)
    with torch.no_grad():
        numel = loss(model(X), y, "none").numel()
    scale = 1.0 / numel if reduction == "mean" else 1.0
    rows = []
    for n in range(X.shape[0]):
        term = loss(model(X[n : n + 1]), y[n : n + 1], "sum") * scale
        grads = torch.autograd.grad(term, params, allow_unused=True)
        rows.append([torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)])
    return {p: torch.stack([row[i] for row in rows]) for i, p in enumerate(params)}


def batch_l2(grad_batch: Tensor) -> Tensor:
    """[N, *shape] -> [N]: squared norm of each per-sample gradient."""
    return grad_batch.reshape(grad_batch.shape[0], -1).square().sum(1)


def sum_grad_squared(grad_batch: Tensor) -> Tensor:
    """[N, *shape] -> shape: sum over samples of the squared per-sample gradients."""
    return grad_batch.square().sum(0)


def variance(grad_batch: Tensor) -> Tensor:
    """[N, *shape] -> shape: BackPACK's variance, ``sgs / N - (grad / N)²``."""
    n = grad_batch.shape[0]
    return sum_grad_squared(grad_batch) / n - (grad_batch.sum(0) / n) ** 2


REFERENCE: dict[str, Callable[[Tensor], Tensor]] = {
    "grad_batch": lambda grad_batch: grad_batch,
    "batch_l2": batch_l2,
    "sum_grad_squared": sum_grad_squared,
    "variance": variance,
}

#: savefield -> the first-order extension that writes it
FIRST_ORDER = {
    "grad_batch": jacmem.BatchGrad,
    "batch_l2": jacmem.BatchL2Grad,
    "sum_grad_squared": jacmem.SumGradSquared,
    "variance": jacmem.Variance,
}

#: ``(savefields, flow, extend kwargs)`` of a layer's test runs: each extension alone,
#: then all four in both flows, then chunked to one sample at a time
FIRST_ORDER_RUNS = (
    [((f,), "inside", {}) for f in FIRST_ORDER]
    + [(tuple(FIRST_ORDER), flow, {}) for flow in FLOWS]
    + [(tuple(FIRST_ORDER), "inside", dict(chunk_bytes=1))]
)


def run_backpack(model: nn.Module, X: Tensor, y: Tensor) -> nn.Module:
    """A copy of ``model`` (extended, in an ``nn.Sequential``) after a backward of the mean
    MSE loss under BackPACK 1.7.1's BatchGrad, BatchL2Grad, SumGradSquared and Variance:
    its parameters hold BackPACK's four answers, in the order of ``model.parameters()``."""
    from backpack import backpack, extend, extensions

    bp_model = extend(nn.Sequential(copy.deepcopy(model)))
    with backpack(extensions.BatchGrad(), extensions.BatchL2Grad(), extensions.SumGradSquared(), extensions.Variance()):
        mse(bp_model(X), y, "mean").backward()
    return bp_model


def assert_close(actual: Tensor, expected: Tensor, what: str = "", terms: Tensor | None = None) -> None:
    """float64 comparison, with an absolute floor scaled by the expected magnitude, or by
    that of ``terms``, where ``expected`` is a difference of them (a variance: of nearly
    equal terms, exactly 0 for one sample, where round-off is all that is left)."""
    scale = (expected if terms is None else terms).abs().max().item() if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=1e-9, atol=1e-11 * max(scale, 1.0), msg=lambda m: f"{what}: {m}")


def clear(model: nn.Module) -> None:
    """Remove ``.grad`` and every first-order attribute from the model's parameters."""
    for p in model.parameters():
        p.grad = None
        for field in SAVEFIELDS:
            if hasattr(p, field):
                delattr(p, field)


def run_jacmem(
    model: nn.Module,
    X: Tensor,
    y: Tensor,
    loss: LossFn,
    reduction: str,
    extensions: Sequence,
    flow: str = "inside",
    **extend_kwargs,
):
    """One forward and backward with jacmem's extensions; returns the block (for explain()).

    flow ``"inside"``: the forward runs inside ``with jacmem.extend(...)``.
    flow ``"track"``: ``jacmem.track(model)``, the forward, then only the backward inside
    the block, then ``jacmem.untrack(model)``.
    """

    clear(model)
    if flow == "inside":
        with jacmem.extend(*extensions, **extend_kwargs) as ctx:
            loss(model(X), y, reduction).backward()
        return ctx
    if flow == "track":
        jacmem.track(model)
        try:
            value = loss(model(X), y, reduction)
            with jacmem.extend(*extensions, **extend_kwargs) as ctx:
                value.backward()
        finally:
            jacmem.untrack(model)
        return ctx
    raise ValueError(f"flow must be one of {FLOWS}, not {flow!r}")


def chosen(ctx, param: str) -> str:
    """What the block ``ctx``'s explain() says gives ``param``'s batch_l2 (``param`` named
    as in ``model.named_parameters()``), e.g. ``"tied ghost"``."""
    line = next(line for line in ctx.explain().splitlines() if line.startswith(f"{param} "))
    return line.split("batch_l2 <- ")[1].split(" (")[0]


def check_against(
    model: nn.Module,
    reference: dict[nn.Parameter, Tensor],
    savefields: Iterable[str],
    what: str = "",
    check_grad: bool = True,
) -> None:
    """Every trainable parameter of ``model`` carries exactly ``savefields``, each equal to
    what the per-sample gradients ``reference`` give; ``.grad`` is their sum."""
    savefields = list(savefields)
    names = {p: n for n, p in model.named_parameters()}
    for p, gb in reference.items():
        where = f"{what} {names.get(p, '?')}"
        if check_grad:
            assert p.grad is not None, f"{where}: no .grad"
            assert_close(p.grad, gb.sum(0), f"{where} .grad vs sum of reference per-sample grads")
        for field in SAVEFIELDS:
            if field not in savefields:
                assert not hasattr(p, field), f"{where}: has {field}, which no extension asked for"
                continue
            assert hasattr(p, field), f"{where}: no {field}"
            terms = REFERENCE["sum_grad_squared"](gb) / len(gb) if field == "variance" else None
            assert_close(getattr(p, field), REFERENCE[field](gb), f"{where} {field}", terms)
        if "grad_batch" in savefields:
            assert_close(p.grad_batch.sum(0), p.grad, f"{where} grad_batch.sum(0) vs .grad")


@contextmanager
def recorded():
    """Every :class:`jacmem.engine.hooks.Record` created inside, as weak references:
    ``with recorded() as records: ...``; ``records`` is a list of ``weakref.ref``."""
    import weakref

    from jacmem.engine import hooks

    records: list = []
    original = hooks.Record

    class Spy(original):
        __slots__ = ()

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            records.append(weakref.ref(self))

    hooks.Record = Spy
    try:
        yield records
    finally:
        hooks.Record = original


def run_grid(model, X, y, loss, reduction, reference, extension_sets, strategy: str, what: str) -> None:
    """Each set of extensions in both flows, then in one-sample chunks, checked against
    ``reference`` (per-sample gradients per parameter); the strategy asked for is the
    one chosen wherever it applies."""
    runs = [(exts, flow, {}) for exts in extension_sets for flow in FLOWS]
    runs += [(exts, "inside", {"chunk_bytes": 1}) for exts in extension_sets]
    for exts, flow, kwargs in runs:
        ctx = run_jacmem(model, X, y, loss, reduction, [e() for e in exts], flow, strategy=strategy, **kwargs)
        check_against(model, reference, [e.savefield for e in exts], f"[{what} {strategy} {exts} {flow} {kwargs}]")
        for d in ctx.plan.decisions.values():
            assert strategy == "auto" or d.estimates.get(strategy) is None or d.chosen == strategy, str(d)


def check_dropout_raises_then_eval_works(model: nn.Module, X: Tensor, y: Tensor, match: str) -> None:
    """A model with dropout inside a layer jacmem recomputes: in training mode the backward
    raises an error matching ``match``; in eval mode BatchGrad equals the loop's."""
    import pytest

    with pytest.raises(RuntimeError, match=match):
        run_jacmem(model, X, y, mse, "mean", [jacmem.BatchGrad()])
    model.eval()
    reference = per_sample_grads(model, X, y, mse, "mean")
    run_jacmem(model, X, y, mse, "mean", [jacmem.BatchGrad()])
    check_against(model, reference, ["grad_batch"], "[eval dropout]")
