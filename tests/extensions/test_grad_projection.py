"""``jacmem.BatchGradProjection``: per-sample gradients projected by the documented rule
(:mod:`jacmem.derivatives.projection`), in float64, against the per-sample autograd loop
of ``tests/support/reference.py`` times projection matrices built here, from the rule as
the docs state it (BLAKE2b of ``"{seed}:{name}"`` seeds a CPU generator; N(0, 1/rows)
entries; the kronecker kind ``vec(P_out G P_inᵀ)`` of each layer's weight seen as
``[out, in]``; the dense kind ``R vec(G)`` in blocks of 4096 columns), never from
jacmem's code. Models: tiny HF GPT-2 (Conv1D, a head tied to the token embedding), an
Embedding, a Conv2d (groups, padding, stride), PEFT's LoRA on GPT-2; the same rows in
any batch split and under ``torch.compile``; the kronecker kind never allocates
``[N, V, d]`` for a tied 50k-token vocabulary.
"""

from __future__ import annotations

import pytest
import torch
from tests.support.allocations import Allocations
from tests.support.projection import DT, rule
from tests.support.reference import cross_entropy, mse, per_sample_grads
from torch import Tensor, nn

import jacmem


def unwrapped_names(model: nn.Module) -> dict[nn.Parameter, str]:
    """param -> its first qualified name (its stable name) in ``model``."""
    return {p: name for name, p in model.named_parameters() if p.requires_grad}


def expected(model: nn.Module, X, y, loss, dim: int, kind: str, seed: int) -> dict[nn.Parameter, Tensor]:
    """The loop's per-sample gradients, projected by the rule: param -> ``[N, dim]``."""
    grads = per_sample_grads(model, X, y, loss)
    return {p: rule(model, name, grads[p], seed, dim, kind) for p, name in unwrapped_names(model).items()}


def projected(model, X, y, loss, ext) -> dict[nn.Parameter, Tensor]:
    with jacmem.extend(ext) as ctx:
        loss(model(X), y, "mean").backward()
    got = {p: p.grad_proj for p in model.parameters() if p.requires_grad}
    for p in got:
        del p.grad_proj
    model.zero_grad()
    projected.explained = ctx.explain()
    return got


def assert_all_close(got: dict, want: dict, names: dict) -> None:
    assert set(got) == set(want)
    for p, w in want.items():
        torch.testing.assert_close(got[p], w, rtol=1e-9, atol=1e-12, msg=lambda m, p=p: f"{names[p]}: {m}")


class EmbConv(nn.Module):
    """An Embedding, a grouped, strided, padded Conv2d, a Linear head: tokens [N, 6] -> [N, 3]."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 4, padding_idx=0)
        self.conv = nn.Conv2d(2, 4, 3, stride=2, padding=1, groups=2)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 3)

    def forward(self, ids):
        h = self.conv(self.emb(ids).unflatten(1, (2, 3)))  # [N, 6, 4] -> [N, 4, 2, 2]
        return self.head(self.norm(torch.tanh(h).flatten(1)))


def emb_conv():
    torch.manual_seed(0)
    model = EmbConv().to(DT)
    X = torch.randint(0, 11, (5, 6))
    X[0, :2] = 3  # a row repeated in one sample
    return model, X, torch.randint(0, 3, (5,))


def gpt2():
    from tests.support.hf_models import build

    model, X, y = build("gpt2")
    return model, X, y


@pytest.mark.parametrize("kind", ["kronecker", "dense"])
@pytest.mark.parametrize("dim", [6, 16])
def test_embedding_conv_against_the_loop(kind, dim):
    model, X, y = emb_conv()
    want = expected(model, X, y, cross_entropy, dim, kind, seed=3)
    got = projected(model, X, y, cross_entropy, jacmem.BatchGradProjection(dim, kind=kind, seed=3))
    assert_all_close(got, want, unwrapped_names(model))
    explained = projected.explained
    for layer in ("emb", "conv", "head"):
        assert (f"{layer}.weight grad_proj" in explained) and (
            (f"{layer}.weight grad_proj(dim={dim}, kind='kronecker', seed=3) <- kronecker" in explained)
            == (kind == "kronecker")
        ), explained


@pytest.mark.parametrize("kind", ["kronecker", "dense"])
def test_gpt2_tied_head_and_conv1d_against_the_loop(kind):
    model, X, y = gpt2()
    want = expected(model, X, y, cross_entropy, 8, kind, seed=0)
    got = projected(model, X, y, cross_entropy, jacmem.BatchGradProjection(8, kind=kind))
    assert_all_close(got, want, unwrapped_names(model))


def test_dense_rule_in_blocks_of_columns():
    """A weight of 4800 entries: two blocks of the dense rule's matrix."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(80, 60), nn.Tanh(), nn.Linear(60, 2)).to(DT)
    X, y = torch.randn(4, 80, dtype=DT), torch.randn(4, 2, dtype=DT)
    want = expected(model, X, y, mse, 5, "dense", seed=1)
    got = projected(model, X, y, mse, jacmem.BatchGradProjection(5, kind="dense", seed=1))
    assert_all_close(got, want, unwrapped_names(model))


