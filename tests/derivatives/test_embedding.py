"""First-order extensions on nn.Embedding and nn.EmbeddingBag, against a per-sample
autograd loop, and against BackPACK where it can answer.

Every case runs, in float64, every strategy the registry offers (``scatter``, ``ghost``,
``segment``) and ``"auto"``; each extension alone and all four together; both flows; and
with ``chunk_bytes=1``.

Definitions checked (see :mod:`jacmem.derivatives.embedding`):

* ``max_norm``: the model starts from weights with rows above the norm; the reference
  runs on an untouched copy, so both renormalise in their own forward, and the gradient
  is w.r.t. the renormed rows, as autograd's.
* ``scale_grad_by_freq``: per-sample gradients divide by the index counts of the whole
  batch, so they sum to autograd's ``.grad``. The reference is the loop without the
  option, each row then divided by its batch count.

BackPACK 1.7.1 answers only for ``Embedding`` without ``padding_idx``, ``max_norm`` and
``scale_grad_by_freq`` (it raises ``NotImplementedError`` on each) and has no
``EmbeddingBag`` (it warns and computes nothing): :func:`test_backpack_cannot` pins that.
"""

from __future__ import annotations

import copy
import itertools
import warnings
from math import prod

import pytest
import torch
from backpack import backpack, extend, extensions
from tests.support.allocations import Allocations
from tests.support.clipping import assert_grads, expected, median_norm
from tests.support.reference import (
    FLOWS,
    REFERENCE,
    assert_close,
    check_against,
    clear,
    cross_entropy,
    mse,
    per_sample_grads,
    run_backpack,
    run_grid,
    run_jacmem,
)
from torch import Tensor, nn

import jacmem
from jacmem.derivatives import REGISTRY
from jacmem.engine.clipping import PROBES

EXTENSIONS = [jacmem.BatchGrad, jacmem.BatchL2Grad, jacmem.SumGradSquared, jacmem.Variance]
EXTENSION_SETS = [[e] for e in EXTENSIONS] + [EXTENSIONS]
V, D, N = 9, 4, 4


def strategies(module_type: type):
    return sorted(REGISTRY[module_type].names() | {"auto"})


def batch_counts(idx: Tensor, mask=None) -> Tensor:
    """How often each row occurs in the batch's input: [V]."""
    return torch.bincount(idx.flatten() if mask is None else idx[mask], minlength=V).clamp(min=1)


def by_name(model: nn.Module, other: nn.Module, grads: dict[nn.Parameter, Tensor]) -> dict[nn.Parameter, Tensor]:
    """Per-sample gradients computed on ``other`` (a copy of ``model``), keyed by ``model``'s parameters."""
    names = {p: n for n, p in other.named_parameters()}
    return {model.get_parameter(names[p]): g for p, g in grads.items()}


# -- Embedding -----------------------------------------------------------------------

#: id -> (input shape without the batch axis, Embedding keyword arguments)
EMBEDDING_CASES: dict[str, tuple] = {
    "1d-input": ((), {}),
    "2d-input": ((6,), {}),
    "3d-input": ((2, 3), {}),
    "padding_idx": ((6,), dict(padding_idx=3)),
    "max_norm": ((6,), dict(max_norm=1.0)),
    "max_norm-l1": ((2, 3), dict(max_norm=1.5, norm_type=1.0)),
    "scale_grad_by_freq": ((6,), dict(scale_grad_by_freq=True)),
    "all-options": ((2, 4), dict(padding_idx=0, max_norm=1.0, scale_grad_by_freq=True)),
}


def embedding_case(case_id: str):
    """(model, X, y, reference): reference per-sample gradients keyed by model's weight."""
    torch.manual_seed(sum(map(ord, case_id)))
    shape, kwargs = EMBEDDING_CASES[case_id]
    model = nn.Embedding(V, D, **kwargs).double()
    with torch.no_grad():
        model.weight.mul_(2.0)  # rows above max_norm, so that the renorm acts
    X = torch.randint(0, V, (N, *shape))
    if "padding_idx" in kwargs:
        X.view(-1)[::5] = kwargs["padding_idx"]
    y = torch.randn(N, *shape, D, dtype=torch.float64)
    plain = copy.deepcopy(model)
    plain.scale_grad_by_freq = False
    grads = per_sample_grads(plain, X, y, mse, "mean")
    if model.scale_grad_by_freq:
        grads = {p: g / batch_counts(X)[:, None] for p, g in grads.items()}
    if model.max_norm is not None:
        assert not torch.allclose(plain.weight, model.weight), "max_norm did not act: raise the weights"
    return model, X, y, by_name(model, plain, grads)


