"""BENCHMARKS.md (a summary: the targets, and jacmem beside its peers per model), one
file per model under ``details/`` beside the plot (every method and strategy, and what
``auto`` chose), the raw results (``results.json``) and the PNG plot.

Sections of an existing BENCHMARKS.md between ``<!-- NAME:start -->`` and
``<!-- NAME:end -->`` (the memory toolkit's ``lean``, the second-order benchmark's) belong
to other benchmarks; they are kept as they are, after this report.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from benchmarks.methods import per_sample_quantity
from benchmarks.models import MODELS, has_batchnorm_derivative

#: sections other benchmarks own, kept as they are: ``<!-- NAME:start --> ... <!-- NAME:end -->``
KEPT = re.compile(r"<!-- ([\w-]+):start -->.*?<!-- \1:end -->", re.S)

#: the targets: extension -> (time vs plain, extra peak memory / per-sample grads)
TARGETS = {
    "BatchGrad": (1.2, 1.1),
    "BatchL2Grad": (1.15, 0.15),
    "SumGradSquared": (1.2, 0.3),
    "Variance": (1.2, 0.3),
}
#: on the real transformers, where more of a step is outside the hooked layers: model -> extension -> (time, memory) as above
MODEL_TARGETS = {
    model: {"BatchGrad": (1.3, 1.1), "BatchL2Grad": (1.2, 0.15), "SumGradSquared": (1.3, 0.3), "Variance": (1.3, 0.3)}
    for model in ("gpt2", "vit-tiny")
}

MiB = 2**20


def ratios(results: list[dict]) -> None:
    """Add ``time_ratio`` and ``mem_ratio`` (extra peak above plain's, in units of the
    per-sample gradients' size) to each result, in place."""
    plain = {r["model"]: r for r in results if r["method"] == "plain" and "error" not in r}
    for r in results:
        base = plain.get(r["model"])
        if "error" in r or base is None:
            continue
        r["time_ratio"] = r["paired_ratio"] or r["time_s"] / base["time_s"] if r["method"] != "plain" else 1.0
        if r.get("extra_bytes") is not None and base.get("extra_bytes") is not None:
            r["extra_over_plain"] = r["extra_bytes"] - base["extra_bytes"]
            r["mem_ratio"] = r["extra_over_plain"] / r["per_sample_bytes"]


def _fmt(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def _label(method: str) -> str:
    family, *args = method.split(":")
    if family == "jacmem":
        return f"jacmem {args[0]} ({args[1]})"
    if family == "backpack":
        return f"BackPACK {args[0]}" + (" (save_memory)" if args[1:] else " (default)")
    if family == "opacus":
        return {"hooks": "Opacus hooks", "ew": "Opacus ew", "ghost": "Opacus ghost-clipping norms"}[args[0]]
    names = {
        "plain": "plain forward+backward",
        "floor": "plain, then zeros of the per-sample gradients' size",
        "torch.func": "torch.func vmap(grad)",
    }
    return names.get(method, method)


def _auto_choices(explain: str | None) -> str:
    """The weight parameters' choices from ``ctx.explain()``, compactly."""
    if not explain:
        return ""
    return "; ".join(line.strip() for line in explain.splitlines() if line.strip())


def targets_table(results: list[dict]) -> list[str]:
    """One row per jacmem ``auto`` case, after the sentence that defines its columns."""
    floor = {r["model"]: r["time_ratio"] for r in results if r["method"] == "floor" and "time_ratio" in r}
    lines = [
        "**time**: the step's × plain. **floor**: × plain of a plain step followed by writing zeros of the "
        "per-sample gradients' size, what storing the result costs at least. **extra peak**: memory above plain's "
        "peak, × the per-sample gradients' size. **met**: yes, or by how much each target is missed.",
        "",
        "| model | extension (auto) | time | target | floor | extra peak | target | met |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        family, *args = r["method"].split(":")
        if family != "jacmem" or args[1] != "auto" or "time_ratio" not in r:
            continue
        t_goal, m_goal = MODEL_TARGETS.get(r["model"], TARGETS)[args[0]]
        mem = r.get("mem_ratio")
        met = [r["time_ratio"] <= t_goal, mem is not None and mem <= m_goal]
        verdict = (
            "yes"
            if all(met)
            else ", ".join(
                f"{what} +{(val / goal - 1) * 100:.0f}%"
                for what, ok, val, goal in (
                    ("time", met[0], r["time_ratio"], t_goal),
                    ("memory", met[1], mem or 0, m_goal),
                )
                if not ok
            )
        )
        lines.append(
            f"| {r['model']} | {args[0]} | {r['time_ratio']:.2f}× | ≤ {t_goal}× | {_fmt(floor.get(r['model']), '.2f')}× | "
            f"{_fmt(mem, '.2f')}× | ≤ {m_goal}× | {verdict} |"
        )
    return lines


def model_section(name: str, rows: list[dict]) -> list[str]:
    """The details file of one model: every method's row, and what ``auto`` chose."""
    ok = [r for r in rows if "error" not in r]
    head = ok[0] if ok else rows[0]
    lines = [f"# {name}", "", MODELS[name].description + "."]
    if ok:
        lines[-1] += (
            f" N = {head['batch']}, {head['n_params']:,} trainable parameters; per-sample gradients "
            f"take {head['per_sample_bytes'] / MiB:.0f} MiB."
        )
    if name == "resnet":
        lines.append(
            "BatchNorm's affine parameters train, with jacmem's BatchNorm derivative (eval mode)."
            if has_batchnorm_derivative()
            else "jacmem has no BatchNorm derivative yet, so the BatchNorm parameters are frozen "
            "(`requires_grad=False`) for every method here."
        )
    lines += [
        "",
        "| method | gives | time (ms) | × plain | extra peak (MiB) | × per-sample grads |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {_label(r['method'])} | {per_sample_quantity(r['method'])} | n/a: {r['error']} | | | |")
            continue
        lines.append(
            f"| {_label(r['method'])} | {per_sample_quantity(r['method'])} | {r['time_s'] * 1e3:.0f} | "
            f"{_fmt(r.get('time_ratio'), '.2f')} | {_fmt((r.get('extra_over_plain', r.get('extra_bytes')) or 0) / MiB, '.0f')} | "
            f"{_fmt(r.get('mem_ratio'), '.2f')} |"
        )
    choices = [(r["method"], r["explain"]) for r in ok if r["method"].endswith(":auto") and r.get("explain")]
    if choices:
        lines += ["", "## What `auto` chose (`ctx.explain()`)", ""]
        for method, explain in choices:
            lines += [f"`{method}`:", "```", explain.strip(), "```"]
    return lines + [""]


#: the peers' columns: title -> method names, the best-timed of which is shown
PEERS = {
    "BackPACK": ("backpack:{ext}", "backpack:{ext}:save_memory"),
    "Opacus": ("opacus:hooks", "opacus:ew", "opacus:ghost"),
    "torch.func": ("torch.func",),
}


def _cell(r: dict | None) -> str:
    """``time × plain / extra peak × per-sample grads``, or why there is none."""
    if r is None:
        return "–"
    if "error" in r:
        return "skipped (memory)" if r["error"].startswith("skipped") else "fails"
    return f"{r['time_ratio']:.2f}× / {_fmt(r.get('mem_ratio'), '.2f')}×"


def peers_table(results: list[dict]) -> list[str]:
    """Per model and quantity (BatchGrad, BatchL2Grad): jacmem's ``auto`` beside each
    peer's fastest method that gives it, and jacmem's step time with its spread."""
    by = {(r["model"], r["method"]): r for r in results}
    lines = [
        "| model | quantity | jacmem step, ms (min–max) | jacmem | " + " | ".join(PEERS) + " |",
        "|---|---|---|---|" + "---|" * len(PEERS),
    ]
    for model in dict.fromkeys(r["model"] for r in results):
        for ext in ("BatchGrad", "BatchL2Grad"):
            mine = by.get((model, f"jacmem:{ext}:auto"))
            if mine is None or "time_ratio" not in mine:
                continue
            cells = []
            for methods in PEERS.values():
                found = [by[key] for m in methods if (key := (model, m.format(ext=ext))) in by]
                found = [r for r in found if per_sample_quantity(r["method"]) == ext]
                timed = [r for r in found if "time_ratio" in r]
                cells.append(_cell(min(timed, key=lambda r: r["time_ratio"]) if timed else (found or [None])[0]))
            times = [t * 1e3 for t in mine.get("times_s") or [mine["time_s"]]]
            spread = f"{mine['time_s'] * 1e3:.0f} ({min(times):.0f}–{max(times):.0f})"
            lines.append(
                f"| [{model}](benchmarks/details/{model}.md) | {ext} | {spread} | {_cell(mine)} | "
                + " | ".join(cells)
                + " |"
            )
    return lines


def markdown(results: list[dict], meta: dict) -> str:
    busy = (
        float(meta["load_before"].split()[0]) > 0.5 * meta["cores"]
        or float(meta["load_after"].split()[0]) > 0.5 * meta["cores"]
    )
    lines = [
        "# Benchmarks",
        "",
        "Per-sample quantities with jacmem, BackPACK 1.7.1, Opacus and torch.func, each beside a plain "
        "forward+backward of the same model; then curvature, private training and lean layers. Written by "
        "`benchmarks/` (`make bench`); do not edit by hand.",
        "",
        f"- Command: `{meta['command']}`"
        + (" (quick: tiny sizes, 1 repeat; not figures to quote)" if meta["quick"] else ""),
        f"- Date: {meta['date']}; the run took {meta['minutes']:.0f} min. Each section below gives its own date.",
        f"- Machine: {meta['cpu']}, {meta['cores']} cores"
        + (f", {meta['gpu']}" if meta.get("gpu") else "")
        + f"; Python {meta['python']}, torch {meta['torch']}, {meta['threads']} torch threads per case; "
        f"device `{results[0]['device'] if results else 'cpu'}`; load average {meta['load_before']} before, "
        f"{meta['load_after']} after." + (" A shared machine: compare ratios, not times." if busy else ""),
        *([f"- Note: {meta['note']}"] if meta.get("note") else []),
        "",
        "Each (model, method) runs in processes of its own (`benchmarks/harness.py`). **× plain**: the median of "
        "the step's ratios to a plain forward+backward of an unhooked copy, timed just before it in the same "
        "process, with glibc keeping freed memory for reuse. **Extra peak**: from a second process in which "
        "glibc returns freed memory at once, the peak RSS during two steps above that after setup, minus plain's, "
        "in units of the per-sample gradients' size (N × parameters × 4 bytes): keeping them costs 1×.",
        "",
        "## Targets: jacmem with `auto`",
        "",
        *targets_table(results),
        "",
        "## Beside the peers",
        "",
        "Each cell: **time × plain / extra peak × per-sample gradients**, for the peer's fastest method that gives "
        "the quantity (BackPACK default or `save_memory`; Opacus hooks, expanded weights or ghost clipping); "
        '"fails": the library refuses the model; "skipped": it would need over 3 GiB. jacmem\'s step time is '
        "the median over the repeats, with the fastest and slowest. Each model's name links to every method and "
        "strategy, and what `auto` chose. On gpt2 and vit-tiny BackPACK 1.7.1 skips what it has no derivative for "
        "(HF's Conv1D, LayerNorm, a ViT's own parameters), so its cells there cover less of the model.",
        "",
        *peers_table(results),
        "",
        "![time and extra peak memory per method](benchmarks/results.png)",
    ]
    return "\n".join(lines) + "\n"


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {
        "plain": "grey",
        "floor": "silver",
        "jacmem": "tab:blue",
        "backpack": "tab:orange",
        "opacus": "tab:green",
        "torch.func": "tab:red",
    }
    models = list(dict.fromkeys(r["model"] for r in results))
    heights = [max(1, len([r for r in results if r["model"] == m])) for m in models]
    fig, axes = plt.subplots(
        len(models),
        2,
        figsize=(13, 0.28 * sum(heights) + 1.2 * len(models)),
        squeeze=False,
        gridspec_kw=dict(height_ratios=heights),
    )
    for (ax_t, ax_m), name in zip(axes, models):
        rows = [r for r in results if r["model"] == name]
        labels = [_label(r["method"]) for r in rows]
        ys = range(len(rows))
        c = [colors[r["method"].split(":")[0]] for r in rows]
        ax_t.barh(ys, [r.get("time_ratio", 0) for r in rows], color=c)
        ax_m.barh(ys, [max(r.get("mem_ratio") or 0, 0) for r in rows], color=c)
        ax_t.set_yticks(list(ys), labels, fontsize=7)
        ax_m.set_yticks(list(ys), [""] * len(rows))
        for ax in (ax_t, ax_m):
            ax.invert_yaxis()
            ax.set_xscale("log")
            ax.grid(axis="x", alpha=0.3)
        ax_t.axvline(1, color="black", lw=0.8)
        ax_m.axvline(1, color="black", lw=0.8, ls=":")
        ax_t.set_title(f"{name}: time / plain forward+backward", fontsize=9)
        ax_m.set_title(f"{name}: extra peak memory / per-sample grads", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write(results: list[dict], meta: dict, md_path: Path, png_path: Path) -> None:
    ratios(results)
    text = markdown(results, meta)
    details = png_path.parent / "details"
    details.mkdir(parents=True, exist_ok=True)
    for name in dict.fromkeys(r["model"] for r in results):
        section = model_section(name, [r for r in results if r["model"] == name])
        (details / f"{name}.md").write_text("\n".join(section))
    if md_path.exists():
        for kept in KEPT.finditer(md_path.read_text()):
            text += "\n" + kept.group(0) + "\n"
    md_path.parent.mkdir(parents=True, exist_ok=True)
    md_path.write_text(text)
    plot(results, png_path)
    png_path.with_name("results.json").write_text(json.dumps(dict(meta=meta, results=results), indent=1))
