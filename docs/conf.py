"""Sphinx configuration of cuonline's documentation.

    pip install ".[docs]"
    python -m sphinx -W -b html docs docs/_build/html

The API reference (api.md) is rendered from the public functions' numpydoc docstrings; the
other pages are the Markdown files of docs/, read by myst-parser, and README.md is the index.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))          # document the source tree, as the tests test it

import cuonline  # noqa: E402

project = "cuonline"
release = cuonline.__version__
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.mathjax",
    "numpydoc",
    "myst_parser",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]

# `name` in a docstring names a parameter or an object: render it as code, not as a link
default_role = "code"
autosummary_generate = False
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False

myst_heading_anchors = 3
myst_enable_extensions = ["dollarmath"]

html_theme = "alabaster"
html_title = f"cuonline {release}"
