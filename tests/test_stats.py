"""cuonline.attention_stats (issue 21) on the NumPy engine, against the dense float64 weights
of tests/oracle.py: every statistic, every score option and the combinations that move the
visible keys, empty rows, ties, small tiles (merged key ranges), workers, memory."""

from __future__ import annotations

import os
import subprocess
import sys
import tracemalloc
import warnings
from pathlib import Path

import numpy as np
import pytest
from oracle import reference_attention_stats
from support import STATS_FIELDS, check_stats

import cuonline
from cuonline.engines import numpy as numpy_engine
from cuonline.engines import numpy_stats

FIELDS = STATS_FIELDS


@pytest.fixture(params=["engine tiles", "small tiles", "small tiles, split keys"])
def tiles(request, monkeypatch):
    """The engine's tiles, or tiles small enough that every case crosses several query blocks
    and key tiles: one task walks them (RowState.update), or, with many cores, the key ranges
    are split into parts merged by RowState.merge."""
    if request.param != "engine tiles":
        monkeypatch.setattr(numpy_engine, "BLOCK_Q", 8)
        monkeypatch.setattr(numpy_engine, "BLOCK_K", 16)
        monkeypatch.setattr(numpy_engine, "MAX_KEY_TILE", 16)
        cores = 16 if "split" in request.param else 1
        monkeypatch.setattr(numpy_engine, "workers", lambda: cores)   # the plan's split
        monkeypatch.setattr(numpy_stats, "workers", lambda: cores)
    return request.param


def _compare(st, ref, rtol=1e-10, atol=1e-12):
    for name in FIELDS:
        got, want = getattr(st, name), ref[name]
        if got is None:
            continue
        assert got.shape == np.shape(want), name
        if name in ("argmax", "top_indices"):
            assert got.dtype == np.int64
            np.testing.assert_array_equal(got, want, err_msg=name)
        else:
            np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=name)


