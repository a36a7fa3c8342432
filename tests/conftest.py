"""Fixtures only: a seeded generator, the engines available on this machine and the CPU
products' libraries.

The helpers that test modules share (dtypes, tolerances, skip markers, case builders, TSan
runs) live in ``tests/support.py``; test modules import that, never this file.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))   # tests import `support` and `oracle` as modules

from support import (Engine, engine_params, needs_emulation, needs_gpu,  # noqa: E402
                     needs_nvrtc)                      # (needs the path above)


@pytest.fixture
def rng():
    return np.random.default_rng(20261129)


@pytest.fixture(autouse=True)
def plans_cut_for_every_core(monkeypatch):
    """The NumPy engine's calls are planned as large ones are, a stack per core, however
    little their work: the tests' small inputs then take the paths they were written for
    (tests/test_short_sequences.py tests the rule for small calls itself)."""
    from cuonline.engines import cpu_runtime

    monkeypatch.setattr(cpu_runtime, "PARALLEL_WORK", 0)


@pytest.fixture(params=engine_params())
def engine(request):
    return Engine(request.param)



def pytest_collection_modifyitems(config, items):
    """The fast tier, ``python -m pytest -m "not slow"``, runs every public function on the
    NumPy engine. Slow: a module marked ``pytestmark = pytest.mark.slow`` (kernels, wheels,
    benchmarks), any case that needs the emulation, NVRTC or a GPU, i.e. that compiles or
    runs cuonline's CUDA kernels, and the long cases that a fast case covers (marked one by
    one, or by ``support.fast_tier`` in a parametrization). The tier runs in under 3 minutes
    on two cores."""
    kernel_marks = [m.mark for m in (needs_emulation, needs_nvrtc, needs_gpu)]
    for item in items:
        if any(mark in kernel_marks for mark in item.iter_markers("skipif")):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(params=["numpy", "openblas", "mkl"])
def library(request, monkeypatch):
    """The CPU engines' products on one library for the test (``CUONLINE_CPU_BLAS``; skipped
    where this machine lacks it). A module narrows the list with
    ``pytest.mark.parametrize("library", [...], indirect=True)``."""
    from cuonline.engines import cpu_blas

    name = request.param
    if name != "numpy" and cpu_blas.available(name) is None:
        pytest.skip(f"{name} is not available here")
    monkeypatch.setenv("CUONLINE_CPU_BLAS", name)
    cpu_blas.reset()
    yield name
    cpu_blas.reset()
