"""Collection settings for the doctests under cuonline/ (pyproject: --doctest-modules): the
framework bindings import their framework, so their modules are collected only where it is
installed (``pip install ".[frameworks]"``)."""

import importlib.util

collect_ignore = [f"cuonline/{name}.py" for name in ("jax", "torch")
                  if importlib.util.find_spec(name) is None]
