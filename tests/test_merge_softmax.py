"""merge, softmax, log_softmax and logsumexp: values, masks, empty slices, warnings."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import scipy.special

import cuonline
from support import DTYPES


def test_merge_with_an_empty_state_is_exact(rng):
    out = rng.standard_normal((5, 3))
    lse = rng.standard_normal(5)
    empty = (np.full((5, 3), np.nan), np.full(5, -np.inf))   # nothing visible: out ignored
    merged_out, merged_lse = cuonline.merge((out, lse), empty)
    np.testing.assert_array_equal(merged_out, out)
    np.testing.assert_array_equal(merged_lse, lse)


def test_merge_of_empty_states_is_zero_and_minus_inf():
    empty = (np.ones((2, 3)), np.full(2, -np.inf))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = cuonline.merge(empty, empty)
    assert np.all(out == 0) and np.all(lse == -np.inf)


def test_merge_keeps_dtypes(rng):
    a = (rng.standard_normal((4, 2)).astype(np.float16), rng.standard_normal(4).astype(np.float32))
    out, lse = cuonline.merge(a, a)
    assert out.dtype == np.float16 and lse.dtype == np.float32
    np.testing.assert_allclose(lse, a[1] + np.log(2), rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: np.dtype(t).name)
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_against_scipy(rng, dtype, axis):
    x = (rng.standard_normal((6, 7, 8)) * 30).astype(dtype)
    x64 = x.astype(np.float64)
    tol = {2: 2e-3 if np.dtype(dtype) == np.float16 else 2e-2, 4: 1e-5, 8: 1e-12}[
        np.dtype(dtype).itemsize]
    for ours, theirs in ((cuonline.softmax, scipy.special.softmax),
                         (cuonline.log_softmax, scipy.special.log_softmax),
                         (cuonline.logsumexp, scipy.special.logsumexp)):
        got = ours(x, axis=axis)
        assert got.dtype == x.dtype
        np.testing.assert_allclose(got.astype(np.float64), theirs(x64, axis=axis),
                                   rtol=tol, atol=tol)


def test_masked_and_empty_slices_without_warnings(rng):
    x = rng.standard_normal((3, 5)) * 1e3
    mask = np.array([[True] * 5, [False] * 5, [True, False, True, False, False]])
    x[2, 3] = -np.inf
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        p = cuonline.softmax(x, mask=mask)
        logp = cuonline.log_softmax(x, mask=mask)
        lse = cuonline.logsumexp(x, mask=mask)
        all_neg_inf = cuonline.logsumexp(np.full(4, -np.inf))
        empty = cuonline.logsumexp(np.zeros((2, 0)), axis=1)
    assert np.all(p[1] == 0) and np.all(logp[1] == -np.inf) and lse[1] == -np.inf
    np.testing.assert_allclose(p.sum(axis=1), [1, 0, 1])
    np.testing.assert_allclose(lse[2], np.logaddexp(x[2, 0], x[2, 2]))
    np.testing.assert_array_equal(p[2, [1, 3, 4]], 0)
    assert all_neg_inf == -np.inf and empty.shape == (2,) and np.all(empty == -np.inf)


def test_logsumexp_keepdims(rng):
    x = rng.standard_normal((4, 5))
    assert cuonline.logsumexp(x, axis=0, keepdims=True).shape == (1, 5)
    assert cuonline.logsumexp(x, axis=0).shape == (5,)


def test_nan_propagates_to_its_slice_only():
    x = np.array([[1.0, np.nan], [1.0, 2.0]])
    p = cuonline.softmax(x)
    assert np.all(np.isnan(p[0])) and np.all(np.isfinite(p[1]))
    assert np.isnan(cuonline.logsumexp(x)[0])


def test_plus_inf_makes_its_slice_nan_without_warning():
    x = np.array([[np.inf, 1.0], [1.0, 2.0]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        results = [f(x) for f in (cuonline.softmax, cuonline.log_softmax, cuonline.logsumexp)]
    for r in results:
        assert np.all(np.isnan(r[0])) and np.all(np.isfinite(r[1]))
