"""First-order extensions on nn.Linear and nn.Conv1d/2d/3d against a per-sample autograd loop.

Every case runs, in float64:
- every strategy the layer's registry entry offers (enumerated, so a strategy is
  covered the day it is registered), and ``"auto"``;
- each of BatchGrad, BatchL2Grad, SumGradSquared and Variance alone, and all four together
  (they share work, so each alone must be right too);
- both flows: the forward inside ``jacmem.extend``, and ``jacmem.track`` before the block;
- with the default memory budget, and with ``chunk_bytes=1`` so that every chunked
  quantity runs one sample at a time.

The conv grid is representative rather than a full product: each hyper-parameter value
(stride, dilation, padding as int / tuple / "same" / "valid", "same" with dilation and
with even kernels, every padding_mode, groups and depthwise, bias or none) appears in
several cases, in different combinations.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from tests.support.firstorder_cases import CONV_CASES, LINEAR_CASES, case, module_type, strategies
from tests.support.reference import FLOWS, assert_close, check_against, cross_entropy, mse, per_sample_grads, run_jacmem
from torch import nn

import jacmem
from jacmem.derivatives import REGISTRY

EXTENSIONS = {
    "BatchGrad": (jacmem.BatchGrad, "grad_batch"),
    "BatchL2Grad": (jacmem.BatchL2Grad, "batch_l2"),
    "SumGradSquared": (jacmem.SumGradSquared, "sum_grad_squared"),
    "Variance": (jacmem.Variance, "variance"),
}
#: each extension alone, then all together
EXTENSION_SETS: list[tuple[str, ...]] = [(name,) for name in EXTENSIONS] + [tuple(EXTENSIONS)]

#: the extension that asks for a quantity, and nothing that would plan a per-sample pass first
ASKS_FOR = {
    "batch_grad": ("BatchGrad",),
    "batch_l2": ("BatchL2Grad",),
    "sum_grad_squared": ("SumGradSquared",),
    "grad": ("Variance",),
}


def assert_used(ctx: jacmem.extend, strategy: str) -> None:
    """Where the named strategy applied to a quantity, it was the one chosen."""
    for d in ctx.plan.decisions.values():
        if d.estimates.get(strategy) is not None:
            assert d.chosen == strategy, f"asked for {strategy!r}, got: {d}"


def run_and_check(case_id: str, strategy: str, extension_names, flow: str, **kwargs) -> jacmem.extend:
    model, X, y, loss, reduction, reference = case(case_id)
    extensions = [EXTENSIONS[e][0]() for e in extension_names]
    ctx = run_jacmem(model, X, y, loss, reduction, extensions, flow, strategy=strategy, **kwargs)
    what = f"[{case_id} {strategy} {'+'.join(extension_names)} {flow} {kwargs}]"
    check_against(model, reference, [EXTENSIONS[e][1] for e in extension_names], what)
    assert_used(ctx, strategy)
    return ctx


GRID = [(c, s) for c in [*LINEAR_CASES, *CONV_CASES] for s in strategies(module_type(c))]


@pytest.mark.parametrize("case_id,strategy", GRID, ids=[f"{c}-{s}" for c, s in GRID])
def test_first_order(case_id, strategy):
    """Every extension alone and all together, both flows, default budget and tiny chunks."""
    for extension_names, flow in itertools.product(EXTENSION_SETS, FLOWS):
        run_and_check(case_id, strategy, extension_names, flow)
    for extension_names in EXTENSION_SETS:
        run_and_check(case_id, strategy, extension_names, "inside", chunk_bytes=1)


def _applicable_case(mtype: type, param: str, quantity: str, name: str) -> str:
    """The first case of this module type on which the strategy's cost model says it applies."""
    for case_id in [c for c in [*LINEAR_CASES, *CONV_CASES] if module_type(c) is mtype]:
        model, X, y, loss, reduction, _ = case(case_id)
        if param not in dict(model.named_parameters()):
            continue
        strategy = REGISTRY[mtype].strategies[(param, quantity)][name]
        if strategy.cost is None:
            return case_id
        entry = REGISTRY[mtype]
        with torch.no_grad():
            gs = tuple(model(X).shape)
        if strategy.cost(tuple(X.shape), gs, **entry.hyperparams(model)) is not None:
            return case_id
    raise AssertionError(f"no case of {mtype.__name__} on which {param} {quantity} {name!r} applies: add one")


