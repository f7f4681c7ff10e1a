"""The generic fallback: per-sample gradients of any trainable module that has no registered
derivative, by recomputing it per sample with torch.func, against a per-sample autograd
loop, float64: every extension alone, then all four together in both flows and chunked,
for every strategy the fallback offers (enumerated) and ``"auto"``.

BackPACK 1.7.1 has no such fallback: it cannot answer for any module below (its
``extend`` knows only its own module types), so there is no BackPACK comparison here.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager

import pytest
import torch
from tests.support.fallback_models import F_, Model, ScaledLinear
from tests.support.reference import (
    FIRST_ORDER,
    FIRST_ORDER_RUNS,
    FLOWS,
    check_against,
    mse,
    per_sample_grads,
    recorded,
    run_jacmem,
)
from torch import nn

import jacmem
from jacmem.derivatives import REGISTRY, lookup

N = 3

#: the words of the block's warning about a module it recomputes per sample
RECOMPUTED = "recomputed one sample at a time"


@contextmanager
def only_recomputed(required: bool = True):
    """Inside: jacmem warns that it recomputes some module (unless not ``required``: the
    broadcast weight of ``WithBatchNorm`` needs no recomputation), and of nothing else (a
    module no extension handles would warn too)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    said = [str(w.message) for w in caught if str(w.message).startswith("jacmem")]
    assert (said or not required) and all(RECOMPUTED in m for m in said), said


def data(seed: int = 0):
    torch.manual_seed(seed)
    return torch.randn(N, 2, 6, 6, dtype=torch.float64), torch.randn(N, 2, dtype=torch.float64)


def test_entries():
    """Custom modules get the fallback for their own parameters; registered ones keep
    theirs; a container without parameters of its own gets nothing."""
    model = Model()
    for name in ("scaled", "gated", "squared"):
        entry = lookup(model.get_submodule(name))
        own = {n for n, _ in model.get_submodule(name).named_parameters(recurse=False)}
        assert entry is not None and set(entry.params) == own, name
    assert lookup(model.conv) is REGISTRY[nn.Conv2d]
    assert lookup(model.scaled.lin) is REGISTRY[nn.Linear]
    assert lookup(nn.Sequential(nn.Linear(2, 2))) is None


STRATEGIES = sorted(lookup(ScaledLinear()).names() | {"auto"})


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_model(strategy):
    model = Model().double()
    X, y = data()
    reference = per_sample_grads(model, X, y, mse, "mean")
    for fields, flow, kwargs in FIRST_ORDER_RUNS:
        extensions = [FIRST_ORDER[f]() for f in fields]
        with only_recomputed():
            run_jacmem(model, X, y, mse, "mean", extensions, flow, strategy=strategy, **kwargs)
        check_against(model, reference, fields, f"[{strategy} {'+'.join(fields)} {flow} {kwargs}]")


@pytest.mark.parametrize("extension", [jacmem.BatchGrad, jacmem.BatchL2Grad, lambda: jacmem.ClipGrad(1.0)])
def test_the_fallback_warns_naming_the_module_and_strict_raises(extension):
    """The fallback is exact but slow: a warning names the module; with strict=True it is
    an error instead, raised before the pass writes anything."""
    model = Model().double()
    X, y = data()
    with pytest.warns(UserWarning, match=rf"'scaled' \(ScaledLinear\).*{RECOMPUTED}.*jacmem.register") as caught:
        run_jacmem(model, X, y, mse, "mean", [extension()])
    assert any("'gated'" in str(w.message) for w in caught)
    assert hasattr(model.scaled.shift, "grad_batch") or model.scaled.shift.grad is not None
    with pytest.raises(RuntimeError, match=rf"(ScaledLinear|Gated|SquaredLinear).*{RECOMPUTED}"):
        run_jacmem(model, X, y, mse, "mean", [extension()], strict=True)
    assert not any(hasattr(p, f) for p in model.parameters() for f in ("grad_batch", "batch_l2"))


def test_container_is_not_recorded_and_children_are():
    """Containers without parameters of their own get no record; their children do, and
    the custom child's fallback holds its own child's parameters fixed."""
    model = nn.Sequential(nn.Sequential(ScaledLinear()), nn.Linear(F_, 1)).double()
    X, y = torch.randn(N, F_, dtype=torch.float64), torch.randn(N, 1, dtype=torch.float64)
    with recorded() as records:
        with jacmem.extend(jacmem.BatchGrad()):
            out = model(X)
            seen = sorted(type(r().module).__name__ for r in records)
            del out
    # ScaledLinear: the use of ``scale`` (a broadcast made explicit), and the fallback for
    # ``shift`` (read as shift[0], which the broadcast does not follow)
    assert seen == ["Linear", "Linear", "ScaledLinear", "ScaledLinear"]
    reference = per_sample_grads(model, X, y, mse, "sum")
    for flow in FLOWS:
        with only_recomputed():
            run_jacmem(model, X, y, mse, "sum", [jacmem.BatchGrad()], flow)
        check_against(model, reference, ["grad_batch"], f"[nested {flow}]")


