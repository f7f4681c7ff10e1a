"""Warnings that name modules, gathered and given once.

A model with twenty BatchNorms that KFAC cannot handle gets one warning naming a few
of them and the count, not twenty. An engine adds a notice per module
(:meth:`Notices.add`); the block gives each kind of notice once
(:meth:`Notices.flush`) at the end of the forward pass, of each backward pass and of
the block. With ``strict=True``, the first notice raises instead.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType

#: how many modules a warning names before it gives the count of the others
LIMIT = 3


def listing(names: Sequence[str], limit: int = LIMIT) -> str:
    """``'a', 'b', 'c' and 17 more``: at most ``limit`` names, quoted, then the count."""
    names = list(dict.fromkeys(names))
    shown = ", ".join(map(repr, names[:limit]))
    return shown if len(names) <= limit else f"{shown} and {len(names) - limit} more"


def and_others(modules: Sequence[str]) -> str:
    """What a notice about ``modules[0]`` adds for the rest: `` The same holds for 2 more
    module(s): 'b', 'c'.``, or nothing for one module."""
    more = len(modules) - 1
    return f" The same holds for {more} more module(s): {listing(modules[1:], LIMIT - 1)}." if more else ""


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` attributed to the first frame outside jacmem and torch (the
    user's line: their ``loss.backward()`` for a warning from a backward hook), however
    deep in the block's machinery the warning is given."""
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] in ("jacmem", "torch"):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


class Notices:
    """Pending warnings: one per key, each with the modules it is about. A block makes one
    at every step, with no call: ``pending`` is the class's empty mapping until the first
    notice; :class:`StrictNotices` raises instead."""

    #: raise ``RuntimeError`` at the first notice, rather than gather them
    strict = False
    #: key -> (the modules, in order; how to say it about them; the category)
    pending: Mapping[object, tuple[list[str], Callable[[list[str]], str], type[Warning]]] = MappingProxyType({})

    def add(
        self, key: object, module: str, say: Callable[[list[str]], str], category: type[Warning] = UserWarning
    ) -> None:
        """A notice of kind ``key`` about ``module``. ``say(modules)`` words it for the
        modules gathered (the ``say`` of the first notice of a kind is used). With
        ``strict``, raise ``RuntimeError(say([module]))`` now."""
        if self.strict:
            raise RuntimeError(say([module]))
        if not self.pending:  # (the class's, read-only: this block's first notice, or the first since a flush)
            self.pending = {}
        entry = self.pending.get(key)
        if entry is None:
            self.pending[key] = ([module], say, category)
        elif module not in entry[0]:
            entry[0].append(module)

    def flush(self) -> None:
        """Give each pending kind of notice as one warning."""
        pending, self.pending = self.pending, {}
        for modules, say, category in pending.values():
            warn(say(modules), category)


class StrictNotices(Notices):
    """:class:`Notices` of a ``strict=True`` block: the first notice raises."""

    strict = True