def _cases(rng, lq, lk):
    """name -> score options: each option alone, and the combinations that change which keys
    a query sees or where the terms meet (offsets with causal, the soft cap after a bias)."""
    bias, coarse = rng.standard_normal((lq, lk)), rng.standard_normal((-(-lq // 4), -(-lk // 5)))
    rel_q, rel_k = rng.standard_normal((lq, 3)), rng.standard_normal((9, 3))
    return {
        "plain": {},
        "scale": {"scale": 0.3},
        "causal": {"causal": True},
        "causal, Lk - Lq off the corner": {"causal": True, "q_offset": 3, "k_offset": 1},
        "window": {"window": (3, 2)},
        "window and causal": {"window": (5, None), "causal": True},
        "bias": {"bias": bias},
        "bias broadcast over rows": {"bias": rng.standard_normal((2, 1, lk))},
        "mask": {"mask": rng.random((2, lq, lk)) > 0.4},
        "kv_lengths": {"kv_lengths": np.array([lk - 7, 3])},
        "alibi": {"alibi_slopes": np.array([0.25, 0.5]), "causal": True},
        "softcap": {"softcap": 2.0, "bias": bias},
        "softcap after bias": {"softcap": 2.0, "bias": bias, "softcap_bias": True},
        "bias_block": {"bias": coarse, "bias_block": (4, 5)},
        "rel_bias": {"rel_bias": rng.standard_normal(2 * (lq + lk) + 1)},
        "rel_bias clamped": {"rel_bias": rng.standard_normal(7), "k_offset": 4},
        "relative logits": {"rel_q": rel_q, "rel_k": rel_k},
        "everything": {"causal": True, "window": (20, None), "bias": bias,
                       "mask": rng.random((lq, lk)) > 0.2, "kv_lengths": np.array([lk, 30]),
                       "alibi_slopes": np.array(0.1), "softcap": 3.0,
                       "rel_bias": rng.standard_normal(11), "rel_q": rel_q, "rel_k": rel_k},
    }


CASES = list(_cases(np.random.default_rng(0), 37, 45))


@pytest.mark.parametrize("case", CASES)
def test_every_option_against_the_dense_weights(rng, tiles, case):
    lq, lk = 37, 45
    q, k = rng.standard_normal((2, lq, 6)), rng.standard_normal((1, lk, 6))
    options = _cases(rng, lq, lk)[case]
    weights = rng.random((2, lq))
    rows = np.array([0, lq - 1, 3, 3, -2, 17])
    st = cuonline.attention_stats(q, k, **options, received=True, query_weights=weights,
                                  top_k=5, rows=rows)
    ref = reference_attention_stats(q, k, **options, query_weights=weights, top_k=5,
                                    rows=rows % lq)
    _compare(st, ref)
    assert st.lse.dtype == np.float64
    # the lse of the statistics is attention's
    v = rng.standard_normal((1, lk, 2))
    _, lse = cuonline.attention(q, k, v, **options, return_lse=True)
    np.testing.assert_allclose(st.lse, lse, rtol=1e-12, atol=0)


@pytest.mark.parametrize("lq, lk", [(1, 1), (1, 700), (17, 1), (63, 64), (129, 65)])
def test_lengths_that_are_not_tile_multiples(rng, lq, lk):
    q, k = rng.standard_normal((lq, 8)), rng.standard_normal((lk, 8))
    st = cuonline.attention_stats(q, k, received=True, top_k=3, rows=[lq - 1])
    _compare(st, reference_attention_stats(q, k, top_k=3, rows=[lq - 1]))


def test_float32_inputs_accumulate_in_float32(rng):
    q, k = rng.standard_normal((3, 50, 16)), rng.standard_normal((3, 70, 16))
    st = cuonline.attention_stats(q.astype(np.float32), k.astype(np.float32), causal=True,
                                  received=True, top_k=4, rows=[5])
    check_stats(st, q.astype(np.float32), k.astype(np.float32), causal=True, top_k=4,
                rows=[5])


def test_queries_that_see_no_key(rng, tiles):
    """lse -inf, entropy 0, max weight 0, argmax -1, top keys -1 / 0, a zero row, no NaN and
    no warning: a batch element with kv_lengths 0, and rows the window leaves keyless."""
    q, k = rng.standard_normal((2, 20, 4)), rng.standard_normal((2, 30, 4))
    options = dict(kv_lengths=np.array([0, 30]), window=(0, 0), q_offset=15, k_offset=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        st = cuonline.attention_stats(q, k, **options, received=True, top_k=3,
                                      rows=np.arange(20))
    empty = np.zeros((2, 20), dtype=bool)
    empty[0] = True
    empty[1, 15:] = True                      # query i at 15 + i faces key 15 + i >= 30
    assert np.array_equal(st.lse == -np.inf, empty)
    assert (st.entropy[empty] == 0).all() and (st.max_weight[empty] == 0).all()
    assert (st.argmax[empty] == -1).all() and (st.top_indices[empty] == -1).all()
    assert (st.top_weights[empty] == 0).all() and (st.weights[empty] == 0).all()
    assert (st.received[0] == 0).all()
    for name in FIELDS:
        assert not np.isnan(getattr(st, name)).any(), name
    # a query that sees one key: weight 1, entropy 0, then fewer keys than top_k
    seen = ~empty
    assert np.allclose(st.max_weight[seen], 1) and np.allclose(st.entropy[seen], 0)
    assert (st.top_indices[seen][:, 1:] == -1).all()
    _compare(st, reference_attention_stats(q, k, **options, top_k=3, rows=np.arange(20)))


def test_ties_go_to_the_lowest_key(tiles):
    """Equal scores across tiles and within them: argmax and the top keys take the lower
    index first, and top_k beyond the visible keys pads with -1 / 0."""
    lk = 40
    k = np.zeros((lk, 2))
    k[[3, 21, 33], 0] = 1.0                   # three keys tie for the largest score
    k[[5, 30], 0] = 0.5
    q = np.tile([[1.0, 0.0]], (9, 1))
    st = cuonline.attention_stats(q, k, top_k=lk + 3, mask=np.arange(lk) != 3)
    assert (st.argmax == 21).all()
    top = st.top_indices[0]
    assert list(top[:4]) == [21, 33, 5, 30]
    rest = [j for j in range(lk) if j not in (3, 5, 21, 30, 33)]
    assert list(top[4:lk - 1]) == rest and list(top[lk - 1:]) == [-1] * 4
    assert st.top_weights[0, 0] == st.top_weights[0, 1] and (st.top_weights[0, lk - 1:] == 0).all()
    _compare(st, reference_attention_stats(q, k, top_k=lk + 3, mask=np.arange(lk) != 3))


def test_received_is_deterministic_for_every_workers(rng):
    q, k = rng.standard_normal((2, 700, 8)), rng.standard_normal((2, 1100, 8))
    w = rng.random(700)
    runs = [cuonline.attention_stats(q, k, causal=True, received=True, query_weights=w,
                                     top_k=2, workers=n) for n in (1, 2, 3)]
    for st in runs[1:]:
        for name in FIELDS:
            a, b = getattr(runs[0], name), getattr(st, name)
            assert (a is None and b is None) or np.array_equal(a, b), name


def test_without_entropy_the_rest_is_the_same(rng, tiles):
    q, k = rng.standard_normal((2, 40, 4)), rng.standard_normal((2, 50, 4))
    options = dict(causal=True, mask=rng.random((40, 50)) > 0.3, received=True, top_k=3,
                   rows=[0, 39])
    full = cuonline.attention_stats(q, k, **options)
    lean = cuonline.attention_stats(q, k, entropy=False, **options)
    assert lean.entropy is None
    for name in FIELDS:
        if name != "entropy":
            np.testing.assert_allclose(getattr(lean, name), getattr(full, name), rtol=1e-13,
                                       err_msg=name)


def test_received_without_weights_sums_every_query(rng):
    q, k = rng.standard_normal((30, 4)), rng.standard_normal((50, 4))
    st = cuonline.attention_stats(q, k, received=True, entropy=False)
    assert st.entropy is None and st.top_indices is None and st.weights is None
    np.testing.assert_allclose(st.received.sum(), 30)
    promoter = np.zeros(30)
    promoter[10:14] = 1
    part = cuonline.attention_stats(q, k, received=True, query_weights=promoter)
    np.testing.assert_allclose(part.received.sum(), 4)


def test_a_nan_query_reaches_only_what_it_weighs(rng, tiles):
    """A query whose scores are NaN has NaN statistics; with weight 0 it adds nothing to
    `received`, and its NaN reaches no key it cannot see."""
    q, k = rng.standard_normal((20, 4)), rng.standard_normal((30, 4))
    q[7, 0] = np.nan
    w = np.ones(20)
    w[7] = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        st = cuonline.attention_stats(q, k, received=True, query_weights=w, rows=[7])
    assert np.isnan(st.lse[7]) and np.isnan(st.entropy[7]) and np.isnan(st.weights).all()
    assert not np.isnan(np.delete(st.lse, 7)).any() and not np.isnan(st.received).any()
    causal = cuonline.attention_stats(q, k, causal=True, received=True, rows=[7])
    visible = np.arange(30) <= 7 + 10
    assert np.isnan(causal.received[visible]).all()
    assert not np.isnan(causal.received[~visible]).any()
    assert (causal.weights[0, ~visible] == 0).all()


def test_memory_is_tiles_not_the_weight_matrix():
    """256 queries x 65536 keys: P would be 128 MiB; every statistic, received and two rows
    stay within a few tiles plus the results."""
    rng = np.random.default_rng(1)
    q, k = rng.standard_normal((256, 16)), rng.standard_normal((65536, 16))
    tracemalloc.start()
    try:
        st = cuonline.attention_stats(q, k, received=True, top_k=4, rows=[0, 255], workers=2)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    results = sum(getattr(st, n).nbytes for n in FIELDS if getattr(st, n) is not None)
    assert peak - results < 24 << 20, f"peak {peak / 2**20:.1f} MiB"


BAD = [
    (dict(top_k=-1), ValueError, r"`top_k` must be >= 0, got -1"),
    (dict(top_k=2.0), TypeError, r"`top_k` must be an int >= 0, got float 2.0"),
    (dict(top_k=True), TypeError, r"`top_k` must be an int"),
    (dict(entropy=1), TypeError, r"`entropy` must be True or False, got 1"),
    (dict(received="yes"), TypeError, r"`received` must be True or False"),
    (dict(query_weights=np.ones(7)), ValueError, r"`query_weights`.*received=False"),
    (dict(received=True, query_weights=np.ones(7)), ValueError,
     r"`query_weights` of shape \(7,\) does not broadcast to S \+ \(Lq,\) = \(2, 5\)"),
    (dict(received=True, query_weights=np.ones(5, dtype=complex)), TypeError,
     r"`query_weights` must be a real array.*complex128"),
    (dict(received=True, query_weights=np.array([1, np.nan, 0, 0, 0])), ValueError,
     r"`query_weights` must be finite"),
    (dict(rows=[[0]]), ValueError, r"`rows` must be 1-D \(query indices\), got shape \(1, 1\)"),
    (dict(rows=[0.5]), TypeError, r"`rows` must be an integer array.*float64"),
    (dict(rows=[5]), ValueError, r"`rows` must hold query indices in \[-Lq, Lq\) = \[-5, 5\), "
                                 r"got 5"),
    (dict(rows=[-6]), ValueError, r"got -6"),
    (dict(causal=1), TypeError, r"`causal` must be True or False"),
    (dict(backend="emulate", top_k=33), ValueError,
     r"`top_k` must be at most 32 on the CUDA engine \(backend='emulate'.*got 33"),
    (dict(backend="cupy"), TypeError, r"backend='cupy' takes cupy arrays"),
    (dict(workers=0), ValueError, r"`workers` must be a positive int"),
]


@pytest.mark.parametrize("keywords, error, message", BAD, ids=[str(b[0]) for b in BAD])
def test_bad_arguments_name_themselves(keywords, error, message):
    q, k = np.zeros((2, 5, 4)), np.zeros((2, 6, 4))
    with pytest.raises(error, match=message):
        cuonline.attention_stats(q, k, **keywords)


def test_bad_arrays_are_attentions_errors():
    q = np.zeros((5, 4))
    with pytest.raises(TypeError, match=r"`q` and `k` must share one dtype, got float64 and "
                                        r"float32"):
        cuonline.attention_stats(q, q.astype(np.float32))
    with pytest.raises(ValueError, match=r"`k` must have at least 2 dimensions"):
        cuonline.attention_stats(q, np.zeros(4))
    with pytest.raises(ValueError, match=r"`k` must have the head dimension of `q`"):
        cuonline.attention_stats(q, np.zeros((6, 3)))
    with pytest.raises(TypeError, match="unexpected keyword argument 'v'"):
        cuonline.attention_stats(q, q, v=q)


@pytest.mark.parametrize("lq, lk, d", [(0, 5, 4), (5, 0, 4), (5, 6, 0), (0, 0, 3)])
def test_empty_sizes(rng, lq, lk, d):
    q, k = rng.standard_normal((2, lq, d)), rng.standard_normal((2, lk, d))
    rows = [] if lq == 0 else [0, -1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        st = cuonline.attention_stats(q, k, received=True, top_k=2, rows=rows)
    assert st.received.shape == (2, lk) and st.weights.shape == (2, len(rows), lk)
    local = np.array(rows, dtype=int) % max(lq, 1)
    _compare(st, reference_attention_stats(q, k, top_k=2, rows=local))


@pytest.mark.parametrize("dtype", [np.float16, "bfloat16"])
def test_broadcast_batch_and_16_bit_inputs(rng, dtype):
    ml_dtypes = pytest.importorskip("ml_dtypes") if dtype == "bfloat16" else None
    dtype = ml_dtypes.bfloat16 if ml_dtypes else dtype
    q = rng.standard_normal((2, 1, 30, 8)).astype(dtype)   # broadcast over 3 heads
    k = rng.standard_normal((1, 3, 41, 8)).astype(dtype)   # broadcast over 2 batch elements
    st = cuonline.attention_stats(q, k, causal=True, received=True, top_k=3, rows=[1, -1])
    assert st.lse.shape == (2, 3, 30) and st.lse.dtype == np.float32
    check_stats(st, q, k, causal=True, top_k=3, rows=[1, 29])


def test_read_only_inputs(rng, tmp_path):
    """Read-only arrays (a memory-mapped file, a broadcast view, a read-only copy) give the
    same bits as writable ones: nothing writes to an input."""
    q, k = rng.standard_normal((2, 30, 8)), rng.standard_normal((2, 40, 8))
    bias, w, rows = rng.standard_normal((30, 40)), rng.random(30), np.array([2, 7])
    path = tmp_path / "k.dat"
    k.tofile(path)
    frozen = [np.memmap(path, dtype=k.dtype, mode="r", shape=k.shape),
              np.broadcast_to(q[:1], q.shape)]
    for x in (bias, w, rows):
        x = x.copy()
        x.flags.writeable = False
        frozen.append(x)
    kq, qb = frozen[0], frozen[1]
    got = cuonline.attention_stats(qb, kq, bias=frozen[2], received=True,
                                   query_weights=frozen[3], rows=frozen[4], top_k=2)
    want = cuonline.attention_stats(np.array(qb), k, bias=bias, received=True,
                                    query_weights=w, rows=rows, top_k=2)
    for name in FIELDS:
        assert np.array_equal(getattr(got, name), getattr(want, name)), name


@pytest.mark.slow
def test_benchmark_prints_its_table():
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, str(root / "benchmarks" / "bench_stats.py"),
                             "--quick"], capture_output=True, text=True, check=True, cwd=root,
                            env={**os.environ, "PYTHONPATH": str(root)})
    assert "| 256 |" in result.stdout and "memory: 64 queries x N=4096 keys" in result.stdout


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_framework_arrays_in_the_same_library_out(rng, framework):
    """torch tensors and JAX arrays go through attention's dispatch: statistics of their
    NumPy views, handed back in the caller's library."""
    lib = pytest.importorskip(framework)
    # float32: JAX holds float64 only with jax_enable_x64
    q, k = (rng.standard_normal((2, n, 4)).astype(np.float32) for n in (10, 12))
    w = rng.random(10).astype(np.float32)
    if framework == "torch":
        convert = lib.from_numpy
        back = lambda x: x.numpy()    # noqa: E731
    else:
        convert = pytest.importorskip("jax.numpy").asarray
        back = np.asarray
    st = cuonline.attention_stats(convert(q), convert(k), received=True,
                                  query_weights=convert(w), top_k=2, rows=[1, 3])
    want = cuonline.attention_stats(q, k, received=True, query_weights=w, top_k=2,
                                    rows=[1, 3])
    for name in FIELDS:
        got = getattr(st, name)
        assert type(got).__module__.split(".")[0] in (framework, "jaxlib"), name
        np.testing.assert_array_equal(back(got), getattr(want, name), err_msg=name)
