"""projection=k: the curvature and the scores in the space of jacmem's Kronecker projection
(``BatchGradProjection``), against a float64 reference built from per-sample gradients
projected by the rule's own matrices."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tests.support.attribution import layer_stats_of
from tests.support.projection import rule
from torch import nn

import jacmem
from jacmem.attribution import TRAK, Influence, margin

if not hasattr(jacmem, "BatchGradProjection"):
    pytest.skip("this build has no jacmem.BatchGradProjection", allow_module_level=True)
from jacmem.derivatives.projection import dense, kronecker  # noqa: E402

K = 4  # (k_rows, k_cols) = (2, 2)


#: the references build their matrices in float64 (restored after each test)
pytestmark = pytest.mark.usefixtures("float64_default")


def _model():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()


def loss_fn(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y, reduction="sum")


def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g)


def _reference(model, x, y, curvature, damping, seed):
    """Per parameter: the projected per-sample gradients ``[n, k]`` and the damped
    curvature ``[k, k]`` in the projected space."""
    names = [n for n, _ in model.named_parameters()]
    grads = []
    for i in range(len(x)):
        grads.append(torch.autograd.grad(loss_fn(model, (x[i : i + 1], y[i : i + 1])), list(model.parameters())))
    stats, linears = [], [m for m in model if isinstance(m, nn.Linear)]
    for m in linears:  # inputs and output gradients, per sample
        stats += [layer_stats_of(model, loss_fn, x, y, m)] * 2  # weight, bias
    rows, blocks = [], []
    for k, (name, p) in enumerate(model.named_parameters()):
        a, g = stats[k]
        if p.dim() == 2:
            P_rows, P_cols = kronecker(seed, name, K, p.shape[0], p.shape[1], dtype=p.dtype, device="cpu")
            vecs = torch.stack([(P_rows @ gr[k] @ P_cols.T).flatten() for gr in grads])
            Gp, Ap = P_rows @ g.T @ g @ P_rows.T, P_cols @ (a.T @ a / len(a)) @ P_cols.T
            lg, Ug = torch.linalg.eigh(Gp)
            la, Ua = torch.linalg.eigh(Ap)
            U = torch.kron(Ug.contiguous(), Ua.contiguous())
            lam = torch.kron(lg, la) if curvature == "kfac" else (vecs @ U).square().sum(0)
        else:
            vecs = dense(torch.stack([gr[k] for gr in grads]), seed, name, K)
            lam, U = torch.linalg.eigh(vecs.T @ vecs)
        if curvature == "diag":
            U, lam = torch.eye(K), vecs.square().sum(0)
        d = 0.1 * lam.mean() if damping is None else damping
        rows.append(vecs)
        blocks.append(U @ torch.diag(lam) @ U.T + d * torch.eye(K))
    assert names
    return torch.cat(rows, 1), torch.block_diag(*blocks)


@pytest.mark.parametrize("curvature", ["ekfac", "kfac", "diag"])
@pytest.mark.parametrize("damping", [None, 0.01])
def test_projected_scores_equal_the_reference(curvature, damping):
    model = _model()
    x, y = _data(12, 0)
    xq, yq = _data(3, 1)
    train = [(x[i : i + 4], y[i : i + 4]) for i in range(0, 12, 4)]
    inf = Influence(model, loss_fn, curvature=curvature, damping=damping, projection=K, seed=3, progress=False)
    got = inf.fit(train).scores([(xq, yq)], train)
    rows, C = _reference(model, x, y, curvature, damping, 3)
    query_rows, _ = _reference(model, xq, yq, curvature, damping, 3)
    assert inf.kronecker_projected == {0, 2}  # the weights; the biases take the dense rule
    torch.testing.assert_close(got, query_rows @ torch.linalg.inv(C) @ rows.T, rtol=1e-9, atol=1e-12)


def test_trak_projects_densely():
    model = _model()
    x, y = _data(10, 0)
    trak = TRAK(model, lambda m, b: margin(m(b[0]), b[1]), damping=0.01, projection=K, progress=False)
    got = trak.fit([(x, y)]).scores([(x[:2], y[:2])], [(x, y)])
    phi = []
    for i in range(len(x)):
        grads = torch.autograd.grad(margin(model(x[i : i + 1]), y[i : i + 1]).sum(), list(model.parameters()))
        phi.append(
            torch.cat([dense(g.reshape(1, -1), 0, n, K) for (n, _), g in zip(model.named_parameters(), grads)], 1)
        )
    phi = torch.cat(phi)
    Q = torch.sigmoid(-margin(model(x), y)).detach()
    want = phi[:2] @ torch.linalg.inv(phi.T @ phi + 0.01 * torch.eye(phi.shape[1])) @ phi.T * Q
    torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-12)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"fisher": "mc"}, "fisher='empirical' with a projection"),
        ({"conventions": "kronfluence"}, "conventions='jacmem' with a projection"),
        ({"projection": 0}, "positive int"),
    ],
)
def test_projection_settings_that_cannot_work_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Influence(_model(), loss_fn, **{"projection": K, **kwargs})


def test_a_transposed_layer_projects_its_factors_by_their_sides():
    """An Embedding ``[V, d]`` (its factors of ``weight.T``): the rule's rows act on the
    vocabulary (the input side, ``A``), its columns on ``d`` (the output side, ``G``); a
    LayerNorm and the head's bias take the dense rule, each a whole ``[k, k]`` block."""
    from tests.attribution.test_influence import _TinyLM, lm_loss

    model = _TinyLM().double()
    g = torch.Generator().manual_seed(0)
    ids, targets = torch.randint(0, 6, (9, 3), generator=g), torch.randint(0, 6, (9, 3), generator=g)
    train = [(ids[i : i + 3], targets[i : i + 3]) for i in range(0, 9, 3)]
    qids, qt = torch.randint(0, 6, (2, 3), generator=g), torch.randint(0, 6, (2, 3), generator=g)
    inf = Influence(model, lm_loss, curvature="ekfac", damping=0.01, projection=K, seed=5, progress=False)
    got = inf.fit(train).scores([(qids, qt)], train)

    def per_sample(ids, targets):
        out = []
        for i in range(len(ids)):
            hooks, kept = [], {}
            for m in (model.embed, model.head):
                hooks.append(m.register_forward_hook(lambda mod, a, o, m=m: kept.__setitem__(m, (a[0], o))))
            loss = lm_loss(model, (ids[i : i + 1], targets[i : i + 1]))
            for h in hooks:
                h.remove()
            grads = torch.autograd.grad(loss, [*model.parameters(), kept[model.embed][1], kept[model.head][1]])
            out.append((grads[:-2], grads[-2][0], grads[-1][0], kept[model.head][0].detach()[0]))
        return out

    names = [n for n, _ in model.named_parameters()]
    sample = per_sample(ids, targets)
    g_embed = torch.cat([s[1] for s in sample])
    g_head, x_head = torch.cat([s[2] for s in sample]), torch.cat([s[3] for s in sample])
    counts = torch.bincount(ids.flatten(), minlength=6).double() / ids.numel()

    def project(grads):
        rows = []
        for name, p, gr in zip(names, model.parameters(), grads):
            if name in ("embed.weight", "head.weight"):
                P_rows, P_cols = kronecker(5, name, K, *p.shape, dtype=p.dtype, device="cpu")
                rows.append((P_rows @ gr @ P_cols.T).flatten())
            else:
                rows.append(dense(gr.reshape(1, -1), 5, name, K)[0])
        return rows

    train_rows = [project(s[0]) for s in sample]
    query_rows = [project(s[0]) for s in per_sample(qids, qt)]
    blocks = []
    for k, (name, p) in enumerate(model.named_parameters()):
        vecs = torch.stack([r[k] for r in train_rows])
        if name in ("embed.weight", "head.weight"):
            P_rows, P_cols = kronecker(5, name, K, *p.shape, dtype=p.dtype, device="cpu")
            if name == "embed.weight":  # rows: the vocabulary (input); columns: d (output)
                G, A, P_out, P_in = g_embed.T @ g_embed, torch.diag(counts), P_cols, P_rows
                vecs = vecs.reshape(-1, 2, 2).transpose(1, 2).flatten(1)  # as [out, in]
            else:
                G, A, P_out, P_in = g_head.T @ g_head, x_head.T @ x_head / len(x_head), P_rows, P_cols
            Ug = torch.linalg.eigh(P_out @ G @ P_out.T).eigenvectors
            Ua = torch.linalg.eigh(P_in @ A @ P_in.T).eigenvectors
            U = torch.kron(Ug.contiguous(), Ua.contiguous())
            C = U @ torch.diag((vecs @ U).square().sum(0)) @ U.T + 0.01 * torch.eye(K)
            if name == "embed.weight":  # back to the stored layout
                perm = torch.arange(K).reshape(2, 2).T.flatten()
                C = C[perm][:, perm]
        else:
            C = vecs.T @ vecs + 0.01 * torch.eye(K)
        blocks.append(C)
    rows_t = torch.stack([torch.cat(r) for r in train_rows])
    rows_q = torch.stack([torch.cat(r) for r in query_rows])
    want = rows_q @ torch.linalg.inv(torch.block_diag(*blocks)) @ rows_t.T
    assert inf.kronecker_projected == {0, 3}
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