EMBEDDING_GRID = [(c, s) for c in EMBEDDING_CASES for s in strategies(nn.Embedding)]


@pytest.mark.parametrize("case_id,strategy", EMBEDDING_GRID, ids=[f"{c}-{s}" for c, s in EMBEDDING_GRID])
def test_embedding(case_id, strategy):
    """Against the loop; ``.grad`` (autograd's, with its batch-level counts) is their sum."""
    model, X, y, reference = embedding_case(case_id)
    run_grid(model, X, y, mse, "mean", reference, EXTENSION_SETS, strategy, case_id)


def test_sparse_gradients():
    """``sparse=True`` changes only the layout of autograd's ``.grad``: the quantities are
    dense, and equal those of the dense layer."""
    model, X, y, reference = embedding_case("2d-input")
    model.sparse = True
    for flow in FLOWS:
        run_jacmem(model, X, y, mse, "mean", [e() for e in EXTENSIONS], flow)
        assert model.weight.grad.is_sparse
        assert_close(model.weight.grad.to_dense(), reference[model.weight].sum(0), f"{flow} .grad")
        for e in EXTENSIONS:
            assert_close(
                getattr(model.weight, e.savefield), REFERENCE[e.savefield](reference[model.weight]), e.savefield
            )


# -- EmbeddingBag --------------------------------------------------------------------


class Bags(nn.Module):
    """An EmbeddingBag fed ``(indices, offsets, per_sample_weights)``: offsets positional,
    per_sample_weights by keyword, as a model would call it."""

    def __init__(self, **kwargs):
        super().__init__()
        self.bag = nn.EmbeddingBag(V, D, **kwargs)

    def forward(self, inputs):
        idx, offsets, weights = inputs
        return self.bag(idx, offsets, per_sample_weights=weights)


#: id -> (layout, EmbeddingBag keyword arguments, per_sample_weights?)
#: layouts: "2d" (input [N, L]); "offsets" (1d input, offsets, bag 1 empty);
#: "last" (1d, include_last_offset=True, bag 2 empty); "pairs" (2d, every index occurs
#: exactly twice in the batch, sometimes twice in one bag, sometimes in two bags)
BAG_CASES: dict[str, tuple] = {
    "sum-2d": ("2d", dict(mode="sum"), False),
    "sum-offsets-weights": ("offsets", dict(mode="sum"), True),
    "sum-last-padding": ("last", dict(mode="sum", include_last_offset=True, padding_idx=2), False),
    "sum-2d-weights-max_norm": ("2d", dict(mode="sum", max_norm=1.0), True),
    "mean-2d-padding": ("2d", dict(mode="mean", padding_idx=1), False),
    "mean-offsets": ("offsets", dict(mode="mean"), False),
    "max-2d": ("2d", dict(mode="max"), False),
    "max-offsets-padding": ("offsets", dict(mode="max", padding_idx=4), False),
    "max-last-max_norm": ("last", dict(mode="max", include_last_offset=True, max_norm=1.0), False),
    "sum-pairs-freq": ("pairs", dict(mode="sum", scale_grad_by_freq=True), True),
    "mean-pairs-freq-padding": ("pairs", dict(mode="mean", scale_grad_by_freq=True, padding_idx=0), False),
}
LENGTHS = [3, 0, 4, 2]  # bag sizes for the 1d layouts


