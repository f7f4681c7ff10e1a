"""Sphinx configuration: ``make docs`` builds it with ``sphinx-build -W`` (offline)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "docs" / "_ext")]
# The gallery runs the examples in quick mode (small sizes); their subprocesses import
# this checkout's jacmem and benchmarks.
os.environ["JACMEM_QUICK"] = "1"
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
os.environ.setdefault("MPLBACKEND", "Agg")

import jacmem  # noqa: E402

project = "jacmem"
author = "the jacmem authors"
copyright = "2026, the jacmem authors"
release = version = "0.1.0"

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx_gallery.gen_gallery",
    "jacmem_docs",
]

exclude_patterns = ["_build", "auto_examples/*.ipynb", "auto_examples/*.py", "auto_examples/*.zip"]
# quotes and ellipses only: "--from-json" in BENCHMARKS.md stays two hyphens
smartquotes_action = "qe"
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_inherit_docstrings = False
napoleon_google_docstring = True
napoleon_numpy_docstring = False

sphinx_gallery_conf = {
    "examples_dirs": "../examples",
    "gallery_dirs": "auto_examples",
    "filename_pattern": r"/plot_",
    "ignore_pattern": r"^(__init__|_\w+)\.py$",  # examples/_*.py: helpers, not examples
    "within_subsection_order": "jacmem_docs.ExampleOrder",
    "abort_on_example_error": True,
    "image_scrapers": ("matplotlib",),
    "download_all_examples": False,
    "remove_config_comments": True,
    "min_reported_time": 1,
}

html_theme = "pydata_sphinx_theme"
html_title = f"jacmem {release}"
html_theme_options = {
    "navbar_align": "left",
    "show_toc_level": 2,
    "navigation_with_keys": False,
    "footer_start": ["copyright"],
    "footer_end": ["sphinx-version"],
}
html_context = {"default_mode": "light"}
html_show_sourcelink = False
html_copy_source = False
assert jacmem.__file__.startswith(str(ROOT)), f"the docs would document {jacmem.__file__}, not {ROOT}"
html_static_path = ["_static"]
html_css_files = ["jacmem.css"]
# pages without sub-pages get no empty "Section Navigation" column
html_sidebars = {page: [] for page in ("index", "install", "api", "benchmarks")}
