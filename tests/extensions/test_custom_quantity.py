"""A quantity of one's own, with parameters, defined as ``docs/guide/custom.rst`` says.

``GradSketch(dim, seed)`` is each sample's gradient projected on ``dim`` fixed random
directions drawn from ``seed``, ``[N, dim]``: one registration (:func:`jacmem.derivatives.quantity`),
a direct strategy for ``nn.Linear``'s weight (a contraction of ``x`` and ``g``, no
per-sample gradient), and from per-sample gradients for every other parameter. Each is
checked in float64 against the per-sample autograd loop of ``tests/support/reference.py``,
projected with the same directions; two parameterisations in turn must get two plans
(a plan keeps the quantities it computes: one shared would compute the first seed's).
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
import torch
from tests.support.reference import assert_close, mse, per_sample_grads, trainable
from torch import Tensor, nn

import jacmem
from jacmem.derivatives import QUANTITIES, REGISTRY, quantity
from jacmem.engine import distributed, planner

GUIDE = Path(__file__).parents[2] / "docs" / "guide" / "custom.rst"


def define():
    """The quantity, its Linear strategy and its extension: the guide's Python blocks,
    run as written."""
    text = GUIDE.read_text()
    blocks = re.findall(r"^( *)\.\. code-block:: python\n\n((?:\1   .*\n|\n)+)", text, re.M)
    assert len(blocks) == 3, "custom.rst walks through the quantity in three Python blocks"
    namespace: dict = {}
    for _, code in blocks:
        exec(compile(textwrap.dedent(code), str(GUIDE), "exec"), namespace)
    return namespace["GradSketch"], namespace["BatchGradSketch"]


def projected(reference: Tensor, dim: int, seed: int) -> Tensor:
    """The loop's per-sample gradients ``[N, *p.shape]`` on the quantity's directions,
    drawn here as its definition says: ``[N, dim]``."""
    flat = reference.flatten(1)
    gen = torch.Generator().manual_seed(seed)
    return flat @ (torch.randn(flat.shape[1], dim, generator=gen, dtype=torch.float64) / dim**0.5)


@pytest.fixture
def sketch():
    """The quantity registered for the test, and taken back after it (the strategy
    tables in place: entries that stand for Linear share them)."""
    tables = REGISTRY[nn.Linear].strategies
    before = set(tables)
    planner._PLANS.clear()
    yield define()
    QUANTITIES.pop("grad_sketch")
    for key in set(tables) - before:
        del tables[key]
    planner._PLANS.clear()


def model_and_batch():
    """Linear (the direct strategy), Conv1d (from per-sample gradients), float64."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(2, 3, 3), nn.Tanh(), nn.Flatten(), nn.Linear(12, 2)).double()
    return model, torch.randn(5, 2, 6, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)


def check(model, X, y, extension, dim: int, seed: int) -> None:
    """One block with ``extension``; every parameter's ``grad_sketch`` against the loop's."""
    reference = per_sample_grads(model, X, y, mse)
    with jacmem.extend(extension):
        mse(model(X), y, "mean").backward()
    for p in trainable(model):
        assert_close(p.grad_sketch, projected(reference[p], dim, seed), f"grad_sketch {tuple(p.shape)}")
        del p.grad_sketch


def test_a_quantity_with_parameters_against_the_loop(sketch):
    GradSketch, BatchGradSketch = sketch
    model, X, y = model_and_batch()
    check(model, X, y, BatchGradSketch(dim=4, seed=0), dim=4, seed=0)
    # the Linear weight's came from the registered strategy, the Conv1d's from per-sample gradients
    plans = [p for p, _ in planner._PLANS.values()]
    assert any(step[1] == "contract" for p in plans for step in p.direct)
    assert any(GradSketch(dim=4, seed=0) in qs for p in plans for _, qs, _ in p.passes)


def test_two_parameterisations_get_two_plans(sketch):
    GradSketch, BatchGradSketch = sketch
    model, X, y = model_and_batch()
    check(model, X, y, BatchGradSketch(dim=4, seed=0), dim=4, seed=0)
    first = len(planner._PLANS)
    check(model, X, y, BatchGradSketch(dim=4, seed=1), dim=4, seed=1)
    assert len(planner._PLANS) == 2 * first
    assert GradSketch(dim=4, seed=0) != GradSketch(dim=4, seed=1)


def test_a_quantity_takes_its_parameters_by_keyword(sketch):
    GradSketch, _ = sketch
    with pytest.raises(TypeError, match="takes the parameters"):
        GradSketch(dim=4)
    with pytest.raises(TypeError, match="unhashable"):
        GradSketch(dim=4, seed=[0])
    assert repr(GradSketch(dim=4, seed=0)) == "GradSketch(dim=4, seed=0)"


class TiedLM(nn.Module):
    """An embedding tied to its head: [N, T] tokens -> [N, T, V] (the tied weight's
    calls have ghost factors, which give only the built-in sums)."""

    def __init__(self):
        super().__init__()
        self.emb, self.mix, self.head = nn.Embedding(7, 3), nn.Linear(3, 3), nn.Linear(3, 7, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens):
        return self.head(torch.tanh(self.mix(self.emb(tokens))))


def test_a_tied_parameter_gets_the_quantity_from_its_summed_per_sample_gradients(sketch):
    _, BatchGradSketch = sketch
    torch.manual_seed(0)
    model = TiedLM().double()
    X, y = torch.randint(0, 7, (4, 5)), torch.randn(4, 5, 7, dtype=torch.float64)
    check(model, X, y, BatchGradSketch(dim=3, seed=2), dim=3, seed=2)


def test_the_ranks_refuse_a_sum_of_ones_own_they_would_not_sum(sketch):
    """Under DDP or FSDP2 a quantity without rows per sample must be summed over the
    ranks, which jacmem does for its own sums only: it raises, not each rank's sum."""
    GradSketch, _ = sketch

    @quantity
    class SketchSum(GradSketch):
        name, per_sample, spelled = "sketch_sum", False, "[dim]"

        def shape(self, n, param_shape):
            return (self.dim,)

    try:
        distributed.check_summed({"grad", "batch_l2", GradSketch(dim=2, seed=0)})
        with pytest.raises(NotImplementedError, match="sketch_sum"):
            distributed.check_summed({"grad", SketchSum(dim=2, seed=0)})
    finally:
        QUANTITIES.pop("sketch_sum")
