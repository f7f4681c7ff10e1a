"""jacmem.engine.broadcast: per-sample gradients of tensors broadcast over the batch, op by op,
against a per-sample autograd loop in float64."""

import pytest
import torch
from tests.support.reference import check_against, mse, per_sample_grads, run_jacmem
from torch import nn

import jacmem
from jacmem.compat import swap_parameters as swap_in
from jacmem.engine.broadcast import Origin, watch

DT = torch.float64
N, T, D = 3, 4, 5


class Tokens(nn.Module):
    """A class token and position embeddings, used as ViTs and HF models use them."""

    def __init__(self, use: str):
        super().__init__()
        self.use = use
        self.cls = nn.Parameter(torch.randn(1, 1, D, dtype=DT))
        self.pos = nn.Parameter(torch.randn(1, T + 3, D, dtype=DT))
        self.scale = nn.Parameter(torch.randn(D, dtype=DT))

    def forward(self, x):  # x: [n, T, D]
        if self.use == "cat-add":
            x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1) + self.pos[:, : T + 1]
        elif self.use == "slice-cast":
            x = x * self.scale + self.pos[:, 1 : T + 1].to(DT).contiguous()
            x = x + self.cls
        elif self.use == "radd-inplace":
            x = x.clone()
            x += self.pos[..., 2 : T + 2, :]
            x = self.scale * x - self.cls
        elif self.use == "matmul":  # mixes nothing, but not an op jacmem follows
            x = x @ torch.diag(self.scale)
        elif self.use == "index":  # pos[0] loses the leading axis
            x = x + self.pos[0, :T]
        return x.tanh().square().sum((1, 2))


def per_sample(model, X, name):
    return torch.stack([torch.autograd.grad(model(X[n : n + 1]).sum(), getattr(model, name))[0] for n in range(N)])


def run(model, X):
    """Per-sample gradients of each watched parameter from its uses, and the ops that
    were not safe."""
    got = {}

    def origin(name, p):
        def on_use(expanded):
            expanded.register_hook(lambda g: got.setdefault(name, []).append(g.reshape(g.shape[0], *p.shape)))

        return Origin(p, on_use)

    origins = {name: origin(name, getattr(model, name)) for name in ("cls", "pos", "scale")}
    restore = swap_in(model, {name: watch(o) for name, o in origins.items()})
    try:
        loss = model(X).sum()
    finally:
        restore()
    loss.backward()
    return {k: sum(v) for k, v in got.items()}, {name: o.unsafe for name, o in origins.items() if o.unsafe}


@pytest.mark.parametrize("use", ["cat-add", "slice-cast", "radd-inplace"])
def test_uses_give_exact_per_sample_gradients(use):
    torch.manual_seed(0)
    model, X = Tokens(use), torch.randn(N, T, D, dtype=DT)
    got, unsafe = run(model, X)
    assert not unsafe
    for name, p in model.named_parameters():
        if p.grad is None or not p.grad.any():
            continue
        ref = per_sample(model, X, name)
        torch.testing.assert_close(got[name], ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got[name].sum(0), p.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("use, name, op", [("matmul", "scale", "diag"), ("index", "pos", "__getitem__")])
def test_other_uses_are_reported(use, name, op):
    torch.manual_seed(0)
    model, X = Tokens(use), torch.randn(N, T, D, dtype=DT)
    got, unsafe = run(model, X)
    assert op in unsafe[name]
    assert name not in got


def test_forward_values_unchanged():
    torch.manual_seed(0)
    for use in ("cat-add", "slice-cast", "radd-inplace"):
        model, X = Tokens(use), torch.randn(N, T, D, dtype=DT)
        restore = swap_in(model, {"pos": watch(Origin(model.pos, lambda e: None))})
        out = model(X)
        restore()
        assert torch.equal(out, model(X))


class Flaky(nn.Module):
    """A learnable scale used as a broadcast, whose forward raises once."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(D, dtype=DT))
        self.fail = True

    def forward(self, x):
        y = x * self.scale
        if self.fail:
            self.fail = False
            raise RuntimeError("once")
        return y


def test_a_forward_that_raised_leaves_nothing_behind():
    """The parameters are back after a forward that raised, and the next forward's
    per-sample gradients are exact (nothing of the failed one counts)."""
    torch.manual_seed(0)
    model, X, y = nn.Sequential(Flaky()), torch.randn(N, T, D, dtype=DT), torch.randn(N, T, D, dtype=DT)
    with jacmem.extend(jacmem.BatchGrad()), pytest.raises(RuntimeError, match="once"):
        model(X)
    assert isinstance(model[0]._parameters["scale"], nn.Parameter)
    reference = per_sample_grads(model, X, y, mse, "mean")
    run_jacmem(model, X, y, mse, "mean", [jacmem.BatchGrad()])
    check_against(model, reference, ["grad_batch"], "[after a failed forward]")


def test_an_attribute_that_gives_a_tensor_is_a_use():
    """``x @ p.T`` reads ``p`` through an attribute, not an op: reported, so that its
    per-sample gradients come from elsewhere (the sum of the uses it saw would miss it)."""
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(D, D, dtype=DT))
    origin = Origin(p, lambda e: None)
    view = watch(origin)
    x = torch.randn(N, T, D, dtype=DT)
    (x @ view.T).sum().backward()
    assert view.shape == p.shape  # metadata is no use
    assert origin.unsafe == [".T"], origin.unsafe


class TransposedLinear(nn.Module):
    """A weight read through ``.T`` (left to the recomputation) and a bias broadcast
    (recorded use by use), in one module."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D, D, dtype=DT))
        self.b = nn.Parameter(torch.randn(D, dtype=DT))

    def forward(self, x):
        return x @ self.w.T + self.b


def test_a_weight_read_through_an_attribute_stays_exact():
    torch.manual_seed(0)
    model, X, y = nn.Sequential(TransposedLinear()), torch.randn(N, T, D, dtype=DT), torch.randn(N, T, D, dtype=DT)
    reference = per_sample_grads(model, X, y, mse, "mean")
    ctx = run_jacmem(model, X, y, mse, "mean", [jacmem.BatchGrad(), jacmem.BatchL2Grad()])
    check_against(model, reference, ["grad_batch", "batch_l2"], "[.T and a broadcast]")
    chosen = {d.param: d.chosen for d in ctx.plan.decisions.values() if d.quantity == "batch_grad"}
    assert chosen == {"w": "vmap", "b": "expand"}, ctx.explain()