def test_lora_adapters_against_the_loop():
    from tests.support.hf_models import build_lora

    model, X, y = build_lora("gpt2")
    want = expected(model, X, y, cross_entropy, 4, "kronecker", seed=0)
    got = projected(model, X, y, cross_entropy, jacmem.BatchGradProjection(4))
    assert_all_close(got, want, unwrapped_names(model))
    assert "lora_A.default.weight grad_proj(dim=4, kind='kronecker', seed=0) <- kronecker" in projected.explained


def test_beside_batch_grad_the_rule_is_the_same():
    """Asked beside per-sample gradients (which a pass computes anyway), a kronecker layer
    still takes its own rule, and a tied parameter's uses are still summed."""
    model, X, y = gpt2()
    want = expected(model, X, y, cross_entropy, 8, "kronecker", seed=0)
    with jacmem.extend(jacmem.BatchGradProjection(8), jacmem.BatchGrad(), jacmem.BatchL2Grad()):
        cross_entropy(model(X), y, "mean").backward()
    names = unwrapped_names(model)
    assert_all_close({p: p.grad_proj for p in want}, want, names)


@pytest.mark.parametrize("kind", ["kronecker", "dense"])
def test_under_bf16_autocast_the_rule_on_its_own_gradients(kind):
    """Under bfloat16 autocast the projection loses nothing to the gradients it projects:
    float32, it is the rule (float64 here) applied to the per-sample gradients of the same
    pass, to float32's rounding (resnet18: 7.5e-7 of the largest entry), not bfloat16's
    (7.8e-3). Its distance from float64 is theirs (``tests/conformance``'s slack)."""
    model, X, y = emb_conv()
    model = model.float()
    with jacmem.extend(jacmem.BatchGradProjection(6, kind=kind, seed=3), jacmem.BatchGrad()):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = cross_entropy(model(X).float(), y, "mean")
        loss.backward()
    for name, p in model.named_parameters():
        want = rule(model, name, p.grad_batch.to(DT), 3, 6, kind)
        assert p.grad_proj.dtype == torch.float32, name
        scale = want.abs().max().item()
        torch.testing.assert_close(p.grad_proj.to(DT), want, rtol=0, atol=1e-6 * scale, msg=lambda m: f"{name}: {m}")


def test_the_same_rows_in_any_batch_split():
    """Sample n's row is the same whether it came with the whole batch or a part (the loss
    summed, so that each sample's gradient is its own)."""
    model, X, y = gpt2()

    def rows(Xs, ys):
        with jacmem.extend(jacmem.BatchGradProjection(8)):
            cross_entropy(model(Xs), ys, "sum").backward()
        out = {n: p.grad_proj for n, p in model.named_parameters()}
        model.zero_grad()
        return out

    whole, first, rest = rows(X, y), rows(X[:1], y[:1]), rows(X[1:], y[1:])
    for n in whole:
        torch.testing.assert_close(torch.cat([first[n], rest[n]]), whole[n], rtol=1e-12, atol=1e-14)


class EmbNorm(nn.Module):
    """An Embedding, a LayerNorm, a Linear head: tokens [N, 6] -> [N, 3]."""

    def __init__(self):
        super().__init__()
        self.emb, self.norm, self.head = nn.Embedding(11, 4), nn.LayerNorm(4), nn.Linear(24, 3)

    def forward(self, ids):
        return self.head(torch.tanh(self.norm(self.emb(ids))).flatten(1))


def compile_cases():
    """An Embedding model and a CNN. (Not :class:`EmbConv`: under torch.compile, jacmem's
    per-sample gradients of a module whose output feeds a Conv2d through a reshape are
    wrong on main today, BatchGrad's too: a bug outside this extension.)"""
    torch.manual_seed(0)
    cnn = nn.Sequential(nn.Conv2d(2, 4, 3, stride=2, padding=1, groups=2), nn.Tanh(), nn.Flatten(), nn.Linear(16, 3))
    yield EmbNorm().to(DT), torch.randint(0, 11, (5, 6)), torch.randint(0, 3, (5,))
    yield cnn.to(DT), torch.randn(5, 2, 3, 4, dtype=DT), torch.randint(0, 3, (5,))


def test_under_torch_compile():
    for model, X, y in compile_cases():
        want = expected(model, X, y, cross_entropy, 8, "kronecker", seed=0)
        compiled = torch.compile(model)
        for _ in range(2):  # the second step runs the recipes a warm step keeps
            got = projected(compiled, X, y, cross_entropy, jacmem.BatchGradProjection(8))
            assert_all_close(got, want, unwrapped_names(model))


