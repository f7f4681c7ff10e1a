"""jacmem against BackPACK 1.7.1, wherever BackPACK can answer.

BackPACK computes the same four quantities (same attribute names, shapes, scaling; its
Variance is ``sgs / N - (grad / N)²``, as ours). We compare every strategy of ours,
each extension alone and all four together, with BackPACK's answer on a copy of the
model, in both of BackPACK's conv modes (im2col, and ``weight_jac_t_save_memory``).

Where BackPACK cannot answer, the test checks that it cannot (it raises, or its numbers
differ from the per-sample autograd loop), says why, and compares with the loop instead:

- ``groups > 1``: BackPACK's ``batch_l2`` of the conv weight is wrong (its other three
  quantities are right);
- a string ``padding`` (``"same"``, ``"valid"``): BackPACK raises in 2d (it hands the
  string to ``im2col``) and in 1d with ``save_memory`` (to its conv of one dimension
  higher); ``"same"`` with dilation: it raises in every dimension and mode;
- a ``padding_mode`` other than ``"zeros"`` with nonzero padding: BackPACK ignores the
  mode and pads with zeros, so every quantity of the weight is wrong;
- a module called more than once in a forward (tied weights, loops): BackPACK raises.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from backpack import backpack, extend, extensions
from backpack.core.derivatives.convnd import weight_jac_t_save_memory
from backpack.custom_module.pad import Pad
from backpack.custom_module.slicing import Slicing
from tests.support.architectures import make as make_architecture
from tests.support.backpack_settings import SETTINGS as BACKPACK_SETTINGS
from tests.support.backpack_settings import SQRT_GGN_SETTINGS
from tests.support.firstorder_cases import CONV_CASES, LINEAR_CASES, case, module_type, strategies
from tests.support.reference import (
    FLOWS,
    REFERENCE,
    assert_close,
    check_against,
    cross_entropy,
    per_sample_grads,
    run_jacmem,
)
from tests.support.secondorder_ref import default_dtype
from tests.support.secondorder_ref import run as run_second_order
from torch import nn
from torch.nn import functional as F

import jacmem

EXTENSIONS = {
    "grad_batch": (jacmem.BatchGrad, extensions.BatchGrad),
    "batch_l2": (jacmem.BatchL2Grad, extensions.BatchL2Grad),
    "sum_grad_squared": (jacmem.SumGradSquared, extensions.SumGradSquared),
    "variance": (jacmem.Variance, extensions.Variance),
}


def run_backpack(model: nn.Module, X, y, loss, reduction: str, save_memory: bool) -> nn.Module:
    """BackPACK's four quantities on a copy of ``model``; returns the copy."""
    bp_model = extend(copy.deepcopy(model))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # BackPACK's full-backward-hook warnings
        with backpack(*[bp() for _, bp in EXTENSIONS.values()]), weight_jac_t_save_memory(save_memory):
            loss(bp_model(X), y, reduction).backward()
    return bp_model


