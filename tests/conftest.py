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
