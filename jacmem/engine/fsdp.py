"""FSDP2 (``torch.distributed.fsdp.fully_shard``): per-sample quantities computed on the
unsharded parameters, stored on the user's sharded ones.

Under FSDP2, ``model.parameters()`` are ``DTensor`` shards (``Shard(0)`` over a 1-D
mesh of ``W`` ranks, dimension 0 cut into ``torch.chunk``-style pieces); while a module
runs forward and backward, FSDP puts in their place unsharded parameters (one object per
parameter, kept across steps), and after its backward reduce-scatters their ``.grad``
into the sharded ``.grad``, averaged over the ranks. jacmem's hooks see the unsharded
parameters, so every per-sample quantity is computed on the full parameter during its
backward, before FSDP's reduce-scatter; at the end of the pass this module lands the
results on the sharded parameters, scaled as FSDP scales gradients (its default
average, as :mod:`jacmem.engine.distributed` does for DDP: each rank's per-sample
gradients divided by ``W``, their squared norms by ``W²``):

- ``grad_batch``: ``DTensor`` ``[N, *param.shape]`` over the *global* batch, placed
  ``Shard(1)`` (the parameter's ``Shard(0)``): each rank holds every sample's gradient
  on the coordinates it owns (one ``all_to_all`` per pass), and ``full_tensor()`` is
  one process's ``grad_batch`` on the concatenated batch (rank 0's samples first);
- ``batch_l2``: a plain tensor ``[n_r]``, the squared norms of the *full* per-sample
  gradients of the rank's own samples;
- ``sum_grad_squared`` and ``variance``: ``DTensor`` like the parameter, over the global
  batch (the sums reduce-scattered to the shards);
- :class:`jacmem.ClipGrad`: the clip factors come from the norms of the full per-sample
  gradients (every parameter of the unsharded model), the clipped sums are
  reduce-scattered (summed over the ranks, as the DDP path sums them: each rank ends
  with its shard of what one process gets on the whole batch, ``ClipGrad.samples`` the
  global count) and added to the sharded ``.grad``, in the sharded parameter's dtype
  (under a ``MixedPrecisionPolicy``, the reduction runs in float32 or float64, never
  lower). autograd's gradients reach FSDP as zeros, so FSDP's own reduce-scatter adds
  nothing: gradient accumulation over several passes adds into ``.grad`` as FSDP does.

A parameter that one rank's batch did not reach (a branch its samples did not take) gets,
on that rank, its shard of the global quantities and of the clipped sum all the same, and
zeros for its own samples, as under DDP: the ranks' shards of one parameter stay parts of
one update.

Frozen parameters (``requires_grad=False``, a LoRA base) are skipped, as FSDP skips them;
a parameter tied across modules (GPT-2's ``wte`` and ``lm_head``) is one FSDP parameter.
Every rank must run the same extensions on the same parameters, as FSDP requires.

What jacmem cannot do exactly raises when the model's forward enters the block (or at
``jacmem.track``), naming FSDP and the module: second-order extensions, a placement other
than ``Shard(0)`` over a 1-D mesh (HSDP's 2-D meshes, ``shard_placement_fn``), and FSDP1
(``FullyShardedDataParallel``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn

from jacmem import compat
from jacmem.derivatives.quantities import as_quantity
from jacmem.engine.distributed import GLOBAL_QUANTITIES, anywhere, check_summed, host_values, zeros

if torch.distributed.is_available():
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.distributed.tensor import DTensor, Shard
else:  # pragma: no cover - builds without torch.distributed
    FSDPModule = FullyShardedDataParallel = DTensor = Shard = None

#: the types of FSDP's modules, FSDP2's and FSDP1's (none without torch.distributed): a model
#: holds none of them, most models, and :func:`check` has nothing to say (asked without a call)
KINDS: tuple[type, ...] = () if FSDPModule is None else (FSDPModule, FullyShardedDataParallel)


def is_fsdp(module: nn.Module) -> bool:
    """Whether ``module`` is an FSDP2 module (``fully_shard``-ed)."""
    return FSDPModule is not None and isinstance(module, FSDPModule)


def sharded(param: Tensor) -> bool:
    """Whether ``param`` is a sharded ``DTensor`` (FSDP2's, for the block's models)."""
    return DTensor is not None and isinstance(param, DTensor)


def unshard_own(module: nn.Module) -> None:
    """An FSDP2 module whose own parameters (not its children's) are still sharded as its
    call begins, when the block sees it: unshard them now (``FSDPModule.unshard``, what
    FSDP's pre-forward hook, which runs after the block's, does next), so that the engines
    see the parameters its forward uses."""
    if is_fsdp(module) and any(map(sharded, module.parameters(recurse=False))):
        module.unshard()


def check(model: nn.Module, name, second_order: bool) -> bool:
    """Raise where jacmem cannot compute exactly under the FSDP modules of ``model``
    (``name(module)`` names them): FSDP1, second-order extensions, a placement other
    than FSDP2's ``Shard(0)`` over a 1-D mesh. Returns whether ``model`` holds FSDP2
    modules (whose calls :func:`unshard_own` must see)."""
    if FSDPModule is None:
        return False
    found = False
    for module in model.modules():
        if not isinstance(module, KINDS):
            continue  # (most modules: no label made)
        label = f"module {name(module)!r} ({type(module).__name__})"
        if isinstance(module, FullyShardedDataParallel):
            raise RuntimeError(
                f"jacmem: {label} is FSDP1 (FullyShardedDataParallel), whose flat parameters jacmem cannot map "
                "to per-sample quantities. Shard it with FSDP2 instead: torch.distributed.fsdp.fully_shard."
            )
        if not is_fsdp(module):
            continue
        found = True
        if second_order:
            raise RuntimeError(
                f"jacmem: {label} is sharded by FSDP (fully_shard); second-order extensions (DiagGGN, DiagHessian, "
                "KFAC, ...) do not support FSDP. Compute them on an unsharded copy of the model in one process, "
                "or under DistributedDataParallel."
            )
        for sharded, _ in compat.fsdp_parameters(module):
            if sharded.device_mesh.ndim != 1 or tuple(sharded.placements) != (Shard(0),):
                raise RuntimeError(
                    f"jacmem: {label} is sharded by FSDP with placements {tuple(sharded.placements)} on a "
                    f"{sharded.device_mesh.ndim}-D mesh; jacmem supports FSDP2's default, Shard(0) on a 1-D mesh "
                    "(no HSDP, no shard_placement_fn)."
                )
    return found


def shardings(models: Iterable[nn.Module]) -> list[Sharding]:
    """The trainable FSDP2 parameters of ``models``, one :class:`Sharding` per mesh, in
    model order (the same on every rank)."""
    by_mesh: dict[int, Sharding] = {}
    seen: set[int] = set()
    if FSDPModule is None:
        return []
    for model in models:
        for module in model.modules():
            if not isinstance(module, FSDPModule):  # (is_fsdp, without a call per module)
                continue
            for sharded, unsharded in compat.fsdp_parameters(module):
                if unsharded is None or not sharded.requires_grad or id(sharded) in seen:
                    continue
                seen.add(id(sharded))
                mesh = sharded.device_mesh
                by_mesh.setdefault(id(mesh), Sharding(mesh)).add(sharded, unsharded)
    return list(by_mesh.values())


class Sharding:
    """The FSDP2 parameters on one 1-D device mesh: ``params`` the unsharded ones (what
    the engines key their quantities by), ``sharded`` ``id(unsharded) -> sharded``."""

    def __init__(self, mesh):
        self.mesh = mesh
        self.group = mesh.get_group()
        self.world, self.rank = mesh.size(), mesh.get_local_rank()
        self.params: list[nn.Parameter] = []
        self.sharded: dict[int, nn.Parameter] = {}

    def add(self, sharded: nn.Parameter, unsharded: nn.Parameter) -> None:
        self.params.append(unsharded)
        self.sharded[id(unsharded)] = sharded

    def _rows(self, p: Tensor) -> tuple[int, int, int]:
        """(chunk size, first row, rows) of this rank's shard of ``p``'s dimension 0."""
        chunk = -(-p.shape[0] // self.world)
        first = min(self.rank * chunk, p.shape[0])
        return chunk, first, min(chunk, p.shape[0] - first)

    def _dtype(self) -> torch.dtype:
        return torch.float64 if any(p.dtype == torch.float64 for p in self.params) else torch.float32

    def reduce_scatter(self, values: dict[int, Tensor], count: int) -> tuple[dict[int, Tensor], Tensor]:
        """Each rank's shard of the sums over the ranks of ``values`` (``id(unsharded)
        -> [*param.shape]``; a parameter this rank lacks contributes zeros), and the sum
        of ``count`` (a 0-d tensor on the device: no host read): one ``reduce_scatter``.
        Returns ``id(unsharded) -> [*local shape]`` for the keys of ``values``, and for
        the parameters that only other ranks had (a branch this rank's batch did not
        take): telling which is a host read of one flag per parameter, made only where
        this rank lacks some."""
        dtype, device = self._dtype(), self.params[0].device
        had = [float(id(p) in values) for p in self.params]
        rows: list[list[Tensor]] = [[] for _ in range(self.world)]
        for p in self.params:
            chunk = self._rows(p)[0]
            padded = torch.zeros((chunk * self.world, *p.shape[1:]), dtype=dtype, device=device)
            if id(p) in values:
                padded[: p.shape[0]] = values[id(p)]
            for r, part in enumerate(padded.split(chunk)):
                rows[r].append(part.flatten())
        tail = torch.cat([host_values(had, dtype, device), host_values([count], dtype, device)])  # to every rank
        buffer = torch.cat([t for row in rows for t in (*row, tail)])
        out = buffer.new_empty(buffer.numel() // self.world)
        torch.distributed.reduce_scatter_single(out, buffer, group=self.group)
        result, offset = {}, 0
        for p, used in zip(self.params, anywhere(out[-1 - len(had) : -1], had)):
            chunk, _, n = self._rows(p)
            size = chunk * p.shape[1:].numel()
            if used:
                shard = out[offset : offset + size].view(chunk, *p.shape[1:])[:n]
                result[id(p)] = shard.to(values[id(p)].dtype if id(p) in values else p.dtype)
            offset += size
        return result, out[-1].round()

    def _gather_samples(self, batches: dict[int, Tensor], n: int) -> dict[int, Tensor]:
        """``id(unsharded) -> [N, *local shape]``: every rank's per-sample gradients on
        this rank's coordinates, from ``batches`` (``id -> [n, *param.shape]``, this rank's
        ``n`` samples; a parameter this rank lacks sends zeros): one ``all_to_all``."""
        dtype, device = self._dtype(), self.params[0].device
        counts = torch.tensor([n], device=device)
        everyone = [torch.empty_like(counts) for _ in range(self.world)]
        torch.distributed.all_gather(everyone, counts, group=self.group)
        sizes = [int(c) for c in torch.cat(everyone).tolist()]
        sends: list[list[Tensor]] = [[] for _ in range(self.world)]
        for p in self.params:
            full = batches.get(id(p))
            full = torch.zeros((n, *p.shape), dtype=dtype, device=device) if full is None else full.to(dtype)
            for r, part in enumerate(full.tensor_split(self._bounds(p), dim=1)):
                sends[r].append(part.flatten())
        send = torch.cat([t for row in sends for t in row])
        local = [self._rows(p)[2] * p.shape[1:].numel() for p in self.params]
        recv = send.new_empty(sum(sizes) * sum(local))
        torch.distributed.all_to_all_single(
            recv,
            send,
            output_split_sizes=[m * sum(local) for m in sizes],
            input_split_sizes=[sum(t.numel() for t in row) for row in sends],
            group=self.group,
        )
        blocks = [[m * n for n in local] for m in sizes]
        parts = [piece.split(block) for piece, block in zip(recv.split(list(map(sum, blocks))), blocks)]
        out = {}
        for i, p in enumerate(self.params):
            if id(p) in batches:
                pieces = [part[i].view(m, -1, *p.shape[1:]) for part, m in zip(parts, sizes)]
                out[id(p)] = torch.cat(pieces).to(batches[id(p)].dtype)
        return out

    def _bounds(self, p: Tensor) -> list[int]:
        """Where dimension 0 of ``p`` is cut into the ranks' shards."""
        chunk = -(-p.shape[0] // self.world)
        return [min(r * chunk, p.shape[0]) for r in range(1, self.world)]

    def synchronize(
        self, wanted: Iterable[str], quantities: dict[int, dict[str, Tensor]], sizes: dict[int, int], batch: int
    ) -> list[nn.Parameter]:
        """As :func:`jacmem.engine.distributed.synchronize`, for the parameters of this
        mesh, and to their shards: ``batch_grad`` becomes ``[N, *local shape]`` over the
        global batch, the global quantities this rank's shard of their sums over the
        ranks, ``sizes`` the global batch size. In place. A parameter that only other
        ranks computed gets zeros on this rank's ``batch`` samples first (telling which
        is a host read of one flag per parameter, made only where this rank lacks some);
        returns those parameters."""
        wanted = set(wanted)
        check_summed(wanted)
        dtype, device = self._dtype(), self.params[0].device
        n = next((sizes[id(p)] for p in self.params if id(p) in sizes), batch)
        had = [float(id(p) in quantities) for p in self.params]
        head = torch.cat([host_values(had, dtype, device), host_values([n], dtype, device)])
        torch.distributed.all_reduce(head, group=self.group)  # the flags, and the global batch size
        added = [p for p, used, own in zip(self.params, anywhere(head[:-1], had), had) if used and not own]
        for p in added:
            quantities[id(p)] = zeros(p, n, wanted, dtype)
        for p in self.params:
            for name, value in quantities.get(id(p), {}).items():
                quantities[id(p)][name] = value / self.world ** as_quantity(name).degree
        if "batch_grad" in wanted:
            batches = {id(p): quantities[id(p)]["batch_grad"] for p in self.params if id(p) in quantities}
            for key, value in self._gather_samples(batches, n).items():
                quantities[key]["batch_grad"] = value
        for name in GLOBAL_QUANTITIES:
            if name in wanted:
                values = {id(p): quantities[id(p)][name] for p in self.params if name in quantities.get(id(p), {})}
                for key, value in self.reduce_scatter(values, n)[0].items():
                    quantities[key][name] = value
        total = head[-1].round()
        for p in self.params:
            if id(p) in quantities:
                sizes[id(p)] = total
        return added

    def dtensor(self, key: int, local: Tensor, dim: int = 0) -> Tensor:
        """``local`` (this rank's shard, ``dim`` the parameter's dimension 0) as a
        ``DTensor`` placed like the sharded parameter of ``key``, in its dtype."""
        sharded = self.sharded[key]
        shape = (*local.shape[:dim], *sharded.shape)
        return DTensor.from_local(
            local.to(sharded.dtype).contiguous(),
            self.mesh,
            [Shard(dim)],
            run_check=False,
            shape=torch.Size(shape),
            stride=torch.empty(shape, device="meta").stride(),
        )
