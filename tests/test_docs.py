"""The docs stay true: the API reference names every public function, help() renders the
docstrings, and README.md and .ci/run agree. (The examples in README.md, docs/*.md and the
docstrings run as doctests: see addopts in pyproject.toml. The reference is built by Sphinx
with warnings as errors in .ci/run: ``python -m sphinx -W -b html docs docs/_build/html``.)"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import cuonline

ROOT = Path(__file__).resolve().parents[1]
PUBLIC = [name for name in cuonline.__all__ if not name.startswith("_")]


def test_api_reference_documents_every_public_name():
    text = (ROOT / "docs" / "api.md").read_text()
    listed = set(re.findall(r"^   (\w+)$", text, flags=re.M))          # the autosummary table
    documented = set(re.findall(r"^\.\. auto(?:function|class):: (\w+)$", text, flags=re.M))
    assert listed == documented == set(PUBLIC)


def test_sphinx_indexes_every_docs_page():
    index = (ROOT / "docs" / "index.md").read_text()
    pages = {p.stem for p in (ROOT / "docs").glob("*.md")} - {"index"}
    assert pages <= set(re.findall(r"^(\w+)$", index, flags=re.M))


@pytest.mark.parametrize("name", PUBLIC)
def test_help_renders_each_docstring(name):
    # a line at column 0 after the first stops inspect.cleandoc from dedenting, so help()
    # shows the whole text indented, and it ends numpydoc's parameter list in Sphinx
    raw = getattr(cuonline, name).__doc__
    assert "\\\n" not in raw
    assert all(not line.strip() or line.startswith("    ")
               for line in raw.expandtabs().splitlines()[1:])


def test_readme_commands_are_the_ones_ci_runs():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'pip install ".[test]" && python -m pytest' in readme
    assert "pip install . && python -m cuonline demo" in readme
    assert "python -m pytest" in ci and ".[test" in ci
    # what CI installs is what the README says it installs
    assert '".[test,cuda13,mkl]"' in readme and '".[test,cuda13,mkl]"' in ci
    assert "nvidia-cuda-nvrtc-cu12" in readme and "nvidia-cuda-nvrtc-cu12" in ci
    assert 'pip install ".[docs]" && python -m sphinx -W -b html docs docs/_build/html' in readme
    assert '".[docs]"' in ci and "python -m sphinx -W -q -b html docs docs/_build/html" in ci


def test_readme_layout_names_every_docs_page():
    readme = (ROOT / "README.md").read_text()
    layout = readme.split("## Layout", 1)[1]
    docs_line = layout.split("\ndocs/", 1)[1]
    for page in (ROOT / "docs").glob("*.md"):
        assert page.stem in docs_line, f"README's layout leaves out docs/{page.name}"


def test_install_commands_work_from_a_clone():
    # no wheel is published: "cuonline[extra]" fails, ".[extra]" installs from the clone
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        assert "cuonline[" not in path.read_text(), path


def test_pointers_from_the_code_name_sections_that_exist():
    """A comment or docstring that says where its reasons are, ``(docs/kernels.md, "Tile
    tables")``, names a heading of that page (the heading may go on after the name)."""
    pointer = re.compile(r'docs/(\w+)\.md, "([^"]+)"')
    found = []
    for path in sorted((ROOT / "cuonline").rglob("*.py")):
        for page, title in pointer.findall(path.read_text(encoding="utf-8")):
            title = re.sub(r"\s*\n\s*(#:?)?\s*", " ", title)   # a title wrapped in a comment
            found.append((path.name, page, title))
    assert found
    for where, page, title in found:
        headings = [line.lstrip("#").strip() for line in
                    (ROOT / "docs" / f"{page}.md").read_text(encoding="utf-8").splitlines()
                    if line.startswith("#")]
        assert any(h.startswith(title) for h in headings), (where, page, title)
