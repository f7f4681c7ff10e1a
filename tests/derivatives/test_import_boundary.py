"""The derivatives package imports torch, einops, opt_einsum and the standard library,
and of jacmem's own code only :mod:`jacmem.compat` (the private torch APIs, which sit
below every layer); inside it, the imports run one way (no circles)."""

import ast
import sys
from pathlib import Path

import jacmem.derivatives

PACKAGE = Path(jacmem.derivatives.__file__).parent
ALLOWED = {"torch", "einops", "opt_einsum", *sys.stdlib_module_names}


def imports(path: Path) -> list[str]:
    """The modules ``path`` imports, anywhere in it; ``from jacmem.derivatives import
    linear`` counts as ``jacmem.derivatives.linear``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path.name}: a relative import"
            found += [
                f"{node.module}.{a.name}"
                if (PACKAGE / f"{a.name}.py").exists() or node.module == "jacmem"
                else node.module
                for a in node.names
            ]
    return found


FILES = {path.stem: imports(path) for path in sorted(PACKAGE.glob("*.py"))}


def test_only_torch_einops_opt_einsum_and_itself():
    outside = {
        (name, module)
        for name, modules in FILES.items()
        for module in modules
        if module.split(".")[0] not in ALLOWED
        and not module.startswith("jacmem.derivatives")
        and module != "jacmem.compat"
    }
    assert not outside, f"imports from outside the allowed set: {sorted(outside)}"


def test_no_import_circles_inside():
    """Every file but ``__init__`` imports only files below it; nothing imports the package itself."""
    edges = {
        name: {
            m.rpartition(".")[2] if m != "jacmem.derivatives" else "__init__"
            for m in modules
            if m.startswith("jacmem.derivatives")
        }
        for name, modules in FILES.items()
    }
    assert not any("__init__" in targets for name, targets in edges.items() if name != "__init__"), edges
    done, path = set(), []

    def visit(name: str) -> None:
        assert name not in path, f"import circle: {' -> '.join([*path[path.index(name) :], name])}"
        if name in done:
            return
        path.append(name)
        for target in sorted(edges[name]):
            visit(target)
        path.pop()
        done.add(name)

    for name in edges:
        visit(name)
