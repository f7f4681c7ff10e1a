"""Every registered strategy against an independent float64 reference, driven by the registry.

The case bank (tests/support/registry_cases.py) holds modules of every registered layer
type, with inputs. For each case, one forward and backward of a per-sample loss capture
what the block would hand the derivatives (``keep`` and ``arrange_input`` of the inputs,
the output gradients arranged, the hyper-parameters). Every strategy that the module's
entry offers, for any parameter and quantity, whose cost applies on those shapes
(``cost`` returns not ``None``) then runs directly on them, and its quantity is compared
with the per-sample autograd loop's (each sample alone through the module).

Then every ``(module type, parameter, quantity, strategy)`` in
:data:`jacmem.derivatives.REGISTRY`, including the names of ``for_module`` entries
(RNNs), must apply in at least one case: a strategy registered without a case here
fails :func:`test_every_registered_strategy_has_a_case`, by name, so coverage cannot
lapse silently. :func:`test_the_checks_catch` shows both checks failing where they
should (a strategy with no case; a strategy whose result is scaled).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from tests.support.projection import kronecker_rule
from tests.support.reference import assert_close
from tests.support.registry_cases import CASES, NAME, PARAMETERS, Captured, applicable, arguments, capture
from torch import Tensor, nn

from jacmem.derivatives import REGISTRY, register


def expected(quantity: str, grad_batch: Tensor) -> Tensor:
    """The reference for one quantity, from the per-sample gradients (a projection's
    strategies: its kronecker rule, built from the docs in tests/support/projection.py)."""
    proj = PARAMETERS["grad_proj"]
    return {
        "grad_proj": lambda: kronecker_rule(grad_batch, proj["seed"], NAME, proj["dim"]),
        "batch_grad": lambda: grad_batch,
        "batch_l2": lambda: grad_batch.flatten(1).square().sum(1),
        "sum_grad_squared": lambda: grad_batch.square().sum(0),
        "grad": lambda: grad_batch.sum(0),
    }[quantity]()


def mismatches(cap: Captured) -> list[str]:
    """Each applicable strategy run on the captured call and compared with the reference;
    returns what differed (empty: all agree)."""
    failed = []
    for param, quantity, name, strategy in applicable(cap):
        want = expected(quantity, cap.reference[param])
        x, g, hp = cap.call()
        hp = {**hp, **arguments(quantity)}
        runs = [lambda: strategy.fn(x, g, **hp)]
        if strategy.writes_out:
            runs.append(lambda: strategy.fn(x, g, out=torch.empty_like(want), **hp))
        for run in runs:
            try:
                got = run()
                assert got.shape == want.shape and got.dtype == want.dtype, f"{tuple(got.shape)}, {got.dtype}"
                assert_close(got, want)
            except Exception as err:  # noqa: BLE001 (every failure is reported, by strategy)
                failed.append(f"{cap.module_type.__name__}.{param} {quantity} {name!r}: {type(err).__name__}: {err}")
    return failed


@pytest.mark.parametrize("case", CASES)
def test_every_applicable_strategy_matches_the_reference(case):
    failed = mismatches(capture(CASES[case]))
    assert not failed, "\n".join(failed)


def registered() -> set[tuple[type, str, str, str]]:
    """Every (module type, parameter, quantity, strategy name) in the registry, but a test's
    own layers' (the conformance matrix registers one, as a user would)."""
    return {
        (module_type, param, quantity, name)
        for module_type, entry in REGISTRY.items()
        if not getattr(module_type, "__module__", "").startswith("tests.")
        for (param, quantity), table in entry.strategies.items()
        for name in table
    }


def covered(cases) -> set[tuple[type, str, str, str]]:
    """Those that apply in at least one of ``cases``."""
    found = set()
    for case in cases:
        cap = capture(case)
        found |= {(cap.module_type, p, q, name) for p, q, name, _ in applicable(cap)}
    return found


def _describe(keys) -> str:
    return "\n".join(sorted(f"{t.__module__}.{t.__qualname__}.{p} {q} {name!r}" for t, p, q, name in keys))


def test_every_registered_strategy_has_a_case():
    """Every strategy in the registry applies (its cost is not None) in some case above,
    where the test before compares it with the reference."""
    missing = registered() - covered(CASES.values())
    assert not missing, (
        "registered strategies that apply in no case of tests/support/registry_cases.py, so nothing "
        f"checks them: add a case where each applies\n{_describe(missing)}"
    )


def test_the_checks_catch():
    """A strategy that applies nowhere is reported missing; a wrong strategy is reported
    by name."""
    linear = [CASES["linear"], CASES["linear-seq"]]
    before = covered(linear)
    register(nn.Linear, "weight", "batch_grad", "nowhere", cost=lambda xs, gs: None)(lambda x, g: None)
    try:
        missing = {k for k in registered() - covered(linear) if k[0] is nn.Linear}
        assert missing == {(nn.Linear, "weight", "batch_grad", "nowhere")}, _describe(missing)
    finally:
        del REGISTRY[nn.Linear].strategies[("weight", "batch_grad")]["nowhere"]
    assert covered(linear) == before

    table = REGISTRY[nn.Linear].strategies[("weight", "batch_l2")]
    good = table["ghost"]
    table["ghost"] = replace(good, fn=lambda x, g: 1.001 * good.fn(x, g))
    try:
        failed = mismatches(capture(CASES["linear"]))
    finally:
        table["ghost"] = good
    assert len(failed) == 1 and "Linear.weight batch_l2 'ghost'" in failed[0], failed
    assert not mismatches(capture(CASES["linear"]))
