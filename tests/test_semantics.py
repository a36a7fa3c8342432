"""The contract of docs/semantics.md, checked once for every engine available here."""

from __future__ import annotations

import warnings

import numpy as np

import pytest
from oracle import naive_attention, reference_attention
from support import (ACCURACY_FACTOR, GRADIENT_CASES, OPTION_NAMES, check_attention,
                     check_gradients, gradient_case, make_case)

from cuonline._gradients import GRADIENT_FIELDS


def normal(rng, shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("name", OPTION_NAMES)
@pytest.mark.parametrize("lq, lk", [(33, 70), (70, 33)])
def test_each_option_alone_against_the_oracle(engine, name, lq, lk):
    q, k, v, opts = make_case(OPTION_NAMES.index(name) * 1000 + lq, batch=(3,), lq=lq, lk=lk,
                              options=(name,))
    opts.pop("return_lse", None)
    out, lse = engine.attention(q, k, v, return_lse=True, **opts)
    check_attention(q, k, v, out, lse, opts)


def test_fully_masked_rows_give_zero_and_minus_inf(engine, rng):
    q, k, v = (normal(rng, (2, 20, 8)) for _ in range(3))
    mask = np.ones((2, 20, 20), dtype=bool)
    mask[0, 3] = False                      # one row sees nothing
    mask[1] = False                         # a whole batch element sees nothing
    with warnings.catch_warnings():
        warnings.simplefilter("error")      # no RuntimeWarning allowed
        out, lse = engine.attention(q, k, v, mask=mask, return_lse=True)
    assert np.all(out[0, 3] == 0) and lse[0, 3] == -np.inf
    assert np.all(out[1] == 0) and np.all(lse[1] == -np.inf)
    assert np.all(np.isfinite(out[0, :3])) and np.all(np.isfinite(lse[0, 4:]))


def test_window_that_sees_nothing(engine, rng):
    # Lk < Lq with causal: the first Lq - Lk queries see no key at all (bottom-right alignment)
    q, k, v = normal(rng, (10, 4)), normal(rng, (4, 4)), normal(rng, (4, 4))
    out, lse = engine.attention(q, k, v, causal=True, return_lse=True)
    assert np.all(out[:6] == 0) and np.all(lse[:6] == -np.inf)
    assert np.all(np.isfinite(lse[6:]))
    check_attention(q, k, v, out, lse, dict(causal=True))


def test_causal_is_bottom_right_aligned(engine, rng):
    q, k, v = normal(rng, (3, 4)), normal(rng, (5, 4)), normal(rng, (5, 4))
    out = engine.attention(q, k, v, causal=True)
    # the last query sees every key; the first sees keys 0..2
    full = engine.attention(q[2:], k, v)
    first = engine.attention(q[:1], k[:3], v[:3])
    np.testing.assert_allclose(out[2:], full, atol=1e-6)
    np.testing.assert_allclose(out[:1], first, atol=1e-6)


def test_nan_in_a_query_row_stays_in_that_row(engine, rng):
    q, k, v = (normal(rng, (30, 8)) for _ in range(3))
    q[7, 2] = np.nan
    out, lse = engine.attention(q, k, v, return_lse=True)
    assert np.all(np.isnan(out[7])) and np.isnan(lse[7])
    rows = np.arange(30) != 7
    assert np.all(np.isfinite(out[rows])) and np.all(np.isfinite(lse[rows]))
    # and the other rows are the attention of the clean queries
    q[7] = 0
    check_attention(q[rows], k, v, out[rows], lse[rows], {})


def test_padding_past_kv_lengths_is_never_read(engine, rng):
    q = normal(rng, (3, 20, 8))
    k, v = normal(rng, (3, 50, 8)), normal(rng, (3, 50, 8))
    lengths = np.array([0, 17, 50])
    reference = engine.attention(q, k, v, kv_lengths=lengths)
    k[0], v[0] = np.nan, np.inf
    k[1, 17:], v[1, 17:] = np.nan, np.nan
    out, lse = engine.attention(q, k, v, kv_lengths=lengths, return_lse=True)
    np.testing.assert_array_equal(out, reference)
    assert np.all(out[0] == 0) and np.all(lse[0] == -np.inf)


def test_empty_lengths(engine, rng):
    q, k, v = normal(rng, (2, 5, 4)), normal(rng, (2, 0, 4)), normal(rng, (2, 0, 3))
    out, lse = engine.attention(q, k, v, return_lse=True)
    assert out.shape == (2, 5, 3) and np.all(out == 0) and np.all(lse == -np.inf)
    out, lse = engine.attention(normal(rng, (2, 0, 4)), normal(rng, (2, 6, 4)),
                                normal(rng, (2, 6, 3)), return_lse=True)
    assert out.shape == (2, 0, 3) and lse.shape == (2, 0)
    out, lse = engine.attention(normal(rng, (0, 5, 4)), normal(rng, (0, 6, 4)),
                                normal(rng, (0, 6, 3)), return_lse=True)
    assert out.shape == (0, 5, 3) and lse.shape == (0, 5)


def test_any_strides(engine, rng):
    base = normal(rng, (2, 40, 3, 16))
    q = base[:, ::-2, 1, :]                    # negative and non-unit strides
    k = np.swapaxes(normal(rng, (2, 16, 30)), -1, -2)    # transposed (Lk, D) view
    v = normal(rng, (30, 6))[None]             # zero-stride broadcast over the batch
    out = engine.attention(q, k, v)
    check_attention(q, k, v, out, None, {})


def test_huge_scores_do_not_overflow(engine, rng):
    # q·k around 1e4 in float32: exp would overflow without the running max
    q = normal(rng, (40, 16)) * 30
    k = normal(rng, (60, 16)) * 30
    v = normal(rng, (60, 8))
    out, lse = engine.attention(q, k, v, scale=1.0, return_lse=True)
    _, ref_lse = reference_attention(q, k, v, scale=1.0)
    assert np.all(np.isfinite(out)) and np.abs(ref_lse).max() > 1e3
    check_attention(q, k, v, out, lse, dict(scale=1.0))


def test_float16_error_within_twice_naive(engine, rng):
    """16-bit accuracy: at most 2x the error of a naive float16 computation vs float64, here
    without the accuracy rule's floor (the contract docs/semantics.md states)."""
    q, k, v = (rng.standard_normal((4, 100, 64)).astype(np.float16) for _ in range(3))
    ref = reference_attention(q, k, v)[0]
    naive_error = np.abs(naive_attention(q, k, v, rounding=np.float16)[0] - ref).max()
    out, lse = engine.attention(q, k, v, return_lse=True)
    error = np.abs(out.astype(np.float64) - ref).max()
    assert error <= ACCURACY_FACTOR * naive_error, (error, naive_error)
    check_attention(q, k, v, out, lse, {})


def test_bias_broadcast_over_batch_and_queries(engine, rng):
    """A bias of shape (Lk,) applies to every batch element and query."""
    q, k, v = (normal(rng, (4, 32, 8)) for _ in range(3))
    row = normal(rng, (32,))
    out = engine.attention(q, k, v, bias=row)
    check_attention(q, k, v, out, None, dict(bias=row))


# --------------------------------------------------------------------------------------------
# gradients


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("name", sorted(GRADIENT_CASES))
def test_gradients_against_the_oracle(engine, name, dtype):
    """attention_backward of the engine's own forward: each gradient in the shape and dtype
    of its input as passed (summed over what the input was broadcast over), within the
    accuracy rule of the oracle's."""
    rng, q, k, v = gradient_case(dtype)
    options = GRADIENT_CASES[name](rng)
    out, lse = engine.attention(q, k, v, return_lse=True, **options)
    dout = rng.standard_normal(out.shape).astype(dtype)
    got = engine.attention_backward(dout, q, k, v, out, lse, **options)
    inputs = dict(options, q=q, k=k, v=v)
    for input_name, field in GRADIENT_FIELDS.items():
        x, g = inputs.get(input_name), got[field]
        assert x is None or (g.shape == x.shape and g.dtype == x.dtype), (field, g.shape, g.dtype)
    check_gradients(got, dout, q, k, v, options)
