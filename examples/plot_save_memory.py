"""Saving memory in convolutions: jacmem beside BackPACK
=====================================================

BackPACK's example "Saving memory in convolutions" computes per-sample gradients
(``BatchGrad``) of a small CNN in two ways and finds that its memory-saving mode needs
977 MB where its default needs 2334 MB. This is the same comparison with jacmem's
strategies beside BackPACK's, on the same CNN (Conv2d 1→128→256→64→32 with ReLUs and
MaxPools, then Linear(32, 10), cross-entropy) and an MNIST-shaped batch of 64.

Every method returns the per-sample gradients (``grad_batch``: N times the parameters,
113 MiB here), so each needs at least that much more than a plain step. What they hold
besides, and why:

* **BackPACK unfold** (its default): each convolution's input unfolded (im2col,
  ``C_in·prod(K)·prod(S_out)`` numbers per sample) for the whole batch at once, then one
  contraction with the output gradient.
* **BackPACK save_memory** (Rochette et al., 2019): one grouped convolution per layer
  computes the per-sample gradients with no unfolded buffer, and slower in the seed.
* **jacmem unfold**: the same im2col, but made for as many samples at a time as fit one
  chunk of temporary memory (16 MiB on CPU), each chunk's products written straight
  into ``grad_batch``. It holds one chunk, not the batch, so it needs no more memory
  than Rochette's method, and keeps im2col's speed.
* **jacmem save_memory**: Rochette's grouped convolution, chunked the same way.
* **jacmem auto** (the default): per layer, the cheapest strategy by a cost model of
  bytes and FLOPs; ``ctx.explain()`` says what it chose.
* **plain**: a forward+backward without per-sample gradients, the reference.

Each method runs in processes of its own, so that each peak is its own: one process for
time, in which glibc keeps freed memory for reuse, and one for memory, in which it
returns every buffer at once (as in ``benchmarks/``). **Peak**: the peak resident set
during the steps above the process's resident set after setup. **Time**: the median
step over the repeats, and **× plain** that median over plain's: one definition for both
columns. Before measuring, the script checks in this process that every method gives
the same ``grad_batch``, and that it sums to the plain ``.grad``.

Run: ``make demo`` (or ``python examples/plot_save_memory.py``; about a minute on two
cores). The docs build runs it in quick mode (``JACMEM_QUICK=1`` or ``--quick``): the
same batch, memory only, one step per method, and no times, because a single step on a
shared build machine says nothing about them. As in BackPACK's example, which strategy
is fastest depends on the layer shapes and the machine: measure your own setting.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from torch import nn

import jacmem
from jacmem.engine.planner import CPU_CHUNK_BYTES

# sphinx-gallery runs an example without __file__, in the example's folder
ROOT = Path(globals().get("__file__", "plot_save_memory.py")).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks import harness  # noqa: E402
from benchmarks.models import MODELS  # noqa: E402

MiB = 2**20
#: the benchmark suite's problem: the seed CNN, Gaussian inputs [N, 1, 28, 28], 10 classes
PROBLEM = "seed-cnn-64"
#: label -> the benchmark suite's method name (see benchmarks/methods.py)
METHODS = {
    "plain": "plain",
    "BackPACK unfold": "backpack:BatchGrad",
    "BackPACK save_memory": "backpack:BatchGrad:save_memory",
    "jacmem unfold": "jacmem:BatchGrad:unfold",
    "jacmem save_memory": "jacmem:BatchGrad:save_memory",
    "jacmem auto": "jacmem:BatchGrad:auto",
}
COLORS = ["0.6", "tab:orange", "navajowhite", "tab:blue", "lightsteelblue", "navy"]


# %%
# The check: every method's per-sample gradients, in this process, on a small batch.


def per_sample_grads(method: str, batch: int) -> dict[str, torch.Tensor]:
    """``{parameter: grad_batch [N, *shape]}`` under ``method`` (``.grad`` for plain)."""
    model, X, y = MODELS[PROBLEM].build(False, batch)
    lossfunc = nn.CrossEntropyLoss()
    family, *args = method.split(":")
    if family == "plain":
        lossfunc(model(X), y).backward()
        return {name: p.grad for name, p in model.named_parameters()}
    if family == "jacmem":
        with jacmem.extend(jacmem.BatchGrad(), strategy=args[1]):
            lossfunc(model(X), y).backward()
    else:
        from backpack import backpack, extend, extensions
        from backpack.core.derivatives.convnd import weight_jac_t_save_memory

        model, lossfunc = extend(model), extend(lossfunc)
        with weight_jac_t_save_memory(save_memory=args[1:] == ["save_memory"]), backpack(extensions.BatchGrad()):
            lossfunc(model(X), y).backward()
    return {name: p.grad_batch for name, p in model.named_parameters()}


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """float32 agreement, relative to the reference's scale."""
    return a.shape == b.shape and torch.allclose(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max()))


