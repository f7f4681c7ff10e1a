"""Every private torch API that jacmem uses is reached through :mod:`jacmem.compat`
(where tests/engine/test_compat.py checks each on the torch installed here): no other
file of the package names one. A torch upgrade that moves one then breaks in one place."""

import ast
import functools
import pathlib
import warnings

import torch
from torch import nn

import jacmem
from jacmem import compat

PACKAGE = pathlib.Path(jacmem.__file__).parent
COMPAT = PACKAGE / "compat.py"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


@functools.cache
def _torch_private_attributes() -> set[str]:
    """The private attribute names of the torch objects jacmem handles: modules (their
    class and an instance's own), a compiled module's wrapper, tensors, autograd nodes,
    hook handles, optimizers."""
    lin = nn.Linear(1, 1)
    out = lin(torch.ones(1, 1))
    handle = out.register_hook(lambda g: g)
    handle.remove()
    sgd = torch.optim.SGD(lin.parameters())
    names = {a for obj in (nn.Module, lin, torch.Tensor, out, out.grad_fn, handle, sgd) for a in dir(obj)}
    with warnings.catch_warnings():  # (torch.compile's first use warns of torch.jit's deprecations)
        warnings.simplefilter("ignore", DeprecationWarning)
        compiled = torch.compile(lin)
    names.update(vars(compiled), compat.child_slots(compiled))  # (_orig_mod; its dir() reads deprecated attributes)
    return {a for a in names if _private(a)}


def _own_attributes(tree: ast.AST) -> set[str]:
    """The names a file assigns to ``self.<name>``: its own objects' attributes."""
    return {
        target.attr
        for node in ast.walk(tree)
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign))
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self"
    }


def _root(node: ast.expr) -> ast.expr:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node


def private_torch_uses(source: str, torch_private: set[str]) -> list[str]:
    """``line: code`` of each private torch name in ``source``: an attribute of ``torch``
    (``torch._C``, ``torch.utils._pytree``), an import from a private torch module or of a
    private name, a private attribute of a torch object (``module._parameters``,
    ``node._saved_alpha``), also as a string (``getattr(node, "_input_metadata")``)."""
    tree = ast.parse(source)
    own = _own_attributes(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            root = _root(node)
            if isinstance(root, ast.Name) and root.id == "torch":
                hit = True
            elif isinstance(node.value, ast.Name) and node.value.id in ("self", "cls") and node.attr in own:
                hit = False  # (the file's own object's attribute, named like one of torch's)
            else:
                hit = node.attr in torch_private or node.attr.startswith("_saved_")
        elif isinstance(node, ast.ImportFrom):
            parts = (node.module or "").split(".")
            hit = parts[0] == "torch" and (any(map(_private, parts)) or any(_private(a.name) for a in node.names))
        elif isinstance(node, ast.Import):
            hit = any(a.name.split(".")[0] == "torch" and any(map(_private, a.name.split("."))) for a in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            hit = node.value in torch_private or node.value.startswith("_saved_")
        else:
            hit = False
        if hit:
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_private_torch_name_outside_compat():
    torch_private = _torch_private_attributes()
    found = {
        str(path.relative_to(PACKAGE)): uses
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != COMPAT and (uses := private_torch_uses(path.read_text(), torch_private))
    }
    assert not found, f"private torch names outside jacmem/compat.py (put each behind a function there): {found}"


def test_the_scan_finds_each_kind_of_private_name():
    """The scan is not blind: each form it looks for, in a sample, is found; public
    names and a file's own attributes are not."""
    sample = """
import torch._dynamo
from torch.utils._pytree import tree_map
from torch.nn.modules.module import _global_forward_hooks
torch._C._current_graph_task_id()
module._parameters
node._saved_alpha
getattr(node, "_input_metadata", None)
t._version
class Own:
    def __init__(self):
        self._indices = {}
    def f(self):
        return self._indices
torch.autograd.grad
module.named_parameters()
"""
    found = private_torch_uses(sample, _torch_private_attributes())
    assert sorted({int(line.split(":")[0]) for line in found}) == [2, 3, 4, 5, 6, 7, 8, 9], found
