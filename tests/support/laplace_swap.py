"""A pytest plugin that runs laplace-torch's own tests against jacmem: ``-p tests.support.laplace_swap``.

It swaps the import, nothing else: laplace's curvlinops backends ``CurvlinopsGGN`` and
``CurvlinopsEF``, which are also the backends Laplace picks by default, are
:class:`jacmem.laplace.JacmemGGN` and :class:`jacmem.laplace.JacmemEF` in every module of
laplace-torch that names them, from before the first test module is imported, as if
laplace-torch had been written with jacmem's backends in their place.
"""

from __future__ import annotations

import laplace
import laplace.baselaplace
import laplace.curvature
import laplace.curvature.curvlinops
import pytest

from jacmem.laplace import JacmemEF, JacmemGGN

#: laplace's modules that import the curvlinops backends by name
_MODULES = (laplace, laplace.curvature, laplace.curvature.curvlinops, laplace.baselaplace)


def pytest_configure(config: pytest.Config) -> None:
    for module in _MODULES:
        for name, backend in (("CurvlinopsGGN", JacmemGGN), ("CurvlinopsEF", JacmemEF)):
            if hasattr(module, name):
                setattr(module, name, backend)
