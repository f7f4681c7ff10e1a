"""DistributedDataParallel: two gloo processes on 127.0.0.1 against one process on the
concatenated batch.

Each rank holds its own half of the batch. The reference is the per-sample autograd
loop of ``tests/support/reference.py`` on the whole batch, in float64, in each rank. With DDP's
averaging and ``reduction="mean"`` (see :mod:`jacmem.engine.distributed`):

- ``grad_batch`` and ``batch_l2`` of rank ``r`` are the reference's rows of rank ``r``'s
  samples;
- ``sum_grad_squared`` and ``variance`` are the reference's, over the whole batch;
- ``.grad`` (DDP's average) is the reference's sum.

A plain model in the same block keeps its own, unscaled quantities.

Three ways in: the forward inside the block (DDP found from the forward, also through
``torch.compile``'s wrapper), the forward
outside with ``jacmem.track``, and a plain (not DDP) model with an explicit
``process_group=`` whose gradients the test averages by hand. Then a branch that one
rank's batch does not take (``find_unused_parameters=True``): its per-sample gradients
are zero on that rank's samples, which the global quantities count. One start of the two
processes runs them all, as starting processes is the slow part.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from tests.support.distributed import needs_gloo, run_ranks
from tests.support.host_reads import backward_reads
from tests.support.reference import REFERENCE, assert_close, clear, mse, per_sample_grads
from torch import nn

import jacmem

WORLD = 2
PER_RANK = 3
FIELDS = ("grad_batch", "batch_l2", "sum_grad_squared", "variance")


def net():
    """[N, 2, 5, 5] -> [N, 3]"""
    return nn.Sequential(nn.Conv2d(2, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(27, 3)).double()


def extensions():
    return [jacmem.BatchGrad(), jacmem.BatchL2Grad(), jacmem.SumGradSquared(), jacmem.Variance()]


def check(rank, params, reference, rows, what):
    for i, (p, gb) in enumerate(zip(params, reference)):
        where = f"rank {rank} {what} param {i}"
        assert_close(p.grad, gb.sum(0), f"{where} .grad")
        for field in FIELDS:
            expected = REFERENCE[field](gb)
            if field in ("grad_batch", "batch_l2"):
                expected = expected[rows]
            assert_close(getattr(p, field), expected, f"{where} {field}")


class TwoHeads(nn.Module):
    """[N, 2, 5, 5] -> [N, 3]: :func:`net`'s body, then head ``a`` or ``b`` (``self.head``)."""

    def __init__(self):
        super().__init__()
        self.body, self.head = net()[:-1], "a"
        self.a, self.b = nn.Linear(27, 3).double(), nn.Linear(27, 3).double()

    def forward(self, x):
        return getattr(self, self.head)(self.body(x))


def _branch_reference(model: TwoHeads, X, y) -> list:
    """Per-sample gradients of the mean loss over the whole batch, rank ``r``'s rows
    through head ``"ab"[r]`` (zero for the other head): [WORLD·PER_RANK, *p.shape] per parameter."""
    parts = []
    for r in range(WORLD):
        model.head = "ab"[r]
        rows = slice(r * PER_RANK, (r + 1) * PER_RANK)
        grads = per_sample_grads(model, X[rows], y[rows], mse)  # the mean over these rows only
        parts.append([grads[p] / WORLD for p in model.parameters()])
    return [torch.cat(rows) for rows in zip(*parts)]


def _worker(rank: int) -> None:
    torch.manual_seed(0)  # the same model and the same whole batch in every rank
    model = net()
    X = torch.randn(WORLD * PER_RANK, 2, 5, 5, dtype=torch.float64)
    y = torch.randn(WORLD * PER_RANK, 3, dtype=torch.float64)
    full = per_sample_grads(model, X, y, mse)
    reference = [full[p] for p in model.parameters()]
    rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    Xr, yr = X[rows], y[rows]

    ddp = nn.parallel.DistributedDataParallel(model)
    local = nn.Linear(4, 2).double()  # not DDP: its quantities stay this rank's own, unscaled
    Zr, zr = torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)
    local_reference = per_sample_grads(local, Zr, zr, mse)
    with jacmem.extend(*extensions()):
        backward_reads(mse(ddp(Xr), yr, "mean")).check("DDP")  # the global batch size stays on the device
        mse(local(Zr), zr, "mean").backward()
    check(rank, model.parameters(), reference, rows, "inside")
    check(rank, local.parameters(), [local_reference[p] for p in local.parameters()], slice(None), "local")

    clear(model)
    with jacmem.extend(*extensions()):  # DDP inside torch.compile's wrapper: its group found through it
        mse(torch.compile(ddp, backend="aot_eager")(Xr), yr, "mean").backward()
    check(rank, model.parameters(), reference, rows, "torch.compile(DDP)")

    clear(model)
    jacmem.track(ddp)
    try:
        loss = mse(ddp(Xr), yr, "mean")
        with jacmem.extend(*extensions()):
            loss.backward()
    finally:
        jacmem.untrack(ddp)
    check(rank, model.parameters(), reference, rows, "track")

    clear(model)
    with jacmem.extend(*extensions(), process_group=dist.group.WORLD):
        mse(model(Xr), yr, "mean").backward()
    for p in model.parameters():  # average as DDP would
        dist.all_reduce(p.grad)
        p.grad /= WORLD
    check(rank, model.parameters(), reference, rows, "process_group=")

    torch.manual_seed(0)
    branches = TwoHeads()
    reference = _branch_reference(branches, X, y)
    branches.head = "ab"[rank]
    ddp = nn.parallel.DistributedDataParallel(branches, find_unused_parameters=True)
    for _ in range(2):  # the second pass must not keep the first's
        clear(branches)
        with jacmem.extend(*extensions()):
            mse(ddp(Xr), yr, "mean").backward()
        check(rank, branches.parameters(), reference, rows, f"find_unused_parameters, head {branches.head}")


@needs_gloo
def test_two_ranks_equal_one_process_on_the_concatenated_batch(tmp_path):
    run_ranks(_worker, tmp_path, world=WORLD)
