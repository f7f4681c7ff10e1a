"""Forward cost of second order's functional interception (issue 16), on stock resnet18.

``python -m benchmarks.functional_overhead``: medians of 40 interleaved forwards
(float32, one thread, batch 4, 32×32) of

* a plain forward (no block: no mode is active, nothing to measure but the baseline);
* the forward inside ``jacmem.extend(DiagGGNExact())``;
* the same with the interception removed (its functional ops are then not followed);
* the same with the mode on but an empty table (the dispatch alone);

and the cost of one untracked ``torch.relu`` call outside and inside the block.
"""

from __future__ import annotations

import statistics
import time

import torch
import torchvision

import jacmem
import jacmem.context
import jacmem.engine.secondorder.engine as backprop


def _forward(model, X) -> float:
    start = time.perf_counter()
    model(X)
    return time.perf_counter() - start


def _in_block(model, X, how: str) -> float:
    with jacmem.extend(jacmem.DiagGGNExact()):
        engine = jacmem.context._ACTIVE.block.engines[0]
        if how == "no interception":
            engine.mode.__exit__(None, None, None)
            engine.mode = None
        table, backprop.FUNCTIONAL = backprop.FUNCTIONAL, {} if how == "empty table" else backprop.FUNCTIONAL
        try:
            return _forward(model, X)
        finally:
            backprop.FUNCTIONAL = table


def _per_call(n: int = 20000) -> float:
    a = torch.randn(4)
    start = time.perf_counter()
    for _ in range(n):
        torch.relu(a)
    return (time.perf_counter() - start) / n


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model, X = torchvision.models.resnet18(num_classes=10).eval(), torch.randn(4, 3, 32, 32)
    runs = {
        "plain": lambda: _forward(model, X),
        "block": lambda: _in_block(model, X, "all"),
        "block, no interception": lambda: _in_block(model, X, "no interception"),
        "block, mode with an empty table": lambda: _in_block(model, X, "empty table"),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(41):
        for name, run in runs.items():
            times[name].append(run())
    for name, t in times.items():
        print(f"{name:34s} {statistics.median(t[1:]) * 1e3:8.2f} ms")
    outside = statistics.median(_per_call() for _ in range(5))
    with jacmem.extend(jacmem.DiagGGNExact()):
        inside = statistics.median(_per_call() for _ in range(5))
    print(f"torch.relu, untracked: {outside * 1e6:.2f} us outside the block, {inside * 1e6:.2f} us inside")


if __name__ == "__main__":
    main()
