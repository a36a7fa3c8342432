"""Extreme inputs on every engine: finite scores of any magnitude, non-finite values at keys a
row cannot see (issue 10, items 8 and 6).

Each case runs on the NumPy engine and on both CUDA families through the emulation (the
``family`` field of the engine's one seam, ``cuonline.engines.target.overrides``): ``simt``
(attention_fwd_simt) and ``mma`` (attention_fwd_mma; float32 takes it with
``precision="tf32"``, exact here because every input is a small integer). The expected
values come from the float64 oracle of tests/oracle.py, which gives a key that a row cannot
see no part in that row, whatever its value.
"""

from __future__ import annotations

import numpy as np
import pytest
from oracle import reference_attention
from support import BFLOAT16 as _BFLOAT16
from support import check_attention, needs_emulation

import cuonline
from cuonline._validate import validate_attention
from cuonline.engines import cuda
from cuonline.engines.target import overrides
from cuonline.kernels import arguments, families
from cuonline.kernels.launch import Launch

ENGINES = ["numpy", pytest.param("simt", marks=needs_emulation),
           pytest.param("mma", marks=needs_emulation)]
DTYPES = {"f32": np.float32, "f64": np.float64}
BIG = {"f32": 3e38, "f64": 1.7e308}          # finite, and overflows once multiplied by log2(e)

_DEFAULTS = dict(scale=None, causal=False, window=None, bias=None, mask=None, kv_lengths=None,
                 alibi_slopes=None, softcap=None, return_lse=True)


def run(engine, q, k, v, **options):
    """(out, lse) of ``engine`` as NumPy arrays."""
    if engine == "numpy":
        return cuonline.attention(q, k, v, backend="numpy", return_lse=True, **options)
    kwargs = dict(_DEFAULTS)
    kwargs.update(options)
    precision = "tf32" if engine == "mma" and q.dtype == np.float32 else "highest"
    p = validate_attention(q, k, v, backend="emulate", precision=precision, **kwargs)
    family = {"simt": "attention_fwd_simt", "mma": "attention_fwd_mma"}[engine]
    with overrides(family=family, tuned={}):
        return cuda.attention(p)


def oracle(q, k, v, **options):
    """float64 (out, lse) of tests/oracle.py, whose rows give a key they cannot see no part,
    whatever its value; scores that overflow float64 are its business, not a warning."""
    with np.errstate(all="ignore"):
        return reference_attention(q, k, v, **options)


def assert_matches(out, lse, ref_out, ref_lse, dtype, engine):
    # tf32 rounds P to 10 mantissa bits before P·V
    tol = 1e-12 if dtype == np.float64 else (2e-3 if engine == "mma" else 2e-6)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref_out))
    np.testing.assert_allclose(out, ref_out.astype(dtype), rtol=tol, atol=tol)
    # lse holds numbers near the dtype's maximum: compare relative to its magnitude
    np.testing.assert_allclose(lse, ref_lse.astype(dtype), rtol=tol, atol=tol)


# --------------------------------------------------------------------------------------------
# item 8: scores of any finite magnitude


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("sign", [-1, 1], ids=["neg", "pos"])
def test_bias_near_the_dtype_maximum(engine, dt, sign):
    dtype = DTYPES[dt]
    q = k = np.zeros((3, 4), dtype)
    v = np.ones((3, 1), dtype)
    bias = np.full((3, 3), sign * BIG[dt], dtype)
    out, lse = run(engine, q, k, v, bias=bias)
    np.testing.assert_array_equal(out, np.ones((3, 1), dtype))
    assert np.all(lse == dtype(sign * BIG[dt]) + dtype(np.log(3))), lse


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("dt", DTYPES)
def test_bias_of_opposite_extremes(engine, dt):
    # s - m = -2 BIG overflows to -inf: weight 0, which is what exp(-2 BIG) is
    dtype = DTYPES[dt]
    q = k = np.zeros((2, 4), dtype)
    v = np.array([[1.0], [5.0]], dtype)
    bias = np.array([[BIG[dt], -BIG[dt]], [-BIG[dt], BIG[dt]]], dtype)
    out, lse = run(engine, q, k, v, bias=bias)
    np.testing.assert_array_equal(out[:, 0], np.array([1.0, 5.0], dtype))
    np.testing.assert_array_equal(lse, np.full(2, BIG[dt], dtype))


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("dt", DTYPES)
def test_scale_near_the_dtype_maximum(engine, dt):
    dtype = DTYPES[dt]
    q = np.array([[1, 0, 0, 0], [0, 0, 0, 0], [0, 1, 0, 0]], dtype)
    k = np.array([[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 0, 0]], dtype)
    v = np.array([[1.0], [2.0], [4.0]], dtype)
    out, lse = run(engine, q, k, v, scale=BIG[dt])
    ref_out, ref_lse = oracle(q, k, v, scale=BIG[dt])
    assert_matches(out, lse, ref_out, ref_lse, dtype, engine)
    # row 1 scores 0 everywhere: the mean of v; rows 0 and 2 pick their key
    np.testing.assert_allclose(out[:, 0], np.array([1.0, 7 / 3, 2.0], dtype), rtol=1e-6)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("option", ["softcap", "alibi"])
