"""Figures shared by the memory examples (not an example itself: the gallery skips it)."""

from __future__ import annotations

import argparse
import os

from jacmem.memory import MemoryReport
from jacmem.memory.report import fmt_bytes

MiB = 2**20


def quick() -> bool:
    """Whether to run small: ``JACMEM_QUICK=1`` (the docs build) or ``--quick``."""
    return os.environ.get("JACMEM_QUICK") == "1"


def small_run(argv, doc: str | None) -> bool:
    """Whether to run small: ``--quick`` in ``argv`` (the tests), or :func:`quick`."""
    parser = argparse.ArgumentParser(description=(doc or "").split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small run (for the tests)")
    return parser.parse_args(argv).quick or quick()


def saved_by_module(reports: dict[str, MemoryReport], title: str, top: int = 8):
    """A horizontal bar chart: what autograd keeps, per module (the ``top`` largest of
    the first report), for each report in ``reports`` ({label: report}); its figure."""
    from matplotlib import pyplot as plt

    first = next(iter(reports.values()))
    names = [m.name for m in sorted(first.modules, key=lambda m: -m.bytes)[:top] if m.bytes]
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(names) * len(reports) + 2.2), layout="constrained")
    height = 0.8 / len(reports)
    for i, (label, rep) in enumerate(reports.items()):
        rows = {m.name: m.bytes for m in rep.modules}
        ys = [k + i * height for k in range(len(names))]
        ax.barh(
            ys, [rows.get(n, 0) / MiB for n in names], height, label=f"{label} (total {fmt_bytes(rep.saved_bytes)})"
        )
    ax.set_yticks([k + height * (len(reports) - 1) / 2 for k in range(len(names))], names)
    ax.invert_yaxis()
    ax.set_xlabel("saved for the backward pass (MiB)")
    ax.set_ylabel("module")
    ax.set_title(title)
    fig.legend(loc="outside lower center")  # below the axes: never over a bar
    return fig


def saved_totals(reports: dict[str, MemoryReport], title: str):
    """A bar per report in ``reports`` ({label: report}): all that autograd keeps; its figure."""
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2), layout="constrained")
    totals = [rep.saved_bytes / MiB for rep in reports.values()]
    ax.barh(list(reports), totals, color=[f"C{i}" for i in range(len(reports))])
    for y, (total, rep) in enumerate(zip(totals, reports.values())):
        ax.annotate(f" {fmt_bytes(rep.saved_bytes)}", (total, y), va="center")
    ax.set_xlim(0, 1.25 * max(totals))
    ax.invert_yaxis()
    ax.set_xlabel("saved for the backward pass (MiB)")
    ax.set_title(title)
    return fig
