"""Positions (``q_offset``, ``k_offset``) and the soft cap of the whole logit (``softcap_bias``).

Every engine against the float64 oracle (tests/oracle.py builds each term densely, in the order
of docs/semantics.md): the NumPy engine, and the CUDA kernels of both families through the
emulation (the family forced through ``overrides(family=...)``) and, marked ``gpu``, on CuPy.
Then chunkings of queries and keys, each chunk called with its own offsets and merged with
``merge``, against the unchunked call; huge offsets; bad input; the NVRTC listing.
"""

from __future__ import annotations

import numpy as np
import pytest
from mutants import mutant_sources
from oracle import reference_attention
from support import (MUTANT_MARGIN, attention_error_ratio, check_attention, needs_emulation,
                     needs_gpu)

import cuonline
from cuonline._validate import validate_attention
from cuonline.engines.target import overrides
from cuonline.kernels import families
from cuonline.kernels.launch import Launch

# (engine, forced family, dtype): float64 on NumPy (tight), the SIMT kernel in float32, the
# tensor-core kernel in float16 (its D = 32 tiles, one warp).
PLACES = [
    pytest.param(("numpy", None, np.float64), id="numpy"),
    pytest.param(("emulate", "attention_fwd_simt", np.float32), id="emulate-simt",
                 marks=needs_emulation),
    pytest.param(("emulate", "attention_fwd_mma", np.float16), id="emulate-mma",
                 marks=needs_emulation),
    pytest.param(("cupy", "attention_fwd_simt", np.float32), id="cupy-simt",
                 marks=[pytest.mark.gpu, needs_gpu]),
    pytest.param(("cupy", "attention_fwd_mma", np.float16), id="cupy-mma",
                 marks=[pytest.mark.gpu, needs_gpu]),
]
ARRAYS = ("bias", "mask", "kv_lengths", "alibi_slopes")


def run(place, q, k, v, **options):
    """``attention`` at ``place`` on NumPy inputs; ``(out, lse)`` as NumPy arrays."""
    backend, family, _ = place
    xp = np
    if backend == "cupy":
        import cupy as xp  # noqa: PLC0415
    options = {n: (xp.asarray(x) if n in ARRAYS and x is not None else x)
               for n, x in options.items()}
    with overrides(family=family):
        out, lse = cuonline.attention(xp.asarray(q), xp.asarray(k), xp.asarray(v),
                                      backend="auto" if backend == "numpy" else backend,
                                      return_lse=True, **options)
    if xp is not np:
        out, lse = out.get(), lse.get()
    return out, lse


def inputs(place, seed, *, batch=(2,), lq=23, lk=41, d=32, dv=24):
    rng = np.random.default_rng(seed)
    dtype = place[2]
    q, k, v = (rng.standard_normal(batch + (n, e)).astype(dtype)
               for n, e in ((lq, d), (lk, d), (lk, dv)))
    return rng, q, k, v


def option_values(rng, names, batch, lq, lk):
    opts = {}
    for name in names:
        if name == "offsets":
            opts.update(q_offset=5, k_offset=-9)       # the diagonal at 14, not Lk - Lq
        elif name == "causal":
            opts["causal"] = True
        elif name == "window":
            opts["window"] = (6, 3)
        elif name == "alibi":
            opts["alibi_slopes"] = rng.uniform(0.05, 0.5, size=batch)
        elif name == "bias":
            opts["bias"] = rng.standard_normal((lq, lk)).astype(np.float32)
        elif name == "mask":
            m = rng.random((lq, lk)) < 0.8
            m[1] = False                                # a row that sees nothing
            opts["mask"] = m
        elif name == "kv_lengths":
            opts["kv_lengths"] = np.array([lk - 7, 0])[: batch[0]]
        elif name == "softcap_bias":
            opts.update(softcap=1.5, softcap_bias=True)
        else:
            raise ValueError(name)
    return opts


def check(place, q, k, v, options):
    """``attention`` at ``place`` against the oracle, by the one accuracy rule."""
    out, lse = run(place, q, k, v, **options)
    check_attention(q, k, v, out, lse, options)


# --------------------------------------------------------------------------------------------
# the oracle itself: offsets are positions, the order of terms is the documented one


