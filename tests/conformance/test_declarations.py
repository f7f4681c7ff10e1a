"""The matrix's declarations: they name only the matrix's own quantities, settings and
models, and they are the docs' settings table (``docs/guide/support.rst``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from . import declarations
from .models import MODELS
from .quantities import QUANTITIES
from .settings import SETTINGS

pytestmark = pytest.mark.conformance
ROOT = Path(__file__).resolve().parents[2]


def test_the_tables_are_the_matrix():
    assert set(declarations.QUANTITY_ORDER) == set(QUANTITIES)
    assert set(declarations.SETTING_ORDER) == set(SETTINGS)
    for qs, setting in [*declarations.NOT_APPLICABLE, *declarations.ERRORS]:
        assert setting in SETTINGS and set(qs) <= set(QUANTITIES), (qs, setting)
    for models, qs in declarations.MODEL_ERRORS:
        assert set(models) <= set(MODELS) and set(qs) <= set(QUANTITIES)
    for model, setting in declarations.MODEL_SETTING_ERRORS:
        assert model in MODELS and setting in SETTINGS
    for model, setting, quantity in declarations.XFAIL:
        for names, table in [(model, MODELS), (setting, SETTINGS), (quantity, QUANTITIES)]:
            assert names == "*" or set((names,) if isinstance(names, str) else names) <= set(table)
    assert set(declarations.BATCH_FIRST_MODELS) == {m for m, spec in MODELS.items() if spec.batch_first}


def test_the_settings_table_has_every_cell_and_every_reason():
    table = declarations.settings_table()
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert len(rows) == len(QUANTITIES)
    assert all(row.count("|") == len(SETTINGS) + 2 for row in rows)
    for reason in declarations.NOT_APPLICABLE.values():
        assert reason in table
    assert "raises `RuntimeError`" in table  # second order under FSDP2
    assert ".. jacmem-settings-table::" in (ROOT / "docs" / "guide" / "support.rst").read_text()


def test_the_settings_table_renders_without_a_warning():
    """The docs' directive converts the table as the support table's: docutils alone, any warning fails."""
    from tests.docs.test_docs import DOCS, jacmem_docs, render

    html = render(jacmem_docs.markdown_to_rst(declarations.settings_table(), DOCS, DOCS))
    assert html.count("<tr") == len(QUANTITIES) + 1
