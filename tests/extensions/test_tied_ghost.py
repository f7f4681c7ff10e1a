"""Norms of a parameter used by several calls (tied weights) from the calls' ghost factors
(:mod:`jacmem.derivatives.tied`), against the per-sample loop in float64, through
BatchL2Grad and ClipGrad (whose clipped sum then sums each call's book-keeping): two
calls of one Linear, two Linears sharing a weight, an Embedding tied to a Linear head
(repeated ids, a padding row), and HF GPT-2 with its tied ``wte``/``lm_head`` at the real
vocabulary of 50257, where nothing of ``[N, V, D]`` may be allocated."""

from __future__ import annotations

import pytest
import torch
from tests.support.allocations import Allocations
from tests.support.clipping import assert_grads, expected, median_norm
from tests.support.hf_models import tied_lm
from tests.support.reference import REFERENCE, batch_l2, chosen, clear, cross_entropy, per_sample_grads, trainable
from torch import nn

import jacmem
import jacmem.derivatives.tied
import jacmem.engine.staging
from jacmem.derivatives.registry import Cost

DT = torch.float64
N = 3


class Twice(nn.Module):
    """One Linear called twice, [N, T, 4] -> [N, T*4]."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(torch.tanh(self.lin(x))).flatten(1)


class SharedLinears(nn.Module):
    """Two Linears sharing their weight (not their bias), on [N, T, 4] -> [N, 4]."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.b.weight = self.a.weight

    def forward(self, x):
        return (self.a(x) * self.b(x.flip(1))).mean(1)


class TiedHead(nn.Module):
    """An Embedding (with a padding row) tied to its Linear head, [N, T] -> [N, V, T]."""

    def __init__(self, v: int = 11):
        super().__init__()
        self.emb = nn.Embedding(v, 4, padding_idx=0)
        self.mix = nn.Linear(4, 4)
        self.head = nn.Linear(4, v, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.mix(self.emb(ids)))).transpose(1, 2)


class HeadTwice(TiedHead):
    """:class:`TiedHead` with its head called twice, the second time on the positions reversed."""

    def forward(self, ids):
        h = torch.tanh(self.mix(self.emb(ids)))
        return (self.head(h) + self.head(h.flip(1))).transpose(1, 2)


def case(name: str):
    """(model, X, y, the tied parameter's name as explain() shows it); ids repeat within samples."""
    torch.manual_seed(0)
    if name == "linear_twice":
        return Twice().to(DT), torch.randn(N, 3, 4, dtype=DT), torch.randint(0, 12, (N,)), "lin.weight"
    if name == "shared_linears":
        return SharedLinears().to(DT), torch.randn(N, 3, 4, dtype=DT), torch.randint(0, 4, (N,)), "b.weight"
    ids = torch.randint(0, 5, (N, 6))
    ids[0, :2] = 0  # the padding row
    if name in ("embedding_head", "head_twice"):
        model = TiedHead() if name == "embedding_head" else HeadTwice()
        return model.to(DT), ids, torch.randint(0, 11, (N, 6)), "head.weight"
    return tied_lm("gpt2", d=8).to(DT).eval(), ids, torch.randint(0, 50257, (N, 6)), "model.lm_head.weight"


CASES = ["linear_twice", "shared_linears", "embedding_head", "gpt2_50257"]


@pytest.mark.parametrize("name", CASES)
def test_batch_l2_of_tied_parameters(name):
    model, X, y, tied = case(name)
    reference = per_sample_grads(model, X, y, cross_entropy, "mean")
    clear(model)
    with jacmem.extend(jacmem.BatchL2Grad()) as ctx:
        cross_entropy(model(X), y, "mean").backward()
    assert chosen(ctx, tied) == "tied ghost"
    for p in trainable(model):
        torch.testing.assert_close(p.batch_l2, batch_l2(reference[p]), rtol=1e-9, atol=1e-15)


