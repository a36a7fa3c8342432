"""cuonline.attention_stats on Dask arrays (issue 21): the key chunks' row states merged
exactly, received summed over query chunks, rows placed, against the NumPy engine."""

from __future__ import annotations

import numpy as np
import pytest
from support import STATS_FIELDS

import cuonline

da = pytest.importorskip("dask.array")

FIELDS = STATS_FIELDS


def _same(lazy, eager, rtol=1e-12):
    for name in FIELDS:
        want = getattr(eager, name)
        got = getattr(lazy, name)
        if want is None:
            assert got is None, name
            continue
        assert isinstance(got, da.Array), name
        got = got.compute()
        assert got.dtype == want.dtype and got.shape == want.shape, name
        if name in ("argmax", "top_indices"):
            np.testing.assert_array_equal(got, want, err_msg=name)
        else:
            np.testing.assert_allclose(got, want, rtol=rtol, atol=1e-14, err_msg=name)


def _options(rng, lq, lk):
    return {
        "plain": {},
        "causal and window": {"causal": True, "window": (30, None)},
        "offsets": {"causal": True, "q_offset": 40, "k_offset": 5},
        "kv_lengths, one batch element empty": {"kv_lengths": np.array([0, 41])},
        "bias_block": {"bias": rng.standard_normal((2, -(-lq // 6), -(-lk // 7))),
                       "bias_block": (6, 7)},
        "relative terms, alibi, softcap": {
            "rel_bias": rng.standard_normal(15), "rel_q": rng.standard_normal((lq, 3)),
            "rel_k": rng.standard_normal((21, 3)), "alibi_slopes": np.array([0.1, 0.3]),
            "softcap": 2.0},
        "mask": {"mask": rng.random((lq, lk)) > 0.3},
    }


@pytest.mark.parametrize("case", list(_options(np.random.default_rng(0), 1, 1)))
def test_dask_matches_numpy(rng, case):
    lq, lk = 45, 61
    q, k = rng.standard_normal((2, lq, 8)), rng.standard_normal((2, lk, 8))
    options = _options(rng, lq, lk)[case]
    w = rng.random((2, lq))
    keywords = dict(options, received=True, top_k=4, rows=[3, 44, 20, 3])
    eager = cuonline.attention_stats(q, k, query_weights=w, **keywords)
    lazy = cuonline.attention_stats(da.from_array(q, chunks=(1, 17, 8)),
                                    da.from_array(k, chunks=(2, 13, 8)),
                                    query_weights=da.from_array(w, chunks=(1, 9)), **keywords)
    _same(lazy, eager)


def test_dask_defaults_and_determinism(rng):
    q, k = rng.standard_normal((90, 4)), rng.standard_normal((100, 4))
    qd, kd = da.from_array(q, chunks=(30, 4)), da.from_array(k, chunks=(11, 4))
    _same(cuonline.attention_stats(qd, kd), cuonline.attention_stats(q, k))
    a = cuonline.attention_stats(qd, kd, received=True).received.compute()
    b = cuonline.attention_stats(qd, kd, received=True).received.compute(scheduler="threads")
    assert np.array_equal(a, b)


def test_dask_errors_are_raised_when_the_graph_is_built(rng):
    q = da.from_array(rng.standard_normal((10, 4)), chunks=(5, 4))
    with pytest.raises(TypeError, match="`rows` must be a NumPy array or a list"):
        cuonline.attention_stats(q, q, rows=da.arange(3))
    with pytest.raises(ValueError, match="runs the NumPy engine on each chunk.*"
                                         "backend='emulate'"):
        cuonline.attention_stats(q, q, backend="emulate")
    with pytest.raises(ValueError, match="`top_k` must be >= 0"):
        cuonline.attention_stats(q, q, top_k=-1)
    with pytest.raises(ValueError, match=r"`query_weights` of shape \(3,\) does not broadcast"):
        cuonline.attention_stats(q, q, received=True, query_weights=da.ones(3))
