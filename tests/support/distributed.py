"""Runs a test's function in several processes, each a rank of one gloo process group.

Three things make these tests deterministic under load, run after run:

- spawn, not fork: a fork inherits the state of every test before it (a lock held by
  another thread at the fork left a rank waiting forever);
- the ranks meet through a file in the test's own ``tmp_path``, not a TCP port: a port
  found free here may be taken by another process before rank 0 binds it, and ranks of
  two test runs on one machine that land on the same port join each other's group;
- a rank that passed meets the others at a barrier and ends with ``os._exit``, its group
  not destroyed: ``destroy_process_group`` (or the interpreter's teardown) joins gloo's
  threads while holding the GIL, and one of them may be freeing a finished collective
  whose thread-local state holds a Python object, waiting for the GIL (a hang, now and
  then); tearing the process down around them aborts it now and then ("terminate called
  without an active exception").
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

needs_gloo = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="no gloo backend in this build"
)


def run_ranks(worker: Callable[..., None], tmp_path: Path, *args: Any, world: int = 2) -> None:
    """``worker(rank, *args)`` in ``world`` processes, each rank ``rank`` of the default
    process group (gloo, on the loopback device). A rank's exception fails the test with
    its traceback. ``worker`` must be importable by name (a module-level function)."""
    store = f"file://{tmp_path / 'rendezvous'}"
    mp.start_processes(_rank, args=(worker, store, world, args), nprocs=world, join=True, start_method="spawn")


def _rank(rank: int, worker: Callable[..., None], store: str, world: int, args: tuple) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world)
    try:
        worker(rank, *args)
    except BaseException:
        dist.destroy_process_group()
        raise  # to torch.multiprocessing, which reports its traceback
    dist.barrier()  # every rank's collectives are done: leave, the group as it is
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
