"""Bad input fails clearly, and no exception leaves jacmem state behind.

- an unknown strategy name: ValueError listing the valid ones (globally, and in a
  per-layer dict keyed by module type or by module name);
- a strategy asked for one module in particular that the module does not offer:
  ValueError naming the module;
- a trainable module that no extension can handle: a warning naming it, an error with
  ``strict=True``;
- an exception in the forward or the backward inside the block: no global hook, no
  tensor hook, no kept input, no active block remain;
- nested blocks: a clear RuntimeError;
- ``track``/``untrack``: no module hook or tensor hook remains.
"""

from __future__ import annotations

import gc
import re
import warnings

import pytest
import torch
from tests.support.reference import check_against, cross_entropy, per_sample_grads, recorded, run_jacmem
from torch import nn
from torch.nn.modules import module as module_hooks

import jacmem
import jacmem.context
from jacmem.derivatives import all_strategy_names, lookup


def small_net():
    """[N, 2, 5, 5] -> [N, 3]"""
    return nn.Sequential(nn.Conv2d(2, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(27, 3)).double()


def data(n=4):
    return torch.randn(n, 2, 5, 5, dtype=torch.float64), torch.randint(0, 3, (n,))


def global_hooks():
    return len(module_hooks._global_forward_pre_hooks), len(module_hooks._global_forward_hooks)


class Outputs:
    """Catches every module's output in a forward (with hooks of its own, removed on exit)."""

    def __init__(self, model: nn.Module):
        self.model, self.tensors, self.handles = model, [], []

    def __enter__(self):
        for m in self.model.modules():
            self.handles.append(m.register_forward_hook(lambda m, a, out: self.tensors.append(out)))
        return self.tensors

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


def assert_clean(model: nn.Module, outputs, records, before) -> None:
    """No block active, no global hook added, no hook on any module or output, every
    record (and so every kept input) freed, though the outputs are still referenced."""
    assert jacmem.context._ACTIVE is None
    assert global_hooks() == before
    for name, m in model.named_modules():
        assert not m._forward_hooks and not m._forward_pre_hooks, f"module {name!r} kept a hook"
    assert outputs, "the forward produced no output to check"
    for out in outputs:
        assert not out._backward_hooks, f"a tensor hook is left on an output {tuple(out.shape)}"
    gc.collect()
    alive = [r() for r in records if r() is not None]
    assert not [rec for rec in alive if rec.x is not None], "an input is still kept after the block"


# -- strategy names ------------------------------------------------------------------


def _assert_lists_valid(err: pytest.ExceptionInfo, bad: str) -> None:
    msg = str(err.value)
    assert repr(bad) in msg
    for name in all_strategy_names() | {"auto"}:
        assert re.search(rf"\b{name}\b", msg), f"{name!r} is not listed in: {msg}"


@pytest.mark.parametrize(
    "strategy",
    ["nonsense", {nn.Linear: "nonsense"}, {"3": "nonsense"}, {nn.Conv2d: "auto", "0": "nonsense"}],
    ids=["global", "by-type", "by-name", "mixed"],
)
def test_unknown_strategy_lists_the_valid_ones(strategy):
    with pytest.raises(ValueError) as err:
        jacmem.extend(jacmem.BatchGrad(), strategy=strategy)
    _assert_lists_valid(err, "nonsense")
    assert jacmem.context._ACTIVE is None


@pytest.mark.parametrize("flow", ["inside", "track"])
@pytest.mark.parametrize("key", [nn.Linear, "3"], ids=["by-type", "by-name"])
def test_strategy_the_module_does_not_offer_names_the_module(key, flow):
    """The Linear offers no "unfold": asked for it in particular, it is an error that names it."""
    assert "unfold" in all_strategy_names() and "unfold" not in lookup(nn.Linear(2, 2)).names()
    model, (X, y) = small_net(), data()
    before = global_hooks()
    with pytest.raises(ValueError, match=r"'3'.*Linear"):
        run_jacmem(model, X, y, cross_entropy, "mean", [jacmem.BatchGrad()], flow, strategy={key: "unfold"})
    assert jacmem.context._ACTIVE is None and global_hooks() == before
    assert not hasattr(model[3].weight, "grad_batch")


def test_not_an_extension():
    with pytest.raises(TypeError, match="BatchGrad"):
        jacmem.extend("BatchGrad")


# -- unsupported modules -------------------------------------------------------------


class RunningScale(nn.Module):
    """A trainable scale, used through ``exp`` (which jacmem's explicit broadcast does not
    follow), that also updates a running statistic in training mode, so a per-sample
    recomputation could not reproduce its forward: [N, *] -> [N, *]."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.5, dtype=torch.float64))
        self.register_buffer("running", torch.zeros((), dtype=torch.float64))

    def forward(self, x):
        if self.training:
            self.running.mul_(0.9).add_(0.1 * x.detach().mean())
        return x * self.scale.exp()


def unsupported_net():
    model = nn.Sequential(nn.Linear(4, 5), RunningScale(), nn.Linear(5, 3)).double()
    assert lookup(model[1]) is None, "jacmem handles RunningScale now: pick a module it cannot handle"
    return model


@pytest.mark.parametrize("flow", ["inside", "track"])
def test_unsupported_module_warns_naming_it(flow):
    model = unsupported_net()
    X, y = torch.randn(4, 4, dtype=torch.float64), torch.randint(0, 3, (4,))
    with pytest.warns(UserWarning, match=r"'1'.*RunningScale.*scale"):
        run_jacmem(model, X, y, cross_entropy, "mean", [jacmem.BatchGrad(), jacmem.Variance()], flow)
    assert not hasattr(model[1].scale, "grad_batch") and not hasattr(model[1].scale, "variance")
    # the other layers are still right
    model.eval()  # the reference loop must not move the running statistic
    reference = per_sample_grads(model, X, y, cross_entropy, "mean")
    del reference[model[1].scale]
    check_against(model, reference, ["grad_batch", "variance"])


@pytest.mark.parametrize("flow", ["inside", "track"])
def test_unsupported_module_strict_raises(flow):
    model = unsupported_net()
    X, y = torch.randn(4, 4, dtype=torch.float64), torch.randint(0, 3, (4,))
    before = global_hooks()
    with pytest.raises(RuntimeError, match=r"'1'.*RunningScale"):
        run_jacmem(model, X, y, cross_entropy, "mean", [jacmem.BatchGrad()], flow, strict=True)
    assert jacmem.context._ACTIVE is None and global_hooks() == before
    for p in model.parameters():
        assert not hasattr(p, "grad_batch"), "a failed backward wrote results"


# -- exceptions inside the block -----------------------------------------------------


class Boom(Exception):
    pass


class FailingForward(nn.Module):
    def forward(self, x):
        raise Boom("in the forward")


@pytest.mark.parametrize("where", ["forward", "backward-tensor-hook", "backward-function"])
def test_exception_inside_the_block_leaves_nothing(where):
    model = small_net()
    X, y = data()
    before = global_hooks()
    mine = []  # this test's own hooks
    with recorded() as records, Outputs(model) as outputs:
        with pytest.raises(Boom):
            with jacmem.extend(jacmem.BatchGrad(), jacmem.BatchL2Grad()):
                h = model[1](model[0](X))
                if where == "forward":
                    FailingForward()(h)
                if where == "backward-tensor-hook":
                    mine.append(h.register_hook(lambda g: (_ for _ in ()).throw(Boom("in a tensor hook"))))
                    out = model[3](model[2](h))
                if where == "backward-function":
                    out = model[3](model[2](Raise.apply(h)))
                loss = cross_entropy(out, y, "mean")
                loss.backward()
        assert records, "nothing was recorded: the test does not exercise the hooks"
    for handle in mine:
        handle.remove()
    assert_clean(model, outputs, records, before)
    for p in model.parameters():
        assert not hasattr(p, "grad_batch") and not hasattr(p, "batch_l2"), "a failed backward wrote results"
    # and the next block works
    reference = per_sample_grads(model, X, y, cross_entropy, "mean")
    run_jacmem(model, X, y, cross_entropy, "mean", [jacmem.BatchGrad()])
    check_against(model, reference, ["grad_batch"])


class Raise(torch.autograd.Function):
    """Identity forward, a backward that raises."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise Boom("in a backward")


def test_exception_in_a_tracked_backward_leaves_nothing():
    model = small_net()
    X, y = data()
    before = global_hooks()
    with recorded() as records, Outputs(model) as outputs:
        jacmem.track(model)
        try:
            out = model(X)
            mine = out.register_hook(lambda g: (_ for _ in ()).throw(Boom("in a tensor hook")))
            with pytest.raises(Boom):
                with jacmem.extend(jacmem.BatchGrad()):
                    cross_entropy(out, y, "sum").backward()
            assert jacmem.context._ACTIVE is None
        finally:
            jacmem.untrack(model)
        assert records
    mine.remove()
    assert_clean(model, outputs, records, before)


# -- nesting, track/untrack -----------------------------------------------------------


def test_nested_blocks_raise():
    model = small_net()
    X, y = data()
    before = global_hooks()
    with jacmem.extend(jacmem.BatchGrad()):
        with pytest.raises(RuntimeError, match="nest"):
            with jacmem.extend(jacmem.Variance()):
                pass
        # the outer block is untouched and still works
        cross_entropy(model(X), y, "mean").backward()
    assert model[0].weight.grad_batch.shape == (4, 3, 2, 3, 3)
    assert not hasattr(model[0].weight, "variance")
    assert jacmem.context._ACTIVE is None and global_hooks() == before


def test_track_untrack_leave_no_hooks():
    model = small_net()
    X, y = data()
    before = global_hooks()
    with recorded() as records, Outputs(model) as outputs:
        assert jacmem.track(model) is model
        jacmem.track(model)  # twice is once
        out = model(X)
        assert any(m._forward_hooks for m in model.modules())
        with jacmem.extend(jacmem.BatchGrad()):
            cross_entropy(out, y, "mean").backward()
        assert jacmem.untrack(model) is model
        jacmem.untrack(model)  # twice is harmless
        assert records
    assert_clean(model, outputs, records, before)
    assert model[3].weight.grad_batch.shape == (4, 3, 27)


def test_block_frees_what_it_kept_while_the_graph_lives():
    """After the block, no record keeps an input, though the loss and its graph live on."""
    model = small_net()
    X, y = data()
    before = global_hooks()
    with recorded() as records, Outputs(model) as outputs:
        with jacmem.extend(jacmem.BatchGrad()):
            loss = cross_entropy(model(X), y, "mean")
            loss.backward(retain_graph=True)
        assert records
    assert_clean(model, outputs, records, before)
    assert loss.grad_fn is not None


def test_sequence_first_model_warns_that_axis_0_is_not_the_batch():
    """A batch_first=False encoder layer: its Linear and LayerNorm see axis 0 (the sequence)
    as the batch while its attention sees the samples; jacmem cannot tell which is meant,
    so it must say so rather than hand out per-position quantities as per-sample ones."""
    torch.manual_seed(0)
    X = torch.randn(5, 3, 8, dtype=torch.float64)  # [L, N, E]
    seq_first = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=False).double()
    with pytest.warns(RuntimeWarning, match=r"different batch sizes \(5: .*'linear1'.*; 3: 'self_attn'\)"):
        with jacmem.extend(jacmem.BatchGrad()):
            seq_first(X).square().sum().backward()

    batch_first = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True).double()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*different batch sizes")
        with jacmem.extend(jacmem.BatchGrad()):
            batch_first(X.transpose(0, 1)).square().sum().backward()
    assert batch_first.linear1.weight.grad_batch.shape[0] == 3
