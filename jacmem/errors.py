"""jacmem's own exceptions.

:class:`UnsupportedModuleError`: a model jacmem cannot give exact per-sample gradients
(raised by :func:`jacmem.extensions.clipping.check`, so by
:meth:`jacmem.privacy.PrivacyEngine.make_private`). It is a ``ValueError`` and, where
Opacus is installed, Opacus's ``opacus.validators.errors.UnsupportedModuleError``, so
that code written for Opacus catches it. Opacus is an optional extra (``jacmem[dp]``),
and importing it takes longer than importing jacmem: the class is made on first use,
``jacmem.UnsupportedModuleError`` and ``jacmem.errors.UnsupportedModuleError`` alike.

:class:`UnsupportedCurvatureError`: a backward reaches trainable parameters that a
second-order extension of the block cannot give its result for; raised before the
backward begins, so nothing is written.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn


class UnsupportedCurvatureError(NotImplementedError):
    """A backward reaches trainable parameters (``params``) that a second-order extension
    of the block has no result for: KFAC for a BatchNorm's, any kind for one read outside
    every module's forward. Raised before the backward begins (nothing is written); the
    message names each parameter, its module, and the fix."""

    def __init__(self, message: str, params: Iterable[nn.Parameter] = ()):
        super().__init__(message)
        #: the parameters refused
        self.params = list(params)


@functools.cache
def unsupported_module_error() -> type[ValueError]:
    """The class :class:`UnsupportedModuleError`, made once: Opacus's error of that name
    among its bases where Opacus is importable, ``ValueError`` in any case."""
    try:
        from opacus.validators.errors import UnsupportedModuleError as OpacusError
    except ImportError:
        bases: tuple[type, ...] = (ValueError,)
    else:
        bases = (OpacusError, ValueError)
    doc = "A module whose per-sample gradients jacmem cannot compute exactly; the message names it and the fix."
    return type("UnsupportedModuleError", bases, {"__module__": __name__, "__doc__": doc})


def __getattr__(name: str):
    if name == "UnsupportedModuleError":
        return unsupported_module_error()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