def check(grads: dict[str, dict[str, torch.Tensor]], batch: int) -> None:
    """Raise unless every method but ``plain`` gives the same grad_batch ``[N, *shape]``
    and it sums to plain's ``.grad``; ``grads`` is ``{label: {parameter: tensor}}``."""
    plain = grads["plain"]
    names = [label for label in grads if label != "plain"]
    reference = grads[names[0]]
    same = {p: g.shape == (batch, *plain[p].shape) for p, g in reference.items()}
    for other in names[1:]:
        for p in same:
            same[p] = same[p] and close(grads[other][p], reference[p])
    sums = {p: close(g.sum(0), plain[p]) for p, g in reference.items()}
    print(f"{'parameter':<10} | same grad_batch under all {len(names)} methods? | sums to .grad?")
    for p in reference:
        print(f"{p:<10} | {str(same[p]):<39} | {sums[p]}")
    bad = [p for p in reference if not (same[p] and sums[p])]
    if bad:
        raise ValueError(f"the methods {names} disagree on grad_batch (or its sum) of {bad}")


# %%
# What the unfold strategies hold: each conv's im2col buffer, from the layer shapes.


def im2col_bytes(batch: int) -> dict[str, int]:
    """``{conv: bytes of its unfolded input per sample}``: C_in·prod(K)·prod(S_out) floats."""
    model, X, _ = MODELS[PROBLEM].build(False, batch)
    sizes: dict[str, int] = {}
    for name, m in model.named_modules():
        if isinstance(m, nn.Conv2d):
            m.register_forward_hook(
                lambda m, x, out, name=name: sizes.__setitem__(
                    name, m.in_channels * m.kernel_size[0] * m.kernel_size[1] * out[0, 0].numel() * out.element_size()
                )
            )
    with torch.no_grad():
        model(X[:1])
    return sizes