class WithBuffer(nn.Module):
    """A parameter, used in a matrix product (only a recomputation gives its per-sample
    gradients), and a buffer that the forward updates in training mode."""

    def __init__(self, broadcast: bool = False):
        super().__init__()
        self.broadcast = broadcast
        self.weight = nn.Parameter(torch.randn(F_))
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        if self.training:
            self.seen += 1
        return x * self.weight if self.broadcast else x @ torch.diag(self.weight)


class WithBatchNorm(nn.Module):
    """A parameter, then a BatchNorm child: in training mode the samples mix."""

    def __init__(self, track_running_stats: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(F_))
        self.norm = nn.BatchNorm1d(F_, affine=False, track_running_stats=track_running_stats)

    def forward(self, x):
        return self.norm(x * self.weight)


def test_a_broadcast_parameter_needs_no_recomputation():
    """The same module with its weight broadcast over the batch (``x * weight``): each use
    of the weight is recorded apart, so the buffer it updates does not matter and
    training mode works, exactly."""
    model = nn.Sequential(nn.Linear(F_, F_), WithBuffer(broadcast=True)).double()
    X, y = torch.randn(N, F_, dtype=torch.float64), torch.randn(N, F_, dtype=torch.float64)
    reference = per_sample_grads(model, X, y, mse, "mean")
    ctx = run_jacmem(model, X, y, mse, "mean", [e() for e in FIRST_ORDER.values()], strict=True)
    check_against(model, reference, FIRST_ORDER, "[broadcast weight]")
    assert {d.chosen for d in ctx.plan.decisions.values() if d.module == "1"} == {"expand"}, ctx.explain()


@pytest.mark.parametrize("cls", [WithBuffer, WithBatchNorm])
def test_refused_in_training_mode_works_in_eval(cls):
    """A module that may mutate buffers or mix samples in training mode gets no fallback:
    the backward raises UnsupportedModuleError naming it, strict or not, and writes
    nothing (it warned and gave it nothing); in eval mode the fallback applies."""
    model = nn.Sequential(nn.Linear(F_, F_), cls()).double()
    X, y = torch.randn(N, F_, dtype=torch.float64), torch.randn(N, F_, dtype=torch.float64)
    assert lookup(model[1]) is None
    for strict in (False, True):
        with pytest.raises(jacmem.UnsupportedModuleError, match=rf"'1' \({cls.__name__}\).*cannot handle"):
            run_jacmem(model, X, y, mse, "mean", [jacmem.BatchGrad()], strict=strict)
        assert not any(hasattr(p, "grad_batch") for p in model.parameters()), "a failed backward wrote results"
    model.eval()
    assert lookup(model[1]) is not None
    reference = per_sample_grads(model, X, y, mse, "mean")
    with only_recomputed(required=cls is WithBuffer):
        run_jacmem(model, X, y, mse, "mean", [e() for e in FIRST_ORDER.values()])
    check_against(model, reference, FIRST_ORDER, f"[{cls.__name__} eval]")


class WithDropout(nn.Module):
    """Dropout after a matrix product with its weight: the recomputation must repeat the
    forward's random draws."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(F_))
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(x @ torch.diag(self.weight))


def test_random_forward_raises_naming_the_fix():
    model = WithDropout().double()
    X, y = torch.randn(N, F_, dtype=torch.float64), torch.randn(N, F_, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"WithDropout.*random.*eval"):
        run_jacmem(model, X, y, mse, "mean", [jacmem.BatchGrad()])
    model.eval()
    reference = per_sample_grads(model, X, y, mse, "mean")
    with only_recomputed():
        run_jacmem(model, X, y, mse, "mean", [jacmem.BatchGrad()])
    check_against(model, reference, ["grad_batch"], "[dropout eval]")


def test_batch_statistics_refused_in_eval_mode_too():
    """Without running statistics, BatchNorm normalises over the batch in eval mode too."""
    module = WithBatchNorm(track_running_stats=False).eval()
    assert next(module.buffers(), None) is None and lookup(module) is None


class Containers(nn.Module):
    """A layer that reads its parameters from a ParameterDict and a ParameterList, as PEFT's
    ``lora.Embedding`` does: [N, 4] -> [N, 2]."""

    def __init__(self):
        super().__init__()
        self.A = nn.ParameterDict({"default": nn.Parameter(torch.randn(3, 4, dtype=torch.float64))})
        self.B = nn.ParameterList([nn.Parameter(torch.randn(2, 3, dtype=torch.float64))])

    def forward(self, x):
        return torch.tanh(x @ self.A["default"].T) @ self.B[0].T


@pytest.mark.parametrize("flow", FLOWS)
def test_parameters_in_parameter_containers_are_the_callers(flow):
    """A ParameterDict or ParameterList is never called: its parameters are its parent's,
    which the fallback covers by dotted name (``A.default``, ``B.0``)."""
    torch.manual_seed(0)
    model, X, y = Containers(), torch.randn(N, 4, dtype=torch.float64), torch.randn(N, 2, dtype=torch.float64)
    reference = per_sample_grads(model, X, y, mse, "mean")
    with recorded() as records:
        run_jacmem(model, X, y, mse, "mean", [jacmem.BatchGrad(), jacmem.BatchL2Grad()], flow)
        assert {r().name for r in records if r() is not None} <= {"Containers"}
    check_against(model, reference, ["grad_batch", "batch_l2"], f"[containers {flow}]")
