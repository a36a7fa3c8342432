"""The NumPy engine against the float64 oracle: shapes, options, dtypes and tile sizes."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import cuonline
import cuonline.engines.numpy as numpy_engine
from oracle import naive_attention, reference_attention
from support import DTYPES, accumulation_of, assert_accurate, check_attention

LENGTHS = [1, 17, 63, 64, 65, 127, 129, 300]
# Lq < Lk, Lq > Lk and Lq == Lk, every length at least once on each side
LENGTH_PAIRS = [(1, 300), (17, 129), (63, 64), (64, 63), (65, 65), (127, 17), (129, 1),
                (300, 127), (1, 1), (300, 300)]


@pytest.fixture(params=["default-tiles", "small-tiles"])
def tiles(request, monkeypatch):
    """Run with the shipped tile sizes and with tiles small enough that every shape above
    spans several query and key tiles with ragged tails."""
    if request.param == "small-tiles":
        monkeypatch.setattr(numpy_engine, "BLOCK_Q", 16)
        monkeypatch.setattr(numpy_engine, "BLOCK_K", 32)
    return request.param


def data(rng, batch_q, batch_k, lq, lk, d, dv, dtype=np.float64):
    q = rng.standard_normal(batch_q + (lq, d)).astype(dtype)
    k = rng.standard_normal(batch_k + (lk, d)).astype(dtype)
    v = rng.standard_normal(batch_k + (lk, dv)).astype(dtype)
    return q, k, v


def check(q, k, v, **options):
    out, lse = cuonline.attention(q, k, v, return_lse=True, **options)
    check_attention(q, k, v, out, lse, options)


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16],
                         ids=lambda t: np.dtype(t).name)
def test_the_accuracy_rule_refuses_an_error_past_its_limit(rng, dtype):
    # the rule of tests/support.py is not vacuous: the engine's result passes it, the same
    # result with one entry moved to twice the rule's limit from the oracle does not
    q, k, v = data(rng, (2,), (2,), 17, 33, 8, 8, dtype)
    out, lse = cuonline.attention(q, k, v, return_lse=True)
    check_attention(q, k, v, out, lse, {})
    ref_out, ref_lse = reference_attention(q, k, v)
    naive_out, naive_lse = naive_attention(q, k, v, rounding=dtype)
    _, limit = assert_accurate("out", out, ref_out, naive_out, np.dtype(dtype))
    bad = out.copy()
    bad[1, 5, 3] = ref_out[1, 5, 3] + 2 * limit
    with pytest.raises(AssertionError, match="out: error"):
        check_attention(q, k, v, bad, lse, {})
    acc = accumulation_of(dtype)
    _, naive_lse = naive_attention(q, k, v, rounding=acc)
    _, limit = assert_accurate("lse", lse, ref_lse, naive_lse, acc)
    bad = lse.copy()
    bad[0, 2] = ref_lse[0, 2] - 2 * limit
    with pytest.raises(AssertionError, match="lse: error"):
        check_attention(q, k, v, out, bad, {})


@pytest.mark.parametrize("lq,lk", LENGTH_PAIRS)
@pytest.mark.parametrize("causal", [False, True])
def test_lengths(rng, tiles, lq, lk, causal):
    q, k, v = data(rng, (2,), (2,), lq, lk, 8, 8)
    check(q, k, v, causal=causal)


@pytest.mark.parametrize("d,dv", [(1, 1), (8, 8), (64, 64), (100, 100), (8, 3), (64, 100)])
def test_head_dims(rng, tiles, d, dv):
    q, k, v = data(rng, (3,), (3,), 65, 129, d, dv)
    check(q, k, v)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: np.dtype(t).name)
@pytest.mark.parametrize("causal", [False, True])
def test_dtypes(rng, tiles, dtype, causal):
    q, k, v = data(rng, (2,), (2,), 63, 129, 16, 24, dtype)
    out, lse = cuonline.attention(q, k, v, causal=causal, return_lse=True)
    acc = np.float64 if np.dtype(dtype) == np.float64 else np.float32
    assert out.dtype == np.dtype(dtype) and lse.dtype == acc
    check(q, k, v, causal=causal)


def test_broadcast_and_grouped_query(rng, tiles):
    # q (B, Hkv, G, Lq, D) against k, v (B, Hkv, 1, Lk, D): grouped-query attention
    q, k, v = data(rng, (2, 3, 4), (2, 3, 1), 33, 70, 8, 5)
    out = cuonline.attention(q, k, v)
    assert out.shape == (2, 3, 4, 33, 5)
    check(q, k, v)
    # a batch dimension of length 1 in q against several in k
    q, k, v = data(rng, (1, 5), (2, 1), 20, 40, 4, 4)
    check(q, k, v)
    # no batch dimension at all on one side
    q, k, v = data(rng, (), (6,), 20, 40, 4, 4)
    check(q, k, v)


OPTIONS = {
    "causal": dict(causal=True),
    "window": dict(window=(13, 5)),
    "window-left": dict(window=(20, None)),
    "window-right": dict(window=(None, 7)),
    "window+causal": dict(window=(9, 30), causal=True),
    "bias": "bias",
    "mask": "mask",
    "kv_lengths": "kv_lengths",
    "alibi": "alibi",
    "softcap": dict(softcap=1.5),
    "scale": dict(scale=0.37),
}


def make_option(rng, name, batch, lq, lk):
    spec = OPTIONS[name]
    if isinstance(spec, dict):
        return dict(spec)
    if spec == "bias":        # broadcast over the batch: read through zero strides
        return dict(bias=rng.standard_normal((1, lq, lk)))
    if spec == "mask":
        return dict(mask=rng.random(batch + (lq, lk)) < 0.7)
    if spec == "kv_lengths":
        return dict(kv_lengths=rng.integers(0, lk + 5, size=batch))
    if spec == "alibi":
        return dict(alibi_slopes=rng.uniform(0.01, 0.5, size=batch))
    raise AssertionError(name)


@pytest.mark.parametrize("name", list(OPTIONS))
@pytest.mark.parametrize("lq,lk", [(65, 129), (129, 65), (40, 40)])
def test_each_option(rng, tiles, name, lq, lk):
    q, k, v = data(rng, (3,), (3,), lq, lk, 8, 6)
    check(q, k, v, **make_option(rng, name, (3,), lq, lk))


@pytest.mark.parametrize("names", list(itertools.combinations(
    ["window+causal", "bias", "mask", "kv_lengths", "alibi", "softcap", "scale"], 3)))
def test_options_combined(rng, tiles, names):
    q, k, v = data(rng, (2, 2), (2, 1), 45, 90, 8, 8)
    options = {}
    for name in names:
        options.update(make_option(rng, name, (2, 2), 45, 90))
    check(q, k, v, **options)


def test_all_options_at_once(rng, tiles):
    q, k, v = data(rng, (2, 2), (2, 1), 77, 150, 16, 12, np.float32)
    options = {}
    for name in ["window+causal", "bias", "mask", "kv_lengths", "alibi", "softcap", "scale"]:
        options.update(make_option(rng, name, (2, 2), 77, 150))
    check(q, k, v, **options)


def test_split_keys_for_few_queries(rng, monkeypatch):
    # A few queries against many keys: too few query blocks for the cores, so the engine
    # splits the keys into parts and merges them. Force several parts whatever the machine.
    monkeypatch.setattr(numpy_engine, "workers", lambda: 4)
    monkeypatch.setattr(numpy_engine, "BLOCK_K", 32)
    q, k, v = data(rng, (), (), 3, 1000, 8, 8)
    check(q, k, v)
    check(q, k, v, causal=True, kv_lengths=np.array(700))
    check(q, k, v, mask=rng.random((3, 1000)) < 0.01)


def test_tf32_precision_on_the_numpy_engine_is_full_float32(rng):
    # the NumPy engine has no TF32 path: precision="tf32" may only make results more exact
    q, k, v = data(rng, (2,), (2,), 40, 70, 16, 8, np.float32)
    np.testing.assert_array_equal(cuonline.attention(q, k, v, precision="tf32"),
                                  cuonline.attention(q, k, v))
