"""Edge inputs that once broke one engine or were silently wrong (issue 10, items 7 and 9-15):
huge window sides, non-native byte order, log_softmax at large magnitude, empty head
dimensions, numpy.ma arrays, merge's dtypes and +inf, scalar and huge kv_lengths, and the
memory of converting a broadcast or overlapping bias.

Attention cases run on every engine (``engine`` fixture: numpy, emulate, cupy where they run)
and compare with the float64 oracle of tests/oracle.py; shapes are tiny so that the emulated
variants compile once and are shared between cases.
"""

from __future__ import annotations

import sys
import tracemalloc
import warnings

import numpy as np
import pytest
from support import check_attention, cuda_backend_params
from numpy.lib.stride_tricks import as_strided

import cuonline
from cuonline import _semantics
from cuonline._validate import validate_attention

LQ, LK, D, DV = 3, 5, 4, 2
SOFTMAX_BACKENDS = [pytest.param("numpy", id="numpy")] + cuda_backend_params()


def data(dtype=np.float32, lq=LQ, lk=LK, d=D, dv=DV, batch=()):
    rng = np.random.default_rng(7)
    return (rng.standard_normal(batch + (lq, d)).astype(dtype),
            rng.standard_normal(batch + (lk, d)).astype(dtype),
            rng.standard_normal(batch + (lk, dv)).astype(dtype))


def assert_matches_oracle(result, q, k, v, **options):
    check_attention(q, k, v, *result, options)


def softmax_input(x, backend):
    if backend == "cupy":
        import cupy
        return cupy.asarray(x)
    return x


def host(x):
    return x.get() if hasattr(x, "get") else np.asarray(x)


# --------------------------------------------------------------------------------------------
# item 7: window sides beyond the sequence


@pytest.mark.parametrize("side", [LQ + LK, sys.maxsize, 2**64, 2**100],
                         ids=["Lq+Lk", "maxsize", "2**64", "2**100"])
def test_window_side_past_every_key_is_unbounded(engine, side):
    q, k, v = data()
    for window, same in (((None, side), None), ((side, None), None), ((side, side), None),
                         ((side, 0), (None, 0))):
        result = engine.attention(q, k, v, window=window, return_lse=True)
        assert_matches_oracle(result, q, k, v, window=same)


def test_window_side_past_every_key_is_none_in_the_problem():
    q, k, v = data()
    p = validate_attention(q, k, v, scale=None, causal=True, window=(2**64, 3),
                           bias=None, mask=None, kv_lengths=None, alibi_slopes=None,
                           softcap=None, return_lse=False, backend="auto")
    assert p.window == (None, 0)
    p = validate_attention(q, k, v, scale=None, causal=False, window=(LQ + LK - 1, LQ + LK),
                           bias=None, mask=None, kv_lengths=None, alibi_slopes=None,
                           softcap=None, return_lse=False, backend="auto")
    assert p.window == (LQ + LK - 1, None)


# --------------------------------------------------------------------------------------------
# item 9: byte order is storage, not dtype


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_non_native_byte_order_is_the_same_dtype(engine, dtype):
    if engine.name == "cupy":
        pytest.skip("CuPy arrays have native byte order only")
    q, k, v = data(dtype)
    swapped = [x.astype(x.dtype.newbyteorder()) for x in (q, k, v)]
    assert not swapped[0].dtype.isnative
    out, lse = engine.attention(*swapped, return_lse=True)
    want_out, want_lse = engine.attention(q, k, v, return_lse=True)
    assert out.dtype == np.dtype(dtype) and out.dtype.isnative
    assert lse.dtype == _semantics.accumulation_dtype(dtype)
    np.testing.assert_array_equal(out, want_out)
    np.testing.assert_array_equal(lse, want_lse)
    # one native, one not: still one dtype; a non-native bias is converted like any other
    bias = np.linspace(-1, 1, LQ * LK).reshape(LQ, LK).astype(">f8")
    out, lse = engine.attention(q, swapped[1], v, bias=bias, return_lse=True)
    assert_matches_oracle((out, lse), q, k, v, bias=bias)


