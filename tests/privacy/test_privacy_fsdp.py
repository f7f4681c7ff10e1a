"""jacmem.privacy.PrivacyEngine on FSDP2 (``fully_shard``) models, two gloo ranks.

Each optimizer parameter is a ``DTensor`` sharded by rows (``Shard(0)``), and so is
its ``.grad``: the rank's rows of the clipped sum over the global batch. The noise:

- with the clipped sum zero (a step on an empty batch), the update gathered with
  ``full_tensor()`` is the noise over ``B``: its per-coordinate standard deviation is
  ``σC/B`` (noise added once per coordinate: W ranks each noising every coordinate
  would give ``√W`` times that), in ``secure_mode`` too (Opacus's secure draws, from a
  per-rank stand-in for ``torchcsprng``'s generator, which is not installed here);
- the ranks' noise is independent (no correlation between the two shards' noise, and
  different draws where every rank was seeded alike), and a seeded run draws it again;
- the accountant counts each step once, and every rank reports the same ε.

With noise 0, one private step under FSDP2 equals the per-sample loop's clipped SGD
step on the whole batch (tiny HF GPT-2, tied embeddings, float64): the optimizer alone,
on each ``.grad`` set to what the engine leaves (the loop's clipped sum, sharded), and
the whole step through the backward. What cannot be noised exactly once (a trainable
parameter outside every ``fully_shard``, HSDP's replicated shards, adaptive clipping)
is refused in ``make_private``, naming FSDP and the module.

One start of the two processes runs each group of checks: starting them is the slow
part.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
from opacus.data_loader import DPDataLoader
from tests.support.clipping import norms, per_sample
from tests.support.distributed import needs_gloo, run_ranks
from tests.support.hf_models import gpt2
from tests.support.privacy import LR, clip_factors, loader, loop_step, train
from tests.support.reference import cross_entropy
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import distribute_tensor
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from jacmem.privacy import PrivacyEngine, ShardedDPOptimizer

WORLD = 2
#: the global expected batch size, σ and C of the noise checks
B, SIGMA, C = 8, 1.5, 2.0
WIDTH = 64


def blocks() -> nn.Module:
    """[N, 64] -> [N, 64]: two Linear blocks, each ``fully_shard``-ed, then the root
    (8320 coordinates, half of each parameter's rows on each rank)."""
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH)).double()
    for layer in (model[0], model[2]):
        fully_shard(layer)
    return fully_shard(model)


def shares(dataset: TensorDataset) -> DataLoader:
    """This rank's share of ``dataset`` in batches of ``B / WORLD``: global batches of ``B``."""
    return DataLoader(dataset, batch_size=B // WORLD, sampler=DistributedSampler(dataset, shuffle=False))


def noise_step(engine: PrivacyEngine, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """One private SGD step (lr 1) of a fresh :func:`blocks` model on an empty batch
    (Poisson sampling's), whose clipped sum is zero: (the update gathered over the
    ranks, flat; this rank's rows of it, flat), both the noise over ``B``."""
    torch.manual_seed(0)  # the same model in every rank, and the same global RNG
    model = blocks()
    _, opt, _ = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), data_loader=shares(TensorDataset(torch.randn(2 * B, WIDTH))),
        noise_multiplier=SIGMA, max_grad_norm=C, **{"poisson_sampling": False, **kwargs},
    )  # fmt: skip
    assert isinstance(opt, ShardedDPOptimizer) and opt.expected_batch_size == B
    before = [p.full_tensor() for p in model.parameters()]
    local_before = [p.to_local().clone() for p in model.parameters()]
    try:
        opt.zero_grad()
        opt.step()  # no backward pass: an empty batch, whose clipped sum is zero
    finally:
        engine.detach()
    update = torch.cat([(b - p.full_tensor()).flatten() for b, p in zip(before, model.parameters())])
    local = torch.cat([(b - p.to_local()).flatten() for b, p in zip(local_before, model.parameters())])
    return update, local


def assert_noise(update: torch.Tensor, what: str) -> None:
    """``update`` (n coordinates) has mean 0 and standard deviation σC/B, to within
    five standard errors."""
    n, std = update.numel(), SIGMA * C / B
    assert abs(update.mean().item()) < 5 * std / n**0.5, f"{what}: mean {update.mean().item()}"
    assert abs(update.std().item() / std - 1) < 5 / (2 * n) ** 0.5, f"{what}: std {update.std().item()} vs {std}"


