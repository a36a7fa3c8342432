"""Algebraic properties of attention and merge, with hypothesis choosing shapes and splits."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import cuonline

SETTINGS = settings(max_examples=40, deadline=None)

shapes = st.tuples(
    st.integers(1, 3),      # batch
    st.integers(1, 40),     # Lq
    st.integers(1, 70),     # Lk
    st.integers(1, 9),      # D
    st.integers(1, 9),      # Dv
)


def draw_data(seed, b, lq, lk, d, dv):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((b, lq, d)), rng.standard_normal((b, lk, d)),
            rng.standard_normal((b, lk, dv)), rng)


@SETTINGS
@given(shapes, st.integers(0, 2**32 - 1), st.floats(-50, 50))
def test_constant_added_to_a_querys_scores_changes_nothing(shape, seed, c):
    q, k, v, _ = draw_data(seed, *shape)
    b, lq = shape[:2]
    row_constant = np.full((b, lq, 1), c)          # bias constant along the keys of each row
    out, base = cuonline.attention(q, k, v, return_lse=True)
    shifted, lse = cuonline.attention(q, k, v, bias=row_constant, return_lse=True)
    np.testing.assert_allclose(shifted, out, atol=1e-12)
    np.testing.assert_allclose(lse, base + c, atol=1e-10)


@SETTINGS
@given(shapes, st.integers(0, 2**32 - 1), st.booleans())
def test_permuting_keys_with_values_changes_nothing(shape, seed, use_mask):
    q, k, v, rng = draw_data(seed, *shape)
    b, lq, lk = shape[:3]
    mask = rng.random((b, lq, lk)) < 0.6 if use_mask else None
    perm = rng.permutation(lk)
    out, lse = cuonline.attention(q, k, v, mask=mask, return_lse=True)
    permuted_mask = None if mask is None else mask[..., perm]
    out_p, lse_p = cuonline.attention(q, k[:, perm], v[:, perm], mask=permuted_mask,
                                      return_lse=True)
    np.testing.assert_allclose(out_p, out, atol=1e-12)
    np.testing.assert_allclose(lse_p, lse, atol=1e-12)


@SETTINGS
@given(shapes, st.integers(0, 2**32 - 1), st.lists(st.integers(0, 70), max_size=4),
       st.booleans())
def test_merge_of_chunks_equals_attention_over_all_keys(shape, seed, cuts, causal):
    q, k, v, _ = draw_data(seed, *shape)
    lk = shape[2]
    bounds = sorted({0, lk, *(c for c in cuts if c <= lk)})
    mask = np.tril(np.ones((shape[1], lk), bool), lk - shape[1]) if causal else None
    states = [cuonline.attention(q, k[:, a:e], v[:, a:e], return_lse=True,
                                 mask=None if mask is None else mask[:, a:e])
              for a, e in zip(bounds, bounds[1:])]
    out, lse = cuonline.merge(*states)
    want_out, want_lse = cuonline.attention(q, k, v, causal=causal, return_lse=True)
    np.testing.assert_allclose(out, want_out, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, atol=1e-12)


@SETTINGS
@given(st.integers(0, 2**32 - 1), st.integers(2, 5), st.data())
def test_merge_is_associative_and_order_independent(seed, n, data):
    rng = np.random.default_rng(seed)
    states = []
    for _ in range(n):
        lse = rng.normal(size=(3, 7)) * 5
        lse[rng.random((3, 7)) < 0.2] = -np.inf              # empty states among them
        states.append((rng.standard_normal((3, 7, 4)), lse))
    whole = cuonline.merge(*states)
    order = data.draw(st.permutations(range(n)))
    shuffled = cuonline.merge(*(states[i] for i in order))
    split = data.draw(st.integers(1, n - 1))
    nested = cuonline.merge(cuonline.merge(*states[:split]), cuonline.merge(*states[split:]))
    for other in (shuffled, nested):
        np.testing.assert_allclose(other[0], whole[0], atol=1e-12)
        np.testing.assert_allclose(other[1], whole[1], atol=1e-12)
