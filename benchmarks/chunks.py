"""Why first-order chunks are small on CPU: per-sample conv gradients (``unfold``),
reduced to their norms and their sum, in chunks of a few samples and of many, beside
autograd's weight gradient. The layer is the seed CNN's second conv at batch 256.

``python -m benchmarks.chunks [--repeats 7] [--threads 2]`` prints the wall time per
chunk size (median and best); :data:`jacmem.extensions.firstorder.CPU_CHUNK_BYTES` is
set from it. Run it on a quiet machine: small chunks mean many short parallel regions,
which suffer most when other processes take the cores (at a load of 4 on 2 cores, the
order reverses).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from jacmem.derivatives import REGISTRY
from jacmem.derivatives.conv import conv_hyperparams
from jacmem.derivatives.quantities import squared_norms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    n = args.batch
    conv = torch.nn.Conv2d(128, 256, 3, padding=1)
    x, g = torch.randn(n, 128, 13, 13), torch.randn(n, 256, 13, 13)
    hp = conv_hyperparams(conv)
    unfold = REGISTRY[torch.nn.Conv2d].strategies[("weight", "batch_grad")]["unfold"].fn
    per_sample = conv.weight.numel() * 4

    def chunked(size: int):
        def run():
            total = 0
            for start in range(0, n, size):
                b = unfold(x[start : start + size], g[start : start + size], **hp)
                total = total + b.sum(0)
                squared_norms(b)

        return run

    cases = {"autograd's weight gradient": lambda: torch.nn.grad.conv2d_weight(x, conv.weight.shape, g, padding=1)}
    for size in (4, 8, 16, 32, 64):
        cases[f"norms + sum, chunks of {size} ({size * per_sample / 2**20:.0f} MiB)"] = chunked(size)
    times = {k: [] for k in cases}
    for _ in range(args.repeats):  # interleaved, so that every case sees the same load
        for name, fn in cases.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    for name, ts in times.items():
        print(f"{name:45s} median {statistics.median(ts) * 1e3:6.0f} ms, best {min(ts) * 1e3:6.0f} ms")


if __name__ == "__main__":
    main()
