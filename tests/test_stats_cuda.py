"""cuonline.attention_stats (issue 21) on the CUDA engine (kernels_cu/attention_stats.cu),
emulated on the CPU (and on a GPU where one exists), against the dense float64 weights of
tests/oracle.py: every statistic, every score option, ties, empty rows, tails, several query
and key tiles, the causal diagonal, determinism, the kernel's mutants and ThreadSanitizer.

Shapes are small: the emulation costs about 4 ms per (block x tile)."""

from __future__ import annotations

import numpy as np
import pytest
from mutants import mutant_sources
from oracle import reference_attention_stats
from support import (BFLOAT16, STATS_FIELDS, STATS_INDICES, check_races, check_stats,
                     cuda_backend_params, needs_emulation)

import cuonline
from cuonline.engines.target import overrides
from cuonline.kernels import families, stats_plan
from cuonline.kernels.launch import Launch
from cuonline.kernels.specs import STATS_MAX_TOP_K

pytestmark = pytest.mark.slow   # the fast tier (-m 'not slow') leaves it out

BACKENDS = cuda_backend_params()
FIELDS = STATS_FIELDS
INDICES = STATS_INDICES


def _get(x):
    return x.get() if hasattr(x, "get") else x


def _put(backend, x):
    if backend != "cupy" or not isinstance(x, np.ndarray):
        return x
    import cupy  # noqa: PLC0415
    return cupy.asarray(x)


def _stats(backend, q, k, **options):
    """attention_stats on ``backend`` with NumPy data in and out (a dict of its fields)."""
    options = {n: _put(backend, x) for n, x in options.items()}
    st = cuonline.attention_stats(_put(backend, q), _put(backend, k), backend=backend, **options)
    return {n: None if getattr(st, n) is None else _get(getattr(st, n)) for n in FIELDS}


def _compare(got, ref, atol):
    """Every field against the oracle: indices exactly, -inf exactly where the oracle has it,
    the rest to ``atol`` (relative to 1 or the value's size for lse)."""
    for name in FIELDS:
        if got.get(name) is None:
            continue
        want = np.asarray(ref[name])
        assert got[name].shape == want.shape, name
        if name in INDICES:
            assert got[name].dtype == np.int64, name
            np.testing.assert_array_equal(got[name], want, err_msg=name)
            continue
        assert not np.isnan(got[name]).any(), name
        np.testing.assert_array_equal(np.isneginf(got[name]), np.isneginf(want), err_msg=name)
        finite = np.isfinite(want)
        scale = np.maximum(1.0, np.abs(want[finite])) if name == "lse" else 1.0
        err = np.abs(got[name][finite] - want[finite]) / scale
        assert float(err.max(initial=0.0)) <= atol, (name, float(err.max(initial=0.0)))