def gathered(local: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``local`` (the same shape in each)."""
    out = [torch.empty_like(local) for _ in range(WORLD)]
    dist.all_gather(out, local)
    return out


def _noise_worker(rank: int) -> None:
    torch.set_default_dtype(torch.float64)
    warnings.simplefilter("ignore")
    for seeded in (False, True):  # torch's global RNG (seeded alike), or one noise_generator per rank seeded alike
        kwargs = {"noise_generator": torch.Generator().manual_seed(1)} if seeded else {}
        engine = PrivacyEngine()
        update, local = noise_step(engine, **kwargs)
        what = f"rank {rank}, {'noise_generator' if seeded else 'global RNG'}"
        assert_noise(update, what)
        # independent ranks: rank r's rows are rank r's noise, as many on each rank
        mine, theirs = gathered(local)
        corr = torch.corrcoef(torch.stack([mine, theirs]))[0, 1].item()
        assert abs(corr) < 5 / mine.numel() ** 0.5, f"{what}: the ranks' noise correlates ({corr})"
        assert not torch.equal(mine, theirs), what
        # seeded alike, a run draws the same noise again
        kwargs = {"noise_generator": torch.Generator().manual_seed(1)} if seeded else {}
        again, _ = noise_step(PrivacyEngine(), **kwargs)
        assert torch.equal(again, update), f"{what}: a second run drew other noise"
        # one step counted once, the same ε on every rank
        assert len(engine.accountant.history) == 1 and engine.accountant.history[0][2] == 1
        eps = gathered(torch.tensor([engine.get_epsilon(1e-5)]))
        assert torch.equal(*eps), f"{what}: ε {eps}"

    # secure_mode: Opacus's path (4 draws and one thrown away), with a per-rank stand-in for torchcsprng's
    # /dev/urandom generator, which is not installed here
    engine = PrivacyEngine()
    engine.secure_mode, engine.secure_rng = True, torch.Generator().manual_seed(1000 + rank)
    update, local = noise_step(engine, poisson_sampling=True)  # Opacus's secure loader is Poisson's
    assert_noise(update, f"rank {rank}, secure_mode")
    mine, theirs = gathered(local)
    assert abs(torch.corrcoef(torch.stack([mine, theirs]))[0, 1].item()) < 5 / mine.numel() ** 0.5


@pytest.mark.slow
@needs_gloo
def test_noise_once_per_coordinate_independent_ranks(tmp_path):
    run_ranks(_noise_worker, tmp_path, world=WORLD)


def _refusal_worker(rank: int) -> None:
    torch.set_default_dtype(torch.float64)
    warnings.simplefilter("ignore")
    torch.manual_seed(0)

    def make_private(model, **kwargs):
        return PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
            data_loader=shares(TensorDataset(torch.randn(2 * B, WIDTH))), noise_multiplier=SIGMA, max_grad_norm=C,
            **kwargs,
        )  # fmt: skip

    # a block sharded, the root not: the root's own Linear is whole on every rank
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH))
    fully_shard(model[0])
    with pytest.raises(ValueError, match=r"FSDP: parameter '1.weight' \(module '1'\) is not sharded"):
        make_private(model, poisson_sampling=False)
    # HSDP: a 2-D mesh replicates each shard over its first axis (here of size 1)
    model = fully_shard(
        nn.Linear(WIDTH, WIDTH), mesh=init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("replicate", "shard"))
    )
    with pytest.raises(
        ValueError, match=r"FSDP: parameter 'weight' \(module 'FSDPLinear'\) has placements .* 2-D mesh"
    ):
        make_private(model, poisson_sampling=False)
    with pytest.raises(ValueError, match=r"clipping='adaptive' is not for distributed training \(FSDP\)"):
        make_private(blocks(), clipping="adaptive", poisson_sampling=False)

    # Poisson sampling: each rank samples its own share; B is the global batch
    _, opt, data = make_private(blocks())
    assert isinstance(data, DPDataLoader) and opt.expected_batch_size == B


@pytest.mark.slow
@needs_gloo
def test_refusals_and_poisson_sampling(tmp_path):
    run_ranks(_refusal_worker, tmp_path, world=WORLD)


PER_RANK = 3


def _step_worker(rank: int, engine: bool, passes: int = 1) -> None:
    """One private step (noise 0) of a tiny HF GPT-2, each block and the root sharded,
    on this rank's rows of the batch, against the loop's step on the whole batch. With
    ``engine`` False the backward is skipped and each ``.grad`` set to what the engine
    leaves under FSDP2 (this rank's rows of the loop's clipped sum over the whole
    batch): the optimizer's part alone. ``passes``: backward passes before the step
    (gradient accumulation), each on a global batch of ``WORLD · PER_RANK``, this
    rank's rows of each: the step divides the clipped sum over all of them by their
    number, as the loop does."""
    torch.set_default_dtype(torch.float64)
    warnings.simplefilter("ignore")
    torch.manual_seed(0)  # the same model and whole batch in every rank
    model = gpt2().double().eval()
    per_pass = WORLD * PER_RANK
    X = torch.randint(0, 23, (passes * per_pass, 5))
    y = torch.randint(0, 23, (passes * per_pass, 5))
    grads = per_sample(model, X, y, cross_entropy, "mean")  # the scale train() gives each sample
    max_norm = norms(grads).median().item()  # clips about half the samples
    factors = clip_factors(grads, max_norm, "flat")
    clipped = [torch.einsum("n,n...->...", factors[p], grads[p]) for p in model.parameters()]
    batches = [(X[k * per_pass : (k + 1) * per_pass], y[k * per_pass : (k + 1) * per_pass]) for k in range(passes)]
    expected = loop_step(copy.deepcopy(model), batches, max_norm, "flat", reduction="mean")

    for block in model.model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    _, opt, _ = PrivacyEngine().make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), data_loader=loader(X, y, per_pass),
        noise_multiplier=0.0, max_grad_norm=max_norm, poisson_sampling=False,
    )  # fmt: skip
    rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    if engine:
        train(model, opt, [(bX[rows], by[rows]) for bX, by in batches])
    else:
        for p, total in zip(model.parameters(), clipped):
            p.grad = distribute_tensor(total, p.device_mesh, p.placements)
        opt.step()
    for (name, p), e in zip(model.named_parameters(), expected):
        torch.testing.assert_close(p.full_tensor(), e, rtol=1e-10, atol=1e-12, msg=lambda m: f"rank {rank} {name}: {m}")


@pytest.mark.slow
@needs_gloo
def test_private_step_on_the_engines_sharded_grad_equals_one_process(tmp_path):
    run_ranks(_step_worker, tmp_path, False, world=WORLD)


@needs_gloo
def test_private_step_under_fsdp_equals_one_process(tmp_path):
    run_ranks(_step_worker, tmp_path, True, world=WORLD)


@pytest.mark.slow
@needs_gloo
def test_gradient_accumulation_under_fsdp_equals_one_process(tmp_path):
    """Two backward passes, then the step."""
    run_ranks(_step_worker, tmp_path, True, 2, world=WORLD)
