"""Comparing strategies: saving memory in convolutions
===================================================

jacmem's version of BackPACK's example "Saving memory in convolutions". There are
several ways to compute a convolution's per-sample weight gradients, and they trade
run time against memory:

* ``unfold``: im2col, then one contraction. Fast where the unfolded input is small;
  the unfolded buffer grows with ``C_in · prod(kernel) · prod(S_out)`` per sample
  (jacmem chunks it over the batch).
* ``save_memory`` (Rochette et al., 2019): one grouped convolution, no unfolded buffer.
* ``grouped``: the weight gradient of one convolution of the whole batch folded into
  groups, by the backend's own kernel (as torch.func's batching rule); fast where each
  layer has many channels and large outputs, slow on this CNN's 1-channel input and
  small late outputs.
* ``auto`` (the default): per layer, the cheapest by a cost model of bytes and FLOPs.

The model is the example's CNN (Conv2d 1→128→256→64→32 with ReLUs and MaxPools, then
Linear(32, 10)) with CrossEntropyLoss, on a seeded random MNIST-shaped batch
``[64, 1, 28, 28]``. Every strategy that ``nn.Conv2d`` offers for the weight's
``batch_grad``, plus ``auto``, plus a plain forward+backward without jacmem, runs in a
process of its own, so that each peak RSS is its own (two processes, in fact: the times
come from one in which glibc keeps freed memory for reuse, the peak from one in which it
returns it at once, as in ``benchmarks/``). Each timed pass follows a plain pass in the
same process, and ``time/plain`` is the median of their ratios, which holds up while
other work loads the machine. The script checks that all
strategies give the same ``grad_batch`` (and that it sums to the plain ``.grad``),
prints a table and saves a bar chart to ``out/plot_save_memory.png``.

Run: ``python examples/plot_save_memory.py`` (or ``make demo``); ``--quick`` (or
``JACMEM_QUICK=1``, as the docs build runs it) for a few-second smoke run (batch 8, one
repeat): its figures say little about the strategies at real sizes.

As in BackPACK's example, which strategy wins depends on the layer shapes and the
machine; measure your own setting. ``ctx.explain()`` says what ``auto`` chose, and why.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch
from torch import nn

import jacmem
from jacmem.derivatives import REGISTRY

PLAIN = "plain"
# sphinx-gallery runs an example without __file__, in the example's folder
HERE = Path(globals().get("__file__", "plot_save_memory.py")).resolve()
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.run import MEMORY_MALLOC, TIME_MALLOC  # noqa: E402

MiB = 2**20


# %%
# The model and its data, then the worker (one strategy in a process of its own) and the
# parent (spawn, check, tabulate, plot). The run itself is at the end of the page.


def build_model() -> nn.Sequential:
    """The CNN of BackPACK's example: [N, 1, 28, 28] -> [N, 10]."""
    return nn.Sequential(
        nn.Conv2d(1, 128, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(3, stride=2),
        nn.Conv2d(128, 256, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(3, padding=1, stride=2),
        nn.Conv2d(256, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(3, stride=2),
        nn.Conv2d(64, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(3, stride=2),
        nn.Flatten(),
        nn.Linear(32, 10),
    )


def setup(batch: int, seed: int = 0):
    """Seeded model, loss and MNIST-shaped random batch: X [N, 1, 28, 28], y [N]."""
    torch.manual_seed(seed)
    model = build_model()
    X = torch.rand(batch, 1, 28, 28)
    y = torch.randint(0, 10, (batch,))
    return X, y, model, nn.CrossEntropyLoss()


def strategies() -> list[str]:
    """Every strategy Conv2d offers for its weight's per-sample gradients, then auto."""
    return [*REGISTRY[nn.Conv2d].strategies[("weight", "batch_grad")], "auto"]


# -- worker: one strategy, in a process of its own ------------------------------------


def _peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


def worker(strategy: str, batch: int, repeats: int, dump: str | None) -> dict:
    """Warm up, then time ``repeats`` forward+backward passes under ``strategy``, each
    paired with a plain pass just before it, so that their ratio holds while other work
    loads the machine. Saves the last pass's result to ``dump``, where given."""
    X, y, model, lossfunc = setup(batch)
    baseline = psutil.Process().memory_info().rss
    explain = ""

    def step(name: str) -> float:
        """One forward+backward under ``name`` (or plain, without jacmem): its seconds."""
        nonlocal explain
        for p in model.parameters():  # drop the previous pass's results first
            p.grad = None
            if hasattr(p, "grad_batch"):
                del p.grad_batch
        start = time.perf_counter()
        if name == PLAIN:
            lossfunc(model(X), y).backward()
        else:
            with jacmem.extend(jacmem.BatchGrad(), strategy=name) as ctx:
                lossfunc(model(X), y).backward()
            explain = ctx.explain()
        return time.perf_counter() - start

    step(PLAIN)  # warm-up
    step(strategy)
    times, ratios = [], []
    for _ in range(repeats):
        plain = step(PLAIN)
        times.append(step(strategy))
        ratios.append(times[-1] / plain)
    peak = _peak_rss_bytes()
    field = "grad" if strategy == PLAIN else "grad_batch"
    if dump is not None:
        torch.save({name: getattr(p, field) for name, p in model.named_parameters()}, dump)
    return dict(strategy=strategy, baseline=baseline, peak=peak, times=times, ratios=ratios, explain=explain)


# -- parent: spawn, check, tabulate, plot ---------------------------------------------


def run_worker(strategy: str, batch: int, repeats: int, dump: str | None, malloc: dict[str, str]) -> dict:
    """Run :func:`worker` for ``strategy`` in a fresh interpreter, with glibc settings
    ``malloc``; its JSON result."""
    cmd = [sys.executable, str(HERE), "--worker", strategy, "--batch", str(batch)]
    cmd += ["--repeats", str(repeats)] + (["--dump", dump] if dump is not None else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ, **malloc))
    if proc.returncode != 0:
        raise RuntimeError(f"the worker for strategy {strategy!r} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(strategy: str, args, dump: str) -> dict:
    """Times from one worker, peak memory from another, as ``benchmarks/`` measures
    (see ``benchmarks.run.TIME_MALLOC``): timed with glibc keeping freed memory, so that
    page faults on a fresh buffer at every pass do not swamp the ratios; the peak with
    glibc returning memory at once, so that it is the peak of live memory."""
    timed = run_worker(strategy, args.batch, args.repeats, dump, TIME_MALLOC)
    memory = run_worker(strategy, args.batch, 1, None, MEMORY_MALLOC)  # its results are the time run's
    return dict(timed, baseline=memory["baseline"], peak=memory["peak"])


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """float32 agreement, relative to the reference's scale."""
    return a.shape == b.shape and torch.allclose(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max()))


def check(dumps: dict[str, str], batch: int) -> int:
    """Raise unless every strategy gives the same grad_batch, and it sums to the plain
    ``.grad``. Returns the size of the per-sample gradients in bytes."""
    grads = torch.load(dumps[PLAIN])
    names = [s for s in dumps if s != PLAIN]
    reference = torch.load(dumps[names[0]])
    same = {p: g.shape == (batch, *grads[p].shape) for p, g in reference.items()}
    for other in names[1:]:
        batches = torch.load(dumps[other])
        for p in same:
            same[p] = same[p] and close(batches[p], reference[p])
        del batches
    sums = {p: close(g.sum(0), grads[p]) for p, g in reference.items()}
    print(f"\n{'parameter':<10} | same grad_batch under {', '.join(names)}? | sums to .grad?")
    for p in reference:
        print(f"{p:<10} | {str(same[p]):<{len(', '.join(names)) + 22}} | {sums[p]}")
    bad = [p for p in reference if not (same[p] and sums[p])]
    if bad:
        raise ValueError(f"the strategies {names} disagree on grad_batch (or its sum) of {bad}")
    return sum(g.numel() * g.element_size() for g in reference.values())


def table(results: dict[str, dict], grad_batch_bytes: int) -> list[dict]:
    """Print peak memory and median time per strategy, against plain; returns the rows."""
    plain = results[PLAIN]
    rows = []
    for name, r in results.items():
        extra = r["peak"] - plain["peak"]
        rows.append(
            dict(
                strategy=name,
                peak=r["peak"] / MiB,
                over_setup=(r["peak"] - r["baseline"]) / MiB,
                extra=extra / MiB,
                extra_ratio=extra / grad_batch_bytes,
                time=statistics.median(r["times"]),
                ratio=statistics.median(r["ratios"]),
            )
        )
    print(f"\nper-sample gradients (grad_batch): {grad_batch_bytes / MiB:.1f} MiB")
    header = (
        f"{'strategy':<12} {'peak MiB':>8} {'over setup':>10} {'extra MiB':>10} {'extra/grad_batch':>16}"
        f" {'time s':>8} {'time/plain':>10}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['strategy']:<12} {r['peak']:>8.1f} {r['over_setup']:>10.1f} {r['extra']:>10.1f}"
            f" {r['extra_ratio']:>16.2f} {r['time']:>8.3f} {r['ratio']:>10.2f}"
        )
    print(
        "over setup: peak RSS above the worker's RSS after setup; extra: peak above plain's; "
        "time: median seconds; time/plain: median ratio to a plain pass just before"
    )
    return rows


def plot(rows: list[dict], grad_batch_bytes: int, batch: int, path: Path):
    """Bar charts of peak memory above setup, and of time relative to plain, saved to
    ``path``; the figure (left open, for the docs' gallery to collect)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    names = [r["strategy"] for r in rows]
    colors = ["0.6" if n == PLAIN else f"C{i}" for i, n in enumerate(names)]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.5))
    memory = [r["over_setup"] for r in rows]
    left.bar(names, memory, color=colors)
    plain = next(r["over_setup"] for r in rows if r["strategy"] == PLAIN)
    budget = plain + grad_batch_bytes / MiB
    left.axhline(budget, color="k", ls="--", lw=1, label="plain + size of grad_batch")
    left.set_ylim(0, 1.3 * max(*memory, budget))  # headroom above the bars for the legend
    left.set_ylabel("peak RSS above setup (MiB)")
    left.legend(loc="upper left")
    ratios = [r["ratio"] for r in rows]
    right.bar(names, ratios, color=colors)
    right.axhline(1, color="k", lw=0.5)
    right.set_ylim(0, 1.15 * max(ratios))
    right.set_ylabel("time / plain forward+backward\n(paired, median)")
    for ax in (left, right):
        ax.set_xlabel("strategy (each in its own process)")
        ax.tick_params(axis="x", labelrotation=25)
        for label in ax.get_xticklabels():
            label.set_horizontalalignment("right")
    fig.suptitle(f"BatchGrad on the example CNN, batch {batch}, CPU, {torch.get_num_threads()} threads")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    print(f"\nsaved {path}")
    return fig


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="BatchGrad under each conv strategy: time and peak memory")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5, help="timed passes after one warm-up")
    parser.add_argument("--quick", action="store_true", help="batch 8, one repeat: a smoke test")
    parser.add_argument("--out", type=Path, default=ROOT / "out", help="folder for the PNG")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--dump", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick or os.environ.get("JACMEM_QUICK") == "1":
        args.batch, args.repeats = 8, 1
    if args.worker:
        print(json.dumps(worker(args.worker, args.batch, args.repeats, args.dump)))
        return

    names = [PLAIN, *strategies()]
    print(f"BatchGrad on the example CNN, batch {args.batch}: {', '.join(names)}, each in its own process")
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        dumps = {name: os.path.join(tmp, f"{name}.pt") for name in names}
        for name in names:
            results[name] = measure(name, args, dumps[name])
            print(f"  {name}: done", flush=True)
        grad_batch_bytes = check(dumps, args.batch)
    rows = table(results, grad_batch_bytes)
    print("\nauto's choices (ctx.explain()):\n" + results["auto"]["explain"])
    plot(rows, grad_batch_bytes, args.batch, args.out / "plot_save_memory.png")


# %%
# Run every strategy in processes of its own, check that they agree, print the table and
# what ``auto`` chose, and plot. The docs build runs it in quick mode (batch 8, one
# repeat), where the memory differences are within noise; ``python
# examples/plot_save_memory.py`` runs batch 64.

if __name__ == "__main__":
    main()
