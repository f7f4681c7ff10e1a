"""The fixed cost of a step: how many Python calls a warm ``BatchGrad`` step makes into
jacmem, against Opacus's ``GradSampleModule`` on the same model (counted the same way,
with ``sys.setprofile``: each ``call`` event whose code lies under the package), and what
a warm step does not do again: choose strategies by the cost model, check a layer's
parameter names, or walk the graph more than its two checks do (once per model call and
once per backward). No time is asserted: counts and calls only.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections import Counter
from collections.abc import Callable

import pytest
import torch
from torch import nn

import jacmem
from jacmem.engine import planner


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 3))


def _calls(step: Callable[[], None], package: str, warm: int = 3, frames: dict | None = None) -> Counter:
    """``(file, function) -> calls`` into ``package`` (a directory) in one call of ``step``,
    after ``warm`` calls (a generator's every resumption counts, as ``sys.setprofile``
    reports it). ``frames``: ``(file, function) -> set()`` for functions whose distinct
    frames (their invocations) are wanted; filled in."""
    for _ in range(warm):
        step()
    counts: Counter = Counter()
    prefix = package + os.sep

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(prefix):
            key = (os.path.relpath(frame.f_code.co_filename, package), frame.f_code.co_name)
            counts[key] += 1
            if frames is not None and key in frames:
                frames[key].add(frame)  # (held: an id is not reused while the set lives)

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    return counts


def _jacmem_step(model: nn.Module, X: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    lossfunc = nn.CrossEntropyLoss()

    def step():
        model.zero_grad(set_to_none=True)
        with jacmem.extend(jacmem.BatchGrad()):
            lossfunc(model(X), y).backward()

    return step


def _counts() -> tuple[int, int]:
    """Calls into jacmem and into Opacus in one warm step of the 2-Linear MLP, N=8."""
    opacus = pytest.importorskip("opacus")
    X, y = torch.randn(8, 10), torch.randint(0, 3, (8,))
    ours = _calls(_jacmem_step(_model(), X, y), os.path.dirname(jacmem.__file__))

    private = opacus.GradSampleModule(_model())
    lossfunc = nn.CrossEntropyLoss()

    def opacus_step():
        private.zero_grad(set_to_none=True)
        lossfunc(private(X), y).backward()

    with pytest.warns(UserWarning, match="Full backward hook"):  # (Opacus's, on an input without grad)
        theirs = _calls(opacus_step, os.path.dirname(opacus.__file__))
    return sum(ours.values()), sum(theirs.values())


def test_the_counts_count():
    """Both counters see calls (a profile that saw nothing would pass any bound)."""
    ours, theirs = _counts()
    assert ours > 0 and theirs > 0


def test_a_warm_step_calls_jacmem_at_most_twice_as_often_as_opacus():
    """The issue's bound: it was 893 calls against Opacus's 61 (14.6x) before the hot path
    reused what it had found, 299 (4.9x) before each module kept its recipe (the forward's:
    entry, parameters, passthrough; the backward's: its plans bound to their strategies)
    and the block's make, enter and exit lost their idle objects; 119 (1.95x) now. The
    phases' own bounds are below."""
    ours, theirs = _counts()
    assert ours <= 2 * theirs, f"{ours} calls into jacmem per warm step, Opacus {theirs}"


def test_a_leaf_inside_a_forward_costs_its_hooks_alone():
    """A module with no parameter and no submodule (an activation, dropout) called inside
    a model's forward records nothing: its three global hooks return at once (it cost 13
    calls each through the block and the engine), while a leaf called alone, the loss,
    is still the outermost call it is (its output's broadcast check), and the results
    are the per-sample loop's."""
    torch.manual_seed(0)
    X, y = torch.randn(8, 10, dtype=torch.float64), torch.randint(0, 3, (8,))
    package = os.path.dirname(jacmem.__file__)
    short = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 3)).double()
    deep = nn.Sequential(nn.Linear(10, 16), *[nn.Tanh() for _ in range(10)], nn.Linear(16, 3)).double()
    deep.load_state_dict({k.replace("2.", "11."): v for k, v in short.state_dict().items()})
    base = sum(_calls(_jacmem_step(short, X, y), package).values())
    calls = _calls(_jacmem_step(deep, X, y), package)
    assert sum(calls.values()) - base <= 3 * 9, f"{sum(calls.values()) - base} calls for 9 more activations"
    assert calls[("engine/broadcast.py", "behind_broadcasts")] == 2, "the model's and the loss's checks"
    lossfunc = nn.CrossEntropyLoss(reduction="sum")
    for n in range(8):
        grads = torch.autograd.grad(lossfunc(deep(X[n : n + 1]), y[n : n + 1]) / 8, list(deep.parameters()))
        for p, g in zip(deep.parameters(), grads):
            torch.testing.assert_close(p.grad_batch[n], g, rtol=1e-12, atol=1e-12)


