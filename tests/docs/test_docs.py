"""The documentation's parts that need no Sphinx build, in seconds.

``make docs`` builds the site and runs ``docs/check_site.py`` on it (every gallery page
has a figure, every public name an API entry, the support table is the registry's).
Here: that check catches what it should, the Markdown converter and the support table
render through docutils as the registry says, the examples follow the gallery's
conventions, and the README's headline figures are BENCHMARKS.md's.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import re
import sys
from pathlib import Path

import docutils.core
import pytest

import jacmem

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def _load(path: Path):
    """A module of the docs' own, from its file (docs/ is no package)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


jacmem_docs = _load(DOCS / "_ext" / "jacmem_docs.py")
check = _load(DOCS / "check_site.py")


def render(rst: list[str]) -> str:
    """rst to HTML with docutils alone, failing on any warning."""
    settings = {"halt_level": 2, "report_level": 2, "raw_enabled": True, "output_encoding": "unicode"}
    return docutils.core.publish_string("\n".join(rst), writer="html5", settings_overrides=settings)


def test_support_table_renders_as_the_registry_says():
    """The docs' table (the registry's Markdown, converted) parses to the registry's cells."""
    from jacmem import support

    html = render(jacmem_docs.markdown_to_rst(support.generate(), DOCS, DOCS))
    assert check.Page(html).tables[0] == check.expected_support_rows()
    assert len(check.expected_support_rows()) > 10  # a header and the layers


def test_support_page_uses_the_generated_table():
    assert ".. jacmem-support-table::" in (DOCS / "guide" / "support.rst").read_text()


def test_markdown_inline_markup_is_escaped():
    """rst markup characters in Markdown text stay text; code, bold and links convert."""
    md = "a * b, snake_ and |pipe| `x_*`s **bold_** [link](https://example.org) end_\n"
    html = render(jacmem_docs.markdown_to_rst(md, DOCS, DOCS))
    assert "a * b, snake_ and |pipe|" in html and html.count("docutils literal") == 1 and "x_*</span>s" in html
    assert "<strong>bold_</strong>" in html and 'href="https://example.org"' in html and "end_</p>" in html


def test_benchmarks_markdown_converts_cleanly():
    """BENCHMARKS.md, as the benchmarks page shows it: no docutils warning, every table."""
    text = (ROOT / "BENCHMARKS.md").read_text()
    html = render(jacmem_docs.markdown_to_rst(text, ROOT, DOCS))
    tables = sum(1 for line, prev in zip(text.splitlines()[1:], text.splitlines()) if line.startswith("|---"))
    assert len(check.Page(html).tables) == tables
    assert "benchmarks/details/seed-cnn-256.md" in html and "results.png" in html  # explain() dumps live there


def test_check_site_finds_each_failure(tmp_path):
    """A complete synthetic site passes; each kind of defect is reported."""
    gallery = tmp_path / "auto_examples"
    (gallery / "images").mkdir(parents=True)
    (gallery / "images" / "sphx_glr_plot_a_001.png").write_bytes(b"png")
    image = '<img src="images/sphx_glr_plot_a_001.png">'
    (gallery / "plot_a.html").write_text(image)
    entries = "".join(f'<dt id="{name}">x</dt>' for name in jacmem_docs.api_entries())
    (tmp_path / "api.html").write_text(entries)

    def table(rows):
        return "<table>" + "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows) + "</table>"

    rows = check.expected_support_rows()
    (tmp_path / "guide").mkdir()
    (tmp_path / "guide" / "support.html").write_text(table(rows))
    assert check.main([str(tmp_path)]) == 0

    (gallery / "plot_b.html").write_text('<img src="images/sphx_glr_plot_b_thumb.png">')
    (gallery / "plot_c.html").write_text('<img src="images/sphx_glr_plot_c_001.png">')
    internal = '<dt id="jacmem.compat.queue_callback">x</dt><dt id="jacmem.KFACX">x</dt><dt id="jacmem.KFAC.x">x</dt>'
    (tmp_path / "api.html").write_text(entries.replace('id="jacmem.KFAC"', 'id="other"') + internal)
    (tmp_path / "guide" / "support.html").write_text(table([rows[0], [*rows[1][:-1], "a strategy it has not"]]))
    failures = check.gallery_failures(tmp_path) + check.api_failures(tmp_path) + check.support_failures(tmp_path)
    assert failures == [
        "plot_b.html: no figure",
        "plot_c.html: missing image images/sphx_glr_plot_c_001.png",
        "api.html: no entry for jacmem.KFAC",
        "api.html: jacmem.KFACX is not public",
        "api.html: jacmem.compat.queue_callback is not public",
        "api.html: other is not public",
        "guide/support.html: the table differs from the registry's at row 1",
    ]
    assert check.main([str(tmp_path)]) == 1


def test_api_lists_the_public_modules_only():
    """``jacmem.__all__``'s modules and the add-ons; not the engine, whatever ``__all__``
    an engine module declares (``jacmem.compat`` has one)."""
    assert jacmem_docs.public_modules() == [
        "jacmem.memory",
        "jacmem.nn",
        "jacmem.privacy",
        "jacmem.laplace",
        "jacmem.attribution",
    ]
    assert hasattr(importlib.import_module("jacmem.compat"), "__all__")
    assert not [name for name in jacmem_docs.api_entries() if name.startswith("jacmem.compat.")]


