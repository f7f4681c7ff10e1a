"""benchmarks/ imports one way: no module imports itself back through others, the
shared harness imports no other benchmark module, and no module imports another's
private names."""

import ast
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _imports(path: Path) -> tuple[set[str], list[str]]:
    """The ``benchmarks`` modules that ``path`` imports (at any depth of its code), and
    the private names it imports from them."""
    modules, private = set(), []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "benchmarks":
            if node.module == "benchmarks":
                modules |= {alias.name for alias in node.names}
            else:
                modules.add(node.module.split(".")[1])
                private += [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
        elif isinstance(node, ast.Import):
            modules |= {a.name.split(".")[1] for a in node.names if a.name.startswith("benchmarks.")}
    return modules, private


GRAPH = {p.stem: _imports(p) for p in BENCHMARKS.glob("*.py")}


def test_no_import_circles():
    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, f"import circle: {' -> '.join((*path, module))}"
        for other in GRAPH.get(module, (set(), []))[0]:
            visit(other, (*path, module))

    for module in GRAPH:
        visit(module, ())


def test_harness_is_the_bottom_and_nothing_imports_the_driver():
    assert GRAPH["harness"][0] == set()
    importers = [m for m, (imports, _) in GRAPH.items() if "run" in imports and m != "__main__"]
    assert importers == []


def test_no_private_names_across_files():
    assert {m: private for m, (_, private) in GRAPH.items() if private} == {}
