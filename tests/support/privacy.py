"""The private-training tests' model, data and per-sample reference step (tests/privacy/):
one SGD step on the clipped per-sample gradients, computed by a loop, to compare a
PrivacyEngine's step against."""

from __future__ import annotations

import torch
from tests.support.clipping import per_sample
from tests.support.reference import LossFn, cross_entropy, per_sample_grads
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

N, LR = 6, 0.5


def net() -> nn.Module:
    """[N, 2, 5, 5] -> [N, 3]: Conv2d, GroupNorm, Linear."""
    return nn.Sequential(
        nn.Conv2d(2, 4, 3), nn.GroupNorm(2, 4), nn.Tanh(), nn.Flatten(), nn.Linear(36, 3)
    )  # fmt: skip


def batch(n: int = N, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 2, 5, 5, generator=g), torch.randint(0, 3, (n,), generator=g)


def loader(X, y, batch_size=N) -> DataLoader:
    return DataLoader(TensorDataset(X, y), batch_size=batch_size)


def clip_factors(grads: dict, max_norm, clipping: str) -> dict:
    """{param: [N]} clip factors of the per-sample gradients ``grads``: {param: [N, *]}."""
    sq = {p: g.reshape(g.shape[0], -1).square().sum(1) for p, g in grads.items()}
    total = torch.stack(list(sq.values())).sum(0).sqrt()
    if clipping == "flat":
        return dict.fromkeys(grads, (max_norm / (total + 1e-6)).clamp(max=1.0))
    if clipping == "automatic":
        return dict.fromkeys(grads, max_norm / (total + 0.01))
    return {p: (c / (sq[p].sqrt() + 1e-6)).clamp(max=1.0) for p, c in zip(grads, max_norm)}


def loop_step(
    model, batches, max_norm, clipping: str, loss: LossFn = cross_entropy, reduction: str = "sum"
) -> list[torch.Tensor]:
    """The parameters after one SGD step on the clipped sum over ``batches`` (a list
    of (X, y)), divided by the number of samples: the per-sample loop. Sample ``n``'s
    gradient is that of its own loss term, computed at the scale ``reduction`` gives it
    (:func:`tests.support.clipping.per_sample`): the same in exact arithmetic, but a
    model that computes in float32 inside (HF LLaMA's RMSNorm) rounds by the scale."""
    total = {p: torch.zeros_like(p) for p in model.parameters()}
    for X, y in batches:
        grads = per_sample(model, X, y, loss, reduction)
        factors = clip_factors(grads, max_norm, clipping)
        for p, g in grads.items():
            total[p] += torch.einsum("n,n...->...", factors[p], g)
    count = sum(len(X) for X, _ in batches)
    return [(p - LR / count * total[p]).detach() for p in model.parameters()]


def train(model, optimizer, batches, loss: LossFn = cross_entropy) -> None:
    """One step over ``batches``: a backward pass of the mean loss each, then the step."""
    optimizer.zero_grad()
    for X, y in batches:
        loss(model(X), y, "mean").backward()
    optimizer.step()


def private(engine, model, max_norm, clipping="flat", **kwargs):
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    kwargs.setdefault("data_loader", loader(*batch()))
    return engine.make_private(
        module=model, optimizer=opt, noise_multiplier=0.0, max_grad_norm=max_norm,
        poisson_sampling=False, clipping=clipping, **kwargs,
    )  # fmt: skip


#: a flat threshold that clips some of the samples of ``batch()`` on ``net()``, not all
#: (the median norm is about 4; tests/privacy/test_privacy.py checks it)
FLAT = 4.0


def medians(model, X, y) -> list[float]:
    """Per-layer thresholds that clip about half the samples: each parameter's median
    per-sample norm (the loop's)."""
    grads = per_sample_grads(model, X, y, cross_entropy, "sum")
    return [g.reshape(g.shape[0], -1).norm(dim=1).median().item() for g in grads.values()]
