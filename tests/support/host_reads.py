"""Counting host reads: :class:`HostReads` counts, under a ``TorchDispatchMode``, the ops
whose result the host must read (on an accelerator, each waits until the device's queue
drains), with ``tolist`` and ``numpy``, which read a tensor's memory without an op the
mode sees. tests/engine/test_host_syncs.py uses it on every layer and model; the
distributed tests on their ranks' backward passes."""

from __future__ import annotations

import collections
import traceback
from unittest import mock

from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

#: ops whose result the host reads (their output's size, or a Python scalar)
HOST_READS = frozenset(
    {
        "_local_scalar_dense",  # .item(), float(t), int(t), bool(t)
        "is_nonzero",
        "nonzero",
        "nonzero_static",
        "equal",
        "allclose",
        "masked_select",
        "_unique",
        "_unique2",
        "unique_dim",
        "unique_consecutive",
        "bincount",  # its length is the largest index
        "histc",
        "repeat_interleave",  # without output_size, its length is a sum of the data
        "lift_fresh",  # torch.tensor(host data): on an accelerator, a copy that waits for its queue
    }
)


class HostReads(TorchDispatchMode):
    """Counts, by op, what reads the device from the host, and where in jacmem each came from."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()
        self.origins: collections.Counter[str] = collections.Counter()

    def note(self, name: str) -> None:
        self.counts[name] += 1
        frames = [f for f in traceback.extract_stack() if "/jacmem/" in f.filename]
        self.origins[f"{name} at {frames[-1].filename}:{frames[-1].lineno}" if frames else name] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        if name in HOST_READS and not (name == "repeat_interleave" and (kwargs or {}).get("output_size")):
            self.note(name)
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        self.patches = []
        for method in ("tolist", "numpy"):
            original = getattr(Tensor, method)

            def counted(t, *a, _original=original, _method=method, **k):
                self.note(_method)
                return _original(t, *a, **k)

            self.patches.append(mock.patch.object(Tensor, method, counted))
        for patch in self.patches:
            patch.start()
        return super().__enter__()

    def __exit__(self, *exc):
        for patch in self.patches:
            patch.stop()
        return super().__exit__(*exc)

    def check(self, what: str) -> None:
        assert not self.counts, f"{what}: host reads in the backward pass: {dict(self.origins)}"


def backward_reads(loss: Tensor) -> HostReads:
    with HostReads() as reads:
        loss.backward()
    return reads