# -- what a warm step does not do again ------------------------------------------------------

#: functions a warm step must not call: the cost model, the planner's choice, the
#: strategies' choice, a layer's parameter-name check
_REPLANNING = {
    ("engine/planner.py", "plan"),
    ("engine/planner.py", "_estimate"),
    ("engine/strategies.py", "choose"),
    ("derivatives/registry.py", "missing_names"),
}
#: the graph walks a step may make (:class:`jacmem.walker.Walk`), once per model call or
#: backward: the broadcast check and the parameters a backward reaches
_WALKS = {("walker.py", "__init__"), ("engine/broadcast.py", "behind_broadcasts"), ("walker.py", "parameters")}


def _replanning(calls: Counter) -> set:
    return {key for key in calls if key in _REPLANNING or key[0] == "engine/cost_model.py"}


def test_a_warm_step_reuses_its_plan_and_a_new_shape_plans_again():
    planner._PLANS.clear()
    model = _model()
    package = os.path.dirname(jacmem.__file__)
    X, y = torch.randn(8, 10), torch.randint(0, 3, (8,))
    walks: dict = {key: set() for key in _WALKS}
    warm = _calls(_jacmem_step(model, X, y), package, frames=walks)
    assert not _replanning(warm), f"a warm step planned again: {sorted(_replanning(warm))}"
    # the graph walks: the broadcast check of each outermost call (the model, the loss), one
    # reach per backward; never one per module call or parameter
    assert {key: len(f) for key, f in walks.items()} == {
        ("walker.py", "__init__"): 3,  # each walk of the graph, and no other
        ("engine/broadcast.py", "behind_broadcasts"): 2,
        ("walker.py", "parameters"): 1,
    }
    walks.clear()
    # a new batch size is a new shape: the first step on it plans (cost model included)
    X, y = torch.randn(5, 10), torch.randint(0, 3, (5,))
    cold = _calls(_jacmem_step(model, X, y), package, warm=0)
    assert ("engine/planner.py", "plan") in cold and ("engine/cost_model.py", "estimated_seconds") in cold
    # and the step after it reuses that plan, with the same results as a fresh plan's
    again = _calls(_jacmem_step(model, X, y), package, warm=0)
    assert not _replanning(again)


def test_a_reused_plan_gives_the_bits_of_a_fresh_one():
    """The per-sample gradients of a warm step are those of a step that planned afresh, to
    the bit (float64, against the per-sample loop as well)."""
    torch.manual_seed(0)
    model = _model().double()
    X, y = torch.randn(8, 10, dtype=torch.float64), torch.randint(0, 3, (8,))
    step = _jacmem_step(model, X, y)
    planner._PLANS.clear()
    step()
    fresh = [p.grad_batch.clone() for p in model.parameters()]
    step()
    step()
    assert all(torch.equal(p.grad_batch, f) for p, f in zip(model.parameters(), fresh))
    lossfunc = nn.CrossEntropyLoss(reduction="sum")
    for n in range(8):
        grads = torch.autograd.grad(lossfunc(model(X[n : n + 1]), y[n : n + 1]) / 8, list(model.parameters()))
        for p, g in zip(model.parameters(), grads):
            torch.testing.assert_close(p.grad_batch[n], g, rtol=1e-12, atol=1e-12)


# -- the forward: the model's and the loss's calls ----------------------------------------


