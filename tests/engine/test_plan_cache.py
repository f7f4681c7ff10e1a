"""The plans that ``auto`` makes are kept across steps and blocks (``jacmem.engine.planner._PLANS``).

A kept plan must be used only where it is still right: each test changes, between two
steps, one thing a plan depends on (the shapes, the strategy asked for, the quantities
wanted, which parameters train) and checks, in float64 against the per-sample loop of
``tests/support/reference.py``, the values and what ``explain()`` says. BackPACK is left out:
what is tested is which plan runs, not the quantities, which other files compare with it.
"""

import pytest
import torch
from tests.support.reference import check_against, mse, per_sample_grads, run_jacmem
from torch import nn

import jacmem
from jacmem.engine import planner

EXTENSIONS = {
    "batch_l2": jacmem.BatchL2Grad,
    "sum_grad_squared": jacmem.SumGradSquared,
    "variance": jacmem.Variance,
    "grad_batch": jacmem.BatchGrad,
}


@pytest.fixture(autouse=True)
def empty_cache():
    """Each test starts with no plan kept, so that its first step makes them."""
    planner._PLANS.clear()
    yield
    planner._PLANS.clear()


def sequence_model() -> nn.Module:
    """[N, T, 4] -> [N, T, 2]: the ghost norm wins for short sequences, per-sample
    gradients (``outer``) for long ones, as the ghost norm costs T² per sample."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).double()


def batch(n: int, t: int):
    """X [n, t, 4], y [n, t, 2], float64."""
    return torch.randn(n, t, 4, dtype=torch.float64), torch.randn(n, t, 2, dtype=torch.float64)


def step(model, X, y, fields, **extend_kwargs):
    """One block, checked against the loop; returns its explain()."""
    reference = per_sample_grads(model, X, y, mse)
    ctx = run_jacmem(model, X, y, mse, "mean", [EXTENSIONS[f]() for f in fields], **extend_kwargs)
    check_against(model, reference, fields)
    return ctx.explain()


def chosen(explain: str, param: str) -> str:
    """How ``param``'s batch_l2 was computed, from explain()."""
    line = next(line for line in explain.splitlines() if line.startswith(param + " "))
    return line.split("batch_l2 <- ")[1].split(" ")[0]


def test_a_changed_shape_gets_its_own_plan():
    model = sequence_model()
    short = step(model, *batch(3, 1), ["batch_l2"])
    long = step(model, *batch(3, 32), ["batch_l2"])
    again = step(model, *batch(3, 1), ["batch_l2"])  # from the kept plan
    assert chosen(short, "0.weight") == "ghost", short
    assert chosen(long, "0.weight").startswith("per-sample"), long
    assert again == short
    assert step(model, *batch(5, 1), ["batch_l2"])  # another batch size


def test_one_block_over_steps_of_different_shapes():
    model = sequence_model()
    with jacmem.extend(jacmem.BatchL2Grad()) as ctx:
        for n, t in [(3, 1), (3, 32), (4, 1), (3, 32)]:
            X, y = batch(n, t)
            reference = per_sample_grads(model, X, y, mse)
            for p in model.parameters():
                p.grad = None
            mse(model(X), y, "mean").backward()
            check_against(model, reference, ["batch_l2"], f"[N={n}, T={t}]")
            expected = "ghost" if t == 1 else "per-sample"
            assert chosen(ctx.explain(), "0.weight").startswith(expected), ctx.explain()


def test_a_changed_strategy_is_honoured():
    model = sequence_model()
    X, y = batch(3, 1)
    assert chosen(step(model, X, y, ["batch_l2"]), "0.weight") == "ghost"
    asked = step(model, X, y, ["batch_l2"], strategy="outer")
    assert "0.weight batch_l2 <- per-sample gradients by outer, reduced (asked for" in asked, asked
    asked = step(model, X, y, ["batch_l2"], strategy={"2": "outer"})
    assert chosen(asked, "0.weight") == "ghost" and chosen(asked, "2.weight").startswith("per-sample"), asked
    assert chosen(step(model, X, y, ["batch_l2"]), "2.weight") == "ghost"


def test_changed_quantities_are_honoured():
    model = sequence_model()
    X, y = batch(3, 1)
    needs = {"batch_l2": {"batch_l2"}, "variance": {"sum_grad_squared"}, "grad_batch": {"batch_grad"}}
    needs["sum_grad_squared"] = {"sum_grad_squared"}
    for fields in (["batch_l2"], ["variance"], ["sum_grad_squared", "grad_batch"], ["batch_l2"]):
        explain = step(model, X, y, fields)
        wanted = set().union(*(needs[f] for f in fields))
        for q in ("batch_l2", "sum_grad_squared", "batch_grad"):
            assert (f" {q} <- " in explain) == (q in wanted), (fields, explain)


def test_a_changed_requires_grad_pattern_is_honoured():
    model = sequence_model()
    X, y = batch(3, 1)
    fields = ["batch_l2", "variance"]
    step(model, X, y, fields)
    model[0].bias.requires_grad_(False)
    step(model, X, y, fields)
    assert not hasattr(model[0].bias, "batch_l2") or model[0].bias.batch_l2 is None
    model[0].bias.requires_grad_(True)
    model[2].weight.requires_grad_(False)
    step(model, X, y, fields)
    assert getattr(model[2].weight, "variance", None) is None


def test_a_kept_plan_still_explains_itself():
    model = sequence_model()
    X, y = batch(3, 1)
    first = step(model, X, y, ["variance"])
    assert planner._PLANS, "the first step keeps its plans"
    assert step(model, X, y, ["variance"]) == first


def test_plans_are_made_once_per_shape(monkeypatch):
    model = sequence_model()
    X, y = batch(3, 1)
    step(model, X, y, ["batch_l2"])
    made = []
    monkeypatch.setattr(planner, "plan", lambda *args: made.append(args) or pytest.fail("planned again"))
    step(model, X, y, ["batch_l2"])
    assert not made
