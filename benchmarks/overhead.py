"""jacmem's Python work per layer: a 12-layer HF GPT-2 at a batch of 4, small enough that
the arithmetic is a few milliseconds, so that what jacmem adds per recorded layer call
shows.

``python -m benchmarks.overhead [--repeats 30] [--threads 2]``

Each step (forward + backward) is timed alternately plain and with jacmem (median over
the repeats, after warm-ups, in one process); the overhead per layer call is
``(jacmem - plain) / calls``, where ``calls`` counts the module calls jacmem recorded.
The arithmetic jacmem adds (per-sample gradients of 4 samples) is in that difference
too, so it bounds the Python work from above. torch.func's per-sample gradients (vmap
over grad) of the same model are timed the same way, for scale: at this size every
method pays for many small kernels.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import jacmem
from benchmarks.methods import prepare
from benchmarks.models import CausalLM, token_batch


def _time(step, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times


def _paired(plain, step, repeats: int) -> tuple[float, float]:
    """Medians of ``plain`` and ``step`` timed alternately, after three warm-ups of each."""
    for _ in range(3):
        plain(), step()
    pairs = [(_time(plain, 1)[0], _time(step, 1)[0]) for _ in range(repeats)]
    return statistics.median(p for p, _ in pairs), statistics.median(e for _, e in pairs)


def measure(layers: int, d: int, batch: int, tokens: int, repeats: int) -> dict:
    torch.manual_seed(0)
    model = CausalLM(layers, d, 4, 256, tokens)
    X, y = token_batch((batch, tokens), 256)
    lossfunc = nn.CrossEntropyLoss()
    calls = []

    def plain():
        model.zero_grad(set_to_none=True)
        lossfunc(model(X), y).backward()

    def extended(ext):
        def step():
            model.zero_grad(set_to_none=True)
            with jacmem.extend(ext) as ctx:
                lossfunc(model(X), y).backward()
            calls.append(len({(d.module, d.param) for d in ctx.plan.decisions.values()}))

        return step

    out = {}
    for name in ("BatchGrad", "BatchL2Grad"):
        t_plain, t_ext = _paired(plain, extended(getattr(jacmem, name)()), repeats)
        params = calls[-1]
        out[name] = dict(plain=t_plain, jacmem=t_ext, params=params, per_param=(t_ext - t_plain) / params)
    # the same per-sample gradients by torch.func (vmap over grad), for scale
    t_plain, t_func = _paired(plain, prepare("torch.func", model, X, y, {}), repeats)
    out["torch.func (BatchGrad's quantity)"] = dict(plain=t_plain, jacmem=t_func, params=None, per_param=None)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--batch", type=int, default=4)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = measure(args.layers, 64, args.batch, 32, args.repeats)
    print(f"HF GPT-2, {args.layers} layers, d=64, T=32, N={args.batch}, {args.threads} threads, {args.repeats} pairs")
    print("| method | plain ms | method ms | ratio | parameters | overhead per parameter |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        per_param = "" if r["per_param"] is None else f"{r['per_param'] * 1e6:.0f} µs"
        print(
            f"| {name} | {r['plain'] * 1e3:.1f} | {r['jacmem'] * 1e3:.1f} | {r['jacmem'] / r['plain']:.2f}x | "
            f"{r['params'] or ''} | {per_param} |"
        )


if __name__ == "__main__":
    main()