def test_softcap_and_alibi_near_the_dtype_maximum(engine, dt, option):
    dtype = DTYPES[dt]
    q = k = np.zeros((3, 4), dtype)
    v = np.array([[1.0], [2.0], [4.0]], dtype)
    if option == "softcap":    # cap tanh(0 / cap) = 0: every weight 1
        options = dict(softcap=float(BIG[dt]))
    else:                      # the diagonal key scores 0, the others -BIG |i - j|
        options = dict(alibi_slopes=np.array(BIG[dt], dtype))
    out, lse = run(engine, q, k, v, **options)
    ref_out, ref_lse = oracle(q, k, v, **options)
    assert_matches(out, lse, ref_out, ref_lse, dtype, engine)


# --------------------------------------------------------------------------------------------
# item 6: keys a row cannot see do not reach it, whatever their values


def _eye_case(dtype, bad_row, bad_value, where="v"):
    q = k = np.eye(4, dtype=dtype)
    v = np.arange(4, dtype=dtype)[:, None].copy()
    if where == "v":
        v[bad_row] = bad_value
    else:
        k = k.copy()
        k[bad_row] = bad_value
    return q, k, v



VISIBILITY = {
    "causal": dict(causal=True),
    "mask": dict(mask=np.tril(np.ones((4, 4), bool))),
    "window": dict(window=(1, 0)),
}


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("how", VISIBILITY)
@pytest.mark.parametrize("bad", ["nan", "inf", "-inf"])
def test_non_finite_value_at_an_invisible_key(engine, dt, how, bad):
    dtype = DTYPES[dt]
    q, k, v = _eye_case(dtype, 3, float(bad))
    out, lse = run(engine, q, k, v, **VISIBILITY[how])
    ref_out, ref_lse = oracle(q, k, v, **VISIBILITY[how])
    assert np.all(np.isfinite(out[:3])), out                   # rows 0-2 never see key 3
    assert_matches(out, lse, ref_out, ref_lse, dtype, engine)
    if bad == "nan":
        assert np.isnan(out[3, 0])                                 # row 3 sees it
    else:
        assert out[3, 0] == float(bad)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("dt", DTYPES)
def test_nan_value_stays_in_the_rows_that_see_it(engine, dt):
    # window (0, 0): only row 1 sees key 1
    dtype = DTYPES[dt]
    q, k, v = _eye_case(dtype, 1, np.nan)
    out, lse = run(engine, q, k, v, window=(0, 0))
    assert np.isnan(out[1, 0])
    np.testing.assert_array_equal(out[[0, 2, 3], 0], np.array([0, 2, 3], dtype))
    # a value takes no part in the normaliser: every row's lse is its one score, NaN or not
    _, ref_lse = oracle(q, k, v, window=(0, 0))
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-6)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("dt", DTYPES)
def test_nan_key_at_an_invisible_position(engine, dt):
    dtype = DTYPES[dt]
    q, k, v = _eye_case(dtype, 3, np.nan, where="k")
    out, lse = run(engine, q, k, v, causal=True)
    ref_out, ref_lse = oracle(q, k, v, causal=True)
    assert np.all(np.isfinite(out[:3])), out
    assert np.isnan(out[3, 0])
    assert_matches(out, lse, ref_out, ref_lse, dtype, engine)


