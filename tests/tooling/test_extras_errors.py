"""A missing extra's error names the extra: ``jacmem.privacy`` without Opacus and
``jacmem.laplace`` without laplace-torch raise an ImportError that says which
``pip install "jacmem[...]"`` brings it. The package is hidden (``None`` in
``sys.modules``, for it and its submodules, makes their import fail), not uninstalled;
``import jacmem`` needs neither.
"""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

EXTRAS = [
    ("jacmem.privacy", "opacus", "dp"),
    ("jacmem.laplace", "laplace", "laplace"),
    ("jacmem.attribution", "numpy", "attribution"),
]


@pytest.mark.parametrize(("module", "package", "extra"), EXTRAS, ids=[e for _, _, e in EXTRAS])
def test_a_missing_extra_is_named_with_its_pip_install(monkeypatch, module, package, extra):
    for name in [package, *(m for m in sys.modules if m.startswith(package + "."))]:
        monkeypatch.setitem(sys.modules, name, None)
    for name in [module, *(m for m in sys.modules if m.startswith(module + "."))]:  # restored afterwards
        monkeypatch.delitem(sys.modules, name, raising=False)
    with pytest.raises(ImportError, match=rf'pip install "jacmem\[{extra}\]"') as err:
        importlib.import_module(module)
    assert isinstance(err.value, ModuleNotFoundError) and err.value.name.partition(".")[0] == package
    assert module not in sys.modules


def test_jacmem_itself_imports_without_the_extras():
    hide = "import sys; sys.modules['opacus'] = sys.modules['laplace'] = None; import jacmem; jacmem.extend"
    subprocess.run([sys.executable, "-c", hide], check=True, capture_output=True)