def bag_inputs(layout: str, with_weights: bool):
    """-> (inputs for Bags, the bags as a list of 1d index tensors, their weights or Nones)."""
    if layout == "pairs":
        idx = torch.arange(8).repeat(2)[torch.randperm(16)].view(N, 4)
        rows = [set(r.tolist()) for r in idx]
        assert any(len(r) < 4 for r in rows) and len(set.union(*rows)) == 8, "want repeats within and across bags"
    elif layout == "2d":
        idx = torch.randint(0, V, (N, 5))
    if layout in ("2d", "pairs"):
        weights = torch.rand(idx.shape, dtype=torch.float64) if with_weights else None
        bags = list(idx)
        return (idx, None, weights), bags, list(weights) if with_weights else [None] * N
    lengths = [3, 4, 0, 2] if layout == "last" else LENGTHS
    idx = torch.randint(0, V, (sum(lengths),))
    starts = torch.tensor([0, *itertools.accumulate(lengths)])
    offsets = starts if layout == "last" else starts[:-1]
    weights = torch.rand(idx.shape, dtype=torch.float64) if with_weights else None
    bags = [idx[a:b] for a, b in zip(starts[:-1], starts[1:])]
    split = [weights[a:b] for a, b in zip(starts[:-1], starts[1:])] if with_weights else [None] * N
    return (idx, offsets, weights), bags, split


def bag_reference(model: Bags, bags, weights, y, reduction: str) -> dict[nn.Parameter, Tensor]:
    """One bag at a time through a copy of the layer (scale_grad_by_freq off, then each
    row divided by its count in the whole batch); keyed by ``model``'s weight."""
    plain = copy.deepcopy(model.bag)
    plain.scale_grad_by_freq = False
    scale = 1.0 / y.numel() if reduction == "mean" else 1.0
    rows = []
    for n, (idx, w) in enumerate(zip(bags, weights)):
        offsets = torch.tensor([0, len(idx)] if plain.include_last_offset else [0])
        term = mse(plain(idx, offsets, per_sample_weights=w), y[n : n + 1], "sum") * scale
        rows.append(torch.autograd.grad(term, plain.weight)[0])
    grads = torch.stack(rows)
    if model.bag.scale_grad_by_freq:
        grads = grads / batch_counts(torch.cat(bags))[:, None]
    return {model.bag.weight: grads}


def bag_case(case_id: str):
    torch.manual_seed(sum(map(ord, case_id)))
    layout, kwargs, with_weights = BAG_CASES[case_id]
    model = Bags(**kwargs).double()
    with torch.no_grad():
        model.bag.weight.mul_(2.0)
    inputs, bags, weights = bag_inputs(layout, with_weights)
    y = torch.randn(N, D, dtype=torch.float64)
    reference = bag_reference(model, bags, weights, y, "mean")
    return model, inputs, y, reference


BAG_GRID = [(c, s) for c in BAG_CASES for s in strategies(nn.EmbeddingBag)]


@pytest.mark.parametrize("case_id,strategy", BAG_GRID, ids=[f"{c}-{s}" for c, s in BAG_GRID])
def test_embedding_bag(case_id, strategy):
    model, inputs, y, reference = bag_case(case_id)
    run_grid(model, inputs, y, mse, "mean", reference, EXTENSION_SETS, strategy, case_id)


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_bag_scale_grad_by_freq_mixed_counts(mode):
    """Indices with different batch counts. torch 2.13's CPU ``embedding_bag`` backward
    divides by the wrong count there (pytorch/pytorch#190063, fixed after 2.13), so
    ``.grad`` is not compared; the quantities are, against the documented definition
    (the loop without the option, rows divided by their batch counts)."""
    torch.manual_seed(1)
    model = Bags(mode=mode, scale_grad_by_freq=True).double()
    inputs, bags, weights = bag_inputs("2d", False)
    counts = batch_counts(inputs[0])
    assert len(set(counts[inputs[0].unique()].tolist())) > 1, "want indices with different counts"
    y = torch.randn(N, D, dtype=torch.float64)
    reference = bag_reference(model, bags, weights, y, "sum")[model.bag.weight]
    for strategy in strategies(nn.EmbeddingBag):
        for exts in EXTENSION_SETS:
            run_jacmem(model, inputs, y, mse, "sum", [e() for e in exts], "inside", strategy=strategy)
            for e in exts:
                ours = getattr(model.bag.weight, e.savefield)
                assert_close(ours, REFERENCE[e.savefield](reference), f"{mode} {strategy} {e.savefield}")