@pytest.mark.parametrize("name", ["shared_linears", "embedding_head"])
def test_cross_terms_chunked_over_the_samples(name, monkeypatch):
    """Under a chunk_bytes below one sample's cross-term matrices, the tied norms come one
    sample at a time, and are the same."""
    model, X, y, tied = case(name)
    reference = per_sample_grads(model, X, y, cross_entropy, "mean")
    clear(model)
    slices = []
    summed = jacmem.derivatives.tied._summed
    monkeypatch.setattr(jacmem.derivatives.tied, "_summed", lambda f, rows: slices.append(rows) or summed(f, rows))
    with jacmem.extend(jacmem.BatchL2Grad(), chunk_bytes=1) as ctx:
        cross_entropy(model(X), y, "mean").backward()
    assert chosen(ctx, tied) == "tied ghost"
    assert slices == [slice(i, i + 1) for i in range(N)]
    for p in trainable(model):
        torch.testing.assert_close(p.batch_l2, batch_l2(reference[p]), rtol=1e-9, atol=1e-15)


@pytest.mark.parametrize("clipping", ["flat", "automatic"])
@pytest.mark.parametrize("name", CASES)
def test_clipped_sum_of_tied_parameters(name, clipping):
    """Both clipping styles whose factors come from the total norm."""
    model, X, y, tied = case(name)
    grads = {p: g * N for p, g in per_sample_grads(model, X, y, cross_entropy, "mean").items()}
    C = median_norm(grads)
    clear(model)
    with jacmem.extend(jacmem.ClipGrad(C, clipping=clipping)) as ctx:
        cross_entropy(model(X), y, "mean").backward()
    assert chosen(ctx, tied) == "tied ghost"
    assert_grads(model, expected(grads, C, clipping), f"{name} {clipping}")


def test_gpt2_real_vocabulary_never_forms_per_sample_gradients():
    """The tied [50257, 8] weight: nothing of N·V·D entries in the backward."""
    model, X, y, _ = case("gpt2_50257")
    for ext in (jacmem.BatchL2Grad(), jacmem.ClipGrad(1.0)):
        watch = Allocations(N * 50257 * 8)
        with jacmem.extend(ext):
            loss = cross_entropy(model(X), y, "mean")
            with watch:
                loss.backward()
        assert watch.large == [], f"{ext}: {watch.large}"


@pytest.mark.slow
@pytest.mark.parametrize("chunk_bytes", [1, 288, 2**30])
@pytest.mark.parametrize("name", CASES)
def test_second_moments_of_tied_parameters(name, chunk_bytes):
    """SumGradSquared, Variance and BatchL2Grad together from the per-sample gradients
    summed over the calls, a block of rows of a slice of samples at a time: one row of
    one sample under chunk_bytes=1; under 288, all 3 samples in blocks of 3 rows of 4
    float64 columns (the last block short: 11 = 3+3+3+2 rows of the embedding), never
    [N, *p.shape] whole; explain() says so."""
    model, X, y, tied = case(name)
    reference = per_sample_grads(model, X, y, cross_entropy, "mean")
    clear(model)
    exts = (jacmem.SumGradSquared(), jacmem.Variance(), jacmem.BatchL2Grad())
    with jacmem.extend(*exts, chunk_bytes=chunk_bytes) as ctx:
        cross_entropy(model(X), y, "mean").backward()
    way = "tied index terms" if name == "gpt2_50257" else "tied per-sample gradients"  # tiny: the fewer steps
    assert f"sum_grad_squared <- {way}" in next(
        line for line in ctx.explain().splitlines() if line.startswith(f"{tied} ")
    )
    for p in trainable(model):
        for field in ("sum_grad_squared", "variance", "batch_l2"):
            expected = REFERENCE[field](reference[p])
            torch.testing.assert_close(getattr(p, field), expected, rtol=1e-9, atol=1e-15, msg=f"{name} {field}")


