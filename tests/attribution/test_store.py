"""The store of training gradients: chunks on disk, resumable, scores in blocks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tests.support.attribution import tiny_mlp

from jacmem.attribution import GradientStore, Influence


def _loader(n: int, size: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g)
    return [(x[i : i + size], y[i : i + size]) for i in range(0, n, size)]


class _Counted:
    """``F.cross_entropy`` summed, counting the batches it is called on."""

    def __init__(self):
        self.calls = 0

    def __call__(self, model, batch):
        self.calls += 1
        x, y = batch
        return F.cross_entropy(model(x), y, reduction="sum")


class _Stop(Exception):
    pass


def _stopped_fill(path, train, batches: int) -> tuple[Influence, _Counted, GradientStore]:
    """An Influence whose training store under ``path`` stopped after ``batches`` batches."""
    loss = _Counted()
    inf = Influence(tiny_mlp(), loss, curvature="identity", store=path, progress=False).fit(train)

    def stops(batch):
        if loss.calls == batches:
            raise _Stop
        return inf._rows(batch, "train")

    store = GradientStore(path, inf._key())
    with pytest.raises(_Stop):
        store.fill(train, stops)
    return inf, loss, store


def test_a_stopped_fill_resumes_without_recomputing_finished_chunks(tmp_path):
    train = _loader(10, 3, 0)  # 4 chunks: 3, 3, 3, 1
    inf, loss, store = _stopped_fill(tmp_path / "g", train, 2)
    assert sorted(p.name for p in (tmp_path / "g").glob("chunk_*.npy")) == ["chunk_0000000.npy", "chunk_0000001.npy"]
    assert not store.complete

    loss.calls = 0
    queries = _loader(4, 2, 1)
    got = inf.scores(queries, train)
    assert loss.calls == 1 + 2 + 2  # the first chunk checked, the two missing ones, then the two query batches
    fresh = Influence(tiny_mlp(), _Counted(), curvature="identity", progress=False).fit(train)
    torch.testing.assert_close(got, fresh.scores(queries, train), rtol=0, atol=0)

    loss.calls = 0
    inf.self_influence(train)  # a complete store, checked: no training batch runs again
    assert loss.calls == 0


def test_scores_in_blocks_equal_scores_at_once_and_can_go_to_a_file(tmp_path):
    train, queries = _loader(11, 3, 0), _loader(7, 2, 1)
    inf = Influence(tiny_mlp(), _Counted(), curvature="ekfac", progress=False).fit(train)
    blocks = inf.scores(queries, train, out=tmp_path / "scores.npy")
    grads_q = torch.cat([inf._rows(b, "query") for b in queries])
    grads_t = torch.cat([inf._rows(b, "train") for b in train])
    at_once = inf.precondition(grads_q) @ grads_t.T
    torch.testing.assert_close(blocks, at_once, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(torch.from_numpy(np.load(tmp_path / "scores.npy")), at_once, rtol=1e-12, atol=1e-14)


def test_a_store_of_another_checkpoint_raises(tmp_path):
    train = _loader(6, 3, 0)
    Influence(tiny_mlp(), _Counted(), curvature="identity", store=tmp_path, progress=False).fit(train).self_influence(
        train
    )
    model = tiny_mlp()
    with torch.no_grad():
        model[0].bias.add_(1.0)
    later = Influence(model, _Counted(), curvature="identity", store=tmp_path, progress=False).fit(train)
    with pytest.raises(ValueError, match="pass a new directory"):
        later.self_influence(train)


def test_progress_bars_name_each_pass(capsys):
    pytest.importorskip("tqdm")
    train = _loader(6, 3, 0)
    inf = Influence(tiny_mlp(), _Counted(), curvature="ekfac", progress=True).fit(train)
    inf.scores(_loader(2, 2, 1), train)
    err = capsys.readouterr().err
    for desc in ("fitting Kronecker factors", "fitting EK-FAC's eigenvalues", "training gradients", "query gradients"):
        assert desc in err


def test_a_complete_store_read_through_other_data_raises_and_the_same_data_rebatched_does_not(tmp_path):
    """A complete store computes nothing again; before, ``scores(q, other_train)`` read the
    first training set's rows as the other's columns, silently."""
    train, queries = _loader(10, 3, 0), _loader(4, 2, 1)
    inf = Influence(tiny_mlp(), _Counted(), curvature="identity", store=tmp_path / "g", progress=False).fit(train)
    want = inf.scores(queries, train)
    other = _loader(10, 3, 5)
    with pytest.raises(ValueError, match="other data than this loader's.*pass the loader it was filled from"):
        inf.scores(queries, other)
    with pytest.raises(ValueError, match="other data"):
        inf.self_influence(train[:2])  # a subset
    with pytest.raises(ValueError, match="other data"):
        inf.scores(queries, train[::-1])  # another order
    x, y = torch.cat([b[0] for b in train]), torch.cat([b[1] for b in train])
    rebatched = [(x[i : i + 4], y[i : i + 4]) for i in range(0, 10, 4)]
    torch.testing.assert_close(inf.scores(queries, rebatched), want, rtol=0, atol=0)
    fresh = Influence(tiny_mlp(), _Counted(), curvature="identity", progress=False).fit(other)
    torch.testing.assert_close(
        Influence(tiny_mlp(), _Counted(), curvature="identity", store=tmp_path / "h", progress=False)
        .fit(other)
        .scores(queries, other),
        fresh.scores(queries, other),
        rtol=0,
        atol=0,
    )


def test_a_stopped_fill_resumed_over_other_data_raises(tmp_path):
    inf, _, _ = _stopped_fill(tmp_path / "g", _loader(10, 3, 0), 1)
    with pytest.raises(ValueError, match="batch 0 differs from the one its stored chunk was computed from"):
        inf.scores(_loader(4, 2, 1), _loader(10, 3, 7))


def test_a_complete_store_read_through_another_loss_raises(tmp_path):
    """The key and the data's fingerprint cannot see ``loss_fn``: a store filled under the
    summed cross-entropy was read as the rows of twice it (scores 50% off, silently)."""
    train = _loader(6, 3, 0)
    Influence(tiny_mlp(), _Counted(), curvature="identity", store=tmp_path, progress=False).fit(train).self_influence(
        train
    )

    def doubled(model, batch):
        return 2 * F.cross_entropy(model(batch[0]), batch[1], reduction="sum")

    later = Influence(tiny_mlp(), doubled, curvature="identity", store=tmp_path, progress=False).fit(train)
    with pytest.raises(ValueError, match="loss function and model give no more"):
        later.self_influence(train)
    again = Influence(tiny_mlp(), _Counted(), curvature="identity", store=tmp_path, progress=False).fit(train)
    torch.testing.assert_close(again.self_influence(train), again.scores(train, train).diagonal(), rtol=1e-12, atol=0)