#: every strategy of the quantities these tests' extensions ask for (ASKS_FOR); those of a
#: parameterised quantity (grad_proj) take its parameters and the parameter's name, and are run
#: against their reference by tests/derivatives/test_registry_coverage.py
REGISTERED = [
    (mtype, param, quantity, name)
    for mtype in (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
    for (param, quantity), table in sorted(REGISTRY[mtype].strategies.items())
    if quantity in ASKS_FOR
    for name in sorted(table)
]


@pytest.mark.parametrize(
    "mtype,param,quantity,name", REGISTERED, ids=[f"{m.__name__}-{p}-{q}-{s}" for m, p, q, s in REGISTERED]
)
@pytest.mark.parametrize("chunk_bytes", [None, 1], ids=["whole", "chunked"])
def test_every_registered_strategy_runs(mtype, param, quantity, name, chunk_bytes):
    """Each registered strategy, asked for by name with the extension that needs its
    quantity, is the one that computes it, and its result matches the reference."""
    case_id = _applicable_case(mtype, param, quantity, name)
    kwargs = {} if chunk_bytes is None else {"chunk_bytes": chunk_bytes}
    ctx = run_and_check(case_id, name, ASKS_FOR[quantity], "inside", **kwargs)
    chosen = {(d.param, d.quantity): d.chosen for d in ctx.plan.decisions.values()}
    via = chosen.get((param, quantity), chosen.get((param, "batch_grad")))
    assert via == name, f"asked for {name!r} for {param} {quantity}; decisions: {ctx.explain()}"


QUANTITY_REFERENCE = {
    "batch_grad": lambda gb: gb,
    "batch_l2": lambda gb: gb.flatten(1).square().sum(1),
    "sum_grad_squared": lambda gb: gb.square().sum(0),
    "grad": lambda gb: gb.sum(0),
}


@pytest.mark.parametrize(
    "mtype,param,quantity,name", REGISTERED, ids=[f"{m.__name__}-{p}-{q}-{s}" for m, p, q, s in REGISTERED]
)
def test_every_registered_strategy_directly(mtype, param, quantity, name):
    """Each registered function, called as the registry documents it (``fn(x, g, **hp)``)
    on every case of its layer type where its cost model says it applies, gives its
    quantity of the reference per-sample gradients: no plan or extension in between."""
    entry, strategy = REGISTRY[mtype], REGISTRY[mtype].strategies[(param, quantity)][name]
    checked = 0
    for case_id in [c for c in [*LINEAR_CASES, *CONV_CASES] if module_type(c) is mtype]:
        model, X, y, loss, reduction, reference = case(case_id)
        if param not in dict(model.named_parameters()):
            continue
        hp = entry.hyperparams(model)
        out = model(X)
        g = entry.arrange(torch.autograd.grad(loss(out, y, reduction), out)[0], **hp)
        x = entry.arrange_input(entry.keep((X,), {}), **hp)
        if strategy.cost is not None and strategy.cost(tuple(x.shape), tuple(g.shape), **hp) is None:
            continue
        expected = QUANTITY_REFERENCE[quantity](reference[getattr(model, param)])
        assert_close(strategy.fn(x, g, **hp), expected, f"{case_id}: {param} {quantity} {name!r}")
        checked += 1
    assert checked, f"no case on which {mtype.__name__} {param} {quantity} {name!r} applies: add one"


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("case_id", ["rank3", "2d-groups2"])
def test_reductions(case_id, reduction):
    """Per-sample gradients carry the loss's scaling, so grad_batch.sum(0) == .grad:
    with "mean" they are those of "sum" divided by the number of loss terms."""
    model, X, y, loss, _, _ = case(case_id)
    reference = per_sample_grads(model, X, y, loss, reduction)
    run_jacmem(model, X, y, loss, reduction, [e() for e, _ in EXTENSIONS.values()])
    check_against(model, reference, [f for _, f in EXTENSIONS.values()], f"[{case_id} {reduction}]")
    numel = y.numel()  # MSE: one loss term per output entry
    if reduction == "mean":  # against the sum-reduced reference, independently of the loop's scaling
        summed = per_sample_grads(model, X, y, loss, "sum")
        for p, gb in summed.items():
            assert_close(p.grad_batch, gb / numel, f"{case_id}: mean = sum / numel")


def test_foreign_strategy_name_falls_back_to_auto():
    """A global name that a layer does not offer (a Linear strategy on a conv) means auto there."""
    conv_only = sorted(REGISTRY[nn.Conv2d].names() - REGISTRY[nn.Linear].names())
    assert conv_only, "Linear and Conv2d offer the same strategy names: pick another foreign name"
    ctx = run_and_check("rank3", conv_only[0], tuple(EXTENSIONS), "inside")
    assert all(d.reason.startswith("auto") for d in ctx.plan.decisions.values()), ctx.explain()


def test_explain_names_layers_and_strategies():
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.Flatten(), nn.Linear(3 * 5 * 4, 2)).double()
    X = torch.randn(4, 2, 7, 6, dtype=torch.float64)
    y = torch.randint(0, 2, (4,))
    ctx = run_jacmem(model, X, y, cross_entropy, "mean", [jacmem.BatchGrad(), jacmem.Variance()], strategy="auto")
    text = ctx.explain()
    for d in ctx.plan.decisions.values():
        assert d.chosen in strategies(type(model.get_submodule(d.module)))
    for name, module in [("0", model[0]), ("2", model[2])]:
        lines = [line for line in text.splitlines() if line.startswith(f"{name}.")]
        assert lines, f"explain() does not name layer {name!r}:\n{text}"
        for param in ("weight", "bias"):
            assert any(line.startswith(f"{name}.{param} ") for line in lines), text
        assert all(any(s in line for s in strategies(type(module))) for line in lines), text


