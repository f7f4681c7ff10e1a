"""Sphinx directives that render the docs from the code, so that nothing goes stale.

* ``.. jacmem-markdown:: ../BENCHMARKS.md``: a Markdown file of the repository, as rst
  (headings, paragraphs, ``-`` lists, tables, fenced code, images, ``<details>``).
* ``.. jacmem-support-table::``: the support table, from the registry
  (:func:`jacmem.support.generate`, the same Markdown the CLI prints).
* ``.. jacmem-settings-table::``: the settings table, from the conformance matrix's
  declarations (``tests/conformance/declarations.py``).
* ``.. jacmem-api::``: an autodoc entry for every name of ``jacmem.__all__`` and of
  each public submodule (:func:`public_modules`), and nothing else.

The Markdown converter knows only what the repository's Markdown files use; text is
escaped for rst, so that a ``*`` or a trailing ``_`` stays text.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
from pathlib import Path

from docutils.statemachine import StringList
from sphinx.util.docutils import SphinxDirective
from sphinx.util.nodes import nested_parse_with_titles

HEADING = {1: "=", 2: "-", 3: "~", 4: "^"}
INLINE = re.compile(r"`([^`]+)`|\*\*(.+?)\*\*|!?\[([^\]]+)\]\(([^)\s]+)\)|<code>(.*?)</code>")
SPECIAL = re.compile(r"([\\*_`|<>\[\]])")


# -- Markdown to rst --------------------------------------------------------------------


def escape(text: str) -> str:
    """Plain text with rst's markup characters escaped."""
    return SPECIAL.sub(r"\\\1", text)


def inline(text: str) -> str:
    """One line of Markdown inline markup (code, bold, links) as rst. Each construct is
    fenced by escaped spaces (``\\ ``), which rst drops, so that it may touch words."""
    out, pos = [], 0
    for m in INLINE.finditer(text):
        out.append(escape(text[pos : m.start()]))
        code, bold, label, url, html_code = m.groups()
        if code is not None or html_code is not None:
            out.append(rf"\ ``{code if code is not None else html_code}``\ ")
        elif bold is not None:
            out.append(rf"\ **{escape(bold)}**\ ")
        else:
            out.append(rf"\ `{escape(label)} <{url}>`__\ ")
        pos = m.end()
    out.append(escape(text[pos:]))
    return "".join(out)


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _table(lines: list[str]) -> list[str]:
    """A Markdown table (header, rule, rows) as an rst list-table."""
    header, *rows = [_cells(line) for line in lines if not re.fullmatch(r"\|?[\s:|-]+\|?", line.strip())]
    out = [".. list-table::", "   :header-rows: 1", ""]
    for row in [header, *rows]:
        out += [f"   * - {inline(row[0]) or ' '}"] + [f"     - {inline(c) or ' '}" for c in row[1:]]
    return out + [""]


def markdown_to_rst(text: str, base: Path, docdir: Path) -> list[str]:
    """Markdown ``text`` (from a file in ``base``) as rst lines of a document in ``docdir``."""
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("```"):
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            out += [".. code-block:: text", ""] + [f"   {c}" for c in lines[i + 1 : end]] + [""]
            i = end + 1
        elif m := re.match(r"(#+) (.*)", line):
            title = inline(m.group(2))
            out += [title, HEADING[len(m.group(1))] * max(len(title), 3), ""]
            i += 1
        elif line.startswith("|"):
            end = next((j for j in range(i, len(lines)) if not lines[j].startswith("|")), len(lines))
            out += _table(lines[i:end])
            i = end
        elif m := re.match(r"!\[([^\]]*)\]\(([^)]+)\)", line):
            image = os.path.relpath((base / m.group(2)).resolve(), docdir.resolve())
            out += [f".. image:: {Path(image).as_posix()}", f"   :alt: {m.group(1)}", ""]
            i += 1
        elif m := re.match(r"<details><summary>(.*)</summary>", line):
            summary = INLINE.sub(lambda c: c.group(5) or c.group(1), m.group(1))
            out += [".. raw:: html", "", f"   <details><summary>{summary}</summary>", ""]
            i += 1
        elif line.startswith("</details>"):
            out += [".. raw:: html", "", "   </details>", ""]
            i += 1
        elif not line.strip() or line.startswith("<!--"):
            i += 1
        else:  # a paragraph or a list item, with its continuation lines
            end = next((j for j in range(i + 1, len(lines)) if _ends_paragraph(lines[j])), len(lines))
            joined = " ".join(s.strip() for s in lines[i:end])
            bullet = joined.startswith("- ")
            out += [("- " + inline(joined[2:])) if bullet else inline(joined), ""]
            i = end
    return out


def _ends_paragraph(line: str) -> bool:
    return not line.strip() or line.startswith(("- ", "#", "|", "```", "<", "!["))


class Markdown(SphinxDirective):
    """``.. jacmem-markdown:: path``: the Markdown file at ``path`` (relative to this
    document), converted at build time."""

    required_arguments = 1

    def run(self):
        docdir = Path(self.env.doc2path(self.env.docname)).parent
        path = (docdir / self.arguments[0]).resolve()
        self.env.note_dependency(str(path))
        return _parse(self, markdown_to_rst(path.read_text(), path.parent, docdir))


def _parse(directive: SphinxDirective, lines: list[str]):
    from docutils import nodes

    node = nodes.section()
    node.document = directive.state.document
    nested_parse_with_titles(directive.state, StringList(lines, source="jacmem-docs"), node)
    return node.children