def _cases(rng, lq, lk):
    """name -> score options: each option alone, and the combinations that move the visible
    keys or where the terms meet (offsets with causal, the soft cap after a bias)."""
    bias, coarse = rng.standard_normal((lq, lk)), rng.standard_normal((-(-lq // 4), -(-lk // 5)))
    rel_q, rel_k = rng.standard_normal((lq, 3)), rng.standard_normal((9, 3))
    return {
        "plain": {},
        "scale": {"scale": 0.3},
        "causal": {"causal": True},
        "causal off the corner": {"causal": True, "q_offset": 30, "k_offset": 1},
        "window": {"window": (3, 2)},
        "bias": {"bias": bias},
        "mask": {"mask": rng.random((2, lq, lk)) > 0.4},
        "kv_lengths": {"kv_lengths": np.array([lk - 7, 3])},
        "alibi": {"alibi_slopes": np.array([0.25, 0.5]), "causal": True},
        "softcap": {"softcap": 2.0, "bias": bias},
        "softcap after bias": {"softcap": 2.0, "bias": bias, "softcap_bias": True},
        "bias_block": {"bias": coarse, "bias_block": (4, 5)},
        "rel_bias": {"rel_bias": rng.standard_normal(7), "k_offset": 4},
        "relative logits": {"rel_q": rel_q, "rel_k": rel_k},
        "everything": {"causal": True, "window": (20, None), "bias": bias,
                       "mask": rng.random((lq, lk)) > 0.2, "kv_lengths": np.array([lk, 30]),
                       "alibi_slopes": np.array(0.1), "softcap": 3.0,
                       "rel_bias": rng.standard_normal(11), "rel_q": rel_q, "rel_k": rel_k},
    }


LQ, LK = 37, 100           # ragged query tiles and two key tiles of 64 (the second ragged)
CASES = list(_cases(np.random.default_rng(0), LQ, LK))


# --------------------------------------------------------------------------------------------
# against the oracle


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES)
def test_every_option_against_the_dense_weights(backend, case):
    """float64, with every field; one SM so that the planner takes several rows per warp
    (query tiles of 16 rows: three, the last ragged; key blocks of 16 in the received pass)."""
    rng = np.random.default_rng(1)
    q, k = rng.standard_normal((2, LQ, 6)), rng.standard_normal((1, LK, 6))
    options = _cases(rng, LQ, LK)[case]
    weights = rng.random((2, LQ))
    weights[:, ::5] = 0                 # a zero weight adds nothing
    rows = np.array([0, LQ - 1, 3, 3, -2, 17])
    with overrides(num_sms=1):
        got = _stats(backend, q, k, **options, received=True, query_weights=weights, top_k=5,
                     rows=rows)
    ref = reference_attention_stats(q, k, **options, query_weights=weights, top_k=5,
                                    rows=rows % LQ)
    _compare(got, ref, atol=1e-12)
    assert got["lse"].dtype == np.float64
    # the same lse as attention's
    _, lse = cuonline.attention(q, k, np.zeros((1, LK, 1)), **options, return_lse=True)
    np.testing.assert_allclose(got["lse"], lse, rtol=1e-13, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lq, lk", [(1, 1), (1, 130), (17, 1), (65, 64), (129, 33)])
def test_lengths_that_are_not_tile_multiples(backend, lq, lk):
    """The default plan (one row per warp for such small grids) and the tails of both axes."""
    rng = np.random.default_rng(lq + lk)
    q, k = rng.standard_normal((lq, 8)), rng.standard_normal((lk, 8))
    got = _stats(backend, q, k, received=True, top_k=3, rows=[lq - 1, 0])
    _compare(got, reference_attention_stats(q, k, top_k=3, rows=[lq - 1, 0]), atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [np.float32, np.float16] + ([BFLOAT16] if BFLOAT16 else []),
                         ids=lambda d: np.dtype(d).name)
def test_lower_precision_inputs_accumulate_in_float32(backend, dtype):
    """Against the oracle on the same (rounded) inputs by the accuracy rule (the naive
    computation in float32, the accumulation dtype); indices where the scores are distinct
    enough for float32 accumulation to order them as the oracle does (moderate logits)."""
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 50, 16)).astype(dtype)
    k = rng.standard_normal((2, 90, 16)).astype(dtype)
    got = _stats(backend, q, k, causal=True, k_offset=40, received=True, top_k=4, rows=[5])
    check_stats(got, q, k, indices=False, causal=True, k_offset=40, top_k=4, rows=[5])
    ref = reference_attention_stats(q, k, causal=True, k_offset=40, top_k=4, rows=[5])
    # argmax and top keys: every disagreement is a near-tie in float32
    top = ref["top_weights"]
    near = np.abs(top[..., :-1] - top[..., 1:]) < 1e-5
    same = got["top_indices"] == ref["top_indices"]
    assert (same | np.concatenate([near, near[..., -1:]], axis=-1)).all()


# --------------------------------------------------------------------------------------------
# ties, empty rows, top_k


@pytest.mark.parametrize("backend", BACKENDS)
def test_ties_take_the_lower_key(backend):
    """Keys repeated (equal scores across tiles and lanes) and a zero query (every visible
    key tied): argmax and the top keys take the lower index first, as the oracle's stable
    sort."""
    rng = np.random.default_rng(4)
    base = rng.standard_normal((10, 8))
    k = np.concatenate([base, base[::-1], base, base[:5], base, base, base])[:70]  # 70 keys
    q = rng.standard_normal((2, 20, 8))
    q[:, 3] = 0.0
    for options in ({}, {"causal": True, "k_offset": 50}, {"window": (40, 3)}):
        got = _stats(backend, q, k, received=True, top_k=STATS_MAX_TOP_K, **options)
        ref = reference_attention_stats(q, k, top_k=STATS_MAX_TOP_K, **options)
        _compare(got, ref, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_rows(backend):
    """Rows that see no key (kv_lengths 0, a mask row of False, a window past the keys) give
    lse -inf, entropy 0, max weight 0, argmax -1, top keys -1 with weight 0 and zero rows of
    P, with no NaN; a row that sees fewer keys than top_k pads with -1 / 0."""
    rng = np.random.default_rng(5)
    q, k = rng.standard_normal((3, 24, 4)), rng.standard_normal((3, 40, 4))
    mask = rng.random((3, 24, 40)) > 0.5
    mask[1, 7] = False
    cases = [dict(kv_lengths=np.array([0, 40, 2])), dict(mask=mask),
             dict(window=(0, 0), q_offset=30),          # queries 10.. face no key
             dict(causal=True, q_offset=-5)]            # the first 5 queries see nothing
    for options in cases:
        got = _stats(backend, q, k, received=True, top_k=6, rows=np.arange(24), **options)
        ref = reference_attention_stats(q, k, top_k=6, rows=np.arange(24), **options)
        _compare(got, ref, atol=1e-12)
        empty = np.isneginf(ref["lse"])
        assert empty.any()
        assert (got["entropy"][empty] == 0).all() and (got["argmax"][empty] == -1).all()
        assert (got["top_indices"][empty] == -1).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_top_k_above_the_limit_is_refused(backend):
    q = np.zeros((4, 2))
    with pytest.raises(ValueError, match=r"`top_k` must be at most 32 on the CUDA engine.*"
                                         r"got 33.*backend='numpy'"):
        cuonline.attention_stats(_put(backend, q), _put(backend, q), top_k=33, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_without_entropy_top_k_or_keys(backend):
    rng = np.random.default_rng(6)
    q, k = rng.standard_normal((2, 9, 5)), rng.standard_normal((2, 11, 5))
    got = _stats(backend, q, k, entropy=False)
    assert got["entropy"] is None and got["top_indices"] is None and got["received"] is None
    _compare(got, reference_attention_stats(q, k), atol=1e-12)
    # no keys, no queries, a zero-width head
    for lq, lk, d in ((4, 0, 3), (0, 5, 3), (4, 5, 0)):
        q, k = rng.standard_normal((2, lq, d)), rng.standard_normal((2, lk, d))
        got = _stats(backend, q, k, received=True, top_k=2, rows=[0] if lq else None)
        _compare(got, reference_attention_stats(q, k, top_k=2, rows=[0] if lq else None),
                 atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_broadcast_batch_and_strided_views(backend):
    rng = np.random.default_rng(7)
    q = rng.standard_normal((2, 1, 30, 12))[..., ::2]       # strided columns
    k = rng.standard_normal((3, 45, 6)).transpose(0, 1, 2)[:, ::-1]   # reversed rows
    w = rng.random(30)
    got = _stats(backend, q, k, received=True, query_weights=w, top_k=3, rows=[2, 29])
    ref = reference_attention_stats(q, k, query_weights=w, top_k=3, rows=[2, 29])
    _compare(got, ref, atol=1e-12)
    assert got["lse"].shape == (2, 3, 30) and got["weights"].shape == (2, 3, 2, 45)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_numpy_and_cuda_engines_agree_and_runs_repeat(backend):
    rng = np.random.default_rng(8)
    q, k = rng.standard_normal((2, 70, 8)), rng.standard_normal((2, 150, 8))
    kw = dict(causal=True, k_offset=80, received=True, top_k=7, rows=[1, 69])
    with overrides(num_sms=1):
        a = _stats(backend, q, k, **kw)
        b = _stats(backend, q, k, **kw)
    for name in FIELDS:                 # bitwise: every sum in a fixed order
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    ref = cuonline.attention_stats(q, k, **kw)
    for name in INDICES:
        np.testing.assert_array_equal(a[name], getattr(ref, name), err_msg=name)
    for name in ("lse", "entropy", "received", "weights"):
        np.testing.assert_allclose(a[name], getattr(ref, name), rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_nan_query_stays_in_its_row(backend):
    """As on the NumPy engine: a NaN query row has NaN statistics (argmax -1, no top key) and
    its NaN reaches only the keys it sees in `received`; the other rows are untouched."""
    rng = np.random.default_rng(10)
    q, k = rng.standard_normal((1, 20, 4)), rng.standard_normal((1, 50, 4))
    q[0, 6, 1] = np.nan
    kw = dict(window=(5, 5), received=True, top_k=3, rows=[6, 7])
    got = _stats(backend, q, k, **kw)
    want = cuonline.attention_stats(q, k, **kw)
    for name in FIELDS:
        np.testing.assert_array_equal(np.isnan(got[name]), np.isnan(getattr(want, name)),
                                      err_msg=name)
        if name in INDICES:
            np.testing.assert_array_equal(got[name], getattr(want, name), err_msg=name)
        else:
            np.testing.assert_allclose(got[name], getattr(want, name), rtol=1e-12,
                                       atol=1e-13, err_msg=name)
    assert np.isnan(got["received"]).sum() == 11


# --------------------------------------------------------------------------------------------
# the plan, and kernels that must fail


def test_the_planner_takes_more_rows_for_larger_grids():
    p = _problem(np.zeros((4, 2048, 64), np.float32), np.zeros((4, 2048, 64), np.float32))
    big = stats_plan.plan_stats(p, Launch(top_k=4, num_sms=132))
    small = stats_plan.plan_stats(_problem(np.zeros((1, 40, 64)), np.zeros((1, 40, 64))), Launch())
    assert big.spec.block_m > small.spec.block_m and big.spec.top_k and not small.spec.top_k
    assert big.grid_stats[0] == 4 * -(-2048 // big.spec.block_m)
    assert big.spec.key.startswith("attention_stats_f32_d64_")
    assert families.of(big.spec) is families.get("attention_stats")


def _problem(q, k, **options):
    from cuonline import _options, _validate
    sp = _validate.validate_attention_stats(q, k, _options.Options(**options))
    return sp.scores


#: mutant name (tests/mutants.py) -> the score options of the case that catches it
STATS_MUTANTS = {
    "stats_entropy_not_rescaled": {"causal": True},
    "stats_argmax_last_tie": {},
    "stats_top_k_ties_later_key_first": {},
    "stats_received_ignores_weights": {},
}


@needs_emulation
@pytest.mark.parametrize("name", sorted(STATS_MUTANTS))
def test_mutants_are_caught(name):
    rng = np.random.default_rng(9)
    k = np.concatenate([rng.standard_normal((10, 8))] * 9)   # 90 keys: each score 9 times
    k[64:] *= 2.0                   # the maximum grows in the second key tile
    q = rng.standard_normal((2, 30, 8))
    q[:, 4] = 0                     # every visible key tied
    weights = rng.random((2, 30))
    options = STATS_MUTANTS[name]
    with overrides(kernel_sources=mutant_sources(name)):
        got = _stats("emulate", q, k, received=True, query_weights=weights, top_k=4, **options)
    ref = reference_attention_stats(q, k, query_weights=weights, top_k=4, **options)
    with pytest.raises(AssertionError):
        _compare(got, ref, atol=1e-12)


# 40 queries and 100 keys: three query tiles and two key tiles in each pass (one SM: several
# rows per warp), with the rel_q / rel_k staging, so that every loop crosses its barriers
_TSAN_SCRIPT = """
import numpy as np
import cuonline
from cuonline.engines.target import overrides
rng = np.random.default_rng(5)
q, k = rng.standard_normal((2, 40, 8)), rng.standard_normal((2, 100, 8))
terms = dict(rel_q=rng.standard_normal((40, 4)), rel_k=rng.standard_normal((9, 4)))
with overrides(num_sms=1, kernel_sources={sources!r},
               emulate_options=dict(mode="threads", tsan=True)):
    st = cuonline.attention_stats(q, k, backend="emulate", received=True, top_k=3,
                                  rows=[0, 39], **terms)
print("DONE", st.lse.shape)
"""


@needs_emulation   # runs the emulated kernels under TSan: slow, not in the fast tier
@pytest.mark.parametrize("broken", [False, True], ids=["correct", "barrier_removed"])
def test_thread_sanitizer(broken):
    """The real kernels race nowhere; without pass 1's barrier after the key tile's scores
    are read (the first one of its loop), the next tile's staging races with them."""
    sources = mutant_sources("stats_no_tile_sync") if broken else None
    check_races(_TSAN_SCRIPT.format(sources=sources), expect_race=broken)
