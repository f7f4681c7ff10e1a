"""Faults and bad input: each gets a clear error or warning, and leaves nothing behind.

"Nothing behind", checked after every case by :class:`State` (or :func:`assert_clean`,
which also checks that every kept input is freed): no global module hook, no tensor
hook on the outputs the block saw, no active block, and no attribute written by a backward pass that failed (results are written at
the end of a backward pass, all at once).

Covered:

- bad arguments: an unknown strategy name (a ValueError listing the valid ones,
  globally and per layer by type or name), a strategy the module does not offer (a
  ValueError naming the module), something that is not an extension;
- a trainable module no extension can handle: UnsupportedModuleError naming it, strict
  or not, with nothing written;
- block misuse: an exception in the forward, in the backward (a tensor hook, an
  autograd Function, a tracked backward), inside a jacmem derivative;
  ``KeyboardInterrupt``; nested blocks; a second thread;
- graph options: ``retain_graph=True`` twice, ``create_graph=True``,
  ``torch.autograd.grad``, ``backward(inputs=...)``;
- tensor state: ``torch.no_grad()`` and ``torch.inference_mode()`` forwards,
  ``ReLU(inplace=True)`` after a conv, channels-last and transposed inputs, empty
  batches, batch size 1;
- inputs and parameters: integer and bool inputs, NaN and Inf inputs, parameters that
  change shape between steps;
- ``track``/``untrack`` leave no hook; a block frees what it kept while the graph
  lives; a model whose axis 0 is not the batch is named;
- no leaks: 100 training steps with every extension keep the process's memory flat.

Every quantity is compared in float64 with the per-sample autograd loop of
``tests/support/reference.py``.
"""

from __future__ import annotations

import copy
import gc
import re
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import psutil
import pytest
import torch
from tests.support.clipping import assert_grads, expected, per_sample
from tests.support.firstorder_cases import strategies
from tests.support.reference import (
    REFERENCE,
    SAVEFIELDS,
    assert_close,
    check_against,
    clear,
    cross_entropy,
    mse,
    per_sample_grads,
    recorded,
    run_jacmem,
)
from torch import nn
from torch.nn.modules import module as module_hooks

import jacmem
import jacmem.context
from jacmem.derivatives import REGISTRY, LayerDerivatives, Strategy, all_strategy_names, lookup
from jacmem.extensions.clipping import check

FIRST_ORDER = (jacmem.BatchGrad, jacmem.BatchL2Grad, jacmem.SumGradSquared, jacmem.Variance)
ALL_FIELDS = [e.savefield for e in FIRST_ORDER]


def extensions():
    return [e() for e in FIRST_ORDER]


def mlp():
    """[N, 3] -> [N, 2]"""
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()


def cnn(inplace=False):
    """[N, 2, 6, 6] -> [N, 2]; the ReLU may modify the conv's output in place."""
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(inplace=inplace), nn.Conv2d(3, 2, 3, stride=2), nn.Flatten(),
        nn.Linear(8, 2),
    ).double()  # fmt: skip


def x64(*shape):
    return torch.randn(*shape, dtype=torch.float64)


def global_hooks():
    return len(module_hooks._global_forward_pre_hooks), len(module_hooks._global_forward_hooks)


class State:
    """What must be the same after a block as before it; ``outputs`` collects the
    output tensors of every module call (those in a tuple or dict too), to check that no
    tensor hook stays on them."""

    def __init__(self, model=None):
        self.hooks = global_hooks()
        self.outputs = []
        self._handles = [] if model is None else [
            m.register_forward_hook(lambda m, a, out: self.outputs.extend(torch.utils._pytree.tree_leaves(out)))
            for m in model.modules()
        ]  # fmt: skip

    def check(self):
        for h in self._handles:
            h.remove()
        assert jacmem.context._ACTIVE is None, "a block is still active"
        after = global_hooks()
        assert after == self.hooks, f"global forward (pre-)hooks went from {self.hooks} to {after}"
        for out in self.outputs:
            assert not isinstance(out, torch.Tensor) or not out._backward_hooks, "a tensor hook stayed on an output"


def no_fields(model, fields=SAVEFIELDS):
    for name, p in model.named_parameters():
        present = [f for f in fields if hasattr(p, f)]
        assert not present, f"{name} got {present}"


def check_reference(model, X, y, fields=ALL_FIELDS, check_grad=True, what=""):
    check_against(model, per_sample_grads(model, X, y, mse), fields, what, check_grad=check_grad)