@pytest.mark.heavy
@pytest.mark.parametrize(
    "module,shape",
    [
        (nn.Conv2d(6, 8, 3, stride=2, padding=1, dilation=(1, 2), groups=2), (6, 14, 13)),
        (nn.Conv3d(4, 4, (3, 2, 3), padding="same", padding_mode="reflect", groups=4), (4, 6, 5, 7)),
        (nn.Linear(12, 9), (5, 3, 12)),
    ],
    ids=["conv2d", "conv3d", "linear-rank4"],
)
def test_larger_layers_in_uneven_chunks(module, shape):
    """Bigger layers, a batch of 7, under budgets from one sample per chunk, through several
    samples per chunk with a shorter last one, to the whole batch at once."""
    model = module.double()
    X = torch.randn(7, *shape, dtype=torch.float64)
    with torch.no_grad():
        y = torch.randn_like(model(X))
    reference = per_sample_grads(model, X, y, mse, "sum")
    fields = [f for _, f in EXTENSIONS.values()]
    for strategy in strategies(type(model)):
        for chunk_bytes in (1, 3e3, 2e4, 6e4, 1.2e5):
            ctx = run_jacmem(
                model,
                X,
                y,
                mse,
                "sum",
                [e() for e, _ in EXTENSIONS.values()],
                strategy=strategy,
                chunk_bytes=chunk_bytes,
            )
            check_against(model, reference, fields, f"[{type(model).__name__} {strategy} {chunk_bytes}]")
            assert_used(ctx, strategy)