def test_api_covers_every_public_name_with_a_docstring():
    entries = jacmem_docs.api_entries()
    for name in jacmem.__all__:
        obj = getattr(jacmem, name)
        if inspect.ismodule(obj):
            assert obj.__name__ in jacmem_docs.public_modules()
            assert obj.__doc__, f"{obj.__name__} has no docstring"
        else:
            assert f"jacmem.{name}" in entries
    for dotted in entries:
        module, name = dotted.rsplit(".", 1)
        obj = getattr(sys.modules[module], name)
        doc = inspect.getdoc(obj) if callable(obj) else jacmem_docs._attribute_doc(module, name)
        assert doc, f"{dotted} has no docstring: its API entry would be empty"


EXAMPLES = sorted((ROOT / "examples").glob("plot_*.py"))
#: examples whose only size is small (a few float64 samples): no quick mode to select
ALWAYS_SMALL = {"plot_custom_module.py", "plot_first_steps.py"}


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_follows_the_gallery_conventions(path):
    """examples/README.rst: a title underlined with ``===``, then a paragraph; the quick
    flag; no bare ``__file__`` (sphinx-gallery runs examples without it)."""
    source = path.read_text()
    lines = ast.get_docstring(ast.parse(source), clean=False).splitlines()
    assert lines[0].strip() and re.fullmatch(r"=+", lines[1]) and len(lines[1]) >= len(lines[0]), lines[:2]
    assert lines[2] == "" and lines[3].strip(), "the title needs a paragraph after it"
    assert path.name in ALWAYS_SMALL or "JACMEM_QUICK" in source or "quick()" in source or "small_run(" in source, (
        "no quick mode"
    )
    code = "\n".join(line.split("# ")[0] for line in source.splitlines())
    assert code.count("__file__") == code.count('globals().get("__file__"'), "a bare __file__"


def _table(text: str, header: str) -> list[list[str]]:
    lines = text[text.index(header) :].splitlines()
    rows = [line for line in lines[2:] if line.startswith("|")][: next(i for i, s in enumerate(lines[2:]) if not s)]
    return [[c.strip() for c in row.strip("|").split("|")] for row in rows]


def test_readme_headline_figures_are_the_benchmarks():
    readme = _table((ROOT / "README.md").read_text(), "| model | extension (auto) | time | extra peak | met |")
    targets = _table((ROOT / "BENCHMARKS.md").read_text(), "| model | extension (auto) | time |")
    measured = {(m, e): (t, peak, met) for m, e, t, _, _, peak, _, met in targets}
    assert readme
    for model, extension, time, peak, met in readme:
        key = (model.split(" ")[0], extension.split(" ")[0])
        assert measured[key] == (time, peak, met), f"README's {key} is not BENCHMARKS.md's: run make bench, then copy"
    assert any(met != "yes" for *_, met in readme), "the README shows only the targets met"


def _python_blocks(path: Path) -> list[str]:
    """The ``.. code-block:: python`` blocks of an rst file, dedented."""
    import textwrap

    blocks = re.findall(r"^( *)\.\. code-block:: python\n\n((?:\1   .*\n|\n)+)", path.read_text(), re.M)
    return [textwrap.dedent(code) for _, code in blocks]


@pytest.mark.parametrize("page", ["index.rst", "guide/concepts.rst"])
def test_guide_code_runs_as_written(page):
    """The self-contained pages' Python blocks, in order, in one namespace."""
    blocks = _python_blocks(DOCS / page)
    assert blocks
    namespace: dict = {}
    for code in blocks:
        exec(compile(code, page, "exec"), namespace)
    weight = namespace["model"][0].weight
    assert weight.grad_batch.shape == (32, 8, 1, 3, 3)  # as the pages say


#: a dotted name under jacmem in prose or code: ``jacmem.memory.report``, ``jacmem.KFAC``
_DOTTED = re.compile(r"(?<![\w/.])jacmem(?:\.[A-Za-z_]\w*)+")


def _resolves(name: str) -> bool:
    """Whether ``name`` is a module of jacmem, or an attribute path under one."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for part in parts[i:]:
            if not hasattr(obj, part):
                return False
            obj = getattr(obj, part)
        return True
    return False


def test_names_the_docs_give_exist():
    """Every ``jacmem.X`` the guide and the README name is a real module or attribute
    (curvature.rst once named ``jacmem.UnsupportedModule``, which never existed)."""
    assert not _resolves("jacmem.UnsupportedModule") and _resolves("jacmem.memory.report")
    pages = [*sorted((DOCS / "guide").glob("*.rst")), *sorted(DOCS.glob("*.rst")), ROOT / "README.md"]
    missing = [
        f"{page.relative_to(ROOT)}: {name}"
        for page in pages
        for name in sorted(set(_DOTTED.findall(page.read_text())))
        if not _resolves(name)
    ]
    assert not missing, missing
