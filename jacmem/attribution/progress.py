"""Progress bars by tqdm where it is installed (the ``attribution`` extra)."""

from __future__ import annotations

from collections.abc import Iterable


def progress_bar(items: Iterable, *, total: int | None, desc: str, enabled: bool | None) -> Iterable:
    """``items`` with a tqdm bar: ``enabled=None`` shows one where tqdm is installed,
    ``True`` requires it (an ``ImportError`` naming the extra), ``False`` shows none."""
    if enabled is False:
        return items
    try:
        from tqdm.auto import tqdm
    except ImportError as err:
        if enabled:
            raise ImportError(
                f'jacmem.attribution: progress=True needs tqdm ({err}): pip install "jacmem[attribution]"'
            ) from err
        return items
    return tqdm(items, total=total, desc=desc, leave=False)