class _TiedLM(nn.Module):
    """An Embedding ``[V, d]`` whose weight is also the output head's (GPT-2's ``wte``/``lm_head``)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(8)
        self.embed, self.head = nn.Embedding(6, 4), nn.Linear(4, 6)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.embed(ids)))


@pytest.mark.parametrize("curvature", ["ekfac", "kfac"])
def test_a_tied_weight_gets_the_second_moment_of_its_projected_gradients(curvature):
    from tests.attribution.test_influence import lm_loss

    model = _TiedLM().double()
    g = torch.Generator().manual_seed(0)
    ids, targets = torch.randint(0, 6, (8, 3), generator=g), torch.randint(0, 6, (8, 3), generator=g)
    train = [(ids[:4], targets[:4]), (ids[4:], targets[4:])]
    inf = Influence(model, lm_loss, curvature=curvature, damping=0.01, projection=K, progress=False)
    got = inf.fit(train).scores([(ids[:2], targets[:2])], train)
    P_rows, P_cols = kronecker(0, "embed.weight", K, 6, 4, dtype=torch.float64, device="cpu")
    rows = []
    for i in range(len(ids)):
        w, b = torch.autograd.grad(lm_loss(model, (ids[i : i + 1], targets[i : i + 1])), list(model.parameters()))
        rows.append(torch.cat([(P_rows @ w @ P_cols.T).flatten(), dense(b[None], 0, "head.bias", K)[0]]))
    rows = torch.stack(rows)
    C = torch.block_diag(*[r.T @ r + 0.01 * torch.eye(K) for r in (rows[:, :K], rows[:, K:])])
    torch.testing.assert_close(got, rows[:2] @ torch.linalg.inv(C) @ rows.T, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("curvature", ["ekfac", "kfac", "diag"])
def test_hf_gpt2_projected_runs_whole(curvature):
    """HF GPT-2 (Conv1D, LayerNorm, position embeddings of ``[1, T]`` ids, ``wte`` tied to
    ``lm_head``): every parameter scored, the tied one by its whole projected block;
    self-influence is the diagonal of the train-train scores."""
    pytest.importorskip("transformers")
    from tests.support.hf_models import tied_lm

    torch.manual_seed(0)
    model = tied_lm("gpt2", d=16, t=8, vocab=97).double().eval()

    def lm(model, ids):
        logits = model(ids).transpose(1, 2)  # [N, T, V]
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")

    ids = torch.randint(0, 97, (8, 8), generator=torch.Generator().manual_seed(0))
    train = [ids[:4], ids[4:]]
    inf = Influence(model, lm, curvature=curvature, projection=16, progress=False).fit(train)
    scores = inf.scores(train, train)
    assert [inf.names[i] for i in inf._whole] == ["model.transformer.wte.weight"]
    assert torch.isfinite(scores).all()
    torch.testing.assert_close(inf.self_influence(train), torch.diagonal(scores), rtol=1e-10, atol=0)


class _UnusedHead(nn.Module):
    """A trunk, a head the loss never reads (``unused``, before ``head`` in the parameter
    order), and the head it reads."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.trunk, self.unused, self.head = nn.Linear(4, 5), nn.Linear(5, 7), nn.Linear(5, 3)

    def forward(self, x):
        h = torch.tanh(self.trunk(x))
        return self.head(h), self.unused(h)