@pytest.mark.parametrize("engine", ENGINES)
def test_nan_value_behind_a_mask_in_a_later_tile(engine):
    # 200 keys: several key tiles in every family; the masked keys carry NaN values and lie
    # in the same tiles as visible ones
    rng = np.random.default_rng(6)
    q = rng.standard_normal((5, 8))
    k = rng.standard_normal((200, 8))
    v = rng.standard_normal((200, 3))
    mask = rng.random((5, 200)) < 0.7
    mask[:, 150] = False                       # at least one key no row sees
    hidden = ~mask.any(axis=0)
    v[hidden] = np.nan
    out, lse = run(engine, q, k, v, mask=mask)
    ref_out, ref_lse = oracle(q, k, v, mask=mask)
    assert np.all(np.isfinite(out))
    assert_matches(out, lse, ref_out, ref_lse, np.float64, engine)


# The tensor-core family forms P·V in an mma, where an invisible key still multiplies weight 0
# into every row; a lane whose share of a row comes out non-finite recomputes it after the key
# loop over the keys the row sees (attention_fwd_mma.cu). The cases below give that slow path
# several key tiles, query and key tails, Dv not a multiple of 16, two query tiles per warp,
# split keys, element-wise loads and every score option, with non-finite values at keys that
# some rows see and others do not (a visible one must still reach its rows).
MMA_DTYPES = {"f16": np.float16, "tf32": np.float32, "f64": np.float64}
if _BFLOAT16 is not None:
    MMA_DTYPES["bf16"] = _BFLOAT16


def run_mma(q, k, v, *, n_splits=None, **options):
    """(out, lse, plan) of the tensor-core family, emulated; out in q's dtype."""
    kwargs = dict(_DEFAULTS)
    kwargs.update(options)
    precision = "tf32" if q.dtype == np.float32 else "highest"
    p = validate_attention(q, k, v, backend="emulate", precision=precision, **kwargs)
    plan = families.plan_attention(p, Launch(n_splits=n_splits, family="attention_fwd_mma",
                                             cp_async=arguments.cp_async_aligned(p), tuned={}))
    with overrides(n_splits=n_splits, family="attention_fwd_mma", tuned={}):
        out, lse = cuda.attention(p)
    return out, lse, plan


def check_mma(q, k, v, out, lse, options):
    """The accuracy rule against the oracle (tf32 for float32: the family's precision there),
    NaN and infinities of the poisoned columns included."""
    with np.errstate(all="ignore"):
        check_attention(q, k, v, out, lse, options,
                        precision="tf32" if q.dtype == np.float32 else "highest")


def _poison(v, seen, rng):
    """v with NaN at every key no row sees, and one key of each kind seen by some rows only:
    NaN in column 0, +inf in column 1, -inf in column 2 (the rows that see it must show it)."""
    v = v.copy()
    v[~seen.any(axis=0)] = np.nan
    partly = np.flatnonzero(seen.any(axis=0) & ~seen.all(axis=0))
    assert len(partly) >= 3, "the case needs keys that only some rows see"
    picks = rng.choice(partly, 3, replace=False)
    for col, (j, bad) in enumerate(zip(picks, [np.nan, np.inf, -np.inf])):
        v[j, col] = bad
    return v


def _visible(lq, lk, *, causal=False, window=None, mask=None, kv_length=None):
    diag = np.arange(lq)[:, None] + lk - lq - np.arange(lk)[None, :]
    seen = np.ones((lq, lk), bool) if mask is None else mask.copy()
    if causal:
        seen &= diag >= 0
    if window is not None:
        seen &= (diag <= window[0]) & (-diag <= window[1])
    if kv_length is not None:
        seen &= np.arange(lk)[None, :] < kv_length
    return seen


MMA_CASES = ["options", "band", "strided"]


