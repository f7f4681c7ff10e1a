"""Influence and TRAK on a DistributedDataParallel model, each of two gloo ranks on its own
shard of the training and query data, against one process on the whole data (float64).

The shards are uneven (rank 0: 5 training examples in batches of 2 and 3, 2 queries;
rank 1: 3 training examples, 1 query), so that a per-rank count or sum cannot pass by
symmetry. Every rank must return the one process's scores ``[n_query, n_train]`` and
self-influences, rows and columns in rank order (here the data's order), to 1e-10: the
curvature summed over the ranks, the per-sample gradients the module's own (not DDP's
``1/world``). Before, the scores were the one process's times ``1/world² = 0.25``
(``"identity"``) and off by factors from -171 to 15 (EK-FAC on one shard's factors), each
rank returning only its own shard's columns. One start of the two processes runs every
setting, as starting them is the slow part.
"""

from __future__ import annotations

import numpy
import pytest
import torch
import torch.distributed as dist
from tests.support.attribution import summed_cross_entropy as loss_fn
from tests.support.attribution import tiny_mlp
from tests.support.distributed import needs_gloo, run_ranks
from torch import nn
from torch.utils.data import DistributedSampler, TensorDataset

from jacmem.attribution import TRAK, Influence, margin
from jacmem.attribution import ranks as ranks_module

TRAIN = {0: [slice(0, 2), slice(2, 5)], 1: [slice(5, 8)]}  # rank -> its training batches
QUERIES = {0: [slice(0, 2)], 1: [slice(2, 3)]}
#: (name, class, keyword arguments); the store is shared by the ranks where it says so
SETTINGS = [
    *[(f"{c}", Influence, {"curvature": c, "damping": None if c == "identity" else 0.1}) for c in
      ("identity", "diag", "kfac", "ekfac")],
    ("ekfac-kronfluence", Influence, {"curvature": "ekfac", "conventions": "kronfluence"}),
    ("diag-kronfluence", Influence, {"curvature": "diag", "conventions": "kronfluence"}),
    ("ekfac-projected", Influence, {"curvature": "ekfac", "projection": 4, "damping": 0.1}),
    ("trak", TRAK, {"damping": 0.1}),
    ("trak-projected", TRAK, {"damping": 0.1, "projection": 3}),
]  # fmt: skip


#: the setting run on a plain model with ``process_group=``
PLAIN = {"curvature": "ekfac", "damping": 0.1}


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (8,), generator=g)


def output_fn(model, batch):
    x, y = batch
    return margin(model(x), y)


def _run(cls, model, kwargs, train, queries, store=None):
    """Scores and self-influences (TRAK: the diagonal's stand-in, none) of one setting."""
    fn = output_fn if cls is TRAK else loss_fn
    attribution = cls(model, fn, progress=False, store=store, **kwargs).fit(train)
    scores = attribution.scores(queries, train)
    own = None if cls is TRAK else attribution.self_influence(train)
    return scores, own


def _worker(rank: int, out: str) -> None:
    torch.set_num_threads(1)
    x, y = _data()
    ddp = nn.parallel.DistributedDataParallel(tiny_mlp())
    train = [(x[s], y[s]) for s in TRAIN[rank]]
    queries = [(x[s], y[s]) for s in QUERIES[rank]]
    got = {}
    for name, cls, kwargs in SETTINGS:
        got[name] = _run(cls, ddp, kwargs, train, queries, store=f"{out}/store-{name}")
    plain = tiny_mlp()  # a plain model on each rank, its group given
    got["ekfac-plain"] = _run(Influence, plain, {**PLAIN, "process_group": dist.group.WORLD}, train, queries)
    inf = Influence(ddp, loss_fn, curvature="identity", progress=False).fit(train)
    got["identity-out"] = inf.scores(queries, train, out=f"{out}/scores{rank}.npy").clone()  # a file per rank
    torch.save(got, f"{out}/rank{rank}.pt")


@pytest.mark.slow
@needs_gloo
def test_ddp_scores_equal_one_process_on_the_whole_data(tmp_path):
    run_ranks(_worker, tmp_path, str(tmp_path))
    x, y = _data()
    train, queries = [(x, y)], [(x[:3], y[:3])]
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert (tmp_path / "store-ekfac" / f"rank_{rank}").is_dir()  # one shared directory, a store per rank
        for name, cls, kwargs in SETTINGS:
            scores, own = _run(cls, tiny_mlp(), kwargs, train, queries)
            assert got[name][0].shape == (3, 8), name
            torch.testing.assert_close(got[name][0], scores, rtol=1e-10, atol=1e-12, msg=f"{name} rank {rank}")
            if own is not None:
                torch.testing.assert_close(got[name][1], own, rtol=1e-10, atol=1e-12, msg=f"{name} rank {rank}")
        torch.testing.assert_close(got["ekfac-plain"][0], got["ekfac"][0], rtol=1e-12, atol=1e-14)
        written = torch.from_numpy(numpy.load(tmp_path / f"scores{rank}.npy"))
        torch.testing.assert_close(written, got["identity"][0], rtol=0, atol=0)
        torch.testing.assert_close(got["identity-out"], got["identity"][0], rtol=0, atol=0)


def test_a_padding_distributed_sampler_names_the_fix():
    """A DistributedSampler that repeats (or drops) examples to share 5 among 2 ranks
    would count them twice (or not at all): refused, naming a shard without repeats; one
    with no process group to sum over would give one shard's scores: refused, naming
    ``process_group=``."""
    dataset = TensorDataset(torch.zeros(5, 4))
    for drop_last, how in ((False, "repeats 1"), (True, "drops 1")):
        sampler = DistributedSampler(dataset, num_replicas=2, rank=0, shuffle=False, drop_last=drop_last)
        loader = torch.utils.data.DataLoader(dataset, batch_size=2, sampler=sampler)
        with pytest.raises(ValueError, match=f"DistributedSampler {how}.*Subset"):
            ranks_module.check_sharded(object(), loader, "training")
    sampler = DistributedSampler(TensorDataset(torch.zeros(4, 4)), num_replicas=2, rank=0, shuffle=False)
    with pytest.raises(ValueError, match=r"one of 2 shards.*process_group=torch.distributed.group.WORLD"):
        ranks_module.check_sharded(None, torch.utils.data.DataLoader(sampler.dataset, sampler=sampler), "training")
    even = TensorDataset(torch.zeros(4, 4))
    sampler = DistributedSampler(even, num_replicas=2, rank=0, shuffle=False)
    ranks_module.check_sharded(object(), torch.utils.data.DataLoader(even, sampler=sampler), "training")
