"""DistributedDataParallel: per-sample quantities of each rank's own samples, sums over
the global batch.

DDP averages the ranks' gradients: with ``W`` ranks, rank ``r`` holding ``n_r``
samples and a loss reduced by ``"mean"`` on each rank,

    .grad = (1/W) Σ_r (1/n_r) Σ_{i ∈ r} ∇ℓ_i

which, for equal ``n_r = N/W``, is ``(1/N) Σ_i ∇ℓ_i``: the gradient of one process on
the concatenated batch. jacmem scales as DDP does, so that the same holds for every
quantity:

- ``grad_batch`` and ``batch_l2`` describe the rank's own samples. ``grad_batch`` is the
  rank's per-sample gradient divided by ``W`` (``batch_l2`` by ``W²``): summed over the
  samples of *all* ranks it gives DDP's ``.grad``, and each rank's rows equal that
  process's rows of a single-process run on the concatenated batch.
- ``sum_grad_squared`` and ``variance`` describe the global batch: each rank's
  ``sum_grad_squared`` (of the scaled per-sample gradients) and summed gradient are
  summed over the ranks with one ``all_reduce`` per backward pass, and ``variance``
  divides by the global batch size ``N = Σ_r n_r``.

This assumes DDP's default communication (average). Every rank must run the same
extensions on the same parameters, as DDP itself requires.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from jacmem import compat
from jacmem.derivatives.quantities import GRAD, SUM_GRAD_SQUARED, as_quantity

#: the quantities that are summed over the ranks; the others (one row per sample) stay
#: local. A quantity carries ``1/W`` to the power of its degree (``Quantity.degree``).
GLOBAL_QUANTITIES = (SUM_GRAD_SQUARED, GRAD)


def check_summed(wanted: Iterable[str]) -> None:
    """Raise where ``wanted`` holds a quantity without a row per sample that the ranks do
    not sum (one of the user's own: only :data:`GLOBAL_QUANTITIES` are summed), rather
    than write each rank's own sum as the global batch's."""
    bad = sorted(str(q) for q in wanted if q not in GLOBAL_QUANTITIES and not as_quantity(q).per_sample)
    if bad:
        raise NotImplementedError(
            f"jacmem: quantity {bad[0]} is a sum over the samples, and across the ranks of DistributedDataParallel "
            "or FSDP2 jacmem sums only sum_grad_squared and grad: each rank would write its own samples' sum. "
            "Make it a per-sample quantity (per_sample = True) and sum its rows yourself, or compute it in one process"
        )


def process_group_of(module: nn.Module) -> Any | None:
    """The process group of a ``DistributedDataParallel`` module, or of the one a
    ``torch.compile`` wrapper holds; None for any other module, or when
    ``torch.distributed`` is not initialised."""
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return None
    module = compat.uncompiled(module)
    if isinstance(module, nn.parallel.DistributedDataParallel):
        return module.process_group
    return None


def synchronize(
    group: Any,
    params: list[nn.Parameter],
    wanted: Iterable[str],
    quantities: dict[int, dict[str, Tensor]],
    sizes: dict[int, int | Tensor],
    batch: int,
) -> list[nn.Parameter]:
    """Scale the quantities of ``params`` (``id(param) -> {quantity: tensor}``, only the
    parameters this rank computed) as DDP scales gradients, sum the global ones over
    ``group`` if the block wants any (``wanted``), and set ``sizes`` (``id(param) ->
    batch size``) to the global batch size, a 0-d tensor on the parameters' device
    (reading it on the host would wait for the ``all_reduce``). In place.

    ``params`` must be the same list, in the same order, on every rank. A parameter that
    this rank did not compute (a branch its ``batch`` samples did not take, under
    ``find_unused_parameters=True``) has zero per-sample gradients on them: it adds zeros
    to the sums and ``batch`` to the count; where another rank computed it, it gets the
    global quantities too, and zeros for the local ones (telling which is a host read of
    one flag per parameter, made only where this rank lacks some of ``params``). Returns
    those parameters, whose quantities are now in ``quantities`` and ``sizes``.
    """
    check_summed(wanted)
    world = torch.distributed.get_world_size(group)
    for key, q in quantities.items():
        if key in {id(p) for p in params}:
            for name, value in q.items():
                q[name] = value / world ** as_quantity(name).degree
    if not params or not any(name in GLOBAL_QUANTITIES for name in wanted):
        return []  # the same decision on every rank, so that all or none call the collective
    dtype = torch.float64 if any(p.dtype == torch.float64 for p in params) else torch.float32
    device = params[0].device
    had = [float(id(p) in quantities) for p in params]
    parts: list[Tensor] = []
    for p in params:
        q = quantities.get(id(p), {})
        for name in GLOBAL_QUANTITIES:
            value = q.get(name)
            parts.append((torch.zeros(p.shape, dtype=dtype, device=device) if value is None else value).flatten())
    counts = host_values([sizes.get(id(p), batch) for p in params], dtype, device)
    buffer = torch.cat([*[t.to(dtype=dtype, device=device) for t in parts], counts, host_values(had, dtype, device)])
    torch.distributed.all_reduce(buffer, group=group)
    flags = anywhere(buffer[-len(params) :], had)
    added = [p for p, used, own in zip(params, flags, had) if used and not own]
    for p in added:
        quantities[id(p)] = zeros(p, batch, wanted, dtype)
    offset = 0
    for p in params:
        q = quantities.get(id(p))
        for name in GLOBAL_QUANTITIES:
            value = buffer[offset : offset + p.numel()].view(p.shape)
            offset += p.numel()
            if q is not None and name in q:
                q[name] = value.to(q[name].dtype)
    counts = buffer[offset : offset + len(params)].round()
    for i, p in enumerate(params):
        if id(p) in quantities:
            sizes[id(p)] = counts[i]
    return added


def zeros(p: nn.Parameter, n: int, wanted: Iterable[str], dtype: torch.dtype) -> dict[str, Tensor]:
    """The ``wanted`` quantities of a parameter with zero per-sample gradients on ``n`` samples."""
    return {
        name: torch.zeros(as_quantity(name).shape(n, tuple(p.shape)), dtype=dtype, device=p.device) for name in wanted
    }


def sum_over_ranks(
    group: Any, params: list[nn.Parameter], values: dict[int, Tensor], count: int
) -> tuple[dict[int, Tensor], Tensor]:
    """The sums over the ranks of ``group`` of ``values`` (``id(param) -> tensor`` of the
    parameter's shape, for those of ``params`` this rank has; the others contribute
    zeros) and of ``count`` (a 0-d tensor on the device: no host read), with one
    ``all_reduce``. ``params`` must be the same list, in the same order, on every rank;
    values of other parameters stay as they are.

    A parameter this rank has no value for gets the sum too where another rank has one
    (a branch this rank's batch did not take, under ``find_unused_parameters=True``), so
    that every rank holds the same sums; telling which is a host read of one flag per
    parameter, made only where this rank lacks some of ``params``."""
    own = {id(p) for p in params}
    dtype = torch.float64 if any(p.dtype == torch.float64 for p in params) else torch.float32
    device = params[0].device if params else torch.device("cpu")
    parts = [values.get(id(p), torch.zeros(p.shape, dtype=dtype, device=device)).to(dtype).flatten() for p in params]
    had = [float(id(p) in values) for p in params]
    buffer = torch.cat([*parts, host_values(had, dtype, device), host_values([count], dtype, device)])
    torch.distributed.all_reduce(buffer, group=group)
    out = {key: v for key, v in values.items() if key not in own}
    sizes = [p.numel() for p in params]
    offset = 0
    for p, size, used in zip(params, sizes, anywhere(buffer[-1 - len(params) : -1], had)):
        if used:
            out[id(p)] = (
                buffer[offset : offset + size].view(p.shape).to(values[id(p)].dtype if id(p) in values else p.dtype)
            )
        offset += size
    return out, buffer[-1].round()


def anywhere(summed: Tensor, had: list[float]) -> list[float]:
    """Whether any rank had each parameter, from ``summed``, the ranks' sums of ``had``
    (this rank's flags): read on the host only where this rank lacks some."""
    return summed.tolist() if not all(had) else had


def host_values(values: list[float], dtype: torch.dtype, device: torch.device) -> Tensor:
    """``values`` as a ``[len(values)]`` tensor on ``device`` by fills, not by a copy from
    host memory (``torch.tensor``), which on an accelerator waits for the device's queue;
    the values of one backward's counts are mostly equal: one fill each run of them."""
    runs, start = [], 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[start]:
            runs.append(torch.full((i - start,), float(values[start]), dtype=dtype, device=device))
            start = i
    return torch.cat(runs) if len(runs) != 1 else runs[0]