def test_per_sample_weights_requiring_grad():
    """per_sample_weights is an input: autograd gives it its .grad (unchanged by jacmem),
    and only the weight gets per-sample quantities."""
    model, inputs, y, reference = bag_case("sum-offsets-weights")
    idx, offsets, weights = inputs
    plain_weights = weights.clone().requires_grad_(True)
    mse(copy.deepcopy(model)((idx, offsets, plain_weights)), y, "mean").backward()
    for flow in FLOWS:
        weights = weights.detach().requires_grad_(True)
        run_jacmem(model, (idx, offsets, weights), y, mse, "mean", [e() for e in EXTENSIONS], flow)
        check_against(model, reference, [e.savefield for e in EXTENSIONS], f"[weights requiring grad {flow}]")
        assert_close(weights.grad, plain_weights.grad, "per_sample_weights.grad")
        assert not any(hasattr(weights, e.savefield) for e in EXTENSIONS)


# -- BackPACK ------------------------------------------------------------------------


def test_against_backpack():
    """Plain Embedding, the one case BackPACK 1.7.1 answers: all four quantities agree.
    BackPACK's Embedding builds a float32 one-hot whatever the dtype, and fails in float64,
    so it runs in float32 here, and the comparison uses float32 tolerances."""
    model, X, y, _ = embedding_case("3d-input")
    bp_model = run_backpack(copy.deepcopy(model).float(), X, y.float())
    run_jacmem(model, X, y, mse, "mean", [e() for e in EXTENSIONS])
    for field in ("grad_batch", "batch_l2", "sum_grad_squared", "variance"):
        ours, theirs = getattr(model.weight, field), getattr(bp_model[0].weight, field)
        torch.testing.assert_close(ours.float(), theirs, rtol=1e-5, atol=1e-6 * theirs.abs().max().item(), msg=field)


EMBEDDING_OPTION = {"padding_idx": 0, "max_norm": 1.0, "scale_grad_by_freq": True}