def _moments(name: str, exts: tuple, monkeypatch, way: str | None = None, chunk_bytes: float = 2**30):
    """The tied case's moments through ``exts``, with the cost model made to choose
    ``way`` where given: checks every parameter's results and ``.grad`` against the
    per-sample loop, and what explain() says -> the chosen way"""
    if way is not None:
        cost = Cost(0, 0) if way == "tied index terms" else Cost(float("inf"), 0)
        monkeypatch.setattr(jacmem.engine.staging, "index_terms_cost", lambda shapes: cost)
    model, X, y, tied = case(name)
    reference = per_sample_grads(model, X, y, cross_entropy, "mean")
    clear(model)
    with jacmem.extend(*exts, chunk_bytes=chunk_bytes) as ctx:
        cross_entropy(model(X), y, "mean").backward()
    for p in trainable(model):
        torch.testing.assert_close(p.grad, reference[p].sum(0), rtol=1e-9, atol=1e-15, msg=f"{name} grad")
        for ext in exts:
            expected = REFERENCE[ext.savefield](reference[p])
            got = getattr(p, ext.savefield)
            torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-15, msg=f"{name} {ext.savefield}")
    line = next(line for line in ctx.explain().splitlines() if line.startswith(f"{tied} "))
    return line.split("sum_grad_squared <- ")[1].split(" (")[0]


@pytest.mark.slow
@pytest.mark.parametrize("way", ["tied per-sample gradients", "tied index terms"])
@pytest.mark.parametrize("name", ["embedding_head", "gpt2_50257"])
def test_second_moments_by_either_way(name, way, monkeypatch):
    """An embedding tied to a head: the moments from the per-sample gradients summed over
    the calls, or from the head's alone with the embedding's terms from gathers; both
    exact, with BatchL2Grad beside them (so the head's moments come at the end of the
    pass), under a chunk_bytes of a few rows."""
    exts = (jacmem.SumGradSquared(), jacmem.Variance(), jacmem.BatchL2Grad())
    assert _moments(name, exts, monkeypatch, way, chunk_bytes=288) == way


@pytest.mark.parametrize("exts", [(jacmem.Variance(),), (jacmem.SumGradSquared(),)], ids=repr)
@pytest.mark.parametrize("name", ["embedding_head", "gpt2_50257"])
def test_second_moments_of_a_tied_head_at_its_call(name, exts):
    """Variance or SumGradSquared alone: the head's moments come at its call, from the
    per-sample products that also give the gradient it hands autograd (one product for
    both), and the embedding's terms at the end of the pass; .grad is autograd's. At
    the real vocabulary the cost model takes the gathers."""
    way = _moments(name, exts, None)
    assert way == "tied index terms" or name == "embedding_head"


def test_second_moments_of_two_dense_calls_and_an_embedding(monkeypatch):
    """A head used twice beside its embedding: the dense calls' moments need their summed
    per-sample products, computed at the end of the pass (the first call's, taken at its
    call, are not reused)."""
    assert _moments("head_twice", (jacmem.Variance(),), monkeypatch, "tied index terms") == "tied index terms"


@pytest.mark.slow
def test_gpt2_real_vocabulary_variance_without_per_sample_gradients():
    """Variance of the tied [50257, 8] weight: nothing of N·V·D entries in the backward."""
    model, X, y, _ = case("gpt2_50257")
    watch = Allocations(N * 50257 * 8)
    with jacmem.extend(jacmem.Variance(), chunk_bytes=1):
        loss = cross_entropy(model(X), y, "mean")
        with watch:
            loss.backward()
    assert watch.large == []


def test_per_sample_gradients_where_the_cost_model_prefers_them(monkeypatch):
    """Where materialising is estimated cheaper, the per-sample gradients summed over the
    calls give the same norms and clipped sums, and explain() says so."""
    costs = jacmem.engine.staging.summed_norm_costs
    monkeypatch.setattr(
        jacmem.engine.staging, "summed_norm_costs", lambda *a: {**costs(*a), "per-sample gradients": Cost(0, 0)}
    )
    model, X, y, tied = case("embedding_head")
    grads = {p: g * N for p, g in per_sample_grads(model, X, y, cross_entropy, "mean").items()}
    C = median_norm(grads)
    clear(model)
    with jacmem.extend(jacmem.ClipGrad(C)) as ctx:
        cross_entropy(model(X), y, "mean").backward()
    assert chosen(ctx, tied) == "tied per-sample gradients"
    assert_grads(model, expected(grads, C), "materialised")