def test_oracle_default_offsets_are_bottom_right_and_only_their_difference_matters():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((n, 4)) for n in (5, 9, 9))
    base = reference_attention(q, k, v, causal=True, alibi_slopes=0.3)
    same = reference_attention(q, k, v, causal=True, alibi_slopes=0.3, q_offset=104,
                               k_offset=100)
    np.testing.assert_array_equal(base[0], same[0])
    np.testing.assert_array_equal(base[1], same[1])
    # q_offset=0: top-left alignment, query 0 sees key 0 only
    out, _ = reference_attention(q, k, v, causal=True, q_offset=0)
    np.testing.assert_allclose(out[0], v[0])


def test_oracle_caps_after_the_bias_with_softcap_bias():
    q, k, v = np.zeros((1, 2)), np.zeros((2, 2)), np.eye(2)
    bias = np.array([[4.0, -np.inf]])
    _, before = reference_attention(q, k, v, bias=bias, softcap=2.0)
    _, after = reference_attention(q, k, v, bias=bias, softcap=2.0, softcap_bias=True)
    assert before[0] == pytest.approx(4.0)                       # tanh(0) + 4; -inf masked
    assert after[0] == pytest.approx(np.logaddexp(2 * np.tanh(2.0), -2.0))


# --------------------------------------------------------------------------------------------
# every new option alone and with the others, on every engine


COMBOS = [
    ("offsets",),
    ("offsets", "causal"),
    ("offsets", "window"),
    ("offsets", "alibi"),
    ("offsets", "bias", "mask", "kv_lengths"),
    ("softcap_bias", "bias"),
    ("softcap_bias", "alibi"),
    ("softcap_bias", "bias", "causal", "mask", "kv_lengths"),
    ("offsets", "softcap_bias", "causal", "window", "alibi", "bias", "mask", "kv_lengths"),
]


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("names", COMBOS, ids=["-".join(c) for c in COMBOS])
def test_new_options_against_the_oracle(place, names):
    rng, q, k, v = inputs(place, len(names) * 31 + len(names[0]))
    check(place, q, k, v, option_values(rng, names, (2,), 23, 41))


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("q_offset, k_offset", [(0, 0), (-30, 12), (60, -3), (None, 17)])
def test_causal_and_window_follow_the_offsets(place, q_offset, k_offset):
    # more queries than keys and the other way round; bands entirely before or after the keys
    for lq, lk in ((23, 41), (41, 23)):
        rng, q, k, v = inputs(place, lq + 3 * lk, lq=lq, lk=lk)
        opts = dict(causal=True, window=(9, None), q_offset=q_offset, k_offset=k_offset)
        check(place, q, k, v, opts)


@pytest.mark.parametrize("place", PLACES)
def test_default_offsets_are_the_explicit_bottom_right_ones(place):
    rng, q, k, v = inputs(place, 5)
    opts = dict(causal=True, alibi_slopes=np.array([0.2, 0.4]))
    out, lse = run(place, q, k, v, **opts)
    out2, lse2 = run(place, q, k, v, q_offset=41 - 23 + 100, k_offset=100, **opts)
    np.testing.assert_array_equal(out, out2)
    np.testing.assert_array_equal(lse, lse2)


# --------------------------------------------------------------------------------------------
# chunks: each with its own offsets, merged, give the unchunked call


def _cuts(rng, n, pieces, least=1):
    """``pieces`` random consecutive ranges covering ``[0, n)``, each of ``least`` or more."""
    while True:
        inner = np.sort(rng.choice(np.arange(1, n), size=pieces - 1, replace=False))
        edges = [0, *map(int, inner), n]
        if min(b - a for a, b in zip(edges[:-1], edges[1:])) >= least:
            return list(zip(edges[:-1], edges[1:]))


TERMS = {
    "causal": dict(causal=True),
    "window": dict(window=(7, 5)),
    "alibi": dict(alibi_slopes=np.array([0.3, 0.1])),
    "causal-window-alibi": dict(causal=True, window=(11, None),
                                alibi_slopes=np.array([0.3, 0.1])),
}


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("terms", sorted(TERMS))
def test_random_chunkings_merge_to_the_unchunked_call(place, terms):
    # emulated: query chunks of 17 rows or more keep the SIMT kernel's tiles (few variants)
    lq, lk, least = (90, 130, 1) if place[0] == "numpy" else (60, 53, 17)
    rng, q, k, v = inputs(place, 11, lq=lq, lk=lk)
    opts = TERMS[terms]
    whole_out, whole_lse = run(place, q, k, v, **opts)
    # the unchunked call is right, and the merged chunks are as accurate as it is
    check_attention(q, k, v, whole_out, whole_lse, opts)
    for trial in range(2):
        outs, lses = [], []
        for i0, i1 in _cuts(rng, lq, 2 + trial, least):
            states = [run(place, q[:, i0:i1], k[:, j0:j1], v[:, j0:j1], q_offset=lk - lq + i0,
                          k_offset=j0, **opts)
                      for j0, j1 in _cuts(rng, lk, 2 + trial)]
            out, lse = cuonline.merge(*states)
            outs.append(out)
            lses.append(lse)
        out, lse = np.concatenate(outs, axis=1), np.concatenate(lses, axis=1)
        check_attention(q, k, v, out, lse, opts)