@pytest.mark.parametrize("layer", [*EMBEDDING_OPTION, "EmbeddingBag"])
def test_backpack_cannot(layer):
    """Where BackPACK 1.7.1 gives no answer (so the loop is the only reference above):
    it raises on Embedding's options and computes nothing for EmbeddingBag."""
    module = (
        nn.EmbeddingBag(V, D) if layer == "EmbeddingBag" else nn.Embedding(V, D, **{layer: EMBEDDING_OPTION[layer]})
    )
    model = extend(nn.Sequential(module.double()))
    X = torch.randint(0, V, (N, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if layer == "EmbeddingBag":
            with backpack(extensions.BatchGrad()):
                model(X).square().sum().backward()
            assert not hasattr(module.weight, "grad_batch")
            return
        with pytest.raises(NotImplementedError, match=layer), backpack(extensions.BatchGrad()):
            model(X).square().sum().backward()


# -- in a model ----------------------------------------------------------------------


class TextNet(nn.Module):
    """Embedding, a Conv1d over the sequence and a Linear, each with a residual
    connection, plus an EmbeddingBag of the same tokens (optionally sharing the weight:
    its per-sample gradients add over the two calls)."""

    def __init__(self, tied: bool):
        super().__init__()
        self.emb = nn.Embedding(V, D, padding_idx=0)
        self.conv = nn.Conv1d(D, D, 3, padding=1)
        self.mix = nn.Linear(D, D)
        self.bag = nn.EmbeddingBag(V, D, mode="mean")
        if tied:
            self.bag.weight = self.emb.weight
        self.head = nn.Linear(D, 3)

    def forward(self, tokens):  # [N, T]
        h = self.emb(tokens)  # [N, T, D]
        h = h + self.conv(h.transpose(1, 2)).transpose(1, 2)
        h = h + torch.tanh(self.mix(h))
        return self.head(h.mean(1) + self.bag(tokens))


MODEL_GRID = [
    (tied, s)
    for tied in (False, True)
    for s in sorted(
        set().union(*(REGISTRY[t].names() for t in (nn.Embedding, nn.EmbeddingBag, nn.Conv1d, nn.Linear))) | {"auto"}
    )
]


@pytest.mark.parametrize("tied,strategy", MODEL_GRID, ids=[f"{'tied' if t else 'untied'}-{s}" for t, s in MODEL_GRID])
def test_model_with_residual(tied, strategy):
    torch.manual_seed(0)
    model = TextNet(tied).double()
    X = torch.randint(0, V, (N, 7))
    y = torch.randint(0, 3, (N,))
    reference = per_sample_grads(model, X, y, cross_entropy, "mean")
    for exts, flow in itertools.product(EXTENSION_SETS, FLOWS):
        run_jacmem(model, X, y, cross_entropy, "mean", [e() for e in exts], flow, strategy=strategy)
        check_against(model, reference, [e.savefield for e in exts], f"[TextNet tied={tied} {strategy} {exts} {flow}]")


# -- a GPT-2-sized vocabulary ----------------------------------------------------------

BIG_V, T = 50257, 5


class TokenNet(nn.Module):
    """GPT-2's input side at its real vocabulary: token embeddings ``wte [V, D]`` (with a
    padding row) plus position embeddings ``wpe [T, D]`` on ``[1, T]`` position ids,
    broadcast over the batch; a small head on the mean over positions. [N, T] -> [N, 3]"""

    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(BIG_V, D, padding_idx=1)
        self.wpe = nn.Embedding(T, D)
        self.head = nn.Linear(D, 3)

    def forward(self, ids):
        positions = torch.arange(ids.shape[1], device=ids.device)[None]  # [1, T]
        return self.head(torch.tanh(self.wte(ids) + self.wpe(positions)).mean(1))


def token_case():
    """(model, ids, y, per-sample gradients by the loop): ids from a few rows, so that
    tokens repeat within a sample, some of them the padding row, and one the last row."""
    torch.manual_seed(0)
    model = TokenNet().double()
    ids = torch.randint(0, 4, (N, T))
    ids[0, 0], ids[1, 2], ids[2, -1] = 1, 1, BIG_V - 1
    y = torch.randint(0, 3, (N,))
    return model, ids, y, per_sample_grads(model, ids, y, cross_entropy, "mean")


@pytest.mark.parametrize("strategy", ["auto", "ghost", "segment"])
def test_real_vocabulary_norms_without_per_sample_gradients(strategy):
    """BatchL2Grad, SumGradSquared and Variance of a 50257-token embedding, against the
    loop, while the backward allocates nothing of ``N·V·D`` entries (``[N, V, D]``);
    BatchGrad, which must form it, shows that the watch sees it."""
    model, ids, y, reference = token_case()
    exts = [jacmem.BatchL2Grad(), jacmem.SumGradSquared(), jacmem.Variance()]
    for ext in [*([e] for e in exts), exts]:
        clear(model)
        watch = Allocations(N * BIG_V * D)
        with jacmem.extend(*ext, strategy={"wte": strategy}):
            loss = cross_entropy(model(ids), y, "mean")
            with watch:
                loss.backward()
        assert watch.large == [], f"{ext}: {watch.large}"
        check_against(model, reference, [e.savefield for e in ext], f"[{strategy} {ext}]")
    watch = Allocations(N * BIG_V * D)
    with jacmem.extend(jacmem.BatchGrad()):
        loss = cross_entropy(model(ids), y, "mean")
        with watch:
            loss.backward()
    assert N * BIG_V * D in [prod(shape) for _, shape in watch.large]  # [N·V, D], viewed as [N, V, D]


@pytest.mark.parametrize("strategy", ["auto", "ghost", "segment"])
def test_real_vocabulary_clipped_sum_without_per_sample_gradients(strategy):
    """ClipGrad on a 50257-token embedding: norms by the strategy, the clipped sum by
    book-keeping (an index_add of the c-scaled output gradients), no ``[N, V, D]``."""
    model, ids, y, reference = token_case()
    grads = {p: g * N for p, g in reference.items()}  # each sample's own loss term
    C = median_norm(grads)
    clear(model)
    watch = Allocations(N * BIG_V * D)
    with jacmem.extend(jacmem.ClipGrad(C), strategy={"wte": strategy}) as ctx:
        loss = cross_entropy(model(ids), y, "mean")
        with watch:
            loss.backward()
    # the recorded-sum check's projections [V, PROBES] are as large as [N, V, D] here
    assert [a for a in watch.large if a[1] != (BIG_V, PROBES)] == []
    (line,) = [line for line in ctx.explain().splitlines() if line.startswith("wte.weight ")]
    assert "batch_l2 <- " + ("segment" if strategy == "auto" else strategy) in line
    assert_grads(model, expected(grads, C), strategy)
