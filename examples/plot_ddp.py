"""DistributedDataParallel: two processes on CPU
==============================================

jacmem finds a ``DistributedDataParallel`` wrapper from the forward pass and needs
nothing else. ``grad_batch`` and ``batch_l2`` describe each rank's own samples;
``sum_grad_squared`` and ``variance`` describe the global batch (jacmem sums them over
the process group at the end of each backward pass, in one ``all_reduce``). With
DDP's average and ``reduction="mean"``, two ranks with equal halves of a batch give
exactly what one process gives on the whole batch.

This example starts two processes with the ``gloo`` backend on the loopback device
(the same script, run as a worker; they meet through a file), then runs the whole
batch in this process and compares.
On GPUs, the same code runs under ``torchrun`` with ``nccl``
(see :doc:`/guide/distributed`).

Run: ``python examples/plot_ddp.py`` (``JACMEM_QUICK=1`` for a small run).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import jacmem

# sphinx-gallery runs an example without __file__, in the example's folder
HERE = Path(globals().get("__file__", "plot_ddp.py")).resolve()
WORLD = 2
PER_RANK = 8 if os.environ.get("JACMEM_QUICK") == "1" else 64


def setup():
    """The model ``[N, 1, 12, 12] -> [N, 10]`` and the whole batch, the same in every
    process (seeded)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 10 * 10, 10))
    X, y = torch.randn(WORLD * PER_RANK, 1, 12, 12), torch.randint(0, 10, (WORLD * PER_RANK,))
    return model, X, y


def step(model, X, y) -> dict[str, dict[str, torch.Tensor]]:
    """One step under BatchGrad and Variance: {field: {parameter: value}}."""
    with jacmem.extend(jacmem.BatchGrad(), jacmem.Variance()):
        nn.functional.cross_entropy(model(X), y).backward()
    params = dict(getattr(model, "module", model).named_parameters())
    return {f: {n: getattr(p, f) for n, p in params.items()} for f in ("grad_batch", "variance", "grad")}


def worker(rank: int, rendezvous: str, out: str) -> None:
    """One rank: its half of the batch, under DDP; saves its results to ``out``. The
    ranks meet through the file ``rendezvous``."""
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=WORLD)
    model, X, y = setup()
    ddp = nn.parallel.DistributedDataParallel(model)
    rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    torch.save(step(ddp, X[rows], y[rows]), out)
    dist.barrier()  # every rank's collectives are done


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "--rank":
    worker(int(sys.argv[2]), sys.argv[3], sys.argv[4])
    # leave at once, the group left as it is: destroying it (or the interpreter's
    # teardown) joins gloo's threads while holding the GIL, and one of them may be freeing
    # a finished collective that holds a Python object, waiting for the GIL (a hang, now
    # and then)
    sys.stdout.flush()
    os._exit(0)

# %%
# Start the two ranks (this file, run with ``--rank``), each on its half of the batch.
# They meet through a file, not a TCP port (a port found free may be taken before rank 0
# binds it), and gloo talks over the loopback device: the host's name may resolve to an
# address a sandbox cannot reach.

with tempfile.TemporaryDirectory() as tmp:
    rendezvous, outs = os.path.join(tmp, "rendezvous"), [os.path.join(tmp, f"rank{r}.pt") for r in range(WORLD)]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE), "--rank", str(r), rendezvous, outs[r]], env=env, stderr=subprocess.PIPE
        )
        for r in range(WORLD)
    ]
    for r, proc in enumerate(procs):
        _, err = proc.communicate(timeout=300)
        if proc.returncode:
            raise RuntimeError(f"rank {r} failed:\n{err.decode()}")
    ranks = [torch.load(o) for o in outs]

# %%
# The whole batch in one process, and the comparison: rank ``r``'s ``grad_batch`` is
# the single process's rows of its samples; ``variance`` and DDP's averaged ``.grad``
# are the single process's.

model, X, y = setup()
single = step(model, X, y)
for name in single["grad"]:
    for r, result in enumerate(ranks):
        rows = slice(r * PER_RANK, (r + 1) * PER_RANK)
        torch.testing.assert_close(result["grad_batch"][name], single["grad_batch"][name][rows])
        torch.testing.assert_close(result["variance"][name], single["variance"][name])
        torch.testing.assert_close(result["grad"][name], single["grad"][name])
    print(f"{name:<9} grad_batch (per rank), variance and .grad: as one process on the whole batch")

# %%
# Each sample's gradient norm, from its rank against from the single process.

from matplotlib import pyplot as plt  # noqa: E402

fig, ax = plt.subplots(figsize=(6, 4))
norm = lambda gb: torch.stack([g.flatten(1).norm(dim=1) for g in gb.values()]).norm(dim=0)  # noqa: E731
whole = norm(single["grad_batch"])
for r, result in enumerate(ranks):
    ax.plot(range(r * PER_RANK, (r + 1) * PER_RANK), norm(result["grad_batch"]), "o", label=f"rank {r}")
ax.plot(whole, "k+", ms=12, label="one process, whole batch")
ax.set(xlabel="sample (global index)", ylabel="per-sample gradient norm", title="BatchGrad under DDP, 2 gloo ranks")
ax.legend(fontsize=8)
fig.tight_layout()