def test_chunked_keys_with_causal_were_wrong_without_offsets():
    # the bug that motivated the offsets (issue 12): each chunk aligned its own diagonal
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((40, 8)) for _ in range(3))
    whole = cuonline.attention(q, k, v, causal=True)
    naive = cuonline.merge(*(cuonline.attention(q, k[a:b], v[a:b], causal=True,
                                                return_lse=True) for a, b in ((0, 20), (20, 40))))
    fixed = cuonline.merge(*(cuonline.attention(q, k[a:b], v[a:b], causal=True, q_offset=0,
                                                k_offset=a, return_lse=True)
                             for a, b in ((0, 20), (20, 40))))
    assert np.max(np.abs(naive[0] - whole)) > 0.1
    np.testing.assert_allclose(fixed[0], whole, atol=1e-12)


@pytest.mark.parametrize("place", [p for p in PLACES if p.id.startswith("emulate")])
@pytest.mark.parametrize("mutant, names", [
    ("diagonal_from_lengths", ("offsets", "causal")),
    ("diagonal_from_lengths", ("offsets", "alibi")),
    ("softcap_before_bias", ("softcap_bias", "bias")),
    ("softcap_before_bias", ("softcap_bias", "alibi")),
])
def test_mutants_of_the_new_terms_fail_the_oracle(place, mutant, names):
    rng, q, k, v = inputs(place, 21)
    opts = option_values(rng, names, (2,), 23, 41)
    with overrides(kernel_sources=mutant_sources(mutant)):
        out, lse = run(place, q, k, v, **opts)
    ratio = attention_error_ratio(q, k, v, out, None, opts)
    assert ratio > MUTANT_MARGIN, (mutant, ratio)
    check(place, q, k, v, opts)


# --------------------------------------------------------------------------------------------
# offsets of any size


@pytest.mark.parametrize("place", PLACES)
def test_huge_offsets_neither_overflow_nor_wrap(place):
    rng, q, k, v = inputs(place, 9)
    # queries far after the keys: causal sees every key, a bounded right side too
    for opts in (dict(causal=True, q_offset=2**70), dict(window=(None, 3), q_offset=2**63),
                 dict(window=(2**64, 0), q_offset=np.int64(2**62), k_offset=-(2**62))):
        out, lse = run(place, q, k, v, **opts)
        check_attention(q, k, v, out, lse, opts)
    # keys far after the queries, under causal or a bounded right side: nothing is seen
    for opts in (dict(causal=True, k_offset=2**70), dict(window=(None, 3), q_offset=-(2**80)),
                 dict(causal=True, q_offset=-(2**53) - 1000)):
        out, lse = run(place, q, k, v, **opts)
        assert np.all(out == 0) and np.all(lse == -np.inf)


@pytest.mark.parametrize("place", PLACES)
def test_large_offsets_keep_a_window_that_a_side_of_lq_plus_lk_would_lose(place):
    # queries at 10**6 + i, keys at j: the window's left side 10**6 + 5 still cuts keys off
    rng, q, k, v = inputs(place, 13)
    check(place, q, k, v, dict(window=(10**6 + 5, 0), q_offset=10**6, k_offset=0))
    check(place, q, k, v, dict(window=(10**6 - 20, 0), q_offset=10**6, k_offset=0))


def test_alibi_distances_are_exact_up_to_the_clamp():
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((2, n, 8)) for n in (6, 10, 10))
    slopes = np.array([1e-3, 2e-4])
    for q_offset in (10**6, -(10**7)):
        out, lse = cuonline.attention(q, k, v, alibi_slopes=slopes, q_offset=q_offset,
                                      return_lse=True)
        ref_out, ref_lse = reference_attention(q, k, v, alibi_slopes=slopes, q_offset=q_offset)
        np.testing.assert_allclose(out, ref_out, atol=1e-10)
        np.testing.assert_allclose(lse, ref_lse, rtol=1e-12)
    # beyond 2**53 the diagonal offset is clamped: the same result as at the bound
    at_bound = cuonline.attention(q, k, v, alibi_slopes=slopes, q_offset=2**53,
                                  return_lse=True)
    beyond = cuonline.attention(q, k, v, alibi_slopes=slopes, q_offset=2**90, return_lse=True)
    np.testing.assert_array_equal(at_bound[1], beyond[1])
    assert np.all(np.isfinite(beyond[1]))