def backpack_fields(bp_model: nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    """{parameter name: {savefield: BackPACK's value}}"""
    return {name: {f: getattr(p, f) for f in EXTENSIONS} for name, p in bp_model.named_parameters() if p.requires_grad}


def compare_with_backpack(model, X, y, loss, reduction, strategy, expected, skip=()) -> None:
    """Every extension alone and all four together, both flows: each of jacmem's
    quantities equals ``expected`` (BackPACK's), except the (param, field) in ``skip``."""
    for fields in [[f] for f in EXTENSIONS] + [list(EXTENSIONS)]:
        for flow in FLOWS:
            exts = [EXTENSIONS[f][0]() for f in fields]
            run_jacmem(model, X, y, loss, reduction, exts, flow, strategy=strategy)
            for name, p in model.named_parameters():
                if not p.requires_grad:
                    continue
                for f in fields:
                    if (name, f) in skip:
                        continue
                    assert_close(
                        getattr(p, f), expected[name][f], f"[{strategy} {fields} {flow}] {name}.{f} vs BackPACK"
                    )


def backpack_limits(case_id: str, save_memory: bool) -> set:
    """Why BackPACK, in this conv mode, cannot answer (some quantities of) this case."""
    if case_id in LINEAR_CASES:
        return set()
    d, _, _, kw = CONV_CASES[case_id]
    padding, dilation = kw.get("padding", 0), kw.get("dilation", 1)
    dilated = any(x > 1 for x in (dilation if isinstance(dilation, tuple) else (dilation,)))
    im2col_or_higher_conv = d == 2 or (save_memory and d == 1)
    if (im2col_or_higher_conv and isinstance(padding, str)) or (padding == "same" and dilated):
        return {"raises"}
    limits = set()
    pads = padding != "valid" and (
        padding == "same" or any(p != 0 for p in (padding if isinstance(padding, tuple) else (padding,)))
    )
    if kw.get("padding_mode", "zeros") != "zeros" and pads:
        limits.add("padding-mode")
    if kw.get("groups", 1) > 1:
        limits.add("groups")
    return limits


CASES = [*LINEAR_CASES, *CONV_CASES]


@pytest.mark.parametrize("case_id", CASES)
def test_layer_against_backpack(case_id):
    model, X, y, loss, reduction, reference = case(case_id)
    compared = False
    for save_memory in (False, True):
        limits = backpack_limits(case_id, save_memory)
        if "raises" in limits:
            # BackPACK hands a string padding to im2col (2d) or to its conv of one dimension
            # higher (save_memory, 1d), and with "same" and dilation it convolves with the
            # dilation as stride and padding="same": it raises.
            with pytest.raises((TypeError, RuntimeError)):
                run_backpack(model, X, y, loss, reduction, save_memory)
            continue
        compared = True
        bp_model = run_backpack(model, X, y, loss, reduction, save_memory)
        expected = backpack_fields(bp_model)
        skip = set()
        if "padding-mode" in limits:
            # BackPACK pads with zeros whatever the padding_mode: its weight quantities are wrong
            bp_weight = dict(bp_model.named_parameters())["weight"]
            assert not torch.allclose(bp_weight.grad_batch, reference[model.weight]), "BackPACK is right now"
            skip |= {("weight", f) for f in EXTENSIONS}
        if "groups" in limits:
            # BackPACK's batch_l2 of a grouped conv's weight is wrong; its other quantities are right
            bp_l2 = expected["weight"]["batch_l2"]
            assert not torch.allclose(bp_l2, REFERENCE["batch_l2"](reference[model.weight])), "BackPACK is right now"
            skip |= {("weight", "batch_l2")}
        for name, values in expected.items():  # where compared, BackPACK's answer is the loop's too
            p = dict(model.named_parameters())[name]
            for f, value in values.items():
                if (name, f) not in skip:
                    assert_close(value, REFERENCE[f](reference[p]), f"BackPACK {name}.{f} vs the loop")
        for strategy in strategies(module_type(case_id)):
            compare_with_backpack(model, X, y, loss, reduction, strategy, expected, skip)
            for name, f in skip:  # ours, where BackPACK is wrong: against the loop
                run_jacmem(model, X, y, loss, reduction, [EXTENSIONS[f][0]()], strategy=strategy)
                p = dict(model.named_parameters())[name]
                assert_close(getattr(p, f), REFERENCE[f](reference[p]), f"{name}.{f} vs the loop")
    if not compared:  # BackPACK cannot answer at all: the loop, for every strategy
        for strategy in strategies(module_type(case_id)):
            run_jacmem(model, X, y, loss, reduction, [e() for e, _ in EXTENSIONS.values()], strategy=strategy)
            check_against(model, reference, list(EXTENSIONS), f"[{case_id} {strategy}]")


class BackpackResidualNet(nn.Module):
    """A residual net with functional ops that BackPACK can take (zero padding given as
    ints, each module called once): [N, 2, 6, 6] -> [N, 3]."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(2, 3, 3, padding=1)
        self.a = nn.Conv2d(3, 3, 3, padding=1)
        self.b = nn.Conv2d(3, 3, 3, padding=(1, 1), bias=False)
        self.down = nn.Conv2d(3, 4, 2, stride=2, dilation=1)
        self.head = nn.Sequential(nn.Linear(4 * 3 * 3, 5), nn.Tanh(), nn.Linear(5, 3))

    def forward(self, x):
        h = F.relu(self.stem(x))
        h = h + self.b(F.relu(self.a(h)))
        h = torch.flatten(self.down(h) * 2, 1)
        return self.head(h) + h[:, :3]


def backpack_residual():
    torch.manual_seed(1)
    return (
        BackpackResidualNet().double(),
        torch.randn(3, 2, 6, 6, dtype=torch.float64),
        torch.randint(0, 3, (3,)),
        cross_entropy,
    )


ARCHITECTURES = {
    "residual": backpack_residual,
    "frozen": lambda: make_architecture("frozen"),
}


@pytest.mark.parametrize("strategy", ["auto", "unfold", "save_memory"])
@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_architecture_against_backpack(name, strategy):
    model, X, y, loss = ARCHITECTURES[name]()
    for reduction in ("mean", "sum"):
        expected = backpack_fields(run_backpack(model, X, y, loss, reduction, save_memory=strategy == "save_memory"))
        compare_with_backpack(model, X, y, loss, reduction, strategy, expected)


@pytest.mark.parametrize("name", ["tied", "loop"])
def test_backpack_cannot_take_modules_called_twice(name):
    """BackPACK raises on a module called more than once in a forward; ours is checked
    against the per-sample loop in test_architectures.py, and here once more."""
    model, X, y, loss = make_architecture(name)
    with pytest.raises(AttributeError):
        run_backpack(model, X, y, loss, "mean", save_memory=False)
    reference = per_sample_grads(model, X, y, loss, "mean")
    run_jacmem(model, X, y, loss, "mean", [e() for e, _ in EXTENSIONS.values()])
    check_against(model, reference, list(EXTENSIONS), f"[{name}]")


# -- second order: BackPACK's own 82 shared settings ---------------------------------

#: exact quantities, compared value for value; the Monte-Carlo ones, shape for shape
SECOND_ORDER = {
    "diag_ggn_exact": (jacmem.DiagGGNExact, extensions.DiagGGNExact),
    "diag_ggn_exact_batch": (jacmem.BatchDiagGGNExact, extensions.BatchDiagGGNExact),
    "diag_h": (jacmem.DiagHessian, extensions.DiagHessian),
    "diag_h_batch": (jacmem.BatchDiagHessian, extensions.BatchDiagHessian),
    "sqrt_ggn_exact": (jacmem.SqrtGGNExact, extensions.SqrtGGNExact),
}
MONTE_CARLO = {
    "diag_ggn_mc": (jacmem.DiagGGNMC, extensions.DiagGGNMC),
    "diag_ggn_mc_batch": (jacmem.BatchDiagGGNMC, extensions.BatchDiagGGNMC),
    "sqrt_ggn_mc": (jacmem.SqrtGGNMC, extensions.SqrtGGNMC),
}
KRONECKER = ("kflr", "kfra")
#: BackPACK's sub-sampling case of its SqrtGGN tests
SUBSAMPLING = [2, 0]


def backpack_second_order(model, lossf, X, y, exts) -> dict[str, nn.Parameter]:
    """BackPACK's quantities on a copy of ``model``: {name: its copy of the parameter}."""
    bp_model, bp_loss = extend(copy.deepcopy(model)), extend(copy.deepcopy(lossf))
    with warnings.catch_warnings(), default_dtype(next(model.parameters()).dtype):
        warnings.simplefilter("ignore")  # BackPACK's full-backward-hook warnings
        with backpack(*exts):
            bp_loss(bp_model(X), y).backward()
    return dict(bp_model.named_parameters())


def close_to_backpack(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """float64, to BackPACK's rounding: it computes LeakyReLU's slope in float32 (1e-9
    relative on what crosses its negative side); zeros come as rounding, up to ~1e-16."""
    scale = want.abs().max().item() if want.numel() else 0.0
    torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-10 * scale + 1e-14, msg=lambda m: f"{what}: {m}")


def trainable(model: nn.Module):
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


@pytest.mark.parametrize("setting", list(BACKPACK_SETTINGS))
def test_second_order_settings_against_backpack(setting):
    """Every BackPACK second-order setting (Pad and Slicing included): the GGN and Hessian
    diagonals, per sample and summed, and the GGN's square root (also sub-sampled) equal
    BackPACK's; the Monte-Carlo quantities have BackPACK's shapes."""
    model, lossf, X, y = BACKPACK_SETTINGS[setting]()
    ref = backpack_second_order(model, lossf, X, y, [bp() for _, bp in SECOND_ORDER.values()])
    run_second_order(model, lossf, X, y, *[ours() for ours, _ in {**SECOND_ORDER, **MONTE_CARLO}.values()])
    for name, p in trainable(model):
        for field in SECOND_ORDER:
            close_to_backpack(getattr(p, field), getattr(ref[name], field), f"{setting} {name}.{field} vs BackPACK")
    mc = [bp() for _, bp in MONTE_CARLO.values()]
    if isinstance(lossf, nn.BCEWithLogitsLoss) and not bool(((y == 0) | (y == 1)).all()):
        with pytest.raises(NotImplementedError):  # BackPACK samples only with binary targets
            backpack_second_order(model, lossf, X, y, mc)
    else:
        ref = backpack_second_order(model, lossf, X, y, mc)
        for name, p in trainable(model):
            for field in MONTE_CARLO:
                assert getattr(p, field).shape == getattr(ref[name], field).shape, f"{setting} {name}.{field}"
    ref = backpack_second_order(model, lossf, X, y, [extensions.SqrtGGNExact(subsampling=SUBSAMPLING)])
    run_second_order(model, lossf, X, y, jacmem.SqrtGGNExact(subsampling=SUBSAMPLING))
    for name, p in trainable(model):
        close_to_backpack(p.sqrt_ggn_exact, ref[name].sqrt_ggn_exact, f"{setting} {name} sub-sampled vs BackPACK")


@pytest.mark.parametrize("setting", list(SQRT_GGN_SETTINGS))
def test_sqrt_ggn_settings_against_backpack(setting):
    """The settings BackPACK's SqrtGGN tests add (Embedding, BatchNorm in eval mode):
    the root, whole and sub-sampled, and the GGN diagonal equal BackPACK's."""
    model, lossf, X, y = SQRT_GGN_SETTINGS[setting]()
    for sub in (None, [1, 0]):
        exts = [extensions.SqrtGGNExact(subsampling=sub), extensions.DiagGGNExact()]
        ref = backpack_second_order(model, lossf, X, y, exts)
        run_second_order(model, lossf, X, y, jacmem.SqrtGGNExact(subsampling=sub), jacmem.DiagGGNExact())
        for name, p in trainable(model):
            for field in ("sqrt_ggn_exact", "diag_ggn_exact"):
                close_to_backpack(getattr(p, field), getattr(ref[name], field), f"{setting} {name}.{field} {sub}")


#: what BackPACK 1.7.1's KFLR and KFRA refuse (it has them for ReLU, Sigmoid, Tanh, 2d pooling)
NO_KRONECKER = (
    nn.LeakyReLU,
    nn.LogSigmoid,
    nn.ELU,
    nn.SELU,
    nn.MaxPool1d,
    nn.MaxPool3d,
    nn.AvgPool1d,
    nn.AvgPool3d,
    Pad,
    Slicing,
    nn.BCEWithLogitsLoss,
)


def backpack_has_kronecker(model: nn.Module, lossf: nn.Module, X: torch.Tensor) -> bool:
    """BackPACK also refuses groups > 1 and a Linear input with middle axes."""
    modules = [*model.modules(), lossf]
    return not (
        any(isinstance(m, NO_KRONECKER) or getattr(m, "groups", 1) > 1 for m in modules)
        or (isinstance(model[0], nn.Linear) and X.dim() > 2)
    )


@pytest.mark.parametrize("setting", list(BACKPACK_SETTINGS))
def test_kronecker_settings_against_backpack(setting):
    """KFLR's and KFRA's factors equal BackPACK's wherever it has them, KFAC's have its
    shapes; elsewhere BackPACK raises and jacmem answers (its factors are checked
    against the exact GGN in test_secondorder_kfac.py)."""
    model, lossf, X, y = BACKPACK_SETTINGS[setting]()
    exts = [extensions.KFLR(), extensions.KFRA(), extensions.KFAC()]
    run_second_order(model, lossf, X, y, jacmem.KFLR(), jacmem.KFRA(), jacmem.KFAC())
    if not backpack_has_kronecker(model, lossf, X):
        with pytest.raises(NotImplementedError):
            backpack_second_order(model, lossf, X, y, exts)
        assert all(hasattr(p, "kflr") and hasattr(p, "kfra") for _, p in trainable(model)), setting
        return
    ref = backpack_second_order(model, lossf, X, y, exts)
    for name, p in trainable(model):
        for field in KRONECKER:
            assert len(getattr(p, field)) == len(getattr(ref[name], field))
            for k, (got, want) in enumerate(zip(getattr(p, field), getattr(ref[name], field))):
                close_to_backpack(got, want, f"{setting} {name}.{field}[{k}] vs BackPACK")
        assert [f.shape for f in p.kfac] == [f.shape for f in ref[name].kfac], f"{setting} {name}.kfac"


@pytest.mark.parametrize("subsampling", [[2, 0], [1, 1]])
def test_batch_grad_subsampling_against_backpack(subsampling):
    """BackPACK's ``BatchGrad(subsampling=)``: the chosen samples' gradients, in the order
    given, repeats included; the loop's too."""
    model, X, y, loss = backpack_residual()
    bp_model = extend(copy.deepcopy(model))
    with warnings.catch_warnings(), backpack(extensions.BatchGrad(subsampling=subsampling)):
        warnings.simplefilter("ignore")
        loss(bp_model(X), y, "mean").backward()
    reference = per_sample_grads(model, X, y, loss, "mean")
    run_jacmem(model, X, y, loss, "mean", [jacmem.BatchGrad(subsampling=subsampling)])
    for (name, p), q in zip(model.named_parameters(), bp_model.parameters()):
        assert_close(p.grad_batch, q.grad_batch, f"{name} vs BackPACK")
        assert_close(p.grad_batch, reference[p][subsampling], f"{name} vs the loop")


def test_slicing_the_batch_axis_raises_as_backpack_does():
    """A Slicing of the batch axis leaves no per-sample factor to pass back: refused,
    naming the fix, with no hooks left behind (BackPACK refuses it too)."""
    model = nn.Sequential(nn.Linear(4, 3), Slicing((slice(0, 2), slice(None)))).double()
    X, y = torch.randn(3, 4, dtype=torch.float64), torch.randint(0, 3, (2,))
    with pytest.raises(ValueError, match="batch axis"):
        backpack_second_order(model, nn.CrossEntropyLoss(), X, y, [extensions.DiagGGNExact()])
    with pytest.raises(NotImplementedError, match=r"Slicing.*slice\(0, 2, None\).*slice\(None\) first"):
        run_second_order(model, nn.CrossEntropyLoss(), X, y, jacmem.DiagGGNExact())
    assert not any(m._forward_hooks or m._backward_hooks for m in model.modules()), "hooks left behind"
