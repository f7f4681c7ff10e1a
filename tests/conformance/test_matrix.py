"""The conformance matrix: every (model, setting, quantity) cell against the one oracle.

A cheap slice (eager ``extend`` on the MLP and GPT-2 for every quantity, ``track`` on the
MLP, one compile cell, one distributed pair) is marked ``conformance`` and runs in
``make test``; every other cell is marked ``conformance_full`` and runs in ``make
conformance``. Declared n.a. cells are skipped with their reason; cells of a known bug
of issue 36 are strict xfails (they fail the suite once fixed, so that the lead flips them).
"""

from __future__ import annotations

import pytest
import torch

from . import cells, declarations
from .models import MODELS
from .quantities import QUANTITIES
from .settings import SETTINGS

pytestmark = pytest.mark.usefixtures("float64_default")

#: (model, setting) pairs whose every quantity is in the cheap slice; and single cells
SLICE_PAIRS = {("mlp", "extend"), ("gpt2", "extend"), ("mlp", "track"), ("mlp", "process_group")}
SLICE_CELLS = {("mlp", "compile", "BatchL2Grad")}


def _params():
    for m in MODELS:
        for s in SETTINGS:
            for q in QUANTITIES:
                cheap = (m, s) in SLICE_PAIRS or (m, s, q) in SLICE_CELLS
                # one (model, setting) run serves all its quantities: its cells stay on one xdist worker
                marks = [
                    pytest.mark.conformance if cheap else pytest.mark.conformance_full,
                    pytest.mark.xdist_group(f"{m}-{s}"),
                ]
                reason = declarations.xfail(m, s, q)
                if reason:
                    marks.append(pytest.mark.xfail(strict=True, reason=reason, raises=AssertionError))
                yield pytest.param(m, s, q, marks=marks, id=f"{m}-{s}-{q}")


@pytest.mark.parametrize("model,setting,quantity", list(_params()))
def test_cell(model, setting, quantity):
    reason = declarations.not_applicable(model, setting, quantity)
    if reason:
        pytest.skip(f"n.a.: {reason}")
    torch.manual_seed(0)
    cells.check(model, setting, quantity)