def test_accumulation_dtype_compares_kind_and_size():
    assert _semantics.accumulation_dtype(">f8") == np.float64
    assert _semantics.accumulation_dtype("<f8") == np.float64
    assert _semantics.accumulation_dtype(">f4") == np.float32
    assert _semantics.accumulation_dtype(np.float16) == np.float32


@pytest.mark.parametrize("backend", SOFTMAX_BACKENDS)
@pytest.mark.parametrize("fn", ["softmax", "log_softmax", "logsumexp"])
def test_softmax_family_non_native_byte_order(backend, fn):
    if backend == "cupy":
        pytest.skip("CuPy arrays have native byte order only")
    x = np.random.default_rng(3).standard_normal((2, 7))
    swapped = x.astype(">f8")
    got = getattr(cuonline, fn)(swapped, backend=backend)
    want = getattr(cuonline, fn)(x, backend=backend)
    assert got.dtype == np.float64 and got.dtype.isnative
    np.testing.assert_array_equal(got, want)


# --------------------------------------------------------------------------------------------
# item 10: log_softmax at large magnitude


@pytest.mark.parametrize("backend", SOFTMAX_BACKENDS)
@pytest.mark.parametrize("row", [[1e4, 1e4, 9999, 0], [3e7, 3e7, 3e7, 0]],
                         ids=["1e4", "3e7"])
def test_softmax_family_exact_at_large_magnitude(backend, row):
    x32 = np.array(row, dtype=np.float32)
    x = x32.astype(np.float64)                 # the float32 values, exactly
    m = x.max()
    log_total = np.log(np.exp(x - m).sum())
    exact = {"log_softmax": (x - m) - log_total, "logsumexp": m + log_total,
             "softmax": np.exp(x - m - log_total)}
    for fn, want in exact.items():
        got = host(getattr(cuonline, fn)(softmax_input(x32, backend), backend=backend))
        assert got.dtype == np.float32
        # a few ulp of each value (the float32 result of the float64 exact value is 1/2 ulp)
        ulp = np.spacing(np.abs(want).astype(np.float32)).astype(np.float64)
        assert np.all(np.abs(got - want) <= 4 * ulp), (fn, got, want)


# --------------------------------------------------------------------------------------------
# item 11: empty head dimensions


def test_empty_key_dimension_scores_zero(engine):
    q, k, v = data(d=1)
    q, k = q[:, :0], k[:, :0]                  # D = 0: every q·k is 0
    bias = np.linspace(-2, 2, LQ * LK).reshape(LQ, LK).astype(np.float32)
    for options in (dict(causal=True), dict(causal=True, bias=bias)):
        result = engine.attention(q, k, v[:, :1], return_lse=True, **options)
        assert_matches_oracle(result, q, k, v[:, :1], **options)


def test_empty_value_dimension_keeps_lse(engine):
    q, k, v = data(d=1, dv=1)
    out, lse = engine.attention(q, k, v[:, :0], causal=True, return_lse=True)
    assert out.shape == (LQ, 0)
    check_attention(q, k, v[:, :0], out, lse, dict(causal=True))
    # both empty at once
    out, lse = engine.attention(q[:, :0], k[:, :0], v[:, :0], causal=True, return_lse=True)
    assert out.shape == (LQ, 0)
    check_attention(q[:, :0], k[:, :0], v[:, :0], out, lse, dict(causal=True))


# --------------------------------------------------------------------------------------------
# item 12: numpy.ma arrays


@pytest.mark.parametrize("name", ["q", "k", "v", "bias", "mask"])
def test_attention_refuses_masked_arrays(name):
    q, k, v = data()
    args = dict(q=q, k=k, v=v, bias=np.zeros((LQ, LK), np.float32), mask=np.ones((LQ, LK), bool))
    args[name] = np.ma.masked_array(args[name], mask=np.zeros(args[name].shape, bool))
    with pytest.raises(TypeError, match=rf"`{name}` is a numpy.ma masked array.*`mask=`"):
        cuonline.attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)