# --------------------------------------------------------------------------------------------
# softcap_bias


@pytest.mark.parametrize("place", PLACES)
def test_softcap_bias_caps_an_infinite_bias_instead_of_masking(place):
    rng, q, k, v = inputs(place, 17)
    bias = rng.standard_normal((23, 41)).astype(np.float32) * 4
    bias[:, 5] = -np.inf
    bias[2, 7] = np.inf
    check(place, q, k, v, dict(bias=bias, softcap=2.0, softcap_bias=True))
    bias[2, 7] = 0.0                  # capped after the bias, +inf is the logit 2; else NaN
    check(place, q, k, v, dict(bias=bias, softcap=2.0))


def test_softcap_bias_without_bias_or_alibi_is_the_default_cap():
    q = np.zeros((2, 20, 8), np.float32)
    p = validate_attention(q, q, q, softcap=3.0, softcap_bias=True, backend="emulate")
    assert not p.softcap_bias
    assert "softcap_bias" not in families.plan_attention(p, Launch()).spec.key
    p = validate_attention(q, q, q, softcap=3.0, softcap_bias=True, backend="emulate",
                           bias=np.zeros((20, 20)))
    assert families.plan_attention(p, Launch()).spec.key.endswith("_softcap_softcap_bias")
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((30, 8)) for _ in range(3))
    np.testing.assert_allclose(cuonline.attention(q, k, v, softcap=3.0, softcap_bias=True),
                               cuonline.attention(q, k, v, softcap=3.0), atol=1e-14)


# --------------------------------------------------------------------------------------------
# bad input


q0 = np.zeros((4, 3))
BAD = [
    (dict(q_offset=1.5), TypeError, r"`q_offset` must be an int or None \(a position\), "
                                    r"got float 1.5"),
    (dict(q_offset="3"), TypeError, r"`q_offset` must be an int or None"),
    (dict(q_offset=True), TypeError, r"`q_offset` must be an int or None .* got bool True"),
    (dict(q_offset=np.array([1, 2])), TypeError, r"`q_offset` must be an int or None"),
    (dict(k_offset=None), TypeError, r"`k_offset` must be an int \(a position\), got NoneType"),
    (dict(k_offset=np.float64(2.0)), TypeError, r"`k_offset` must be an int"),
    (dict(k_offset=np.bool_(False)), TypeError, r"`k_offset` must be an int"),
    (dict(softcap_bias=True), ValueError, r"`softcap_bias=True` .* `softcap` is None"),
    (dict(softcap_bias=1), TypeError, r"`softcap_bias` must be True or False, got 1"),
]


@pytest.mark.parametrize("options, error, message", BAD,
                         ids=[", ".join(f"{n}={x!r}" for n, x in o.items()) for o, _, _ in BAD])
def test_bad_offsets_and_softcap_bias_name_the_argument(options, error, message):
    with pytest.raises(error, match=message):
        cuonline.attention(q0, q0, q0, **options)


def test_numpy_ints_are_offsets():
    rng = np.random.default_rng(8)
    q, k, v = (rng.standard_normal((n, 4)) for n in (5, 7, 7))
    a = cuonline.attention(q, k, v, causal=True, q_offset=np.int16(3), k_offset=np.uint8(1))
    b = cuonline.attention(q, k, v, causal=True, q_offset=3, k_offset=1)
    np.testing.assert_array_equal(a, b)


# --------------------------------------------------------------------------------------------
# the variants: softcap_bias is a row of the feature table, listed for both families


def test_softcap_bias_variants_are_listed_for_both_families():
    for arch in ("sm_90", "sm_80", "sm_75"):
        listed = {s.family for s in families.listing_specs(arch)
                  if s.family != "softmax" and s.has("softcap_bias")}
        expected = {"attention_fwd_simt"} | ({"attention_fwd_mma"} if arch != "sm_75" else set())
        expected |= {"attention_bwd_simt"}     # the backward family, listed on every arch
        expected |= {"attention_stats"}        # the statistics family, on every arch
        assert listed == expected, arch
    for spec in families.listing_specs("sm_90"):
        if spec.family != "softmax" and spec.has("softcap_bias"):
            assert spec.has("softcap")
