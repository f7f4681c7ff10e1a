"""Per-sample gradient rows on disk: computed once, in chunks, read memory-mapped.

A :class:`GradientStore` is a directory of ``.npy`` chunks ``[c, D]`` (``D`` the width of
one sample's row: its flattened, concatenated gradients) and a ``meta.json`` that says
what the rows are. A chunk is written to a temporary name and renamed when whole, so a
fill that stops (an interrupted job, a crash) leaves only finished chunks; the next
:meth:`GradientStore.fill` over the same loader skips them (no forward, no backward) and
computes the rest. The store fingerprints the loader's tensors as it goes (:class:`Fingerprint`):
each chunk's batch, so that a resumed fill over other data raises, and the whole data, however
batched, so that a complete store read through another loader (another training set, another
order) raises rather than scoring the old rows; and the first batch's rows are computed again
and compared with the stored ones, so that another ``loss_fn`` or forward raises too. Reads map the chunks (``numpy.load(mmap_mode="c")``: copy on write, the files are never changed): what is in memory
at once is one chunk, never the whole ``[n, D]``.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

try:
    import numpy as np
except ModuleNotFoundError as err:
    raise ModuleNotFoundError(
        f'jacmem.attribution needs numpy for its store ({err}): pip install "jacmem[attribution]"', name=err.name
    ) from err

from jacmem.attribution.progress import progress_bar

__all__ = ["Fingerprint", "GradientStore", "allocate"]

_META = "meta.json"


def _tensors(batch: Any) -> list[Tensor]:
    """The tensors of ``batch`` in order: itself, or those of its tuple's, list's or
    mapping's values, nested (other values are not fingerprinted)."""
    if isinstance(batch, Tensor):
        return [batch]
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    return [t for v in values for t in _tensors(v)]


def _bytes(t: Tensor) -> memoryview:
    """The bytes of ``t``'s values, row-major, on the host."""
    return memoryview(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())


class Fingerprint:
    """A BLAKE2b digest of a loader's tensors that does not depend on how it batches them:
    one digest per tensor position in a batch (``(x, y)``: two), fed each batch's rows in
    order, and the rows' dtype and shape where they change; and :meth:`of_batch`, one
    batch's."""

    def __init__(self):
        self.streams: list = []
        self.rows: list[str] = []  # each stream's rows' dtype and shape, as last fed

    def update(self, batch: Any) -> None:
        tensors = _tensors(batch)
        while len(self.streams) < len(tensors):
            self.streams.append(hashlib.blake2b(digest_size=16))
            self.rows.append("")
        for i, t in enumerate(tensors):
            rows = f"{t.dtype}{tuple(t.shape[1:])}"
            if rows != self.rows[i]:
                self.streams[i].update(rows.encode())
                self.rows[i] = rows
            self.streams[i].update(_bytes(t))

    def hexdigest(self) -> str:
        return "-".join(s.hexdigest() for s in self.streams)

    @staticmethod
    def of_batch(batch: Any) -> str:
        one = Fingerprint()
        one.update(batch)
        return f"{[tuple(t.shape) for t in _tensors(batch)]}:{one.hexdigest()}"