def _forward_calls(model: nn.Module, X: torch.Tensor, y: torch.Tensor) -> tuple[int, int]:
    """Calls into jacmem of the model's forward and of the loss's, in a warm step (the block
    entered before and the backward run after, uncounted)."""
    package = os.path.dirname(jacmem.__file__)
    prefix = package + os.sep
    lossfunc = nn.CrossEntropyLoss()
    counts = {"model": 0, "loss": 0}
    phase = ["model"]

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(prefix):
            counts[phase[0]] += 1

    def step(count: bool):
        model.zero_grad(set_to_none=True)
        with jacmem.extend(jacmem.BatchGrad()):
            if count:
                sys.setprofile(profile)
            try:
                phase[0] = "model"
                out = model(X)
                phase[0] = "loss"
                loss = lossfunc(out, y)
            finally:
                sys.setprofile(None)
            loss.backward()

    for _ in range(3):
        step(False)
    step(True)
    return counts["model"], counts["loss"]


def test_a_warm_forward_reuses_what_it_found():
    """The model's and the loss's forwards in a warm step: 111 + 27 calls before each
    module's recipe was reused, a registered layer's enter and leave passed inside a
    forward, the calls inside it went straight to the stager, a loss called alone reached
    no engine and the outermost calls' checks lost their helpers' calls; 39 + 11 now. A
    Linear (and its activation) more costs its forward hook's path alone: the recipe,
    the record and ComputeOnce."""
    X, y = torch.randn(8, 10), torch.randint(0, 3, (8,))
    model, loss = _forward_calls(_model(), X, y)
    assert model <= 39 and loss <= 11, f"model forward {model} calls, loss {loss}"
    deeper = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))
    more, _ = _forward_calls(deeper, X, y)
    assert more - model <= 13, f"{more - model} calls for a Linear and a ReLU more"


# -- the recipes hold only while what they were found from holds ------------------------------


def _check_against_the_loop(model: nn.Module, X: torch.Tensor, y: torch.Tensor) -> None:
    """A block's per-sample gradients of every trainable parameter against the loop's
    (float64), and none for the frozen ones."""
    lossfunc = nn.CrossEntropyLoss(reduction="sum")
    model.zero_grad(set_to_none=True)
    for p in model.parameters():
        if hasattr(p, "grad_batch"):
            del p.grad_batch
    with jacmem.extend(jacmem.BatchGrad()):
        (lossfunc(model(X), y) / len(X)).backward()
    trainable = [p for p in model.parameters() if p.requires_grad]
    for n in range(len(X)):
        grads = torch.autograd.grad(lossfunc(model(X[n : n + 1]), y[n : n + 1]) / len(X), trainable)
        for p, g in zip(trainable, grads):
            torch.testing.assert_close(p.grad_batch[n], g, rtol=1e-12, atol=1e-12)
    assert all(not hasattr(p, "grad_batch") for p in model.parameters() if not p.requires_grad)


def test_a_swapped_parameter_or_a_flipped_requires_grad_is_found_again():
    """Between warm steps: a layer's weight replaced by a new parameter, then its bias
    frozen, then trained again; each step's per-sample gradients are the loop's, for the
    parameters the layer holds and trains then."""
    torch.manual_seed(0)
    model = _model().double()
    X, y = torch.randn(8, 10, dtype=torch.float64), torch.randint(0, 3, (8,))
    for _ in range(3):
        _check_against_the_loop(model, X, y)
    old = model[0].weight
    del old.grad_batch
    model[0].weight = nn.Parameter(torch.randn_like(old))
    _check_against_the_loop(model, X, y)
    assert not hasattr(old, "grad_batch")
    model[2].bias.requires_grad_(False)
    _check_against_the_loop(model, X, y)
    model[2].bias.requires_grad_(True)
    _check_against_the_loop(model, X, y)


class _Gain(nn.Module):
    """x ⊙ weight + bias: [N, d] -> [N, d]."""

    def __init__(self, d: int = 3):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d, dtype=torch.float64))
        self.bias = nn.Parameter(torch.randn(d, dtype=torch.float64))

    def forward(self, x):
        return x * self.weight + self.bias


