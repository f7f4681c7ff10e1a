"""Laplace approximations of a ResNet with jacmem
==================================================

laplace-torch turns a trained network into a Bayesian one: a Gaussian around the
trained weights whose precision is the curvature of the loss (the GGN) plus a prior.
Its BackPACK backend refuses networks with BatchNorm or residual units; with
``backend=jacmem.laplace.JacmemGGN`` the curvature comes from jacmem's extensions
(``DiagGGNExact`` for a diagonal Laplace, ``KFLR`` for a Kronecker-factored one).

This script trains a small ResNet (BatchNorm, ReLU, two residual units written with
``jacmem.nn.Residual``) on synthetic 3-class images, each class a coloured square at its
own place. It then fits a diagonal and a Kronecker Laplace, tunes their prior precision
by the marginal likelihood, and compares the predictive confidence (the largest class
probability) of the trained network (MAP) and of both Laplace approximations as noise
shifts the inputs away from the training data. A Bayesian model should stay confident
where it is right and grow unsure as the inputs leave the training distribution.

A stock ``torchvision.models.resnet18`` fits with the same calls: jacmem follows its
in-place ReLU, ``torch.flatten`` and ``+=`` (``tests/integration/test_laplace.py`` checks its
diagonal against laplace's curvlinops backend).

Run: ``python examples/plot_laplace_resnet.py``; ``JACMEM_QUICK=1`` (as the docs build
runs it) for 8×8 images, 128 training images and three noise levels.
It prints a table and saves ``out/plot_laplace_resnet.png``.
"""

from __future__ import annotations

import argparse
import os
import warnings
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from laplace import Laplace  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import jacmem  # noqa: E402
from jacmem.laplace import JacmemGGN  # noqa: E402

QUICK = os.environ.get("JACMEM_QUICK") == "1"
CLASSES = 3
#: image side, training set size, training epochs, test set size
#: (quick: enough training steps for the MAP network to learn the classes, so that the
#: figure compares a trained network with its Laplace approximations)
SIDE, N_TRAIN, EPOCHS, N_TEST = (8, 128, 6, 64) if QUICK else (16, 320, 8, 150)
#: standard deviations of the noise added to the test images
SHIFTS = (0.0, 1.0, 3.0) if QUICK else (0.0, 0.5, 1.0, 2.0, 3.0, 5.0)


def images(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Class ``k``: a square of colour channel ``k`` in its own quadrant, with pixel noise:
    ``[n, 3, SIDE, SIDE]``, labels ``[n]``."""
    y = torch.randint(0, CLASSES, (n,), generator=generator)
    X = 0.3 * torch.randn(n, 3, SIDE, SIDE, generator=generator)
    h = SIDE // 2
    for k in range(CLASSES):
        rows, cols = divmod(k, 2)
        X[y == k, k, rows * h : rows * h + h, cols * h : cols * h + h] += 1.0
    return X, y


def block(channels: int) -> nn.Module:
    """``x + conv-BN-ReLU-conv-BN(x)``"""
    return jacmem.nn.Residual(
        nn.Conv2d(channels, channels, 3, padding=1, bias=False),
        nn.BatchNorm2d(channels),
        nn.ReLU(),
        nn.Conv2d(channels, channels, 3, padding=1, bias=False),
        nn.BatchNorm2d(channels),
    )


def resnet(width: int = 8) -> nn.Module:
    """[N, 3, SIDE, SIDE] -> [N, CLASSES]"""
    return nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(),
        block(width),
        nn.ReLU(),
        block(width),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(width, CLASSES),
    )


def train(model: nn.Module, loader: DataLoader) -> nn.Module:
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(EPOCHS):
        for X, y in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(X), y).backward()
            optimizer.step()
    return model.eval()  # BatchNorm on its running statistics from here on


def confidences(predict, X: torch.Tensor, y: torch.Tensor, generator: torch.Generator) -> list[tuple[float, float]]:
    """(mean largest probability, accuracy) on ``X`` plus noise of each of SHIFTS"""
    rows = []
    for shift in SHIFTS:
        probs = predict(X + shift * torch.randn(X.shape, generator=generator))
        rows.append((probs.max(-1).values.mean().item(), (probs.argmax(-1) == y).double().mean().item()))
    return rows


def main(argv=None) -> dict[str, list[tuple[float, float]]]:
    p = argparse.ArgumentParser(description="A diagonal and a Kronecker Laplace on a small ResNet")
    p.add_argument(
        "--out",
        type=Path,
        default=Path(globals().get("__file__", "plot_laplace_resnet.py")).resolve().parents[1] / "out",
    )
    args = p.parse_args(argv)
    torch.manual_seed(0)
    data = torch.Generator().manual_seed(0)
    train_loader = DataLoader(TensorDataset(*images(N_TRAIN, data)), batch_size=32, shuffle=True)
    X_test, y_test = images(N_TEST, data)
    model = train(resnet(), train_loader)

    predictors = {"MAP": lambda X: torch.softmax(model(X), -1)}
    warnings.filterwarnings("ignore", message="By default `link_approx` is `probit`")  # it is what we use
    for structure in ("diag", "kron"):
        la = Laplace(model, "classification", subset_of_weights="all", hessian_structure=structure, backend=JacmemGGN)
        la.fit(train_loader)
        la.optimize_prior_precision(method="marglik", n_steps=10 if QUICK else 50, link_approx="probit")
        print(
            f"{structure:>4} Laplace: prior precision {la.prior_precision.item():.3g}, log marginal likelihood "
            f"{la.log_marginal_likelihood().item():.1f}"
        )
        predictors[f"{structure} Laplace"] = lambda X, la=la: la(X, pred_type="glm", link_approx="probit")

    results = {}
    for name, predict in predictors.items():  # the same noise for each
        results[name] = confidences(predict, X_test, y_test, torch.Generator().manual_seed(1))
    print(f"\nmean confidence (accuracy) on {N_TEST} test images plus Gaussian noise of standard deviation:")
    print(f"{'':>13}" + "".join(f"{s:>14g}" for s in SHIFTS))
    for name, rows in results.items():
        print(f"{name:>13}" + "".join(f"{c:>8.3f} ({a:.2f})" for c, a in rows))

    fig, (conf, acc) = plt.subplots(1, 2, figsize=(10, 4))
    for name, rows in results.items():
        conf.plot(SHIFTS, [c for c, _ in rows], marker="o", label=name)
        acc.plot(SHIFTS, [a for _, a in rows], marker="o", label=name)
    for ax, what in ((conf, "mean confidence (largest class probability)"), (acc, "accuracy")):
        ax.axhline(1 / CLASSES, color="grey", linestyle=":", label="chance")
        ax.set_xlabel("noise added to the test images (standard deviation)")
        ax.set_ylabel(what)
        ax.legend(loc="lower left")
    fig.suptitle("A small ResNet: MAP vs Laplace (backend=JacmemGGN)")
    fig.tight_layout()
    args.out.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out / "plot_laplace_resnet.png", dpi=100)
    return results


if __name__ == "__main__":
    main()