def buffers(batch: int) -> str:
    """The largest conv's im2col buffer: per sample, per jacmem chunk, per batch."""
    name, per_sample = max(im2col_bytes(batch).items(), key=lambda kv: kv[1])
    chunk = max(1, min(batch, int(CPU_CHUNK_BYTES // per_sample)))
    return (
        f"conv {name}'s im2col buffer: {per_sample / MiB:.2f} MiB per sample; BackPACK's unfold makes it for "
        f"all {batch} samples ({batch * per_sample / MiB:.1f} MiB), jacmem's for {chunk} at a time "
        f"({chunk * per_sample / MiB:.1f} MiB, one {CPU_CHUNK_BYTES / MiB:.0f} MiB chunk)"
    )


# %%
# The measurement: each method in processes of its own (benchmarks/child.py).


def measure(method: str, batch: int, repeats: int, quick: bool) -> dict:
    """``benchmarks.child``'s result for ``method``: ``time_s`` (median step, absent in
    quick mode), ``extra_bytes`` (peak RSS during the steps above that after setup)."""
    case = dict(model=PROBLEM, method=method, batch=batch, quick=False, device="cpu", threads=2)
    case.update(warmup=1, repeats=repeats, seconds=0.0, paired=False)
    if quick:  # one step, in the memory process alone
        result = harness.run_case(dict(case, repeats=1), 600, env=harness.MEMORY_MALLOC)
        result.pop("time_s", None)
    else:
        result = harness.measure(case, 600)
    if "error" in result:
        raise RuntimeError(f"{method}: {result['error']}")
    return result


def table(results: dict[str, dict], grad_batch_bytes: int) -> list[dict]:
    """Print the peak and the time of each method beside plain's; returns the rows."""
    plain = results["plain"]
    rows = []
    for label, r in results.items():
        row = dict(method=label, peak=r["extra_bytes"] / MiB)
        if "time_s" in r:
            row.update(time=r["time_s"], ratio=r["time_s"] / plain["time_s"])
        rows.append(row)
    timed = "time" in rows[0]
    print(f"per-sample gradients (grad_batch): {grad_batch_bytes / MiB:.0f} MiB")
    header = f"{'method':<21} {'peak MiB':>9}" + (f" {'time s':>7} {'× plain':>7}" if timed else "")
    print(header + "\n" + "-" * len(header))
    for row in rows:
        line = f"{row['method']:<21} {row['peak']:>9.0f}"
        print(line + (f" {row['time']:>7.3f} {row['ratio']:>7.2f}" if timed else ""))
    return rows


def plot(rows: list[dict], grad_batch_bytes: int, batch: int, caption: str, path: Path):
    """Peak memory (and, where measured, time) per method, saved to ``path``; the
    figure (left open, for the docs' gallery to collect)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    timed = "time" in rows[0]
    fig, axes = plt.subplots(1, 2 if timed else 1, figsize=(11 if timed else 6.5, 4.8), squeeze=False)
    names = [r["method"].replace(" ", "\n", 1) for r in rows]
    memory = axes[0][0]
    memory.bar(names, [r["peak"] for r in rows], color=COLORS)
    budget = rows[0]["peak"] + grad_batch_bytes / MiB
    memory.axhline(budget, color="k", ls="--", lw=1, label="plain + size of grad_batch")
    memory.set_ylabel("peak RSS above setup (MiB)")
    memory.legend(loc="upper right")
    if timed:
        time = axes[0][1]
        bars = time.bar(names, [r["time"] for r in rows], color=COLORS)
        time.bar_label(bars, [f"{r['ratio']:.2f}×" for r in rows], fontsize=8)
        time.set_ylim(0, 1.15 * max(r["time"] for r in rows))
        time.set_ylabel("median step time (s)\n(label: × plain's median)")
    for ax in axes[0]:
        ax.tick_params(axis="x", labelsize=8)
    how = "" if timed else " (quick mode: memory only, one step per method)"
    fig.suptitle(f"BatchGrad on BackPACK's example CNN, batch {batch}, CPU, 2 threads{how}", fontsize=10)
    fig.text(0.5, 0.01, caption, ha="center", fontsize=7.5, wrap=True)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    print(f"saved {path}")
    return fig


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="BatchGrad with BackPACK's and jacmem's conv strategies")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5, help="timed steps after one warm-up")
    parser.add_argument("--quick", action="store_true", help="memory only, one step per method")
    parser.add_argument("--out", type=Path, default=ROOT / "out", help="folder for the PNG")
    args = parser.parse_args(argv)
    quick = args.quick or os.environ.get("JACMEM_QUICK") == "1"

    grads = {label: per_sample_grads(method, 8) for label, method in METHODS.items()}
    check(grads, 8)
    n_params = sum(g.numel() for g in grads["plain"].values())
    grad_batch_bytes = args.batch * n_params * 4
    caption = buffers(args.batch)
    print(caption)

    print(f"\nBatchGrad at batch {args.batch}, each method in processes of its own:", flush=True)
    results = {label: measure(method, args.batch, args.repeats, quick) for label, method in METHODS.items()}
    rows = table(results, grad_batch_bytes)
    print("\nauto's choices (ctx.explain()):\n" + results["jacmem auto"]["explain"])
    plot(rows, grad_batch_bytes, args.batch, caption, args.out / "plot_save_memory.png")


# %%
# Check, then measure, print the table and what ``auto`` chose, and plot.

if __name__ == "__main__":
    main()