@pytest.mark.parametrize("fn", ["softmax", "log_softmax", "logsumexp"])
@pytest.mark.parametrize("name", ["x", "mask"])
def test_softmax_family_refuses_masked_arrays(fn, name):
    x = np.ma.masked_array([1.0, 2.0, 3.0], mask=[True, False, False])
    args = dict(x=x, mask=None) if name == "x" else dict(x=x.data, mask=np.ma.make_mask([1, 1, 0]))
    args[name] = np.ma.asarray(args[name])
    with pytest.raises(TypeError, match=rf"`{name}` is a numpy.ma masked array.*`mask=`"):
        getattr(cuonline, fn)(args["x"], mask=args["mask"])


# --------------------------------------------------------------------------------------------
# item 13: merge


@pytest.mark.parametrize("kind", ["int64", "bool", "complex128"])
@pytest.mark.parametrize("part", ["out", "lse"])
def test_merge_refuses_non_floating_states(kind, part):
    state = [np.ones((2, 3)), np.zeros(2)]
    state[part == "lse"] = state[part == "lse"].astype(kind)
    with pytest.raises(TypeError, match=rf"state 0: `{part}` must have a real floating dtype"):
        cuonline.merge(tuple(state), (np.ones((2, 3)), np.zeros(2)))


@pytest.mark.parametrize("part", ["out", "lse"])
def test_merge_refuses_mixed_dtypes(part):
    a = (np.ones((2, 3)), np.zeros(2))
    b = list(a)
    b[part == "lse"] = b[part == "lse"].astype(np.float32)
    with pytest.raises(TypeError, match=rf"state 1: `{part}` has dtype float32 but state 0 has "
                                        rf"float64"):
        cuonline.merge(a, tuple(b))


