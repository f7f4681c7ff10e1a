"""jacmem's Python work per layer: a 12-layer HF GPT-2 at a batch of 4, small enough that
the arithmetic is a few milliseconds, so that what jacmem adds per recorded layer call
shows; and a deep narrow MLP (32 ``Linear(64, 64)`` + ReLU and a head, N=4), where the
arithmetic is next to nothing and each method's fixed cost per layer is what is timed.

``python -m benchmarks.overhead [--repeats 30] [--threads 2] [--model gpt2|mlp|both]``

Each step (forward + backward) is timed alternately plain and with jacmem (median over
the repeats, after warm-ups, in one process); the overhead per layer call is
``(jacmem - plain) / calls``, where ``calls`` counts the module calls jacmem recorded.
The arithmetic jacmem adds (per-sample gradients of 4 samples) is in that difference
too, so it bounds the Python work from above. torch.func's per-sample gradients (vmap
over grad) of the same model are timed the same way, for scale: at this size every
method pays for many small kernels.

The deep MLP times, in turns within each round (median over the rounds, after warm-ups),
the plain step, jacmem's ``BatchGrad`` block, Opacus's ``GradSampleModule`` (hooks) and
BackPACK's ``BatchGrad``, each on its own copy of the model (Opacus and BackPACK hook the
model they are given); a method's extra time per layer is ``(method - plain) / layers``,
``layers`` its Linear layers; and the Python calls one step makes into the method's own
package (``sys.setprofile``, as tests/engine/test_fixed_cost.py counts them), which the
machine's load does not change. Timings are noisy on a shared machine: compare the
methods within one run.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch
from torch import nn

import jacmem
from benchmarks.methods import clear, prepare
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


def _rounds(steps: dict, repeats: int) -> dict[str, float]:
    """Median seconds of each of ``steps`` (name -> step), timed in turns within each
    round, after three warm-up rounds."""
    for _ in range(3):
        for step in steps.values():
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            times[name] += _time(step, 1)
    return {name: statistics.median(t) for name, t in times.items()}


def _calls(step, package) -> int:
    """The Python calls one ``step`` makes into ``package`` (a module), counted by
    ``sys.setprofile``: each call event whose code lies under the package's directory."""
    prefix, count = os.path.dirname(package.__file__) + os.sep, 0

    def profile(frame, event, arg):
        nonlocal count
        if event == "call" and frame.f_code.co_filename.startswith(prefix):
            count += 1

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    return count


def deep_mlp(depth: int = 32, width: int = 64, classes: int = 10) -> nn.Sequential:
    """``depth`` ``Linear(width, width)`` + ReLU, then a ``Linear(width, classes)`` head."""
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, classes))


def measure_mlp(depth: int, batch: int, repeats: int) -> dict:
    """Plain, jacmem ``BatchGrad``, Opacus hooks and BackPACK ``BatchGrad`` on the deep MLP:
    name -> (median seconds, extra seconds per Linear layer over plain, Python calls per
    step into the method's package; None for plain)."""
    torch.manual_seed(0)
    model = deep_mlp(depth)
    X, y = torch.randn(batch, 64), torch.randint(0, 10, (batch,))
    layers = sum(isinstance(m, nn.Linear) for m in model.modules())
    lossfunc = nn.CrossEntropyLoss()
    ours = copy.deepcopy(model)

    def jacmem_step():
        with jacmem.extend(jacmem.BatchGrad()):
            lossfunc(ours(X), y).backward()
        clear(ours)

    steps = {
        "plain": prepare("plain", model, X, y, {}),
        "jacmem BatchGrad": jacmem_step,
        "Opacus GradSampleModule (hooks)": prepare("opacus:hooks", copy.deepcopy(model), X, y, {}),
        "BackPACK BatchGrad": prepare("backpack:BatchGrad", copy.deepcopy(model), X, y, {}),
    }
    medians = _rounds(steps, repeats)
    import backpack
    import opacus

    packages = {"jacmem BatchGrad": jacmem, "Opacus GradSampleModule (hooks)": opacus, "BackPACK BatchGrad": backpack}
    calls = {name: _calls(steps[name], package) for name, package in packages.items()}
    return {name: (t, (t - medians["plain"]) / layers, calls.get(name)) for name, t in medians.items()}, layers


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--model", choices=("gpt2", "mlp", "both"), default="both")
    p.add_argument("--depth", type=int, default=32, help="the deep MLP's hidden layers")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.model in ("mlp", "both"):
        results, layers = measure_mlp(args.depth, args.batch, args.repeats)
        print(f"deep MLP, {args.depth} x (Linear(64, 64) + ReLU) + Linear(64, 10), N={args.batch}, ", end="")
        print(f"{args.threads} threads, {args.repeats} rounds")
        print("| method | ms per step | extra per layer (over plain) | Python calls per step |")
        print("|---|---|---|---|")
        for name, (t, extra, calls) in results.items():
            per_layer = "" if name == "plain" else f"{extra * 1e6:.0f} µs"
            print(f"| {name} | {t * 1e3:.2f} | {per_layer} | {'' if calls is None else calls} |")
        print(f"({layers} Linear layers)")
    if args.model == "mlp":
        return
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
