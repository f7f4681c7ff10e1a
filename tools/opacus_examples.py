"""Run one of Opacus's examples (``mnist.py``, ``cifar10.py``) on synthetic data, with
``opacus.PrivacyEngine`` swapped for :class:`jacmem.privacy.PrivacyEngine` at run time.

The examples ship in Opacus's sdist, not in its wheel::

    pip download --no-deps --no-binary :all: opacus==1.6.0 -d /tmp/opacus-sdist
    tar xzf /tmp/opacus-sdist/opacus-1.6.0.tar.gz -C /tmp/opacus-sdist
    python tools/opacus_examples.py [--stock] /tmp/opacus-sdist/opacus-1.6.0/examples/mnist.py -- --device cpu -n 1 -r 2

Everything after ``--`` goes to the example as its own arguments. ``--stock`` runs
Opacus's own engine instead, for comparison. torchvision's ``MNIST`` and ``CIFAR10``
become a few batches of random images of their shapes (already tensors: the
example's transforms are not applied), so nothing is downloaded.
"""

from __future__ import annotations

import argparse
import runpy
import sys

import opacus
import opacus.privacy_engine
import torch
import torchvision.datasets
from torch.utils.data import TensorDataset

#: samples in each synthetic dataset
SAMPLES = 128


def synthetic(shape: tuple[int, ...], classes: int = 10) -> type:
    """A stand-in for a torchvision dataset class: ``SAMPLES`` random images of
    ``shape`` and labels in ``[0, classes)``, whatever the constructor's arguments."""

    class Synthetic(TensorDataset):
        def __init__(self, *args, train: bool = True, **kwargs):
            g = torch.Generator().manual_seed(0 if train else 1)
            super().__init__(
                torch.randn(SAMPLES, *shape, generator=g), torch.randint(0, classes, (SAMPLES,), generator=g)
            )

    return Synthetic


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("example", help="path to mnist.py or cifar10.py from Opacus's sdist")
    parser.add_argument("--stock", action="store_true", help="Opacus's own PrivacyEngine, not jacmem's")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="-- then the example's own arguments")
    args = parser.parse_args()
    if not args.stock:
        from jacmem.privacy import PrivacyEngine

        opacus.PrivacyEngine = opacus.privacy_engine.PrivacyEngine = PrivacyEngine
    torchvision.datasets.MNIST = synthetic((1, 28, 28))
    torchvision.datasets.CIFAR10 = synthetic((3, 32, 32))
    sys.argv = [args.example, *(a for a in args.args if a != "--")]
    runpy.run_path(args.example, run_name="__main__")


if __name__ == "__main__":
    main()
