"""The library's import structure (docs: DESIGN.md, "Layers of the code").

Each module imports only modules of its own layer or below (derivatives < extensions <
engine < context < the package's public names < privacy, laplace), no module takes part
in an import circle, and no module imports another file's private names.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "jacmem"

#: module name prefix -> layer; the longest prefix decides
LAYERS = {
    "jacmem.compat": 0,  # the private torch APIs, behind one function each: below everything
    "jacmem.derivatives": 0,
    "jacmem.errors": 0,
    "jacmem.walker": 0,  # the one walk of autograd's graph, which the engine and the memory report use
    "jacmem.extensions": 1,
    "jacmem.nn": 1,
    "jacmem.engine": 2,
    "jacmem.context": 3,
    "jacmem.memory": 3,
    "jacmem": 4,
    "jacmem.privacy": 5,
    "jacmem.laplace": 5,
    "jacmem.support": 5,
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> list[tuple[str, list[str]]]:
    """(module imported, the names taken from it) for each jacmem import in ``path``,
    at any depth (late imports count)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names if a.name.split(".")[0] == "jacmem"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] != "jacmem":
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append((sub, []) if sub in MODULES else (base, [alias.name]))
    return found


def _graph() -> dict[str, set[str]]:
    return {name: {m for m, _ in _imports(name, path) if m in MODULES and m != name} for name, path in MODULES.items()}


def _layer(name: str) -> int:
    prefix = max((p for p in LAYERS if name == p or name.startswith(p + ".")), key=len)
    return LAYERS[prefix]


def _package_of(name: str) -> str:
    """The module itself and its parents, as far as ``jacmem.X``."""
    return ".".join(name.split(".")[:2])


def test_every_module_has_a_layer():
    assert all(name == "jacmem" or name.startswith("jacmem.") for name in MODULES)
    assert "jacmem.engine.secondorder.engine" in MODULES, "the layout moved: update this test"


def test_no_import_runs_up_the_layers():
    up = sorted(
        f"{a} (layer {_layer(a)}) imports {b} (layer {_layer(b)})"
        for a, targets in _graph().items()
        for b in targets
        if _layer(b) > _layer(a)
    )
    assert not up, "\n".join(up)


def test_no_import_circles():
    graph = _graph()
    circles = []
    for start in sorted(graph):
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    circles.append(" -> ".join([*path, start]))
                elif nxt not in seen and nxt > start:  # each circle once, from its smallest module
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
    # a package's __init__ importing its own submodules, which import the package's
    # names back, is how Python packages re-export: not a circle between files
    circles = [c for c in circles if not _reexport(c)]
    assert not circles, "\n".join(circles)


def _reexport(circle: str) -> bool:
    names = circle.split(" -> ")
    return any(n in MODULES and MODULES[n].name == "__init__.py" for n in names)


def test_no_file_imports_another_files_private_names():
    reached = []
    for name, path in MODULES.items():
        for module, names in _imports(name, path):
            if module.rsplit(".", 1)[-1].startswith("_") and module.rsplit(".", 1)[-1] != "__init__":
                reached.append(f"{name} imports the private module {module}")
            reached += [f"{name} imports {module}.{n}" for n in names if n.startswith("_")]
        tree = ast.parse(path.read_text())
        aliases = set()  # the names jacmem modules are bound to in this file
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                aliases |= {a.asname or a.name for a in node.names if a.name.split(".")[0] == "jacmem"}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jacmem"):
                aliases |= {a.asname or a.name for a in node.names if f"{node.module}.{a.name}" in MODULES}
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                reached.append(f"{name} reads {node.value.id}.{node.attr}")
    assert not reached, "\n".join(sorted(set(reached)))


def test_the_public_add_ons_import_public_names_only():
    """privacy, laplace and memory import the package's public names, the block
    (:class:`jacmem.engine.block.Block`) and the public extensions, nothing else of the
    engine; :mod:`jacmem.compat`, the one way to a private torch API for every layer; and the one
    graph walker (:mod:`jacmem.walker`), which the memory report's walk uses."""
    allowed = {"jacmem", "jacmem.compat", "jacmem.engine.block", "jacmem.extensions.clipping", "jacmem.walker"}
    wrong = []
    for name, path in MODULES.items():
        if _package_of(name) not in ("jacmem.privacy", "jacmem.laplace", "jacmem.memory"):
            continue
        for module, names in _imports(name, path):
            if module.startswith("jacmem.memory") and name.startswith("jacmem.memory"):
                continue
            if module not in allowed or (module == "jacmem.engine.block" and names != ["Block"]):
                wrong.append(f"{name} imports {module} {names}")
    assert not wrong, "\n".join(wrong)