def test_sum_of_squares_both_ways():
    """SumGradSquared and Variance reduce per-sample gradients of 64 KiB or more a sample
    by one fused call per sample, smaller ones in blocks of samples: here the conv weight
    (32·32·3·3 float64 = 72 KiB) takes the first, the bias the second; both against the
    per-sample loop, whole and chunked. With ``unfold`` asked for, Variance's summed
    gradient comes from the same loop (auto computes it directly here)."""
    from jacmem.derivatives import quantities

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(32, 32, 3), nn.Tanh(), nn.Flatten(), nn.Linear(288, 3)).double()
    assert model[0].weight.numel() * 8 >= quantities._SAMPLE_LOOP_BYTES > model[0].bias.numel() * 8
    X, y = torch.randn(4, 32, 5, 5, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    reference = per_sample_grads(model, X, y, mse)
    for kwargs in ({}, {"chunk_bytes": 1}, {"strategy": "unfold"}, {"strategy": "unfold", "chunk_bytes": 1}):
        ctx = run_jacmem(model, X, y, mse, "mean", [jacmem.SumGradSquared(), jacmem.Variance()], **kwargs)
        if "strategy" in kwargs:
            assert ctx.plan.decisions[("0", "weight", "grad")].kind == "reuse", ctx.explain()
        check_against(model, reference, ["sum_grad_squared", "variance"], f"sum of squares {kwargs}")


@pytest.mark.parametrize("block_bytes", [1, 2 * 6 * 5 * 8, 2**20], ids=["one", "two-short-last", "whole"])
def test_second_moments_of_a_sequence_linear_in_blocks_of_samples(block_bytes, monkeypatch):
    """A Linear on sequences: SumGradSquared and Variance by ``outer``, the per-sample
    products of a block of samples at a time in one buffer (one sample, two with a
    short last block of five, all), against the per-sample loop; the summed gradient
    (Variance's, and the one the compute-once layer hands autograd) from the same
    products, so one product per sample gives both."""
    from jacmem.derivatives import linear

    monkeypatch.setattr(linear, "_MOMENT_BLOCK_BYTES", block_bytes)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Flatten(), nn.Linear(18, 3)).double()
    X, y = torch.randn(5, 3, 5, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    reference = per_sample_grads(model, X, y, mse)
    ctx = run_jacmem(model, X, y, mse, "mean", [jacmem.SumGradSquared(), jacmem.Variance()])
    assert ctx.plan.decisions[("0", "weight", "sum_grad_squared")].chosen == "outer", ctx.explain()
    grad = ctx.plan.decisions[("0", "weight", "grad")]
    assert (grad.kind, grad.chosen, grad.reuses) == ("along", "outer", ("sum_grad_squared",)), ctx.explain()
    assert "grad <- the same outer as sum_grad_squared" in ctx.explain()
    check_against(model, reference, ["sum_grad_squared", "variance"], f"blocks of {block_bytes} bytes")


def run_auto(conv: nn.Module, size: int, extension) -> jacmem.extend:
    """``extension`` with auto on ``conv`` (module "0") and a Linear head, cross-entropy,
    a batch of two ``size``×``size`` inputs: the block, whose ``plan.decisions`` say
    what auto chose."""
    out = conv(torch.zeros(1, conv.in_channels, size, size)).shape[1:]
    model = nn.Sequential(conv, nn.Flatten(), nn.Linear(out.numel(), 2))
    X, y = torch.randn(2, conv.in_channels, size, size), torch.randint(0, 2, (2,))
    return run_jacmem(model, X, y, cross_entropy, "mean", [extension])


@pytest.mark.parametrize(
    "c_in,c_out,groups,size,chosen",
    [
        (16, 16, 1, 16, "grouped"),
        (3, 16, 1, 16, "unfold"),
        (16, 16, 1, 8, "unfold"),
        (32, 32, 32, 8, "grouped"),
    ],
    ids=["many channels, large output", "three input channels", "8x8 output", "depthwise"],
)
def test_auto_takes_grouped_where_its_kernel_is_fast(c_in, c_out, groups, size, chosen):
    """The grouped weight-gradient kernel is charged a third of im2col's FLOP time where
    each group has 16 channels and 256 output positions or more, or one channel in and
    out (depthwise), and three times it otherwise (the shapes measured in the cost
    constants' comment)."""
    ctx = run_auto(nn.Conv2d(c_in, c_out, 3, padding=1, groups=groups), size, jacmem.BatchGrad())
    assert ctx.plan.decisions[("0", "weight", "batch_grad")].chosen == chosen, ctx.explain()


@pytest.mark.parametrize(
    "conv,size,chosen",
    [(nn.Conv2d(64, 256, 3, padding=1), 6, "ghost_gram"), (nn.Conv2d(3, 64, 4, stride=4), 16, "ghost")],
    ids=["overlapping 3x3", "4x4 patches"],
)
def test_auto_takes_the_cheaper_ghost_norm(conv, size, chosen):
    """Norms alone: the Gram matrix over input positions costs ``P_padded²`` per channel
    against unfolding's ``prod(K)·P²``, so ``ghost_gram`` wins where kernels overlap and
    ``ghost`` on patches (stride = kernel size). Both beat per-sample gradients here."""
    ctx = run_auto(conv, size, jacmem.BatchL2Grad())
    assert ctx.plan.decisions[("0", "weight", "batch_l2")].chosen == chosen, ctx.explain()


def test_the_summed_gradient_rides_along_a_cheaper_pass():
    """BatchL2Grad also writes ``.grad``. Where one pass of per-sample gradients gives
    both for less than a ghost norm plus its own weight gradient (the seed CNN's
    128→256 conv), the plan takes the pass for both: the summed gradient is planned
    last, after the quantities a pass could give it with."""
    ctx = run_auto(nn.Conv2d(128, 256, 3, padding=1), 13, jacmem.BatchL2Grad())
    l2, grad = ctx.plan.decisions[("0", "weight", "batch_l2")], ctx.plan.decisions[("0", "weight", "grad")]
    assert (l2.kind, l2.chosen, grad.kind, grad.chosen) == ("pass", "unfold", "reuse", "unfold"), ctx.explain()
