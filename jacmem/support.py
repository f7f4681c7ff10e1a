"""The support table, extensions × layers × strategies, generated from the registry.

A row per parameter of each layer jacmem ships a derivative for; a column per
extension, listing the strategy names that extension can use on that parameter (see
:func:`strategy_names`). Parameters with equal cells share a row, and so do layers
with equal rows. A line after the table names the losses and modules that the
second-order extensions' curvature passes through.
Modules registered by users (their functions live outside jacmem) are left out.
The docs render it when the site is built (``docs/guide/support.rst``).

.. code-block:: text

    python -m jacmem.support                  # print the Markdown table
    python -m jacmem.support --write FILE.md  # rewrite the block between the markers of a file
    python -m jacmem.support --check FILE.md  # exit 1 if that block is stale
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import jacmem
from jacmem.derivatives import LOSSES, PASSTHROUGH, QUANTITIES, REGISTRY, LayerDerivatives
from jacmem.extensions.firstorder import FirstOrderExtension
from jacmem.extensions.secondorder import SecondOrderExtension

START = "<!-- support-table:start -->"
#: marks a layer whose parameter names depend on the instance (``for_module``)
VARIES = "†"
END = "<!-- support-table:end -->"


def extensions() -> list[type]:
    """The public first-order extension classes, in ``jacmem.__all__`` order."""
    found = (getattr(jacmem, name) for name in jacmem.__all__)
    return [e for e in found if isinstance(e, type) and issubclass(e, FirstOrderExtension)]


def _origin(fn: Callable) -> str:
    """The module that defines ``fn``, through ``functools.partial``."""
    while isinstance(fn, partial):
        fn = fn.func
    return getattr(fn, "__module__", None) or ""


def builtin(module_type: type | str, entry: LayerDerivatives) -> bool:
    """Whether this is a stock torch layer, or a library's layer known by its qualified
    name, that jacmem itself ships a derivative for (types registered by users stay out)."""
    return shipped(module_type) and any(
        _origin(s.fn).startswith("jacmem.") for table in entry.strategies.values() for s in table.values()
    )


def shipped(module_type: type | str) -> bool:
    """Whether jacmem ships this type's entry: torch's and :mod:`jacmem.nn`'s types, and
    library types registered by qualified name (not those registered by users)."""
    return isinstance(module_type, str) or module_type.__module__.startswith(("torch.", "jacmem.nn"))


def layer_name(module_type: type | str) -> str:
    if isinstance(module_type, str):
        return module_type
    if module_type.__module__.startswith("torch.nn"):
        return f"nn.{module_type.__qualname__}"
    return f"{module_type.__module__}.{module_type.__qualname__}"


def strategy_names(entry: LayerDerivatives, param: str, extension: type) -> tuple[str, ...]:
    """The strategies ``extension`` can use for ``param``: those of ``batch_grad``,
    from which every quantity can be derived, then those of its own quantities, as
    :func:`jacmem.engine.planner.compute` offers them."""
    names = dict.fromkeys(entry.strategies[(param, "batch_grad")])
    for quantity in (q for q in QUANTITIES if q in extension.quantities):
        names.update(dict.fromkeys(entry.strategies.get((param, quantity), {})))
    return tuple(names)


def rows() -> list[tuple[list[str], list[tuple[list[str], tuple[tuple[str, ...], ...]]]]]:
    """``[(layer names, [(param names, strategies per extension), ...]), ...]``, in
    registration order; layer names in Markdown, marked with ``VARIES`` where needed.
    Parameters of a layer with equal cells share a row, and layers with equal rows too."""
    groups: dict[tuple, list[str]] = {}
    exts = extensions()
    for module_type, entry in REGISTRY.items():
        if not builtin(module_type, entry) or not entry.params:
            continue
        params: dict[tuple, list[str]] = {}
        for p in entry.params:
            params.setdefault(tuple(strategy_names(entry, p, e) for e in exts), []).append(p)
        key = tuple((tuple(names), cells) for cells, names in params.items())
        groups.setdefault(key, []).append(f"`{layer_name(module_type)}`" + (VARIES if entry.for_module else ""))
    return [(names, [(list(ps), cells) for ps, cells in key]) for key, names in groups.items()]


def table() -> str:
    """The support table, as Markdown."""
    exts = extensions()
    lines = [
        "| layer | parameters | " + " | ".join(f"`{e.__name__}`" for e in exts) + " |",
        "|---|---|" + "---|" * len(exts),
    ]
    varies = False
    for names, params in rows():
        varies = varies or any(n.endswith(VARIES) for n in names)
        for i, (pnames, cells) in enumerate(params):
            layer = ", ".join(names) if i == 0 else ""
            strategies = [", ".join(f"`{s}`" for s in cell) for cell in cells]
            lines.append(f"| {layer} | {', '.join(f'`{p}`' for p in pnames)} | " + " | ".join(strategies) + " |")
    if varies:
        note = "The parameter names depend on the instance (an RNN's depth, say); all get the same strategies."
        lines += ["", f"{VARIES} {note}"]
    return "\n".join(lines) + "\n"


def _names(types) -> str:
    """Markdown names of the stock module types among ``types``: torch's and
    :mod:`jacmem.nn`'s (not those registered by users)."""
    stock = [t for t in types if shipped(t)]
    return ", ".join(f"`{layer_name(t)}`" for t in stock)


def second_order() -> str:
    """Where the second-order extensions' curvature starts (losses) and which modules
    it flows back through, from :mod:`jacmem.derivatives`, as Markdown."""
    exts = [getattr(jacmem, n) for n in jacmem.__all__]
    exts = [e for e in exts if isinstance(e, type) and issubclass(e, SecondOrderExtension)]
    if not exts:
        return ""
    return (
        f"Second order ({', '.join(f'`{e.__name__}`' for e in exts)}): the curvature starts at "
        f"{_names(LOSSES)} and flows back through {_names(PASSTHROUGH)}.\n"
    )


def _split(text: str, path: str) -> tuple[str, str, str]:
    """(before and START, the block, END and after)."""
    if text.count(START) != 1 or text.count(END) != 1 or text.index(START) > text.index(END):
        raise ValueError(f"{path} needs one {START!r} line, then one {END!r} line, for the support table")
    head, rest = text.split(START)
    block, tail = rest.split(END)
    return head + START, block, END + tail


def generate() -> str:
    """Everything between the markers: the table, then the second-order line."""
    extra = second_order()
    return table() + (f"\n{extra}" if extra else "")


def block(text: str, path: str = "README.md") -> str:
    """The table between the markers of ``text``."""
    return _split(text, path)[1].strip("\n") + "\n"


def rewrite(text: str, path: str = "README.md") -> str:
    """``text`` with the block between the markers replaced by the current table."""
    head, _, tail = _split(text, path)
    return f"{head}\n{generate()}{tail}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Print, write or check jacmem's support table.")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write", metavar="README", help="rewrite the block between the markers of this file")
    group.add_argument("--check", metavar="README", help="exit 1 if this file's block differs from the registry")
    args = parser.parse_args(argv)
    if args.write:
        path = Path(args.write)
        path.write_text(rewrite(path.read_text(), args.write))
        print(f"wrote the support table to {path}")
    elif args.check:
        if block(Path(args.check).read_text(), args.check) != generate():
            print(f"{args.check}'s support table is stale: run python -m jacmem.support --write {args.check}")
            return 1
        print(f"{args.check}'s support table matches the registry")
    else:
        print(generate(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