def test_a_tied_50k_vocabulary_never_makes_its_per_sample_gradients():
    """GPT-2's tied head at its real vocabulary: nothing of ``N·V·d`` entries (nor
    ``V·d``... the summed gradient is autograd's) is allocated by the projection."""
    from tests.support.hf_models import tied_lm

    torch.manual_seed(0)
    model = tied_lm("gpt2").float()
    n, t = 4, 8
    X = torch.randint(0, 50257, (n, t))
    wte = model.model.transformer.wte.weight
    out = model(X)
    loss = nn.functional.cross_entropy(out, X)
    with jacmem.extend(jacmem.BatchGradProjection(16)):
        out = model(X)
        loss = nn.functional.cross_entropy(out, X)
        with Allocations(n * wte.numel()) as seen:
            loss.backward()
    assert wte.grad_proj.shape == (n, 16)
    assert not seen.large, seen.large


def test_a_wrapped_model_gets_the_names_of_the_model_it_wraps():
    """DDP's ``module.`` is not part of a name: a stand-in with DataParallel's ``module``
    (one process, on the CPU it runs the module as it is)."""
    model, X, y = emb_conv()
    want = expected(model, X, y, cross_entropy, 6, "kronecker", seed=2)
    got = projected(nn.DataParallel(model), X, y, cross_entropy, jacmem.BatchGradProjection(6, seed=2))
    assert_all_close(got, want, unwrapped_names(model))


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="unknown kind 'lowrank'; valid: kronecker, dense"):
        jacmem.BatchGradProjection(8, kind="lowrank")
    with pytest.raises(ValueError, match="dim must be a positive integer"):
        jacmem.BatchGradProjection(0)


def drawn_in(step) -> int:
    """How many times ``step()`` draws normal numbers (``aten::normal_``)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    return sum(e.count for e in prof.key_averages() if e.key == "aten::normal_")


def deep_mlp() -> tuple[nn.Module, Tensor, Tensor]:
    """30 Linear layers with biases: 90 matrices (two per weight, one per bias), more than
    a cache of the last 64 holds."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(30) for m in (nn.Linear(3, 3), nn.Tanh())]).to(DT)
    return model, torch.randn(4, 3, dtype=DT), torch.randn(4, 3, dtype=DT)


def test_a_warm_step_draws_no_matrix():
    """The matrices are drawn once and kept (the cost a GPT-2's step paid: 31 M float64
    normals for its biases and norms alone), with more matrices than a step's LRU of 64."""
    model, X, y = deep_mlp()
    want = expected(model, X, y, mse, 4, "kronecker", seed=3)
    projected(model, X, y, mse, jacmem.BatchGradProjection(4, seed=3))  # (a new extension each step)
    got = {}
    assert drawn_in(lambda: got.update(projected(model, X, y, mse, jacmem.BatchGradProjection(4, seed=3)))) == 0
    assert_all_close(got, want, unwrapped_names(model))


def test_clear_matrices_lets_every_matrix_go_and_the_next_step_draws_the_same():
    """The kept matrices stay after ``extend`` exits (so that a warm step draws nothing);
    ``clear_matrices`` is how a user takes that memory back."""
    from jacmem.derivatives import projection

    model, X, y = deep_mlp()
    want = expected(model, X, y, mse, 4, "kronecker", seed=5)
    projected(model, X, y, mse, jacmem.BatchGradProjection(4, seed=5))
    assert projection.DRAWN.bytes > 0
    jacmem.BatchGradProjection.clear_matrices()
    assert projection.DRAWN.bytes == 0 and not projection.DRAWN.kept
    got = {}
    assert drawn_in(lambda: got.update(projected(model, X, y, mse, jacmem.BatchGradProjection(4, seed=5)))) > 0
    assert_all_close(got, want, unwrapped_names(model))


def test_past_the_cache_bound_it_keeps_what_it_holds_and_draws_the_same(monkeypatch):
    """A cache too small for the model's matrices keeps serving those it holds (it lets
    none go for a new one while it is asked every step) and draws the rest again, the
    same numbers; another seed's matrices take the place of stale ones."""
    from jacmem.derivatives import projection

    model, X, y = deep_mlp()
    names = unwrapped_names(model)
    want = {seed: expected(model, X, y, mse, 4, "dense", seed) for seed in (3, 4)}
    # each seed's 60 matrices (dense kind: 4 rows, 9 or 3 columns per parameter) take 11520 bytes
    small = projection.Drawn(limit=6000)
    monkeypatch.setattr(projection, "DRAWN", small)
    for seed, steps in ((3, 3), (4, 8)):
        draws = []
        for _ in range(steps):
            got = {}
            ext = jacmem.BatchGradProjection(4, kind="dense", seed=seed)
            draws.append(drawn_in(lambda ext=ext: got.update(projected(model, X, y, mse, ext))))
            assert_all_close(got, want[seed], names)
            assert 0 < small.bytes <= small.limit
        assert draws[-1] < 40, draws  # least recently used first out: all 60 at every step