class GradientStore:
    """Rows ``[n, D]`` in chunks under ``path`` (created if missing).

    ``key``: what the rows are (JSON-serialisable: the width, the dtype, how they were
    computed); a directory filled under another key raises, naming both and the fix, so
    that rows of another model or setting are never read as these."""

    def __init__(self, path: str | os.PathLike, key: dict[str, Any]):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.key = json.loads(json.dumps(key))  # as it reads back
        meta = self.path / _META
        if meta.exists():
            found = json.loads(meta.read_text())
            if found["key"] != self.key:
                raise ValueError(
                    f"jacmem.attribution: the store {str(self.path)!r} holds rows of {found['key']}, not of "
                    f"{self.key}; pass a new directory (or delete this one) to compute them again"
                )
            self._chunks: int | None = found.get("chunks")
            self._data: str | None = found.get("data")
        else:
            self._chunks, self._data = None, None
            self._write_meta()
        #: whether this object's rows are known to be those ``fill``'s ``rows`` gives
        #: (it wrote them, or checked its first chunk)
        self._rows_checked = False

    def _write_meta(self) -> None:
        tmp = self.path / (_META + ".tmp")
        tmp.write_text(json.dumps({"key": self.key, "chunks": self._chunks, "data": self._data}))
        os.replace(tmp, self.path / _META)

    def _chunk(self, i: int) -> Path:
        return self.path / f"chunk_{i:07d}.npy"

    def _batch_print(self, i: int) -> Path:
        return self.path / f"chunk_{i:07d}.batch"

    def _other_data(self, what: str) -> ValueError:
        return ValueError(
            f"jacmem.attribution: the store {str(self.path)!r} holds the rows of other data than this loader's "
            f"({what}); pass the loader it was filled from, in the same order, or a new directory (or delete "
            f"this one) to compute the rows of this one"
        )

    @property
    def complete(self) -> bool:
        """Whether a fill has run to the end of its loader."""
        return self._chunks is not None

    def fill(
        self,
        batches: Iterable,
        rows: Callable[[Any], Tensor],
        *,
        total: int | None = None,
        desc: str = "training gradients",
        progress: bool | None = None,
    ) -> None:
        """Compute ``rows(batch) -> [b, D]`` for each batch not stored yet, one chunk per
        batch, in the loader's order (which must be the same on every fill: no shuffling).
        A complete store computes only its first batch's rows again (once per object), to
        check them against the stored ones, and reads the loader through once to check that its data are those
        stored (a :class:`Fingerprint`; any batching), else raises."""
        data, count = Fingerprint(), 0
        if self.complete:
            for i, batch in enumerate(batches):
                data.update(batch)
                if i == 0 and not self._rows_checked:
                    self._check_rows(batch, rows)
            if data.hexdigest() != self._data:
                raise self._other_data("their values, shapes or order differ")
            return
        for i, batch in enumerate(progress_bar(batches, total=total, desc=desc, enabled=progress)):
            count = i + 1
            data.update(batch)
            printed = Fingerprint.of_batch(batch)
            if self._chunk(i).exists():
                if self._batch_print(i).read_text() != printed:
                    raise self._other_data(f"batch {i} differs from the one its stored chunk was computed from")
                if i == 0 and not self._rows_checked:
                    self._check_rows(batch, rows)
                continue
            self._batch_print(i).write_text(printed)
            self.write(i, rows(batch))
        self._chunks, self._data = count, data.hexdigest()
        self._rows_checked = True
        self._write_meta()

    def _check_rows(self, batch: Any, rows: Callable[[Any], Tensor]) -> None:
        """Raise unless ``rows(batch)`` (the loader's first batch) equals the stored chunk 0
        to ``max(1e-4, 10 eps)`` of its norm: the key and the data's fingerprint cannot see a
        changed ``loss_fn`` or forward (a loss scaled by 2 read the old rows, scores 50% off)."""
        stored = torch.from_numpy(np.load(self._chunk(0), mmap_mode="c"))
        now = rows(batch).detach().cpu()
        tol = max(1e-4, 10 * torch.finfo(now.dtype).eps)
        if now.shape != stored.shape or (now.double() - stored.double()).norm() > tol * stored.double().norm():
            raise ValueError(
                f"jacmem.attribution: the store {str(self.path)!r} holds rows that the loss function and model "
                "give no more (its first batch's rows, computed again, differ: another loss_fn, or the model's "
                "code changed); pass a new directory (or delete this one) to compute them again"
            )
        self._rows_checked = True

    def write(self, i: int, rows: Tensor) -> None:
        """Chunk ``i`` := ``rows [b, D]`` (on the host, as a float type numpy holds),
        renamed into place once written."""
        rows = rows.detach().cpu()
        if rows.dtype == torch.bfloat16:  # numpy has no bfloat16
            rows = rows.float()
        tmp = self.path / f"chunk_{i:07d}.tmp.npy"
        out = np.lib.format.open_memmap(tmp, mode="w+", dtype=rows.numpy().dtype, shape=tuple(rows.shape))
        out[...] = rows.numpy()
        out.flush()
        del out
        os.replace(tmp, self._chunk(i))

    def chunks(self) -> Iterator[Tensor]:
        """The chunks in order, each ``[c, D]``, memory-mapped (copy on write: the file stays as it is)."""
        if not self.complete:
            raise RuntimeError(
                f"jacmem.attribution: the store {str(self.path)!r} is not complete; fill it from its loader first"
            )
        for i in range(self._chunks):
            yield torch.from_numpy(np.load(self._chunk(i), mmap_mode="c"))

    def sizes(self) -> list[int]:
        """The rows of each chunk (from the files' headers; nothing is read)."""
        return [chunk.shape[0] for chunk in self.chunks()]

    def __len__(self) -> int:
        return sum(self.sizes())


def allocate(shape: tuple[int, ...], dtype: torch.dtype, out: str | os.PathLike | None) -> Tensor:
    """Zeros of ``shape`` in memory (``out=None``), or memory-mapped in the ``.npy`` file ``out``."""
    if out is None:
        return torch.zeros(shape, dtype=dtype)
    kind = torch.empty((), dtype=torch.float32 if dtype == torch.bfloat16 else dtype).numpy().dtype
    return torch.from_numpy(np.lib.format.open_memmap(out, mode="w+", dtype=kind, shape=shape))