@pytest.mark.parametrize("rows", ["dense", "indices"])
def test_projections_of_a_summed_gradient_from_its_ghost_factors(rows):
    """``uₖᵀ (Σ_n G_n) vₖ`` from one call's factors, and of a tensor of any shape seen as
    ``[R, C]``, against the summed gradient formed whole (the clipping check's probes)."""
    torch.manual_seed(0)
    n, t, r_, c_ = 3, 5, 7, 4
    r = torch.randn(n, t, r_, dtype=DT) if rows == "dense" else torch.randint(0, r_, (n, t))
    c = torch.randn(n, t, c_, dtype=DT)
    dense = r if rows == "dense" else nn.functional.one_hot(r, r_).to(DT)
    whole = torch.einsum("ntr,ntc->rc", dense, c)
    u, v = torch.randn(r_, 6, dtype=DT), torch.randn(c_, 6, dtype=DT)
    want = torch.einsum("rk,rc,ck->k", u, whole, v)
    torch.testing.assert_close(jacmem.derivatives.tied.factor_projections((r, c), u, v), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(jacmem.derivatives.tied.projections(whole, u, v), want, rtol=1e-12, atol=1e-12)
    conv = torch.randn(r_, 2, 2, dtype=DT)  # [R, C] = [7, 2·2]
    torch.testing.assert_close(
        jacmem.derivatives.tied.projections(conv, u, v), torch.einsum("rk,rc,ck->k", u, conv.flatten(1), v)
    )


@pytest.mark.parametrize("layout", ["row-major", "column-major"])
def test_clipped_sum_from_factors_whose_positions_do_not_flatten(layout):
    """``Σ_n c_n G_n`` from one call's factors, where the wide factor is an LM head's
    output gradient seen through a transpose (``[N, T, V]`` with ``T`` innermost: summed
    one sample at a time, never copied), and added to a total, against the einsum."""
    torch.manual_seed(0)
    n, t, v, d = 3, 5, 9, 4
    wide = torch.randn(n, t, v, dtype=DT) if layout == "row-major" else torch.randn(n, v, t, dtype=DT).transpose(1, 2)
    narrow, c = torch.randn(n, t, d, dtype=DT), torch.rand(n, dtype=DT)
    want = torch.einsum("n,ntv,ntd->vd", c, wide, narrow)
    got = jacmem.derivatives.tied.add_clipped_sum(None, (wide, narrow), c, (v, d))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    start = torch.randn(v, d, dtype=DT)
    got = jacmem.derivatives.tied.add_clipped_sum(start.clone(), (wide, narrow), c, (v, d))
    torch.testing.assert_close(got, start + want, rtol=1e-12, atol=1e-12)
    got = jacmem.derivatives.tied.add_clipped_sum(None, (narrow, wide), c, (d, v))
    torch.testing.assert_close(got, want.T, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("gathered", [True, False], ids=["gathered", "held"])
def test_a_tied_heads_output_gradient_goes_at_its_call(gathered, monkeypatch):
    """Variance of GPT-2's tied head: at the head's call its per-sample gradients are
    gathered at the embedding's token rows, and its output gradient [N, T, V] is let go
    (not held to the end of the pass); where the embedding's rows cannot be read ahead
    (forced here), the head's call is held and its factors give the same rows."""
    engine = jacmem.engine.staging
    held = []
    early = engine.Stager.early

    def spy(self, staged, rec, pname, dtype):
        out = early(self, staged, rec, pname, dtype)
        held.append(staged.calls[-1].g is not None)
        return out

    monkeypatch.setattr(engine.Stager, "early", spy)
    if not gathered:
        monkeypatch.setattr(engine, "_index_rows", lambda *a: None)
    assert _moments("gpt2_50257", (jacmem.Variance(),), None) == "tied index terms"
    assert held == [not gathered]
