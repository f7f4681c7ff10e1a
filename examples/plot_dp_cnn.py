"""Private training of a CNN with jacmem's PrivacyEngine
=====================================================

Differentially private training of the seed CNN (Conv2d 1→128→256→64→32 with ReLUs and MaxPools, then
Linear(32, 10); the model of ``plot_save_memory.py``) with synthetic MNIST-shaped data:
ten random class templates, each image its class's template plus noise. The training
loop is Opacus's, with one import changed: ``jacmem.privacy.PrivacyEngine`` clips every
sample's gradient inside the one backward pass, and Opacus's Poisson-sampling loader,
noise and accountant do the rest; Adam steps on the noised mean of the clipped
gradients. The script prints and plots ε (at δ = 1e-5) and the training loss against
the steps, to ``out/plot_dp_cnn.png``. The CNN leaves its initial plateau slowly (even
without privacy, plain Adam needs about 35 steps of 128 here), so expect the loss to
start falling late in the run.

Run: ``python examples/plot_dp_cnn.py``; ``JACMEM_QUICK=1`` for a small, fast run. The
docs build runs it so: eight steps, too few for the training loss to mean anything
(see above), so its figure shows ε alone, which the accountant gives exactly whatever
the run's length; the loss is plotted at full size.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

ROOT = Path(globals().get("__file__", "plot_dp_cnn.py")).resolve().parents[1]  # the gallery runs it in examples/
sys.path.insert(0, str(ROOT))

from benchmarks.models import seed_cnn  # noqa: E402
from jacmem.privacy import PrivacyEngine  # noqa: E402

QUICK = os.environ.get("JACMEM_QUICK") == "1"
SAMPLES, BATCH, EPOCHS = (32, 8, 2) if QUICK else (2048, 128, 5)
SIGMA, C, DELTA, LR = 1.0, 1.0, 1e-5, 2e-3
#: ε is computed at about this many steps (the accountant takes a while each time)
POINTS = 4 if QUICK else 12


def synthetic_mnist(n: int, seed: int = 0) -> TensorDataset:
    """``n`` images [1, 28, 28] of 10 classes: a random template per class plus noise."""
    g = torch.Generator().manual_seed(seed)
    templates = torch.randn(10, 1, 28, 28, generator=g)
    labels = torch.randint(0, 10, (n,), generator=g)
    return TensorDataset(templates[labels] + torch.randn(n, 1, 28, 28, generator=g), labels)


def train() -> tuple[list[float], dict[int, float]]:
    """DP-Adam; the training loss after each step, and ε after some."""
    torch.manual_seed(0)
    model = seed_cnn()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)  # DP-Adam: Adam sees the noised gradient
    loader = DataLoader(synthetic_mnist(SAMPLES), batch_size=BATCH)
    engine = PrivacyEngine()
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=SIGMA, max_grad_norm=C
    )
    losses, epsilons = [], {}
    every = max(1, EPOCHS * len(loader) // POINTS)
    try:
        for epoch in range(EPOCHS):
            for x, y in loader:  # Poisson sampling: each batch's size varies, and may be 0
                optimizer.zero_grad()
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
                optimizer.step()
                losses.append(loss.item() if len(x) else float("nan"))  # an empty batch has no loss
                if len(losses) % every == 0:
                    epsilons[len(losses)] = engine.get_epsilon(DELTA)
            epsilons[len(losses)] = engine.get_epsilon(DELTA)
            print(f"epoch {epoch + 1}: loss {losses[-1]:.3f}, ε = {epsilons[len(losses)]:.2f} at δ = {DELTA:g}")
    finally:
        engine.detach()
    return losses, epsilons


def plot(losses: list[float], epsilons: dict[int, float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if QUICK:  # too few steps for the loss to show anything: ε alone
        fig, ax_eps = plt.subplots(figsize=(5, 3.5))
    else:
        fig, (ax_loss, ax_eps) = plt.subplots(1, 2, figsize=(10, 3.5))
        ax_loss.plot(range(1, len(losses) + 1), losses)
        ax_loss.set(xlabel="step", ylabel="training loss", title="seed CNN, DP-Adam")
    ax_eps.plot(list(epsilons), list(epsilons.values()), "o-", color="tab:red")
    ax_eps.set(xlabel="step", ylabel=f"ε at δ = {DELTA:g}", title=f"privacy spent (σ = {SIGMA:g}, PRV accountant)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    warnings.filterwarnings("ignore", message="Secure RNG turned off")
    losses, epsilons = train()
    plot(losses, epsilons, ROOT / "out" / "plot_dp_cnn.png")
    print(f"wrote {ROOT / 'out' / 'plot_dp_cnn.png'}")
