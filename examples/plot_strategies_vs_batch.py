"""Strategies against batch size
=============================

Where each conv strategy wins: time and memory versus batch size.

jacmem has three ways to get a convolution's per-sample weight gradients, and two more
for their norms alone:

* ``unfold``: im2col, then one batched matrix product. Fast, but the unfolded input
  (``C_in · prod(kernel) · prod(S_out)`` per sample) is a buffer that grows with N;
  jacmem chunks it over the batch.
* ``save_memory`` (Rochette et al., 2019): one grouped convolution, no unfolded buffer.
* ``grouped``: the weight gradient of one convolution of the batch folded into groups,
  by the backend's own kernel; fast where channels are many and outputs large (the seed
  CNN's first layer has one input channel, its later ones small outputs).
* ``ghost`` (norms only): ``‖Gᵀ A‖² = ⟨A Aᵀ, G Gᵀ⟩`` per sample, never forming the
  per-sample gradients; ``ghost_gram``, the same with ``A Aᵀ`` from the Gram matrix of
  the input's positions (no im2col).
* ``auto``: per layer, the cheapest by jacmem's cost model.

This script runs the seed CNN of ``plot_save_memory.py`` (Conv2d 1→128→256→64→32,
MaxPools, Linear(32, 10)) at several batch sizes, with ``BatchGrad`` and
``BatchL2Grad`` under each strategy and a plain forward+backward, every point in a
process of its own (the benchmark suite's ``benchmarks.child``). It prints a table and
saves ``out/plot_strategies_vs_batch.png``: step time, and peak memory above the plain
run's, versus N.

Run: ``python examples/plot_strategies_vs_batch.py``; ``--quick`` (or ``JACMEM_QUICK=1``,
as the docs build runs it) for a smoke run (batches 4 and 16, fewer strategies, one repeat,
one process per point), whose figure says little about large batches.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# sphinx-gallery runs an example without __file__, in the example's folder
ROOT = Path(globals().get("__file__", "plot_strategies_vs_batch.py")).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import harness  # noqa: E402

MiB = 2**20
COLORS = {
    "unfold": "tab:blue",
    "save_memory": "tab:orange",
    "grouped": "tab:purple",
    "ghost": "tab:green",
    "ghost_gram": "tab:olive",
    "auto": "tab:red",
}
METHODS = {
    "BatchGrad": ["unfold", "save_memory", "grouped", "auto"],
    "BatchL2Grad": ["unfold", "save_memory", "grouped", "ghost", "ghost_gram", "auto"],
}
#: quick mode: fewer points, each in one process (time and memory together, glibc's
#: default malloc), so that the docs build stays short
QUICK_METHODS = {
    "BatchGrad": ["unfold", "save_memory", "grouped", "auto"],
    "BatchL2Grad": ["unfold", "ghost", "auto"],
}


def measure(batches, methods, quick: bool, threads: int):
    """{(extension, strategy or "plain", N): result dict of benchmarks.child}"""
    results = {}
    todo = [("plain", "plain", n) for n in batches]
    todo += [(ext, s, n) for n in batches for ext, names in methods.items() for s in names]
    for i, (ext, strategy, n) in enumerate(todo, 1):
        method = "plain" if ext == "plain" else f"jacmem:{ext}:{strategy}"
        case = dict(model="seed-cnn-256", method=method, quick=quick, device="cpu", threads=threads, batch=n)
        case.update(warmup=1, repeats=1 if quick else 5, seconds=0 if quick else 4.0)
        r = harness.measure(case, timeout=300)  # on CPU: time and memory from two processes
        results[(ext, strategy, n)] = r
        status = r.get("error") or f"{r['time_s'] * 1e3:.0f} ms, peak +{r['extra_bytes'] / MiB:.0f} MiB"
        print(f"[{i}/{len(todo)}] N={n} {method}: {status}", file=sys.stderr, flush=True)
    return results


def table(results, batches, methods) -> str:
    lines = ["| extension | strategy | " + " | ".join(f"N={n}" for n in batches) + " |"]
    lines.append("|---|---|" + "---|" * len(batches))
    for ext, names in [("plain", ["plain"]), *methods.items()]:
        for s in names:
            cells = []
            for n in batches:
                r, base = results[(ext, s, n)], results[("plain", "plain", n)]
                if "error" in r:
                    cells.append("n/a")
                    continue
                extra = (r["extra_bytes"] - base["extra_bytes"]) / MiB
                cells.append(f"{r['time_s'] * 1e3:.0f} ms, +{extra:.0f} MiB")
            lines.append(f"| {ext} | {s} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results, batches, methods, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    fig, axes = plt.subplots(2, 2, figsize=(11, 8), sharex=True)
    for row, (ext, names) in enumerate(methods.items()):
        ax_t, ax_m = axes[row]
        ns = [n for n in batches if "error" not in results[("plain", "plain", n)]]
        ax_t.plot(ns, [results[("plain", "plain", n)]["time_s"] * 1e3 for n in ns], "k--", label="plain")
        grads = [results[("plain", "plain", n)]["per_sample_bytes"] / MiB for n in ns]
        ax_m.plot(ns, grads, "k:", label="size of the per-sample grads")
        for s in names:
            ok = [n for n in ns if "error" not in results[(ext, s, n)]]
            ax_t.plot(ok, [results[(ext, s, n)]["time_s"] * 1e3 for n in ok], "o-", color=COLORS[s], label=s)
            extra = [
                max((results[(ext, s, n)]["extra_bytes"] - results[("plain", "plain", n)]["extra_bytes"]) / MiB, 0.1)
                for n in ok
            ]
            ax_m.plot(ok, extra, "o-", color=COLORS[s], label=s)
        ax_t.set(title=f"{ext}: step time", ylabel="ms")
        ax_m.set(title=f"{ext}: peak memory above plain", ylabel="MiB")
        for ax in (ax_t, ax_m):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.xaxis.set_major_formatter(ScalarFormatter())
            ax.yaxis.set_major_formatter(ScalarFormatter())
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    for ax in axes[1]:
        ax.set_xlabel("batch size N")
    fig.suptitle("seed CNN: jacmem's conv strategies versus batch size (CPU)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    return fig  # left open, for the docs' gallery to collect


def main() -> None:
    parser = argparse.ArgumentParser(description="Conv strategies against batch size: time and peak memory")
    parser.add_argument("--quick", action="store_true", help="batches 4 and 16, fewer strategies, one repeat")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "plot_strategies_vs_batch.png")
    args = parser.parse_args()
    args.quick = args.quick or os.environ.get("JACMEM_QUICK") == "1"
    batches, methods = ([4, 16], QUICK_METHODS) if args.quick else ([16, 32, 64, 128, 256], METHODS)
    results = measure(batches, methods, args.quick, args.threads)
    print(table(results, batches, methods))
    plot(results, batches, methods, args.out)
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
