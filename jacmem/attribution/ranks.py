"""The training set sharded over the ranks of a process group (DDP): sums and gathers,
and the checks of the loaders that feed them.

Each rank feeds its own shard of the training (and query) data to
:class:`~jacmem.attribution.Influence`; the curvature is a sum over training examples, so
each rank sums its shard's and the ranks add theirs (:func:`summed`), and the scores of
the ranks' shards are put side by side in rank order (:func:`gathered`). With no group
(``None``) each function returns its input: one process holds the whole data.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from jacmem import compat
from jacmem.engine.distributed import process_group_of


def unwrapped(model: nn.Module, process_group: Any) -> tuple[nn.Module, Any]:
    """``(the model to run, the process group)``: a ``DistributedDataParallel`` model (also
    under ``torch.compile``) gives its module and its group, so that the per-sample
    gradients are the module's own (not scaled by ``1/world`` as DDP's averaging, and
    named without DDP's ``module.``) and DDP's gradient hooks stay out; any other model is
    run as it is, with ``process_group`` (``None``: one process)."""
    group = process_group_of(model)
    if group is None:
        return model, process_group
    return compat.uncompiled(model).module, group if process_group is None else process_group


def summed(group: Any, values: dict[Any, Tensor]) -> dict[Any, Tensor]:
    """``values`` summed over the ranks of ``group`` (one ``all_reduce``): every rank gets
    every key that any rank has, a key a rank lacks (a parameter its shard never used)
    counting as zeros there. Keys must be sortable and the same type on every rank."""
    if group is None:
        return values
    shapes = {key: (tuple(v.shape), v.dtype) for key, v in values.items()}
    everyone: list[Any] = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(everyone, shapes, group=group)
    union: dict[Any, tuple[tuple[int, ...], torch.dtype]] = {}
    for found in everyone:
        union.update(found)
    if not union:
        return {}
    like = next(iter(values.values()), None)
    home = like.device if like is not None else torch.device("cpu")
    device = _device(group, home)
    dtype = torch.float64 if any(d == torch.float64 for _, d in union.values()) else torch.float32
    keys = sorted(union)
    buffer = torch.cat(
        [
            (
                values[k].to(device, dtype) if k in values else torch.zeros(union[k][0], dtype=dtype, device=device)
            ).flatten()
            for k in keys
        ]
    )
    torch.distributed.all_reduce(buffer, group=group)
    out, at = {}, 0
    for k in keys:
        shape, kind = union[k]
        size = torch.Size(shape).numel()
        out[k] = buffer[at : at + size].view(shape).to(home, kind)
        at += size
    return out


def gathered(group: Any, local: Tensor, dim: int = 0) -> Tensor:
    """The ranks' ``local`` tensors concatenated along ``dim`` in rank order (their sizes
    along ``dim`` may differ; the other dims must agree): every rank gets the whole."""
    if group is None:
        return local
    world = torch.distributed.get_world_size(group)
    sizes: list[Any] = [None] * world
    torch.distributed.all_gather_object(sizes, local.shape[dim], group=group)
    most = max(sizes)
    pad = list(local.shape)
    pad[dim] = most - local.shape[dim]
    mine = local.to(_device(group, local.device))
    padded = torch.cat([mine.contiguous(), mine.new_zeros(pad)], dim=dim)
    parts = [torch.empty_like(padded) for _ in range(world)]
    torch.distributed.all_gather(parts, padded, group=group)
    return torch.cat([part.narrow(dim, 0, size) for part, size in zip(parts, sizes)], dim=dim).to(local.device)


def _device(group: Any, device: torch.device) -> torch.device:
    """Where ``group``'s collectives run: NCCL's on the current CUDA device (the stored
    rows are on the host), any other backend's on ``device``."""
    if torch.distributed.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return device


def check_sharded(group: Any, loader: Iterable, what: str) -> None:
    """Raise where ``loader`` draws from a ``DistributedSampler`` of several ranks with no
    process group to sum over (each rank's curvature and scores would be its shard's
    alone), or from one that repeats or drops examples to give every rank as many (a
    dataset not divisible by the ranks): the repeated ones would count twice in the
    curvature and the scores, the dropped ones not at all."""
    sampler = getattr(loader, "sampler", None)
    if not isinstance(sampler, torch.utils.data.DistributedSampler):
        return
    if group is None:
        if sampler.num_replicas > 1:
            raise ValueError(
                f"jacmem.attribution.Influence: the {what} loader's DistributedSampler gives this process one of "
                f"{sampler.num_replicas} shards, but the model is not DistributedDataParallel and no process_group= "
                "was given, so the curvature and the scores would be this shard's alone; pass "
                "process_group=torch.distributed.group.WORLD (or wrap the model in DistributedDataParallel)"
            )
        return
    total, n = sampler.total_size, len(sampler.dataset)
    if total != n:
        how = f"repeats {total - n}" if total > n else f"drops {n - total}"
        raise ValueError(
            f"jacmem.attribution.Influence: the {what} loader's DistributedSampler {how} of the {n} examples to "
            f"share them evenly among {sampler.num_replicas} ranks, so that the curvature and the scores would count "
            "them twice or not at all; give each rank a shard without repeats, e.g. "
            "torch.utils.data.Subset(dataset, range(rank, len(dataset), world)), or a dataset whose size the "
            "number of ranks divides"
        )


def check_ordered(loader: Iterable, what: str) -> None:
    """Raise where ``loader`` shuffles (a ``RandomSampler``, a ``DistributedSampler`` with
    ``shuffle=True``): rows are stored and scored by position, so the scores' columns (or
    rows) would come in an order drawn at random, which the caller cannot know."""
    sampler = getattr(loader, "sampler", None)
    if isinstance(sampler, torch.utils.data.RandomSampler) or (
        isinstance(sampler, torch.utils.data.DistributedSampler) and sampler.shuffle
    ):
        raise ValueError(
            f"jacmem.attribution.Influence: the {what} loader shuffles ({type(sampler).__name__}), so the scores "
            f"would follow an order drawn at random; build the {what} loader with shuffle=False"
        )
