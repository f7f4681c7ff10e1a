"""jacmem's own exceptions.

:class:`UnsupportedModuleError`: a model jacmem cannot give exact per-sample gradients
(raised by :func:`jacmem.extensions.clipping.check`, so by
:meth:`jacmem.privacy.PrivacyEngine.make_private`). It is a ``ValueError`` and, where
Opacus is installed, Opacus's ``opacus.validators.errors.UnsupportedModuleError``, so
that code written for Opacus catches it. Opacus is an optional extra (``jacmem[dp]``),
and importing it takes longer than importing jacmem: the class is made on first use,
``jacmem.UnsupportedModuleError`` and ``jacmem.errors.UnsupportedModuleError`` alike.
"""

from __future__ import annotations

import functools


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