def test_merge_plus_inf_lse_is_infinite_mass():
    outs = np.array([[1.0, 2.0], [3.0, 4.0]])
    a = (outs, np.array([np.inf, 0.0]))
    b = (outs[::-1].copy(), np.array([0.0, np.inf]))
    c = (outs, np.array([1.0, np.nan]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = cuonline.merge(a, (outs, np.zeros(2)))
        np.testing.assert_array_equal(lse, [np.inf, np.log(2)])
        assert np.isnan(out[0]).all()
        np.testing.assert_allclose(out[1], outs[1])
        out, lse = cuonline.merge(a, b)          # +inf in both rows
        assert np.all(lse == np.inf) and np.isnan(out).all()
        out, lse = cuonline.merge(a, c)          # NaN beats +inf
        assert lse[0] == np.inf and np.isnan(lse[1]) and np.isnan(out).all()


def test_merge_accepts_byte_order_and_computes_in_the_wider_dtype():
    rng = np.random.default_rng(5)
    out = rng.standard_normal((3, 2))
    lse = rng.standard_normal(3)
    merged_out, merged_lse = cuonline.merge((out, lse), (out.astype(">f8"), lse.astype(">f8")))
    np.testing.assert_allclose(merged_lse, lse + np.log(2), rtol=0, atol=1e-15)
    np.testing.assert_allclose(merged_out, out, rtol=1e-14)
    # float32 out with a float64 lse: float64 arithmetic, float32 out back
    o32 = out.astype(np.float32)
    merged_out, merged_lse = cuonline.merge((o32, lse), (o32, lse + 1e-9))
    assert merged_out.dtype == np.float32 and merged_lse.dtype == np.float64
    np.testing.assert_allclose(merged_lse, lse + 5e-10 + np.log(2), rtol=0, atol=1e-15)


# --------------------------------------------------------------------------------------------
# item 14: scalar and huge kv_lengths


@pytest.mark.parametrize("lengths", [2, np.array(2), np.int64(2)], ids=["int", "0-d", "np.int64"])
def test_scalar_kv_lengths_with_unbatched_inputs(engine, lengths):
    q, k, v = data()
    result = engine.attention(q, k, v, kv_lengths=lengths, return_lse=True)
    assert_matches_oracle(result, q, k, v, kv_lengths=2)


def test_huge_python_int_kv_lengths_mean_all_keys(engine):
    q, k, v = data()
    result = engine.attention(q, k, v, kv_lengths=2**70, return_lse=True)
    assert_matches_oracle(result, q, k, v)
    qb, kb, vb = data(batch=(2,))
    result = engine.attention(qb, kb, vb, kv_lengths=[2**70, 3], return_lse=True)
    assert_matches_oracle(result, qb, kb, vb, kv_lengths=np.array([LK, 3]))


def test_huge_negative_kv_lengths_is_a_value_error():
    q, k, v = data(batch=(2,))
    with pytest.raises(ValueError, match=r"`kv_lengths` must be >= 0, got minimum -2361183"):
        cuonline.attention(q, k, v, kv_lengths=[-2**71, 3])


# --------------------------------------------------------------------------------------------
# item 15: no hidden full-size copies


def toeplitz_view(values, lq, lk):
    """bias[i, j] = values[j - i + lq - 1], read-only, over lq + lk - 1 float64 values."""
    return as_strided(values[lq - 1:], (lq, lk), (-values.itemsize, values.itemsize),
                      writeable=False)


def test_toeplitz_and_broadcast_bias_convert_only_their_values():
    lq, lk = 64, 200_000
    rng = np.random.default_rng(11)
    q = rng.standard_normal((lq, 2)).astype(np.float32)
    k = rng.standard_normal((lk, 2)).astype(np.float32)
    values = rng.standard_normal(lq + lk - 1)
    dense_bytes = lq * lk * 4                  # 51 MB: what a dense float32 copy would take
    for bias in (toeplitz_view(values, lq, lk),
                 np.broadcast_to(values[:lk].astype(np.float16), (lq, lk))):
        tracemalloc.start()
        try:
            p = validate_attention(q, k, k, scale=None, causal=False, window=None, bias=bias,
                                   mask=None, kv_lengths=None, alibi_slopes=None, softcap=None,
                                   return_lse=False, backend="auto")
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert p.bias.dtype == np.float32 and p.bias.shape == (lq, lk)
        # one float32 copy of the lq + lk - 1 values it reaches, plus small change
        assert peak < 2 * (lq + lk) * 4 and peak < dense_bytes / 10, peak
        for i, j in ((0, 0), (lq - 1, 0), (3, lk - 1), (lq - 1, lk - 1)):
            assert p.bias[i, j] == np.float32(bias[i, j])


def test_toeplitz_bias_through_attention_stays_small():
    lq, lk = 64, 500_000
    rng = np.random.default_rng(12)
    q = rng.standard_normal((lq, 2)).astype(np.float32)
    k = rng.standard_normal((lk, 2)).astype(np.float32)
    bias = toeplitz_view(rng.standard_normal(lq + lk - 1), lq, lk)
    cuonline.attention(q[:2], k[:600], k[:600], bias=bias[:2, :600])   # pool and BLAS warmed up
    tracemalloc.start()
    try:
        out = cuonline.attention(q, k, k, bias=bias)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert out.shape == (lq, 2)
    # tiles are a few 64 x 512 float32 blocks per worker; a dense bias copy alone is 128 MB
    assert peak < lq * lk * 4 / 4, peak


def test_strided_bias_of_another_dtype_gives_the_dense_result(engine):
    q, k, v = data()
    values = np.random.default_rng(13).standard_normal(LQ + LK - 1)
    for bias in (toeplitz_view(values, LQ, LK),
                 np.broadcast_to(values[:LK].astype(np.float16), (LQ, LK)),
                 toeplitz_view(values, LQ, LK)[::-1, ::-2]):
        lk = bias.shape[1]
        kk, vv = k[:lk], v[:lk]
        got = engine.attention(q, kk, vv, bias=bias, return_lse=True)
        want = engine.attention(q, kk, vv, bias=np.array(bias, dtype=np.float32),
                                return_lse=True)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
