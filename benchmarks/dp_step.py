"""One clipped step (jacmem.ClipGrad) against one plain SGD step: median of 5, paired.

    python -m benchmarks.dp_step [gpt2 seed-cnn-256 vit-tiny ...] [--threads 2] [--flow inside|track]

Each step: forward, backward, ``optimizer.step()``, ``zero_grad``; the DP step inside
``jacmem.extend(ClipGrad(1.0))`` (noise and accounting are the privacy engine's, not
timed here). Prints the two medians and their ratio per model.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from torch.nn import functional as F

import jacmem
from benchmarks.models import MODELS


def step(model, opt, X, y, clip=None, flow="inside"):
    if clip is None:
        F.cross_entropy(model(X), y).backward()
    elif flow == "track":
        loss = F.cross_entropy(model(X), y)
        with jacmem.extend(clip):
            loss.backward()
    else:
        with jacmem.extend(clip):
            F.cross_entropy(model(X), y).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def timed(*args) -> float:
    """Seconds one :func:`step` with ``args`` takes."""
    start = time.perf_counter()
    step(*args)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("models", nargs="*", default=["gpt2", "seed-cnn-256"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--flow", choices=["inside", "track"], default="inside")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for name in args.models:
        model, X, y = MODELS[name].build(quick=False)
        dp = copy.deepcopy(model)
        if args.flow == "track":
            jacmem.track(dp)
        opts = [torch.optim.SGD(m.parameters(), lr=1e-3) for m in (model, dp)]
        clip = jacmem.ClipGrad(1.0)
        plain, private = [], []
        for i in range(args.repeats + 1):  # the first pair warms up
            t0 = timed(model, opts[0], X, y)
            t1 = timed(dp, opts[1], X, y, clip, args.flow)
            if i:
                plain.append(t0)
                private.append(t1)
        a, b = statistics.median(plain), statistics.median(private)
        print(f"{name}: plain {a * 1e3:.1f} ms, ClipGrad {b * 1e3:.1f} ms, ratio {b / a:.2f}", flush=True)


if __name__ == "__main__":
    main()