# -- the support table -------------------------------------------------------------------


class SupportTable(SphinxDirective):
    """``.. jacmem-support-table::``: :func:`jacmem.support.generate`, as rst."""

    def run(self):
        from jacmem import support

        docdir = Path(self.env.doc2path(self.env.docname)).parent
        return _parse(self, markdown_to_rst(support.generate(), docdir, docdir))


class SettingsTable(SphinxDirective):
    """The settings table: quantity x setting, from the conformance matrix's declarations
    (``tests/conformance/declarations.py``, :func:`settings_table`)."""

    def run(self):
        from tests.conformance import declarations

        docdir = Path(self.env.doc2path(self.env.docname)).parent
        return _parse(self, markdown_to_rst(declarations.settings_table(), docdir, docdir))


# -- the API reference -------------------------------------------------------------------


#: the public add-ons beside ``jacmem.__all__``'s own modules (DESIGN.md's layout): they
#: import optional packages (Opacus, laplace-torch, numpy), so ``import jacmem`` leaves them out
ADD_ONS = ["jacmem.memory", "jacmem.privacy", "jacmem.laplace", "jacmem.attribution"]


def public_modules() -> list[str]:
    """The public submodules of jacmem: those named in ``jacmem.__all__``, then the
    add-ons (:data:`ADD_ONS`). Engine modules are internal, whatever ``__all__`` they declare."""
    import jacmem

    named = [f"jacmem.{n}" for n in jacmem.__all__ if inspect.ismodule(getattr(jacmem, n))]
    return named + [m for m in ADD_ONS if m not in named]


def module_members(module_name: str) -> list[str]:
    """A module's public names: its ``__all__``, else what it defines itself."""
    module = importlib.import_module(module_name)
    if hasattr(module, "__all__"):
        return list(module.__all__)
    return [
        n
        for n, obj in vars(module).items()
        if not n.startswith("_") and getattr(obj, "__module__", None) == module_name and callable(obj)
    ]


def api_entries() -> list[str]:
    """Every object the API reference documents, by its dotted name under jacmem:
    ``jacmem.X`` for ``X`` in ``jacmem.__all__``, ``jacmem.mod.Y`` for the submodules."""
    import jacmem

    top = [f"jacmem.{n}" for n in jacmem.__all__ if not inspect.ismodule(getattr(jacmem, n))]
    return top + [f"{m}.{n}" for m in public_modules() for n in module_members(m)]


def _autodoc(dotted: str) -> list[str]:
    module, name = dotted.rsplit(".", 1)
    obj = getattr(importlib.import_module(module), name)
    if inspect.isclass(obj):
        kind = "autoexception" if issubclass(obj, BaseException) else "autoclass"
        return [f".. {kind}:: {dotted}", "   :members:", ""]
    if callable(obj):
        return [f".. autofunction:: {dotted}", ""]
    doc = _attribute_doc(module, name)
    return [f".. py:data:: {name}", f"   :module: {module}", ""] + [f"   {line}" for line in doc] + [""]


def _attribute_doc(module: str, name: str) -> list[str]:
    """The ``#:`` comment above ``name``'s assignment, in ``module`` or the submodule of
    it that defines ``name`` (autodoc finds it only in the defining module)."""
    import sys

    from sphinx.pycode import ModuleAnalyzer

    for candidate in sorted(m for m in sys.modules if m == module or m.startswith(module + ".")):
        docs = ModuleAnalyzer.for_module(candidate).find_attr_docs()
        if ("", name) in docs and name in vars(sys.modules[candidate]):
            return list(docs[("", name)])
    raise ValueError(f"{module}.{name} has no #: comment above its assignment: the API reference needs one")


class Api(SphinxDirective):
    """``.. jacmem-api::``: the top-level names, then one section per public submodule."""

    def run(self):
        top = [n for n in api_entries() if n.count(".") == 1]
        lines = ["Top level", "---------", "", ".. currentmodule:: jacmem", ""]
        for dotted in top:
            lines += _autodoc(dotted)
        for module in public_modules():
            title = f"``{module}``"
            lines += [title, "-" * len(title), "", f".. automodule:: {module}", "   :no-members:", ""]
            lines += [f".. currentmodule:: {module}", ""]
            for name in module_members(module):
                lines += _autodoc(f"{module}.{name}")
        return _parse(self, lines)


def setup(app):
    app.add_directive("jacmem-markdown", Markdown)
    app.add_directive("jacmem-support-table", SupportTable)
    app.add_directive("jacmem-settings-table", SettingsTable)
    app.add_directive("jacmem-api", Api)
    return {"parallel_read_safe": True, "parallel_write_safe": True}


# -- the gallery's order -----------------------------------------------------------------

#: the gallery's first pages, in this order; other examples follow by file name
FIRST = [
    "plot_first_steps.py",
    "plot_save_memory.py",
    "plot_strategies_vs_batch.py",
    "plot_norms.py",
    "plot_curvature.py",
    "plot_memory_nngp_kernel.py",
    "plot_memory_rnn_cell.py",
    "plot_memory_conv_bn_relu.py",
    "plot_memory_transformer_finetune.py",
    "plot_ddp.py",
    "plot_custom_module.py",
]


class ExampleOrder:
    """sphinx-gallery's ``within_subsection_order``: :data:`FIRST`, then by name."""

    def __init__(self, src_dir: str):
        self.src_dir = src_dir

    def __call__(self, filename: str) -> tuple[int, str]:
        return (FIRST.index(filename) if filename in FIRST else len(FIRST), filename)
