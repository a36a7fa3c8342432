"""The docs stay true: api.md matches the docstrings. (The examples in README.md, docs/*.md
and the docstrings run as doctests: see addopts in pyproject.toml.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_api_reference_is_generated_from_current_docstrings():
    result = subprocess.run([sys.executable, str(ROOT / "docs" / "make_api.py"), "--check"],
                            capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr


def test_readme_commands_are_the_ones_ci_runs():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'pip install ".[test]" && python -m pytest' in readme
    assert "pip install . && python -m cuonline demo" in readme
    assert "python -m pytest" in ci and ".[test" in ci