def test_a_registration_between_warm_steps_is_found_again():
    """A layer whose bias no derivative covers is refused (its record says which names its
    layer covers); once a strategy is registered for the bias, the next step covers it,
    by the loop's numbers."""
    from jacmem.derivatives import REGISTRY
    from jacmem.errors import UnsupportedModuleError

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), _Gain(3), nn.Tanh(), nn.Linear(3, 3)).double()
    X, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    try:
        jacmem.register(_Gain, "weight")(lambda x, g: g * x)
        model[1].bias.requires_grad_(False)
        for _ in range(2):
            _check_against_the_loop(model, X, y)
        model[1].bias.requires_grad_(True)
        with pytest.raises(UnsupportedModuleError, match="bias"):
            _check_against_the_loop(model, X, y)
        jacmem.register(_Gain, "bias")(lambda x, g: g)
        _check_against_the_loop(model, X, y)
        _check_against_the_loop(model, X, y)
    finally:
        REGISTRY.pop(_Gain, None)


# -- the block's own cost: made, entered, exited ------------------------------------------------


def _lifecycle_calls(model: nn.Module, X: torch.Tensor, y: torch.Tensor) -> Counter:
    """``(file, function) -> calls`` into jacmem of making and entering a ``BatchGrad``
    block, and of exiting it, in a warm step (its forward and backward not counted)."""
    package = os.path.dirname(jacmem.__file__)
    prefix, counts, counting = package + os.sep, Counter(), [False]
    lossfunc = nn.CrossEntropyLoss()

    def profile(frame, event, arg):
        if counting[0] and event == "call" and frame.f_code.co_filename.startswith(prefix):
            counts[(os.path.relpath(frame.f_code.co_filename, package), frame.f_code.co_name)] += 1

    for warm in (True, True, True, False):
        model.zero_grad(set_to_none=True)
        sys.setprofile(None if warm else profile)
        try:
            counting[0] = True
            ctx = jacmem.extend(jacmem.BatchGrad())
            ctx.__enter__()
            counting[0] = False
            loss = lossfunc(model(X), y)
            loss.backward()
            counting[0] = True
            ctx.__exit__(None, None, None)
        finally:
            sys.setprofile(None)
    return counts


def test_making_entering_and_exiting_a_block_costs_at_most_22_calls():
    """A block is made, entered and exited at every step: 43 calls (24 to make and enter,
    19 to exit) before its parts stopped calling helpers, constructors with nothing to do,
    and each other's hops on the way; the calls of its forward and backward are apart."""
    torch.manual_seed(0)
    X, y = torch.randn(8, 10), torch.randint(0, 3, (8,))
    calls = _lifecycle_calls(_model(), X, y)
    assert 0 < sum(calls.values()) <= 22, f"{sum(calls.values())} calls: {sorted(calls.items())}"


def _per_sample(model: nn.Module, X: torch.Tensor, y: torch.Tensor) -> list[list[torch.Tensor]]:
    """Each trainable parameter's per-sample gradients of the mean cross-entropy, by a loop."""
    lossfunc, params = nn.CrossEntropyLoss(reduction="sum"), [p for p in model.parameters() if p.requires_grad]
    rows = [torch.autograd.grad(lossfunc(model(X[n : n + 1]), y[n : n + 1]) / len(X), params) for n in range(len(X))]
    return [torch.stack([row[i] for row in rows]) for i in range(len(params))]


def test_a_block_entered_again_watches_and_computes_again():
    """The same ``jacmem.extend`` entered twice: each entry replaces torch's autograd
    functions (its backward watch opens again) and gives the per-sample loop's gradients;
    each exit puts torch's own functions back."""
    torch.manual_seed(0)
    model = _model().double()
    X, y = torch.randn(8, 10, dtype=torch.float64), torch.randint(0, 3, (8,))
    originals = torch.autograd.backward, torch.autograd.grad
    ctx = jacmem.extend(jacmem.BatchGrad())
    for X_ in (X, 2 * X):
        with ctx:
            assert torch.autograd.backward is not originals[0] and torch.autograd.grad is not originals[1]
            nn.CrossEntropyLoss()(model(X_), y).backward()
        assert (torch.autograd.backward, torch.autograd.grad) == originals
        for p, expected in zip(model.parameters(), _per_sample(model, X_, y)):
            torch.testing.assert_close(p.grad_batch, expected, rtol=1e-12, atol=1e-12)
        model.zero_grad(set_to_none=True)


