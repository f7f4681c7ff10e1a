"""Check the built site with an HTML parser; ``make docs`` runs it after the build.

* every page of the gallery has at least one image, and each image file exists;
* every public name (:func:`jacmem_docs.api_entries`) has an entry in the API page, and
  nothing else has one;
* the support table in the docs equals the registry's (:func:`jacmem.support.rows`).

``python docs/check_site.py [docs/_build/html]``: exit 1, listing every failure.
"""

from __future__ import annotations

import re
import sys
from html.parser import HTMLParser
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "docs" / "_ext")]


class Page(HTMLParser):
    """What the checks read from one page: image sources, the ids of API entries
    (``<dt id=...>``), and the tables' rows as cell texts."""

    def __init__(self, text: str):
        super().__init__()
        self.images: list[str] = []
        self.entries: set[str] = set()
        self.tables: list[list[list[str]]] = []
        self._cell: list[str] | None = None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "img":
            self.images.append(attrs.get("src", ""))
        elif tag == "dt" and attrs.get("id"):
            self.entries.add(attrs["id"])
        elif tag == "table":
            self.tables.append([])
        elif tag == "tr" and self.tables:
            self.tables[-1].append([])
        elif tag in ("td", "th") and self.tables:
            self._cell = []

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self.tables[-1][-1].append(" ".join("".join(self._cell).split()))
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


def gallery_failures(html: Path) -> list[str]:
    """Each example's page (``auto_examples/plot_*.html``) must show an image that exists."""
    pages = sorted((html / "auto_examples").glob("plot_*.html"))
    if not pages:
        return [f"no gallery pages under {html / 'auto_examples'}"]
    failures = []
    for page in pages:
        images = [s for s in Page(page.read_text()).images if "sphx_glr" in s and "thumb" not in s]
        if not images:
            failures.append(f"{page.name}: no figure")
        failures += [f"{page.name}: missing image {s}" for s in images if not (page.parent / s).is_file()]
    return failures


def api_failures(html: Path) -> list[str]:
    """Every public name must have an entry (``<dt id="jacmem.X">``) in ``api.html``, and
    every entry must be a public name or one of its members (``jacmem.X.method``)."""
    from jacmem_docs import api_entries

    public, entries = api_entries(), Page((html / "api.html").read_text()).entries
    missing = [f"api.html: no entry for {name}" for name in public if name not in entries]
    internal = [
        f"api.html: {entry} is not public"
        for entry in sorted(entries)
        if not any(entry == name or entry.startswith(name + ".") for name in public)
    ]
    return missing + internal


def expected_support_rows() -> list[list[str]]:
    """The registry's table as cell texts, from the Markdown that :mod:`jacmem.support`
    generates (code marks removed, as the HTML shows them)."""
    from jacmem import support

    lines = [line for line in support.table().splitlines() if line.startswith("|")]
    rows = [[c.strip().replace("`", "") for c in line.strip().strip("|").split("|")] for line in lines]
    return [row for row in rows if not all(re.fullmatch(r"-+", c) for c in row)]


def support_failures(html: Path) -> list[str]:
    """The first table of ``guide/support.html`` must be the registry's, cell by cell."""
    tables = Page((html / "guide" / "support.html").read_text()).tables
    if not tables:
        return ["guide/support.html: no table"]
    expected, found = expected_support_rows(), tables[0]
    if found != expected:
        bad = next((i for i, (a, b) in enumerate(zip(found, expected)) if a != b), min(len(found), len(expected)))
        return [f"guide/support.html: the table differs from the registry's at row {bad}"]
    return []


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    html = Path(args[0]) if args else ROOT / "docs" / "_build" / "html"
    failures = gallery_failures(html) + api_failures(html) + support_failures(html)
    for failure in failures:
        print(failure)
    print(f"{html}: {'FAILED, ' + str(len(failures)) + ' problems' if failures else 'every check passed'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