def small_net():
    """[N, 2, 5, 5] -> [N, 3]"""
    return nn.Sequential(nn.Conv2d(2, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(27, 3)).double()


def data(n=4):
    return torch.randn(n, 2, 5, 5, dtype=torch.float64), torch.randint(0, 3, (n,))


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


#: UnsupportedModuleError's words for RunningScale under BatchGrad and Variance
UNSUPPORTED = (
    r"module '1' \(RunningScale\) has trainable parameter\(s\) \['scale'\] that BatchGrad\(\), Variance\(\) "
    r"cannot handle: jacmem has no exact grad_batch, variance for them\. Register a derivative with "
    r"jacmem\.register\(\.\.\.\).*or freeze them \(requires_grad_\(False\)\)"
)


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("flow", ["inside", "track"])
def test_unsupported_module_raises_naming_it_and_writes_nothing(flow, strict):
    """A trainable module no derivative covers, whose generic fallback is refused (it
    moves a buffer in training mode), raises UnsupportedModuleError out of
    ``loss.backward()``, naming the module, its parameter, the extensions and the fix,
    with or without ``strict`` (which is about the exact-but-slow fallback): it warned
    and gave that parameter nothing, a warning beside a missing result. The layer after
    it, whose quantities the pass had computed before, gets nothing either (the pass
    writes at its end), and the block leaves no hook and no active block. Frozen, the
    module is no longer in the way, and the other layers are exact."""
    model = unsupported_net()
    X, y = torch.randn(4, 4, dtype=torch.float64), torch.randint(0, 3, (4,))
    state = State(model)
    with pytest.raises(jacmem.UnsupportedModuleError, match=UNSUPPORTED):
        run_jacmem(model, X, y, cross_entropy, "mean", [jacmem.BatchGrad(), jacmem.Variance()], flow, strict=strict)
    state.check()
    no_fields(model)
    model[1].scale.requires_grad_(False)
    model.eval()  # the reference loop must not move the running statistic
    reference = per_sample_grads(model, X, y, cross_entropy, "mean")
    model.train()
    clear(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run_jacmem(model, X, y, cross_entropy, "mean", [jacmem.BatchGrad(), jacmem.Variance()], flow)
    check_against(model, reference, ["grad_batch", "variance"])


def test_unsupported_module_a_backward_does_not_differentiate_is_no_error():
    """``backward(inputs=...)`` that leaves the unsupported module's parameter out
    computes the quantities of the parameters it names, and raises nothing: that
    parameter gets no result because none was asked for."""
    model = unsupported_net()
    X, y = torch.randn(4, 4, dtype=torch.float64), torch.randint(0, 3, (4,))
    first = model[0].weight
    reference = per_sample_grads(model, X, y, cross_entropy, "mean")[first]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with jacmem.extend(jacmem.BatchGrad()):
            cross_entropy(model(X), y, "mean").backward(inputs=[first])
    assert_close(first.grad_batch, reference, "the first Linear's weight")
    assert not any(hasattr(p, "grad_batch") for p in model.parameters() if p is not first)


# -- block misuse -----------------------------------------------------------------


class Boom(ValueError):
    pass


class FailingForward(nn.Module):
    def forward(self, x):
        raise Boom("boom in forward")


class FailingBackward(torch.autograd.Function):
    """Identity forward, a backward that raises."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise Boom("boom in backward")


class FailBetween(nn.Module):
    """Identity whose backward raises: the layers after it have been processed (and
    staged) when the backward pass fails."""

    def forward(self, x):
        return FailingBackward.apply(x)


@pytest.mark.parametrize("flow", ["inside", "track"])
@pytest.mark.parametrize("extension", FIRST_ORDER, ids=lambda e: e.__name__)
def test_a_call_behind_a_broadcast_over_the_batch_is_refused(extension, flow):
    """HF T5's relative attention bias runs on [T, T] bucket ids, its output broadcast
    over the batch: where N = T its rows passed for samples (batch_l2 per query
    position, with no word). The forward now raises naming it (the backward, where the
    forward ran before the block, tracked); frozen, the rest of the model equals the
    per-sample loop."""
    from tests.support.hf_models import T5Classifier

    torch.manual_seed(0)
    model, X, y = T5Classifier().double(), torch.randint(0, 50, (5, 5)), torch.tensor([0, 1, 2, 1, 0])
    state = State(model)
    with pytest.raises(RuntimeError, match=r"module '[\w.]*relative_attention_bias' \(Embedding\) reaches"):
        if flow == "inside":
            with jacmem.extend(extension()):
                cross_entropy(model(X), y, "mean").backward()
        else:
            jacmem.track(model)
            try:
                loss = cross_entropy(model(X), y, "mean")
                with jacmem.extend(extension()):
                    loss.backward()
            finally:
                jacmem.untrack(model)
    state.check()
    for name, p in model.named_parameters():
        p.requires_grad_("relative_attention_bias" not in name)
    reference = per_sample_grads(model, X, y, cross_entropy)
    run_jacmem(model, X, y, cross_entropy, "mean", [extension()], flow)
    check_against(model, reference, [extension.savefield])


class Prompted(nn.Module):
    """[N, 3, 4] -> [N, 3]: a prompt (an Embedding on one row of ids) tiled over the batch
    by ``repeat(N, *tile)`` before each sample's rows, then a Linear head on their mean."""

    def __init__(self, tile: tuple[int, int]):
        super().__init__()
        self.prompt, self.head, self.tile = nn.Embedding(5, 4), nn.Linear(4, 3), tile
        self.register_buffer("ids", torch.arange(2)[None])

    def forward(self, x):
        prompts = self.prompt(self.ids).repeat(x.shape[0], *self.tile)
        return self.head(torch.cat([prompts, x], 1).mean(1))


@pytest.mark.parametrize("flow", ["inside", "track"])
@pytest.mark.parametrize("extension", [*FIRST_ORDER, jacmem.ClipGrad], ids=lambda e: e.__name__)
def test_a_call_on_one_row_repeated_over_the_batch_is_exact_or_refused(extension, flow):
    """PEFT's prompt tuning runs its prompt embedding on one row of ids and ``repeat``-s
    the prompts over the batch: the first-order extensions gave the batch's sums as
    "per-sample" quantities, with no word. ``repeat(N, 1, 1)`` is now the expansion it
    is, exact; a repeat jacmem does not follow (the tokens tiled too) raises, naming
    the module."""
    make = (lambda: jacmem.ClipGrad(0.5)) if extension is jacmem.ClipGrad else extension
    field = "grad" if extension is jacmem.ClipGrad else extension.savefield
    X, y = torch.randn(4, 3, 4, dtype=torch.float64), torch.tensor([0, 1, 2, 1])
    torch.manual_seed(0)
    model = Prompted((1, 1)).double()
    if extension is jacmem.ClipGrad:
        reference = expected(per_sample(model, X, y, cross_entropy, "mean"), 0.5)
        run_jacmem(model, X, y, cross_entropy, "mean", [make()], flow)
        assert_grads(model, reference, f"repeat(N, 1, 1) {flow}")
    else:
        reference = per_sample_grads(model, X, y, cross_entropy)
        run_jacmem(model, X, y, cross_entropy, "mean", [make()], flow)
        check_against(model, reference, [field])
    model = Prompted((2, 1)).double()
    state = State(model)
    with pytest.raises(
        RuntimeError, match=r"module 'prompt' \(Embedding\) ran on a batch of one.* only through repeat"
    ):
        run_jacmem(model, X, y, cross_entropy, "mean", [make()], flow)
    state.check()


def test_exception_in_forward_leaves_nothing():
    model = nn.Sequential(nn.Linear(3, 4), FailingForward(), nn.Linear(4, 2)).double()
    state = State(model)
    with pytest.raises(ValueError, match="boom in forward"):
        with jacmem.extend(*extensions()):
            model(x64(5, 3))
    state.check()
    no_fields(model)


@pytest.mark.parametrize("flow", ["inside", "track"])
def test_exception_in_backward_writes_nothing(flow):
    model = nn.Sequential(nn.Linear(3, 4), FailBetween(), nn.Tanh(), nn.Linear(4, 2)).double()
    X, y = x64(5, 3), x64(5, 2)
    state = State(model)
    if flow == "track":
        jacmem.track(model)
    try:
        with pytest.raises(ValueError, match="boom in backward"):
            with jacmem.extend(*extensions()):
                mse(model(X), y, "mean").backward()
    finally:
        jacmem.untrack(model)
    state.check()
    no_fields(model)  # the last Linear was computed before the failure, and not written


def test_failed_backward_inside_block_leaves_no_stale_results():
    """A backward that fails inside the block, caught there; the next one is right."""
    model = nn.Sequential(nn.Linear(3, 4), FailBetween(), nn.Tanh(), nn.Linear(4, 2)).double()
    good = nn.Sequential(model[0], nn.Tanh(), model[3])
    X, y = x64(5, 3), x64(5, 2)
    state = State()
    with jacmem.extend(*extensions()):
        with pytest.raises(ValueError, match="boom in backward"):
            mse(model(X), y, "mean").backward()
        no_fields(model)
        clear(model)
        mse(good(X), y, "mean").backward()
    state.check()
    check_reference(good, X, y)


class TwoOutputs(nn.Module):
    """x [N, I] -> (x Wᵀ, 2 x Wᵀ): one record with two outputs."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(x64(3, 4))

    def forward(self, x):
        return x @ self.weight.T, 2 * (x @ self.weight.T)  # neither depends on the other


def two_outputs_batch_grad(x, g):
    """(g1 + 2 g2)ᵀ x per sample: [N, I], ([N, O], [N, O]) -> [N, O, I]"""
    return torch.einsum("no,ni->noi", g[0] + 2 * g[1], x)


def test_failed_backward_through_a_retained_graph_leaves_no_stale_gradients(monkeypatch):
    """A retained graph whose first backward fails after one of a record's two output
    gradients arrived; a second pass through the same graph that reaches only the
    other output must not use the first pass's gradient (it stands in zeros)."""
    entry = LayerDerivatives()
    entry.strategies[("weight", "batch_grad")] = {"default": Strategy(two_outputs_batch_grad)}
    monkeypatch.setitem(REGISTRY, TwoOutputs, entry)
    layer = TwoOutputs()
    X, y1, y2 = x64(5, 4), x64(5, 3), x64(5, 3)

    def fail(g):
        raise ValueError("boom in a tensor hook")

    with jacmem.extend(jacmem.BatchGrad()):
        out1, out2 = layer(X)
        handle = out2.register_hook(fail)  # after jacmem's: out2's gradient reaches jacmem, then this fails
        with pytest.raises(ValueError, match="boom in a tensor hook"):
            ((out1 * y1).sum() + (out2 * y2).sum()).backward(retain_graph=True)
        handle.remove()
        no_fields(layer)
        (out1 * y1).sum().backward()
    expected = torch.einsum("no,ni->noi", y1, X)
    assert_close(layer.weight.grad_batch, expected, "grad_batch of the second pass")


def raising(message):
    def fn(x, g, **hp):
        raise ArithmeticError(message)

    return fn


def test_exception_inside_a_derivative_names_the_module(monkeypatch):
    """The first Linear's derivative raises; the second was computed already."""
    model = mlp()
    table = REGISTRY[nn.Linear].strategies[("weight", "batch_grad")]
    original = table["outer"]

    def outer_unless_first(x, g, **hp):
        if x.shape[-1] == 3:
            raise ArithmeticError("derivative failed")
        return original.fn(x, g, **hp)

    monkeypatch.setitem(table, "outer", Strategy(outer_unless_first, original.cost))
    state = State(model)
    with pytest.raises(RuntimeError, match=r"module '0' \(Linear\) failed: derivative failed") as info:
        with jacmem.extend(jacmem.BatchGrad(), strategy="outer"):
            mse(model(x64(5, 3)), x64(5, 2), "mean").backward()
    assert isinstance(info.value.__cause__, ArithmeticError)
    assert "strategy=" in str(info.value), "the error should say how to pick another implementation"
    del info
    state.check()
    no_fields(model)


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_keyboard_interrupt(where):
    model = mlp()
    X, y = x64(5, 3), x64(5, 2)

    def interrupt(*args):
        raise KeyboardInterrupt

    state = State(model)
    handles = [model[1].register_forward_hook(interrupt)] if where == "forward" else []
    try:
        with pytest.raises(KeyboardInterrupt):
            with jacmem.extend(*extensions()):
                out = model(X)
                handles.append(model[0].weight.register_hook(interrupt))  # after the last layer was staged
                mse(out, y, "mean").backward()
    finally:
        for handle in handles:
            handle.remove()
    state.check()
    no_fields(model)
    clear(model)
    run_jacmem(model, X, y, mse, "mean", extensions())
    check_reference(model, X, y)


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
                    out = model[3](model[2](FailingBackward.apply(h)))
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


def test_a_backward_that_failed_midway_leaves_the_next_one_in_the_block_whole():
    """A backward that raises after the block's pass began (the Linear's hook ran, then a
    hook below it raised): autograd drops the pass, so the next backward in the same
    block begins its own (a backward beginning inside a running pass joins it, see
    :class:`jacmem.engine.base.Passes`) and gets every result."""
    model = small_net()
    X, y = data()
    reference = per_sample_grads(model, X, y, cross_entropy, "mean")
    with jacmem.extend(jacmem.BatchGrad()):
        h = model[1](model[0](X))
        handle = h.register_hook(lambda g: (_ for _ in ()).throw(Boom("below the Linear")))
        with pytest.raises(Boom):
            cross_entropy(model[3](model[2](h)), y, "mean").backward()
        handle.remove()
        clear(model)
        cross_entropy(model(X), y, "mean").backward()
    check_against(model, reference, ["grad_batch"])


@pytest.mark.parametrize("parametrization", ["weight_norm", "orthogonal"])
def test_a_parametrized_layer_is_refused_and_leaves_the_layers_registrations_whole(parametrization):
    """A Linear under ``torch.nn.utils.parametrize`` (its ``weight`` a tensor computed from
    other parameters) is refused, in the forward and by ``check`` (UnsupportedModuleError),
    naming the parametrization and the fix. It was matched to Linear's derivatives, whose name
    check, finding no parameter ``weight``, took Linear's registrations back for the
    whole process: every plain Linear after it had no per-sample gradients."""
    wrap = getattr(torch.nn.utils.parametrizations, parametrization)
    model = nn.Sequential(wrap(nn.Linear(4, 4)), nn.Tanh(), nn.Linear(4, 3)).double()
    X, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    match = r"\['weight'\] under a parametrization.*remove_para"
    for ext in (jacmem.BatchGrad(), jacmem.ClipGrad(1.0)):
        with pytest.raises(ValueError, match=match):
            with jacmem.extend(ext):
                cross_entropy(model(X), y, "mean").backward()
    with pytest.raises(jacmem.UnsupportedModuleError, match=match + r".*module '0'"):
        check(model)  # as make_private does, before any step
    plain = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    reference = per_sample_grads(plain, X, y, cross_entropy, "mean")
    run_jacmem(plain, X, y, cross_entropy, "mean", [jacmem.BatchGrad()])
    check_against(plain, reference, ["grad_batch"])


def test_a_frozen_parametrized_layer_is_no_call_to_count():
    """A frozen layer has nothing to compute: the one rule for which calls count
    (:func:`jacmem.engine.hooks.counted`) skips it before looking up its derivatives, in
    first order as in second. First order used to look them up for any module with
    parameters, frozen or not, and refused a frozen weight-normed Linear (a frozen
    backbone's) that second order passed, instead of the exact per-sample gradients of
    the layers after it."""
    model = nn.Sequential(torch.nn.utils.parametrizations.weight_norm(nn.Linear(4, 4)), nn.Tanh(), nn.Linear(4, 3))
    model = model.double().requires_grad_(False)
    model[2].requires_grad_(True)
    X, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    reference = per_sample_grads(model, X, y, cross_entropy, "mean")
    run_jacmem(model, X, y, cross_entropy, "mean", [jacmem.BatchGrad()])
    check_against(model, reference, ["grad_batch"])


#: run in a process of its own: the first Linear of the process is legacy-weight-normed
_LEGACY_WEIGHT_NORM_FIRST = """
import warnings
import pytest, torch
from torch import nn
import jacmem
from tests.support.reference import assert_close, cross_entropy, per_sample_grads

X, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
normed = nn.Sequential(torch.nn.utils.weight_norm(nn.Linear(4, 3))).double()  # weight_g, weight_v, bias
with pytest.raises(jacmem.UnsupportedModuleError, match=r"\\['weight_g', 'weight_v'\\] that BatchGrad\\(\\) cannot handle"):
    with jacmem.extend(jacmem.BatchGrad()):
        cross_entropy(normed(X), y, "mean").backward()
bias = normed[0].bias
assert not any(hasattr(p, "grad_batch") for p in normed.parameters()), "a failed backward wrote results"
normed[0].weight_g.requires_grad_(False)
normed[0].weight_v.requires_grad_(False)
with jacmem.extend(jacmem.BatchGrad()):
    cross_entropy(normed(X), y, "mean").backward()
assert_close(bias.grad_batch, per_sample_grads(normed, X, y, cross_entropy)[bias], "the normed Linear's bias")
normed[0].weight_g.requires_grad_(True)
normed[0].weight_v.requires_grad_(True)
with pytest.raises(RuntimeError, match=r"\\['weight_g', 'weight_v'\\] whose per-sample gradients"):
    with jacmem.extend(jacmem.ClipGrad(1.0)):
        cross_entropy(normed(X), y, "mean").backward()
plain = nn.Sequential(nn.Linear(4, 3)).double()
with warnings.catch_warnings():
    warnings.simplefilter("error")
    with jacmem.extend(jacmem.BatchGrad()):
        cross_entropy(plain(X), y, "mean").backward()
for p, gb in per_sample_grads(plain, X, y, cross_entropy).items():
    assert_close(p.grad_batch, gb, "a plain Linear after it")
"""


def test_a_legacy_weight_normed_layer_met_first_leaves_the_layers_registrations_whole():
    """``torch.nn.utils.weight_norm`` (the legacy hook, common in audio models) leaves a
    Linear with ``weight_g`` and ``weight_v`` and no parameter ``weight``. Met first in a
    process, Linear's name check took Linear's own registrations back, with an error
    about a misspelt registration: every plain Linear after it got no per-sample
    gradients. Its two parameters are now unsupported like any (``BatchGrad`` and
    ``ClipGrad`` raise, naming them), its bias is exact once they are frozen, and so is
    a plain Linear after it."""
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", _LEGACY_WEIGHT_NORM_FIRST], check=True, cwd=root)


def test_nested_blocks_fail_clearly_and_the_outer_block_still_works():
    model = mlp()
    X, y = x64(5, 3), x64(5, 2)
    state = State()
    with jacmem.extend(*extensions()) as outer:
        with pytest.raises(RuntimeError, match=r"do not nest.*jacmem.extend\(BatchGrad\(\), Variance\(\)\)"):
            with jacmem.extend(jacmem.BatchGrad()):
                pass
        with pytest.raises(RuntimeError, match="do not nest"):
            with outer:
                pass
        assert jacmem.context._ACTIVE is outer
        mse(model(X), y, "mean").backward()
    state.check()
    check_reference(model, X, y)


@pytest.mark.parametrize("flow", ["inside", "track"])
def test_threads_other_than_the_owner_get_nothing(flow):
    """The block belongs to the thread that entered it: another thread's forward is not
    recorded (or, tracked, is recorded but not extended) and its backward writes
    nothing, on the same model, while the block is active; a block entered in the
    other thread meanwhile fails clearly."""
    model = mlp()
    if flow == "track":
        jacmem.track(model)
    X, y = x64(6, 3), x64(6, 2)
    X2, y2 = x64(4, 3), x64(4, 2)
    errors, records_in_thread = [], []
    entered, done = threading.Event(), threading.Event()

    def other():
        try:
            entered.wait(10)
            with recorded() as records:
                mse(model(X2), y2, "mean").backward()
            if flow == "inside":
                records_in_thread.extend(r for r in records if r() is not None)
            no_fields(model)
            try:
                with jacmem.extend(jacmem.BatchGrad()):
                    pass
            except RuntimeError as err:
                errors.append(str(err))
        except BaseException as err:  # report it in the main thread
            errors.append(repr(err))
        finally:
            done.set()

    thread = threading.Thread(target=other)
    thread.start()
    state = State()
    with jacmem.extend(*extensions()):
        out = model(X)
        entered.set()
        assert done.wait(20)
        clear(model)
        mse(out, y, "mean").backward()
    thread.join()
    jacmem.untrack(model)
    state.check()
    assert not records_in_thread
    assert len(errors) == 1 and "in another thread" in errors[0], errors
    check_reference(model, X, y)


# -- graph options ----------------------------------------------------------------


def test_retain_graph_twice_gives_each_pass_its_own_results():
    model = cnn()
    X, y = x64(4, 2, 6, 6), x64(4, 2)
    with jacmem.extend(*extensions()):
        loss = mse(model(X), y, "mean")
        loss.backward(retain_graph=True)
        first = {p: p.grad_batch.clone() for p in model.parameters()}
        loss.backward()
    reference = per_sample_grads(model, X, y, mse)
    for p, gb in reference.items():
        torch.testing.assert_close(first[p], gb, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(p.grad, 2 * gb.sum(0), rtol=1e-9, atol=1e-12)  # .grad accumulates
        p.grad /= 2  # check_against compares grad_batch.sum(0) with one pass's .grad
    check_against(model, reference, ALL_FIELDS, "second pass")


class Branches(nn.Module):
    """[N, 3] -> [N, 2]: ``a(x)``, plus ``b(x)`` where ``self.skip`` is False."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.skip = nn.Linear(3, 2).double(), nn.Linear(3, 2).double(), False

    def forward(self, x):
        return self.a(x) if self.skip else self.a(x) + self.b(x)


@pytest.mark.parametrize("where", ["new block", "same block", "track"])
def test_a_branch_the_batch_skipped_loses_the_results_of_an_earlier_batch(where):
    """A pass writes its results; where the model's forward ran, the trainable parameters
    it did not write lose the block's results from before (an earlier batch's, which
    would read as this one's), as ``.grad`` does under ``zero_grad(set_to_none=True)``.
    A model whose forward did not run, and a frozen parameter, keep theirs."""
    model, other = Branches(), mlp()
    X, y, Z = x64(4, 3), x64(4, 2), x64(4, 3)

    def first():
        mse(model(X), y, "mean").backward()
        mse(other(Z), y, "mean").backward()
        assert all(hasattr(p, f) for p in model.parameters() for f in ALL_FIELDS)
        return {p: p.grad_batch for p in other.parameters()}

    def skip():
        model.skip = True
        model.b.bias.requires_grad_(False)
        model.zero_grad()

    with jacmem.extend(*extensions()):
        earlier = first()
        skip()
        if where == "same block":
            mse(model(X), y, "mean").backward()
    if where == "new block":
        with jacmem.extend(*extensions()):
            mse(model(X), y, "mean").backward()
    elif where == "track":
        jacmem.track(model)
        loss = mse(model(X), y, "mean")
        with jacmem.extend(*extensions()):
            loss.backward()
        jacmem.untrack(model)
    assert not any(hasattr(model.b.weight, f) for f in ALL_FIELDS)
    assert all(hasattr(model.b.bias, f) for f in ALL_FIELDS)
    reference = per_sample_grads(model, X, y, mse)
    check_against(model, {p: reference[p] for p in model.a.parameters()}, ALL_FIELDS)
    assert all(p.grad_batch is earlier[p] for p in other.parameters())


def test_create_graph_works_and_gives_constants():
    """The quantities' values are the loop's; differentiating them raises, naming jacmem
    (tests/engine/test_create_graph.py has the rest)."""
    model = cnn()
    X, y = x64(4, 2, 6, 6), x64(4, 2)
    with jacmem.extend(*extensions()):
        params = list(model.parameters())
        grads = torch.autograd.grad(mse(model(X), y, "mean"), params, create_graph=True)
    assert all(g.requires_grad for g in grads), "create_graph=True must still give a graph"
    for p, g in zip(params, grads):
        p.grad = g.detach()
        for f in ALL_FIELDS:
            with pytest.raises(RuntimeError, match="jacmem: .* is not differentiable"):
                torch.autograd.grad(getattr(p, f).sum(), p)
    check_reference(model, X, y)


def test_autograd_grad_gives_quantities_of_its_inputs_only():
    model = cnn()
    X, y = x64(4, 2, 6, 6), x64(4, 2)
    asked = [model[2].weight, model[4].bias]
    state = State(model)
    with jacmem.extend(*extensions()):
        grads = torch.autograd.grad(mse(model(X), y, "mean"), asked)
    state.check()
    reference = per_sample_grads(model, X, y, mse)
    for p, g in zip(asked, grads):
        p.grad = g
    check_against(model, {p: reference[p] for p in asked}, ALL_FIELDS, check_grad=True)
    for p in model.parameters():
        if all(p is not q for q in asked):
            assert p.grad is None and not any(hasattr(p, f) for f in ALL_FIELDS)


def test_backward_inputs_gives_quantities_of_those_only():
    model = cnn()
    X, y = x64(4, 2, 6, 6), x64(4, 2)
    asked = [model[0].weight, model[4].weight]
    with jacmem.extend(*extensions()):
        mse(model(X), y, "mean").backward(inputs=asked)
    reference = per_sample_grads(model, X, y, mse)
    check_against(model, {p: reference[p] for p in asked}, ALL_FIELDS)
    for p in model.parameters():
        if all(p is not q for q in asked):
            assert p.grad is None and not any(hasattr(p, f) for f in ALL_FIELDS)


# -- tensor state -----------------------------------------------------------------


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_forward_without_grad_records_nothing(mode):
    model = cnn()
    state = State(model)
    with recorded() as records, jacmem.extend(*extensions()):
        with mode():
            model(x64(4, 2, 6, 6))
    assert not records
    state.check()
    no_fields(model)


@pytest.mark.parametrize("strategy", strategies(nn.Conv2d))
def test_inplace_relu_after_conv(strategy):
    """The conv's output is overwritten by ReLU(inplace=True); its gradient, and so every
    quantity, must be that of the conv's output."""
    model = cnn(inplace=True)
    X, y = x64(4, 2, 6, 6), x64(4, 2)
    run_jacmem(model, X, y, mse, "mean", extensions(), strategy=strategy)
    check_reference(model, X, y)


@pytest.mark.parametrize("strategy", strategies(nn.Conv2d))
@pytest.mark.parametrize("layout", ["channels_last", "transposed"])
def test_non_contiguous_inputs(layout, strategy):
    model = cnn()
    if layout == "channels_last":
        model = model.to(memory_format=torch.channels_last)
        X = x64(4, 2, 6, 6).to(memory_format=torch.channels_last)
    else:  # a view with the spatial axes swapped
        X = x64(4, 2, 6, 6).transpose(2, 3)
    assert not X.is_contiguous()
    y = x64(4, 2)
    run_jacmem(model, X, y, mse, "mean", extensions(), strategy=strategy)
    check_reference(model, X, y)


def test_non_contiguous_linear_input():
    model = mlp()
    X, y = x64(3, 5).t(), x64(5, 2)  # [5, 3], a transposed view
    run_jacmem(model, X, y, mse, "mean", extensions())
    check_reference(model, X, y)


@pytest.mark.parametrize("strategy", strategies(nn.Conv2d))
def test_empty_batch(strategy):
    """N = 0: per-sample quantities are empty, sums are zero, and variance, a mean over
    no samples, is NaN (as ``torch.var`` of nothing)."""
    model = cnn()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about: no value is NaN or Inf
        run_jacmem(model, x64(0, 2, 6, 6), x64(0, 2), mse, "sum", extensions(), strategy=strategy)
    for p in model.parameters():
        assert p.grad_batch.shape == (0, *p.shape)
        assert p.batch_l2.shape == (0,)
        assert torch.equal(p.sum_grad_squared, torch.zeros_like(p))
        assert p.variance.shape == p.shape and p.variance.isnan().all()


@pytest.mark.parametrize("strategy", strategies(nn.Conv2d))
def test_batch_size_one(strategy):
    model = cnn()
    X, y = x64(1, 2, 6, 6), x64(1, 2)
    run_jacmem(model, X, y, mse, "mean", extensions(), strategy=strategy)
    check_reference(model, X, y)


# -- inputs and parameters --------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool])
@pytest.mark.parametrize("net", ["mlp", "cnn"])
def test_integer_input_names_the_module_and_the_fix(net, dtype):
    model = mlp() if net == "mlp" else cnn()
    X = torch.ones(2, 3) if net == "mlp" else torch.ones(2, 2, 6, 6)
    state = State(model)
    with pytest.raises(RuntimeError) as info:
        with jacmem.extend(*extensions()):
            model(X.to(dtype))
    kind = "Linear" if net == "mlp" else "Conv2d"
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert f"module '0' ({kind}) got an input of dtype {dtype}" in notes, notes
    assert "X.to(torch.float64)" in notes
    del info
    state.check()


@pytest.mark.parametrize("alone", [False, True], ids=["all extensions", "BatchGrad alone"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_or_inf_input_is_flagged_not_fatal(bad, alone):
    """BatchGrad alone: the check reads the summed gradient instead of the per-sample ones."""
    model = cnn()
    X, y = x64(4, 2, 6, 6), x64(4, 2)
    X[1, 0, 2, 2] = bad
    with pytest.warns(RuntimeWarning, match=r"of module\(s\) '0', '2', '4' hold NaN or Inf") as caught:
        run_jacmem(model, X, y, mse, "mean", [jacmem.BatchGrad()] if alone else extensions())
    assert "it entered at '0': check the data with torch.isfinite(X).all()" in str(caught[0].message)
    for p in model.parameters():
        assert all(hasattr(p, f) for f in (["grad_batch"] if alone else ALL_FIELDS))
    # the samples the bad one does not touch are still right
    good = [0, 2, 3]
    reference = per_sample_grads(model, X[good], y[good], mse)
    for p, gb in reference.items():
        torch.testing.assert_close(p.grad_batch[good], gb * 3 / 4, rtol=1e-9, atol=1e-12)


def test_clean_input_gives_no_warning():
    model = cnn()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run_jacmem(model, x64(4, 2, 6, 6), x64(4, 2), mse, "mean", extensions())


def test_parameters_that_change_shape_between_steps():
    """One block over several steps; each step re-creates the first layer and re-shapes
    the second's weight in place. The references run after the block (a per-sample
    loop inside it would be extended too)."""
    model = mlp()
    steps = []
    with jacmem.extend(*extensions()):
        for step, width in enumerate([4, 7, 2, 7]):
            model[0] = nn.Linear(3, width).double()
            model[2].in_features = width
            model[2].weight = nn.Parameter(x64(2, width))
            X, y = x64(5 + step, 3), x64(5 + step, 2)
            snapshot = copy.deepcopy(model)
            mse(model(X), y, "mean").backward()
            results = {n: {f: getattr(p, f) for f in ALL_FIELDS} for n, p in model.named_parameters()}
            steps.append((snapshot, X, y, results))
    for step, (snapshot, X, y, results) in enumerate(steps):
        reference = per_sample_grads(snapshot, X, y, mse)
        for name, p in snapshot.named_parameters():
            for field in ALL_FIELDS:
                got = results[name][field]
                assert_close(got, REFERENCE[field](reference[p]), f"step {step} {name} {field}")


# -- nesting, track/untrack, batch axis -----------------------------------------------------------


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


# -- no leaks over many steps ----------------------------------------------------

BOUND = 4 * 2**20
WARMUP, STEPS = 20, 100


def every_extension():
    return [
        jacmem.BatchGrad(), jacmem.BatchL2Grad(), jacmem.SumGradSquared(), jacmem.Variance(),
        jacmem.DiagGGNExact(), jacmem.DiagGGNMC(), jacmem.BatchDiagGGNExact(), jacmem.DiagHessian(),
        jacmem.BatchDiagHessian(), jacmem.KFAC(), jacmem.KFLR(), jacmem.KFRA(),
    ]  # fmt: skip


def training_net():
    """[N, 2, 6, 6] -> [N, 3]"""
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, stride=2), nn.ReLU(), nn.Flatten(),
        nn.Linear(4 * 2 * 2, 3),
    )  # fmt: skip


def rss() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


def step(model, lossf, opt, X, y):
    opt.zero_grad()
    lossf(model(X), y).backward()
    for p in model.parameters():  # use the results, as training would
        assert p.grad_batch.shape[0] == X.shape[0] and p.diag_ggn_exact.shape == p.shape
    opt.step()


@pytest.mark.heavy
@pytest.mark.parametrize("blocks", ["one per step", "one for all steps"])
def test_rss_stays_flat_over_100_steps(blocks):
    """Every first- and second-order extension at once, SGD steps on a small CNN: a new
    block per step, or one block around all the steps (a block a lab leaves open for a
    week). After a warm-up of ``WARMUP`` steps (allocator pools, lazy imports, autograd
    caches), ``STEPS`` more may grow the resident set size by less than ``BOUND`` (4 MB).
    Each step keeps the extensions' results alive until the next replaces them, as
    training does. Afterwards no record, hook or block remains.

    An honest leak is well above the bound: the inputs kept for one step of this model
    are ~2 kB, but keeping each step's loss (so its graph) and results grows RSS by
    ~7 MB over 100 steps, where clean steps grow it by ~0.5 MB (measured on this model)."""
    torch.manual_seed(0)
    model, lossf = training_net(), nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    X, y = torch.randn(8, 2, 6, 6), torch.randint(0, 3, (8,))
    hooks_before = global_hooks()

    def run(steps):
        if blocks == "one per step":
            for _ in range(steps):
                with jacmem.extend(*every_extension()):
                    step(model, lossf, opt, X, y)
        else:
            with jacmem.extend(*every_extension()) as block:
                for _ in range(steps):
                    step(model, lossf, opt, X, y)
                assert len(block._tensor_handles) < 100, "the block keeps the hook handles of every step"

    run(WARMUP)
    start = rss()
    run(STEPS)
    growth = rss() - start
    assert growth < BOUND, f"RSS grew by {growth / 2**20:.1f} MB over {STEPS} steps ({blocks})"
    assert jacmem.context._ACTIVE is None
    assert global_hooks() == hooks_before