def test_a_backward_after_the_block_through_its_compute_once_calls_is_autograds():
    """A graph made in a block whose backward runs after it closed: its records are void
    (the stager no longer resets its thread), so its ComputeOnce calls backpropagate as
    autograd would, and no per-sample result is written."""
    torch.manual_seed(0)
    model = _model().double()
    X, y = torch.randn(8, 10, dtype=torch.float64), torch.randint(0, 3, (8,))
    with jacmem.extend(jacmem.BatchGrad()):
        loss = nn.CrossEntropyLoss()(model(X), y)
    with pytest.warns(UserWarning, match="after the block had closed"):
        loss.backward()
    expected = torch.autograd.grad(nn.CrossEntropyLoss()(model(X), y), list(model.parameters()))
    for p, g in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, g, rtol=1e-12, atol=1e-12)
        assert not hasattr(p, "grad_batch")


class _Apply(nn.Module):
    """A module with no parameter and no submodule that calls the model it is given."""

    def forward(self, model, x):
        return model(x)


def test_what_passes_the_hooks_still_computes_the_loops_numbers():
    """A layer called alone (the outermost call, whose hooks never pass), a model called
    through a leaf called alone (whose engines then hear of its enter), and the model as
    it is, each with its warm steps: the per-sample loop's gradients (float64)."""
    torch.manual_seed(0)
    X, y = torch.randn(8, 10, dtype=torch.float64), torch.randint(0, 3, (8,))
    layer = nn.Linear(10, 3).double()
    model = _model().double()
    for _ in range(2):
        _check_against_the_loop(layer, X, y)
        _check_against_the_loop(model, X, y)
    lossfunc, apply = nn.CrossEntropyLoss(reduction="sum"), _Apply()
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        with jacmem.extend(jacmem.BatchGrad()):
            (lossfunc(apply(model, X), y) / len(X)).backward()
        for p, expected in zip(model.parameters(), _per_sample(model, X, y)):
            torch.testing.assert_close(p.grad_batch, expected, rtol=1e-12, atol=1e-12)


# -- the backward of a warm step -------------------------------------------------------------

#: the calls into jacmem that the backward of a warm step (phase 4: from ``loss.backward()``
#: to the pass's end) may make on the 2-Linear MLP: it made 118 when each call planned its
#: strategies from the cache (a key of the strategies' tables, the shapes and the
#: hyper-parameters per parameter), ran them through the checked, chunked path and staged
#: them through the engine's general loop; it runs each module's recipe now (47)
_BACKWARD_CALLS = 50


def _backward_calls(model: nn.Module, X: torch.Tensor, y: torch.Tensor, warm: int = 3) -> Counter:
    """``(file, function) -> calls`` into jacmem made by ``loss.backward()`` alone in a
    ``BatchGrad`` step, after ``warm`` steps."""
    package = os.path.dirname(jacmem.__file__)
    counts: Counter = Counter()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(package + os.sep):
            counts[(os.path.relpath(frame.f_code.co_filename, package), frame.f_code.co_name)] += 1

    lossfunc = nn.CrossEntropyLoss()
    for i in range(warm + 1):
        model.zero_grad(set_to_none=True)
        with jacmem.extend(jacmem.BatchGrad()):
            loss = lossfunc(model(X), y)
            sys.setprofile(profile if i == warm else None)
            try:
                loss.backward()
            finally:
                sys.setprofile(None)
    return counts


def test_a_warm_backward_calls_jacmem_at_most_fifty_times():
    """The backward of a warm step runs each Linear's recipe (its strategies, bound): no
    plan, no key of the plan cache, no checked or chunked execution, no finalize of an
    extension that writes a quantity as it is."""
    X, y = torch.randn(8, 10), torch.randint(0, 3, (8,))
    calls = _backward_calls(_model(), X, y)
    assert calls, "the profile saw the backward"
    assert sum(calls.values()) <= _BACKWARD_CALLS, f"{sum(calls.values())} calls: {calls.most_common()}"
    assert not calls.keys() & {("engine/planner.py", "cached_plan"), ("engine/planner.py", "execute")}