def _first_output_loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x)[0], y, reduction="sum")


@pytest.mark.parametrize("dim", [4, 6])
def test_a_parameter_the_loss_does_not_use_takes_its_projected_width(dim):
    """A trainable parameter the loss never reaches has zero rows of the *projected* width
    (``dim``), not of ``p.numel()``: otherwise the later parameters' columns shift (the
    scores were 97% off at dim=4) or the widths do not match."""
    model = _UnusedHead().double()
    x, y = _data(6, 0)
    train = [(x[:3], y[:3]), (x[3:], y[3:])]
    got = Influence(model, _first_output_loss, curvature="identity", projection=dim, progress=False)
    got = got.fit(train).scores([(x[:2], y[:2])], train)
    names = dict(model.named_parameters())
    rows = []
    for i in range(len(x)):
        grads = torch.autograd.grad(
            _first_output_loss(model, (x[i : i + 1], y[i : i + 1])), list(names.values()), allow_unused=True
        )
        rows.append(
            torch.cat(
                [
                    rule(model, n, torch.zeros_like(p)[None] if g is None else g[None], 0, dim, "kronecker")
                    for (n, p), g in zip(names.items(), grads)
                ],
                1,
            )
        )
    rows = torch.cat(rows)
    torch.testing.assert_close(got, rows[:2] @ rows.T, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("curvature", ["ekfac", "kfac"])
def test_a_densely_projected_norm_needs_no_kronecker_factors(curvature):
    """With a projection, a parameter the rule projects densely (here a BatchNorm's scale
    and shift, in eval mode) is documented to get the whole second moment of its projected
    gradients: it needs no Kronecker factors, so a module KFAC has no rule for must not
    stop the fit (it raised UnsupportedCurvatureError for the BatchNorm)."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5), nn.Tanh(), nn.Linear(5, 3)).double()
    model(torch.randn(16, 4))  # running statistics
    model.eval()
    x, y = _data(8, 0)
    train = [(x[:4], y[:4]), (x[4:], y[4:])]
    inf = Influence(model, loss_fn, curvature=curvature, damping=0.01, projection=K, progress=False)
    got = inf.fit(train).scores([(x[:2], y[:2])], train)
    names = dict(model.named_parameters())
    grads = [torch.autograd.grad(loss_fn(model, (x[i : i + 1], y[i : i + 1])), list(names.values())) for i in range(8)]
    rows, blocks = [], []
    for k, (name, p) in enumerate(names.items()):
        vecs = torch.cat([rule(model, name, g[k][None], 0, K, "kronecker") for g in grads])
        if name.endswith("weight") and p.dim() == 2:  # a Linear's: KFAC's factors projected
            a, g = layer_stats_of(model, loss_fn, x, y, model[int(name[0])])
            P_rows, P_cols = kronecker(0, name, K, *p.shape, dtype=torch.float64, device="cpu")
            lg, Ug = torch.linalg.eigh(P_rows @ g.T @ g @ P_rows.T)
            la, Ua = torch.linalg.eigh(P_cols @ (a.T @ a / len(a)) @ P_cols.T)
            U = torch.kron(Ug.contiguous(), Ua.contiguous())
            lam = torch.kron(lg, la) if curvature == "kfac" else (vecs @ U).square().sum(0)
            blocks.append(U @ torch.diag(lam) @ U.T)
        else:  # dense: the whole second moment
            blocks.append(vecs.T @ vecs)
        rows.append(vecs)
    rows, C = torch.cat(rows, 1), torch.block_diag(*blocks) + 0.01 * torch.eye(K * len(names))
    torch.testing.assert_close(got, rows[:2] @ torch.linalg.inv(C) @ rows.T, rtol=1e-9, atol=1e-12)
