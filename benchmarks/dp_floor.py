"""What a private step costs beyond a plain one, part by part: jacmem's private step with
its noise, its ghost norms' Gram matrices, or both taken out.

    python -m benchmarks.dp_floor [vit-tiny gpt2 ...] [--rounds 11] [--quick]

One process per model alternates five steps for ``--rounds`` rounds after two warm-up
rounds: a plain SGD step of an untouched copy; jacmem's private step (as
:mod:`benchmarks.dp`: flat clipping, C = 1, σ = 1); the same with the noise drawn as
zeros; with each Gram matrix ``X Xᵀ`` of a Linear's ghost norm (a ``bmm`` of a tensor
with its own transpose) a tensor of ones; and with both. Prints each step's median time
and the median (min–max) of its per-round ratio to the plain step. The parts taken out
give wrong steps: this measures cost, not results. Where the Gram matrices and the noise
alone cost more than a target allows, no exact step meets it on this machine.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import time
import warnings

import torch

from benchmarks import dp
from benchmarks.models import MODELS

VARIANTS = {"plain": (), "private": (), "no noise": ("noise",), "no Gram": ("gram",), "neither": ("noise", "gram")}


@contextlib.contextmanager
def without(parts: tuple[str, ...]):
    """jacmem's private step with ``parts`` ("noise", "gram") taken out, for this context."""
    import jacmem.derivatives.linear as linear
    import jacmem.privacy as privacy

    bmm = torch.bmm

    def gram_free(a, b, **kwargs):
        if a.data_ptr() == b.data_ptr() and a.shape[1] == b.shape[2]:  # X Xᵀ: a Gram matrix
            return a.new_ones(a.shape[0], a.shape[1], a.shape[1])
        return bmm(a, b, **kwargs)

    def zeros(*args, size, dtype=None, device=None, **kwargs):
        return torch.zeros(size, dtype=dtype, device=device)

    patches = {linear: _Proxy(bmm=gram_free)} if "gram" in parts else {}
    patches.update({privacy: _Proxy(normal=zeros)} if "noise" in parts else {})
    try:
        for module, proxy in patches.items():
            module.torch = proxy
        yield
    finally:
        for module in patches:
            module.torch = torch


class _Proxy:
    """``torch``, with some of its functions replaced."""

    def __init__(self, **replaced):
        self.__dict__.update(replaced)

    def __getattr__(self, name):
        return getattr(torch, name)


def measure(name: str, rounds: int, quick: bool) -> dict[str, tuple[float, list[float]]]:
    """variant -> (median seconds, per-round ratios to the plain step) for model ``name``."""
    model, X, y = MODELS[name].build(quick)
    model = dp._training(model)
    plain = dp.prepare("plain", copy.deepcopy(model), X, y)
    private = dp.prepare("jacmem", model, X, y)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(rounds + 2):
        for variant, parts in VARIANTS.items():
            with without(parts):
                start = time.perf_counter()
                (plain if variant == "plain" else private)()
                if r >= 2:
                    times[variant].append(time.perf_counter() - start)
    return {v: (statistics.median(t), [a / b for a, b in zip(t, times["plain"])]) for v, t in times.items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="*", default=["vit-tiny", "gpt2"], choices=sorted(MODELS))
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (checks the script)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    for name in args.models:
        for variant, (seconds, ratios) in measure(name, args.rounds, args.quick).items():
            spread = f"({min(ratios):.2f}–{max(ratios):.2f})"
            print(f"{name:10s} {variant:9s} {seconds * 1e3:7.0f} ms  {statistics.median(ratios):.2f}× {spread}")


if __name__ == "__main__":
    main()