def _step_matches_the_loop(model: nn.Module, X: torch.Tensor, y: torch.Tensor) -> Counter:
    """One ``BatchGrad`` step, its ``grad_batch`` and ``.grad`` checked against the loop
    (float64); the calls into jacmem it made."""
    package = os.path.dirname(jacmem.__file__)
    calls = _calls(_jacmem_step(model, X, y), package, warm=0)
    trainable = [p for p in model.parameters() if p.requires_grad]
    for p, want in zip(trainable, _per_sample(model, X, y)):
        torch.testing.assert_close(p.grad_batch, want, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(p.grad, want.sum(0), rtol=1e-12, atol=1e-12)
    return calls


def _bound(calls: Counter) -> int:
    """How many parameters' plans a step bound to their strategies (a recipe made)."""
    return calls[("engine/planner.py", "bind")]


def test_a_recipe_holds_while_its_parameters_do():
    """A warm step reuses each Linear's recipe (nothing bound); a swapped parameter of the
    same shape and dtype keeps it (its values are not part of it), one of another dtype, a
    frozen one, or a new batch size makes a new one, and each step is the loop's, in
    float64."""
    torch.manual_seed(0)
    model = _model().double()
    X, y = torch.randn(8, 10, dtype=torch.float64), torch.randint(0, 3, (8,))
    assert _bound(_step_matches_the_loop(model, X, y)) == 4, "a cold step binds each parameter's plan"
    assert _bound(_step_matches_the_loop(model, X, y)) == 0, "a warm step reuses them"
    model[2].weight = nn.Parameter(torch.randn(3, 16, dtype=torch.float64))
    assert _bound(_step_matches_the_loop(model, X, y)) == 0, "a swapped parameter of the same kind"
    model[0].weight.requires_grad_(False)
    assert _bound(_step_matches_the_loop(model, X, y)) == 1, "a frozen weight: the first Linear's bias alone"
    model[0].weight.requires_grad_(True)
    assert _bound(_step_matches_the_loop(model, X, y)) == 2
    X, y = X[:5], y[:5]
    assert _bound(_step_matches_the_loop(model, X, y)) == 4, "a new batch size"
    model.float()  # (in place: the same parameters, in another dtype)
    calls = _calls(_jacmem_step(model, X.float(), y), os.path.dirname(jacmem.__file__), warm=0)
    assert _bound(calls) == 4
    model.double()
    assert _bound(_step_matches_the_loop(model, X, y)) == 4


def test_a_recipe_follows_the_registry():
    """A strategy registered between two warm steps (cheaper by its cost model) is chosen
    at the next step; one replaced in its table in place, not through jacmem.register, is
    run from the step after (a recipe checks that its strategies are still those of their
    tables); the results are the loop's, in float64."""
    torch.manual_seed(0)
    model = _model().double()
    X, y = torch.randn(8, 10, dtype=torch.float64), torch.randint(0, 3, (8,))
    _step_matches_the_loop(model, X, y)
    _step_matches_the_loop(model, X, y)
    table = jacmem.derivatives.REGISTRY[nn.Linear].strategies[("weight", "batch_grad")]
    ran = []

    def counted(x, g):
        ran.append(x.shape)
        return torch.einsum("no,ni->noi", g, x)

    try:
        jacmem.register(
            nn.Linear, "weight", "batch_grad", "counted", cost=lambda xs, gs: jacmem.derivatives.Cost(0, 0)
        )(counted)
        assert _bound(_step_matches_the_loop(model, X, y)) == 4, "a registration: every recipe made again"
        assert len(ran) == 2, "the new strategy, the cheapest, computed both Linears"
        _step_matches_the_loop(model, X, y)
        assert len(ran) == 4, "and the recipes made with it run it"
        scaled = jacmem.derivatives.Strategy(lambda x, g: 2 * counted(x, g), table["counted"].cost)
        table["counted"] = scaled  # (in place: no registration counted)
        with pytest.raises(AssertionError, match="grad_batch|Tensor-likes"):
            _step_matches_the_loop(model, X, y)  # the replaced strategy ran, doubling the results
        assert len(ran) == 6
    finally:
        table.pop("counted", None)
    assert _bound(_step_matches_the_loop(model, X, y)) == 4, "gone from its table: the Linears' recipes made again"


def test_a_recipe_s_strategy_that_raises_names_itself(monkeypatch):
    """A strategy that raises in a warm step (its recipe's) fails the step as it fails a
    cold one: the error names the module and the strategy, and nothing is written."""
    torch.manual_seed(0)
    model = _model().double()
    X, y = torch.randn(8, 10, dtype=torch.float64), torch.randint(0, 3, (8,))
    table = jacmem.derivatives.REGISTRY[nn.Linear].strategies[("weight", "batch_grad")]
    original, fail = table["outer"], []

    def outer(x, g, out=None):
        if fail:
            raise ArithmeticError("derivative failed")
        return original.fn(x, g, out=out)

    monkeypatch.setitem(table, "outer", dataclasses.replace(original, fn=outer))
    step = _jacmem_step(model, X, y)
    step()
    step()  # (warm: the recipes bound to this table's strategy)
    for p in model.parameters():
        del p.grad_batch
    fail.append(True)
    with pytest.raises(RuntimeError, match=r"module '2' \(Linear\) failed: derivative failed \(strategy 'outer'\)"):
        step()
    assert not any(hasattr(p, "grad_batch") for p in model.parameters())


# -- the torch ops of a warm step ------------------------------------------------------------

#: the torch ops (under a ``TorchDispatchMode``) of a warm ``BatchGrad`` step on the 2-Linear
#: MLP, N=8; the plain step makes 33, Opacus's hooks 62 on the same model. It made 76: a detach
#: of what needed none (the recipe's ``x`` and ``g``, a layer's input kept twice), the input
#: gradient through ``jac_t`` on one vector (an unsqueeze, two views and a select around its
#: product), reshapes of 2-D operands, an empty result to write the per-sample gradients into,
#: and a copy of each summed gradient into ``.grad`` (the block held a reference to it, for its
#: NaN check); 52 now
_STEP_OPS = 52


def _ops(step: Callable[[], None], warm: int = 3) -> Counter:
    """``op -> count`` of the torch ops one call of ``step`` dispatches, after ``warm`` calls."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: Counter = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[str(func)] += 1
            return func(*args, **(kwargs or {}))

    for _ in range(warm):
        step()
    with Count() as counted:
        step()
    return counted.ops


def test_a_warm_step_runs_at_most_52_torch_ops():
    """The ops of a warm step, counted (not timed): each Linear's summed gradients go into
    ``.grad`` as they are (no copy), and the step is the per-sample loop's, in float64."""
    torch.manual_seed(0)
    model = _model().double()
    X, y = torch.randn(8, 10, dtype=torch.float64), torch.randint(0, 3, (8,))
    ops = _ops(_jacmem_step(model, X, y))
    assert sum(ops.values()) <= _STEP_OPS, f"{sum(ops.values())} ops: {ops.most_common()}"
    assert not ops.keys() & {"aten.copy_.default", "aten.new_empty_strided.default"}, "a gradient copied"
    _step_matches_the_loop(model, X, y)


def test_forward_and_backward_keep_one_recipe_per_module():
    """The backward's bound plans live on the module's one recipe (the forward's: its
    entry, parameters, passthrough), in one cache that lets the module go; a registration
    makes both again, and the step is the loop's."""
    import gc
    import weakref

    from jacmem.engine import hooks, staging

    torch.manual_seed(0)
    model = _model().double()
    X, y = torch.randn(8, 10, dtype=torch.float64), torch.randint(0, 3, (8,))
    _step_matches_the_loop(model, X, y)
    first = [hooks.recipe(model[i]) for i in (0, 2)]
    assert all(r.plans is not None and r.params is not None for r in first), "one recipe holds both"
    assert _bound(_step_matches_the_loop(model, X, y)) == 0
    assert [hooks.recipe(model[i]) for i in (0, 2)] == first, "the same recipes, reused"
    assert not hasattr(staging, "_RECIPES"), "the backward keeps no cache of its own"
    linear = weakref.ref(model[2])
    del model
    gc.collect()
    assert linear() is None, "the cache let the module go"
