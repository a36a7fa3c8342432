"""Fixtures only: a seeded generator and the engines available on this machine.

The helpers that test modules share (dtypes, tolerances, skip markers, case builders, TSan
runs) live in ``tests/support.py``; test modules import that, never this file.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))   # tests import `support` and `oracle` as modules

from support import Engine, engine_params  # noqa: E402 - needs the path above


@pytest.fixture
def rng():
    return np.random.default_rng(20261129)


@pytest.fixture(params=engine_params())
def engine(request):
    return Engine(request.param)


#: Parameter values that put a test on cuonline's CUDA kernels (emulated on the CPU, or a GPU).
_KERNEL_ENGINES = ("emulate", "cupy")


def pytest_collection_modifyitems(config, items):
    """The fast tier, ``python -m pytest -m "not slow"``, runs every public function on the
    NumPy engine; a test that runs the CUDA kernels (a case parametrized with the emulate or
    cupy engine, or a module marked ``pytestmark = pytest.mark.slow``) is slow."""
    slow = pytest.mark.slow
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and any(
                isinstance(value, str) and value in _KERNEL_ENGINES
                for value in callspec.params.values()):
            item.add_marker(slow)