@needs_emulation
@pytest.mark.parametrize("dt", MMA_DTYPES)
@pytest.mark.parametrize("case", MMA_CASES)
def test_mma_non_finite_values_reach_only_the_rows_that_see_them(dt, case):
    dtype = MMA_DTYPES[dt]
    rng = np.random.default_rng(61)
    # 70 queries: two query tiles per warp where the table takes them (f16/bf16/tf32 at
    # D = 32), a query tail; 150 keys: several key tiles and a key tail; Dv = 8 pads to 16
    # (and keeps rows 16-byte aligned: cp.async, except in the strided case)
    lq, lk, d, dv = 70, 150, 32, 8
    q = rng.standard_normal((lq, d)).astype(dtype)
    k = rng.standard_normal((lk, d)).astype(dtype)
    v = rng.standard_normal((lk, dv))
    if case == "options":
        mask = rng.random((lq, lk)) < 0.6
        mask[:, 140:] = False                            # keys no row sees, in the last tile
        # scores within a few units of each other: no visible weight rounds to 0 in float16
        # (0 * inf would then be NaN, as in every float16 P·V)
        options = dict(mask=mask, bias=(0.5 * rng.standard_normal((lq, lk))).astype(q.dtype),
                       softcap=2.0, alibi_slopes=np.array(0.01, dtype))
        seen = _visible(lq, lk, mask=mask)
        oracle_options = dict(options)
    else:  # a causal band cut by kv_lengths: every row sees a different key range
        options = dict(causal=True, window=(40, None), kv_lengths=np.array(130))
        seen = _visible(lq, lk, causal=True, window=(40, np.inf), kv_length=130)
        oracle_options = dict(mask=seen)
    v = _poison(v, seen, rng).astype(dtype)
    if case == "strided":                                # element-wise loads (no cp.async)
        v = np.asfortranarray(v)
    out, lse, plan = run_mma(q, k, v, **options)
    assert plan.spec.cp_async == (case != "strided"), plan.spec.key
    ref_out, ref_lse = oracle(q, k, v, **oracle_options)
    # the poisoned columns are non-finite exactly in the rows that see their key
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref_out))
    np.testing.assert_array_equal(np.isinf(out), np.isinf(ref_out))
    assert np.isnan(out[:, 0]).any() and np.isinf(out[:, 1]).any() and np.isinf(out[:, 2]).any()
    assert np.isfinite(out[:, 3:]).all()
    check_mma(q, k, v, out, lse, oracle_options)


@needs_emulation
@pytest.mark.parametrize("dt", ["f16", "tf32", "f64"])
def test_mma_non_finite_values_with_split_keys(dt):
    # few queries against many keys: three key splits, each recomputing its own partial rows
    dtype = MMA_DTYPES[dt]
    rng = np.random.default_rng(62)
    lq, lk, d, dv = 3, 300, 16, 8
    q = rng.standard_normal((lq, d)).astype(dtype)
    k = rng.standard_normal((lk, d)).astype(dtype)
    mask = rng.random((lq, lk)) < 0.5
    mask[:, 100:200] = False                             # one split sees nothing at all
    v = _poison(rng.standard_normal((lk, dv)), mask, rng).astype(dtype)
    out, lse, plan = run_mma(q, k, v, n_splits=3, mask=mask)
    assert plan.n_splits == 3, plan
    ref_out, ref_lse = oracle(q, k, v, mask=mask)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref_out))
    np.testing.assert_array_equal(np.isinf(out), np.isinf(ref_out))
    assert np.isfinite(out[:, 3:]).all()
    check_mma(q, k, v, out, lse, dict(mask=mask))


# --------------------------------------------------------------------------------------------
# item 8 for the softmax family (kernels_cu/softmax.cu; engines/softmax.py on "numpy")

SOFTMAX_ENGINES = [
    "numpy",
    pytest.param("emulate", marks=needs_emulation),
]


SIGNS = [pytest.param(s, id=i) for s, i in [((1, 1), "pos"), ((-1, -1), "neg"), ((-1, 1), "mixed")]]


@pytest.mark.parametrize("backend", SOFTMAX_ENGINES)
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("signs", SIGNS)
def test_softmax_near_the_dtype_maximum(backend, dt, signs):
    dtype = DTYPES[dt]
    x = np.array([[signs[0] * BIG[dt], signs[1] * BIG[dt]]], dtype)
    with np.errstate(all="ignore"):
        x64 = x.astype(np.float64)
        m = x64.max()
        w = np.exp(x64 - m)
        ref_lse = m + np.log(w.sum())
    y = cuonline.softmax(x, backend=backend)
    ly = cuonline.log_softmax(x, backend=backend)
    lse = cuonline.logsumexp(x, backend=backend)
    np.testing.assert_allclose(y, (w / w.sum()).astype(dtype), rtol=1e-6)
    # (x - m) - log l: x - lse would round away log l at this magnitude
    np.testing.assert_allclose(ly, (x64 - m - np.log(w.sum())).astype(dtype), rtol=1e-6)
    np.testing.assert_allclose(lse, np.array([ref_lse], dtype), rtol=1e-6)
