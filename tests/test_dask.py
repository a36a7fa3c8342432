"""Attention and merge on Dask arrays (cuonline/engines/dask.py).

Against the in-memory NumPy engine on random shapes, chunkings and options; the graph's shape
(tasks skipped where no query sees a key chunk, a fixed merge tree); validation on stand-ins;
merge of Dask states; a LocalCluster of two worker processes, one of them killed mid-way; and
keys and values streamed from a zarr store in bounded memory.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest
from oracle import reference_attention
from support import ROOT, needs_gpu

import cuonline

da = pytest.importorskip("dask.array")
import dask  # noqa: E402 - after the skip: dask is an extra

CHUNK = "cuonline-attention-chunk-"


def chunk_tasks(x) -> int:
    """The per-(query chunk, key chunk) tasks in the graph of ``x``."""
    return sum(1 for key in dict(x.__dask_graph__())
               if isinstance(key, tuple) and key[0].startswith(CHUNK))


def cuonline_tasks(x) -> int:
    """The tasks of ``x``'s graph that cuonline added (chunk calls, merges, outputs)."""
    return sum(1 for key in dict(x.__dask_graph__())
               if isinstance(key, tuple) and key[0].startswith("cuonline-"))


def tol(dtype):
    return {np.dtype(np.float64): 1e-12, np.dtype(np.float32): 2e-6}[np.dtype(dtype)]


def compute(result):
    """Compute a Dask array or a tuple of them; refuse anything else (an eager result)."""
    arrays = result if isinstance(result, tuple) else (result,)
    assert all(isinstance(x, da.Array) for x in arrays), [type(x) for x in arrays]
    got = dask.compute(*arrays)
    return got if isinstance(result, tuple) else got[0]


def check_same(dask_result, ref, dtype):
    """``dask_result`` (Dask arrays) computes to ``ref`` (NumPy): dtypes, -inf rows, values."""
    got = compute(dask_result)
    pairs = zip(got, ref) if isinstance(ref, tuple) else [(got, ref)]
    for g, r in pairs:
        assert isinstance(g, np.ndarray) and g.dtype == r.dtype and g.shape == r.shape
        assert np.array_equal(np.isneginf(g), np.isneginf(r))
        finite = np.isfinite(r)
        np.testing.assert_allclose(g[finite], r[finite], rtol=0, atol=tol(dtype) * 10)


def random_chunks(rng, n, style):
    """A chunking of an axis of length ``n``: one chunk, one element per chunk, or uneven."""
    if style == "single" or n <= 1:
        return (max(n, 1),) if n else (0,)
    if style == "ones":
        return (1,) * n
    cuts = sorted(set(rng.integers(1, n, size=rng.integers(1, min(n, 5) + 1)).tolist()))
    bounds = [0, *cuts, n]
    return tuple(b - a for a, b in zip(bounds, bounds[1:]))


def test_import_cuonline_does_not_import_dask():
    code = "import sys, cuonline; print('dask' in sys.modules, 'distributed' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout.split()
    assert out == ["False", "False"]


def test_the_result_is_lazy_and_dask():
    # a key chunk that raises when computed: building the graph reads no chunk
    k = da.from_array(np.ones((40, 8)), chunks=20).map_blocks(_raise_if_computed, dtype=float)
    q = da.ones((10, 8), chunks=5)
    out, lse = cuonline.attention(q, k, k, return_lse=True)
    assert type(out).__module__.startswith("dask.array") and out.shape == (10, 8)
    assert lse.shape == (10,) and lse.dtype == np.float64 and out.chunks == ((5, 5), (8,))
    with pytest.raises(RuntimeError, match="computed"):
        out.compute()


def _raise_if_computed(x):
    if x.size:
        raise RuntimeError("a chunk was computed")
    return x


OPTIONS = ("causal", "window", "bias", "mask", "kv_lengths", "alibi_slopes", "softcap",
           "softcap_bias", "offsets", "scale", "gqa")


def random_case(seed):
    """Random shapes, chunkings and options: ``(numpy inputs, options, dask inputs)``."""
    rng = np.random.default_rng(seed)
    dtype = [np.float32, np.float64][seed % 2]
    lq, lk = (int(n) for n in rng.integers(1, 40, size=2))
    d, dv = (int(n) for n in rng.integers(1, 12, size=2))
    batch = (2, 3)
    chosen = [o for o in OPTIONS if rng.random() < 0.4]
    kv_batch = (2, 1) if "gqa" in chosen else batch
    q = rng.standard_normal(batch + (lq, d)).astype(dtype)
    k = rng.standard_normal(kv_batch + (lk, d)).astype(dtype)
    v = rng.standard_normal(kv_batch + (lk, dv)).astype(dtype)
    opts = {}
    if "causal" in chosen:
        opts["causal"] = True
    if "window" in chosen:
        opts["window"] = (int(rng.integers(0, 12)), [None, 3][seed % 2])
    if "bias" in chosen or "softcap_bias" in chosen:
        opts["bias"] = rng.standard_normal((3, lq, lk))            # broadcast over dim 0
    if "mask" in chosen:
        opts["mask"] = rng.random((2, 1, lq, lk)) < 0.7
    if "kv_lengths" in chosen:
        opts["kv_lengths"] = rng.integers(0, lk + 3, size=batch)
    if "alibi_slopes" in chosen:
        opts["alibi_slopes"] = rng.uniform(0.1, 0.5, size=(3,))
    if "softcap" in chosen or "softcap_bias" in chosen:
        opts["softcap"] = 2.0
    if "softcap_bias" in chosen:
        opts["softcap_bias"] = True
    if "offsets" in chosen:
        opts["q_offset"], opts["k_offset"] = int(rng.integers(-20, 40)), int(rng.integers(-9, 9))
    if "scale" in chosen:
        opts["scale"] = np.float64(0.3)                          # a NumPy scalar is no array
    styles = ["uneven", "single", "ones"]
    qs, ks = styles[seed % 3], styles[(seed // 3) % 3]
    dq = da.from_array(q, chunks=((1, 1), random_chunks(rng, 3, "uneven"),
                                  random_chunks(rng, lq, qs), (d,)))
    dk = da.from_array(k, chunks=(1,) * (k.ndim - 2) + (random_chunks(rng, lk, ks), (d,)))
    # v chunked otherwise than k along the keys: the graph refines both
    dv_ = da.from_array(v, chunks=v.shape[:-2] + (random_chunks(rng, lk, "uneven"), (dv,)))
    dopts = dict(opts)
    for name in ("bias", "mask", "kv_lengths"):
        if name in opts and rng.random() < 0.7:
            x = opts[name]
            dopts[name] = da.from_array(x, chunks=tuple(random_chunks(rng, n, "uneven")
                                                        for n in x.shape))
    return (q, k, v), opts, (dq, dk, dv_), dopts


@pytest.mark.parametrize("seed", range(18))
def test_matches_the_numpy_engine(seed):
    (q, k, v), opts, (dq, dk, dv), dopts = random_case(seed)
    ref = cuonline.attention(q, k, v, return_lse=True, **opts)
    got = cuonline.attention(dq, dk, dv, return_lse=True, **dopts)
    check_same(got, ref, q.dtype)


@pytest.mark.parametrize("option", ["causal", "window", "bias", "mask", "kv_lengths",
                                    "alibi_slopes", "softcap", "softcap_bias", "offsets"])
def test_each_option_against_the_oracle(option):
    # one option at a time, one key per chunk and uneven query chunks, against the oracle
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((2, n, 8)) for n in (13, 11, 11))
    opts = {"causal": dict(causal=True), "window": dict(window=(3, 1)),
            "bias": dict(bias=rng.standard_normal((13, 11))),
            "mask": dict(mask=rng.random((2, 13, 11)) < 0.5),
            "kv_lengths": dict(kv_lengths=np.array([0, 7])),
            "alibi_slopes": dict(alibi_slopes=np.array([0.2, 0.4])),
            "softcap": dict(softcap=1.5),
            "softcap_bias": dict(softcap=1.5, softcap_bias=True,
                                 bias=rng.standard_normal((13, 11))),
            "offsets": dict(q_offset=30, k_offset=25, causal=True)}[option]
    dq = da.from_array(q, chunks=(1, (5, 8), 8))
    dk, dv = (da.from_array(x, chunks=(2, 1, 8)) for x in (k, v))
    out, lse = compute(cuonline.attention(dq, dk, dv, return_lse=True, **opts))
    ref_out, ref_lse = reference_attention(q, k, v, **opts)
    np.testing.assert_allclose(out, ref_out, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], atol=1e-12)


def test_rows_that_see_no_key_give_zero_and_minus_inf():
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((16, 4)) for _ in range(3))
    mask = np.ones((16, 16), bool)
    mask[3] = False                            # row 3 sees nothing; rows 0-1 see only chunk 0
    mask[:2, 4:] = False
    dq, dk, dv = (da.from_array(x, chunks=(4, 4)) for x in (q, k, v))
    out, lse = compute(cuonline.attention(dq, dk, dv, mask=mask, return_lse=True))
    assert lse[3] == -np.inf and np.all(out[3] == 0)
    ref = cuonline.attention(q, k, v, mask=mask, return_lse=True)
    np.testing.assert_allclose(out, ref[0], atol=1e-14)


@pytest.mark.parametrize("offsets", [dict(q_offset=2**53), dict(q_offset=2**70),
                                     dict(q_offset=-(2**53)), dict(q_offset=0, k_offset=2**60)])
def test_alibi_past_the_diagonal_clamp_is_clamped_once(offsets):
    # each task's offsets are the clamped diagonal plus its chunk's: clamped again, a chunk's
    # ALiBi distances shifted by its chunk offsets
    rng = np.random.default_rng(24)
    q, k, v = (rng.standard_normal((2, n, 8)) for n in (64, 70, 70))
    slopes = np.array([2.0**-16, 2.0**-18])    # slope * 2**53: lse of 2**37, ulp 2**-15
    opts = dict(alibi_slopes=slopes, **offsets)
    out, lse = cuonline.attention(q, k, v, return_lse=True, **opts)
    dq = da.from_array(q, chunks=(1, 16, 8))
    dk = da.from_array(k, chunks=(2, 13, 8))
    got_out, got_lse = compute(cuonline.attention(dq, dk, v, return_lse=True, **opts))
    # merging (out, lse) states rounds each lse at its magnitude: a floor of a few ulp
    ulp = np.spacing(np.abs(lse).max())
    assert np.abs(got_lse - lse).max() <= 2 * ulp
    assert np.abs(got_out - out).max() <= 2 * ulp
    dout = rng.standard_normal(out.shape)
    ref = cuonline.attention_backward(dout, q, k, v, out, lse, **opts)
    got = cuonline.attention_backward(dout, dq, dk, v, out, lse, **opts)
    for field in ("dq", "dk", "dv"):
        np.testing.assert_allclose(compute(getattr(got, field)), getattr(ref, field),
                                   atol=1e-12, err_msg=field)


# --------------------------------------------------------------------------------------------
# the graph


def square(n, chunk, dtype=np.float64, batch=()):
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal(batch + (n, 8)).astype(dtype) for _ in range(3)]
    return xs, [da.from_array(x, chunks=batch + (chunk, 8)) for x in xs]


def test_a_causal_graph_has_about_half_the_tasks():
    (q, k, v), (dq, dk, dv) = square(64, 8)
    full = cuonline.attention(dq, dk, dv)
    causal = cuonline.attention(dq, dk, dv, causal=True)
    assert chunk_tasks(full) == 64
    assert chunk_tasks(causal) == 8 * 9 // 2                     # the diagonal and below
    # with the merges and the outputs: 36 + 7 + 8 tasks against 64 + 8 + 8
    assert cuonline_tasks(causal) < 0.65 * cuonline_tasks(full)
    check_same(causal, cuonline.attention(q, k, v, causal=True), np.float64)


def test_window_and_kv_lengths_graphs_skip_invisible_chunks():
    (q, k, v), (dq, dk, dv) = square(64, 8)
    # each query sees its chunk's keys and, for a left side of 8, the chunk before
    assert chunk_tasks(cuonline.attention(dq, dk, dv, window=(8, 0))) == 8 + 7
    assert chunk_tasks(cuonline.attention(dq, dk, dv, window=(0, 0))) == 8
    # offsets put the keys after every query: causal sees none, no task, zeros and -inf
    out, lse = cuonline.attention(dq, dk, dv, causal=True, q_offset=0, k_offset=64,
                                  return_lse=True)
    assert chunk_tasks(out) == 0
    assert np.all(out.compute() == 0) and np.all(np.isneginf(lse.compute()))
    (q, k, v), (dq, dk, dv) = square(64, 8, batch=(2,))
    lengths = np.array([10, 30])
    dq, dk, dv = (x.rechunk((1, 8, 8)) for x in (dq, dk, dv))
    out = cuonline.attention(dq, dk, dv, kv_lengths=lengths)
    assert chunk_tasks(out) == 8 * (2 + 4)                       # ceil(10 / 8), ceil(30 / 8)
    check_same(out, cuonline.attention(q, k, v, kv_lengths=lengths), np.float64)


def test_the_merge_tree_is_fixed_and_the_result_does_not_depend_on_scheduling():
    from cuonline.engines.dask import SPLIT_EVERY
    (q, k, v), (dq, dk, dv) = square(200, 8)                     # 25 key chunks: 3 levels
    out = cuonline.attention(dq, dk, dv)
    merges = [key for key in dict(out.__dask_graph__())
              if isinstance(key, tuple) and key[0].startswith("cuonline-attention-merge-")]
    assert SPLIT_EVERY == 8
    # per output block: groups of 8, 8, 8 and 1 (passed up as it is), then one merge of 4
    assert len(merges) == 25 * 4
    sync = out.compute(scheduler="synchronous")
    threads = out.compute(scheduler="threads", num_workers=2)
    assert np.array_equal(sync, threads)
    np.testing.assert_allclose(sync, cuonline.attention(q, k, v), atol=1e-14)


def test_bias_and_mask_chunks_are_rechunked_to_the_queries_and_keys():
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((2, 30, 4)) for _ in range(3))
    bias, mask = rng.standard_normal((2, 30, 30)), rng.random((30, 30)) < 0.8
    dq, dk, dv = (da.from_array(x, chunks=(1, 7, 4)) for x in (q, k, v))
    dbias = da.from_array(bias, chunks=(2, 11, 13))
    dmask = da.from_array(mask, chunks=(30, 4))
    out = cuonline.attention(dq, dk, dv, bias=dbias, mask=dmask, causal=True)
    assert out.chunks[:2] == dq.chunks[:2]
    check_same(out, cuonline.attention(q, k, v, bias=bias, mask=mask, causal=True), np.float64)


def test_float16_chunks_merge_in_float32():
    rng = np.random.default_rng(6)
    q, k, v = (rng.standard_normal((40, 16)).astype(np.float16) for _ in range(3))
    dq, dk, dv = (da.from_array(x, chunks=(8, 16)) for x in (q, k, v))
    out, lse = compute(cuonline.attention(dq, dk, dv, return_lse=True))
    assert out.dtype == np.float16 and lse.dtype == np.float32
    ref, _ = reference_attention(q, k, v)
    assert np.abs(out.astype(np.float64) - ref).max() < 4e-3


def _relative_terms_supported():
    # the NumPy engine runs each chunk: without its issue-12 terms the Dask result cannot match
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((4, 2)) for _ in range(3))
    rel = rng.standard_normal(3)
    got = cuonline.attention(q, k, v, rel_bias=rel)
    return np.allclose(got, reference_attention(q, k, v, rel_bias=rel)[0])


@pytest.mark.parametrize("term", ["bias_block", "rel_bias", "rel_qk"])
def test_block_bias_and_relative_terms(term):
    if not _relative_terms_supported():
        pytest.skip("the NumPy engine has no block bias or relative terms yet (issue 12)")
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((2, n, 8)) for n in (29, 37, 37))
    opts = {"bias_block": dict(bias=rng.standard_normal((2, 8, 10)), bias_block=(4, 4)),
            "rel_bias": dict(rel_bias=rng.standard_normal((2, 9)), causal=True),
            "rel_qk": dict(rel_q=rng.standard_normal((2, 29, 3)),
                           rel_k=rng.standard_normal((11, 3)))}[term]
    dq = da.from_array(q, chunks=(1, (6, 9, 14), 8))              # not multiples of the block
    dk, dv = (da.from_array(x, chunks=(2, 5, 8)) for x in (k, v))
    dopts = {n: (da.from_array(x, chunks=tuple(max(1, s // 2) for s in x.shape))
                 if isinstance(x, np.ndarray) else x) for n, x in opts.items()}
    out, lse = compute(cuonline.attention(dq, dk, dv, return_lse=True, **dopts))
    ref_out, ref_lse = reference_attention(q, k, v, **opts)
    np.testing.assert_allclose(out, ref_out, atol=1e-12)
    np.testing.assert_allclose(lse, ref_lse, atol=1e-12)


# --------------------------------------------------------------------------------------------
# broadcast arguments: their axes are read from the right, as NumPy broadcasts


@pytest.mark.parametrize("chunks", [(4, 4), ((5, 7), (3, 9))], ids=["shared", "unshared"])
@pytest.mark.parametrize("option", ["bias", "mask"])
def test_a_1d_bias_or_mask_is_a_key_axis_when_lq_equals_lk(option, chunks):
    # (Lk,) with Lq == Lk: aligned to the left it was sliced by query chunks (a wrong answer
    # with shared chunks, a ValueError at compute time without)
    rng = np.random.default_rng(21)
    q, k, v = (rng.standard_normal((12, 4)) for _ in range(3))
    opts = {"bias": dict(bias=rng.standard_normal(12)),
            "mask": dict(mask=rng.random(12) < 0.6)}[option]
    out, lse = cuonline.attention(q, k, v, return_lse=True, **opts)
    dq = da.from_array(q, chunks=(chunks[0], 4))
    dk, dv = (da.from_array(x, chunks=(chunks[1], 4)) for x in (k, v))
    dopts = {n: da.from_array(x, chunks=5) for n, x in opts.items()}
    check_same(cuonline.attention(dq, dk, dv, return_lse=True, **dopts), (out, lse), q.dtype)
    dout = rng.standard_normal(out.shape)
    ref = cuonline.attention_backward(dout, q, k, v, out, lse, **opts)
    got = cuonline.attention_backward(dout, dq, dk, dv, out, lse, **dopts)
    for field in ("dq", "dk", "dv", "dbias"):
        want = getattr(ref, field)
        if want is not None:
            np.testing.assert_allclose(compute(getattr(got, field)), want, atol=1e-12,
                                       err_msg=field)


@pytest.mark.parametrize("q_chunks", [4, (1, 3)])
def test_a_dout_of_shape_dv_is_a_head_axis_when_dv_equals_lq(q_chunks):
    rng = np.random.default_rng(22)
    q = rng.standard_normal((4, 4))
    k, v = rng.standard_normal((9, 4)), rng.standard_normal((9, 4))
    out, lse = cuonline.attention(q, k, v, return_lse=True)
    dout = rng.standard_normal(4)                # broadcast over the 4 queries
    ref = cuonline.attention_backward(dout, q, k, v, out, lse)
    got = cuonline.attention_backward(da.from_array(dout, chunks=2),
                                      da.from_array(q, chunks=(q_chunks, 4)),
                                      da.from_array(k, chunks=(3, 4)), v, out, lse)
    for field in ("dq", "dk", "dv"):
        np.testing.assert_allclose(compute(getattr(got, field)), getattr(ref, field),
                                   atol=1e-12, err_msg=field)


# --------------------------------------------------------------------------------------------
# validation: the NumPy engine's messages


BAD = [
    ("dtype", dict(k_dtype=np.float32), {}),
    ("window", {}, dict(window=(-1, 0))),
    ("bias shape", {}, dict(bias=np.zeros((3, 5)))),
    ("kv_lengths", {}, dict(kv_lengths=np.array([-1, 2]))),
    ("mask dtype", {}, dict(mask=np.zeros((6, 5)))),
    ("backend", {}, dict(backend="cupy")),
    ("softcap_bias", {}, dict(softcap_bias=True)),
    ("offset", {}, dict(q_offset=1.5)),
]


@pytest.mark.parametrize("case", BAD, ids=[b[0] for b in BAD])
def test_errors_are_those_of_the_numpy_engine(case):
    _, arrays, opts = case
    q = np.zeros((2, 6, 4))
    k = np.zeros((2, 5, 4), dtype=arrays.get("k_dtype", np.float64))
    v = np.zeros((2, 5, 4))
    with pytest.raises((TypeError, ValueError)) as numpy_error:
        cuonline.attention(q, k, v, **opts)
    dopts = {n: (da.from_array(x) if isinstance(x, np.ndarray) and n != "kv_lengths" else x)
             for n, x in opts.items()}
    # q raises if computed: the errors come from validation on stand-ins, before any chunk
    lazy_q = da.from_array(q).map_blocks(_raise_if_computed, dtype=q.dtype)
    with pytest.raises(numpy_error.type) as dask_error:
        cuonline.attention(lazy_q, da.from_array(k), v, **dopts)
    assert str(dask_error.value) == str(numpy_error.value)


def test_negative_lazy_kv_lengths_raise_when_computed():
    q = da.zeros((2, 6, 4), chunks=(1, 3, 4))
    out = cuonline.attention(q, q, q, kv_lengths=da.from_array(np.array([3, -2])))
    with pytest.raises(ValueError, match="kv_lengths` must be >= 0"):
        out.compute()


def test_unknown_chunk_sizes_are_refused():
    x = da.zeros((6, 4), chunks=3)
    x = x[x[:, 0] == 0]                        # a boolean index: NaN chunk sizes
    with pytest.raises(ValueError, match="unknown chunk sizes"):
        cuonline.attention(x, x, x)


# --------------------------------------------------------------------------------------------
# merge


def test_merge_of_dask_states():
    rng = np.random.default_rng(8)
    q, k, v = (rng.standard_normal((2, 30, 6)) for _ in range(3))
    a = cuonline.attention(q, k[:, :12], v[:, :12], return_lse=True)
    b = cuonline.attention(q, k[:, 12:], v[:, 12:], return_lse=True)
    da_ = (da.from_array(a[0], chunks=(1, 7, 6)), da.from_array(a[1], chunks=(2, 11)))
    out, lse = cuonline.merge(da_, b)          # a Dask state and a NumPy one
    assert type(out).__module__.startswith("dask.array")
    check_same((out, lse), cuonline.merge(a, b), np.float64)
    with pytest.raises(ValueError, match="state 1: `out` has shape"):
        cuonline.merge(da_, (b[0][:1], b[1][:1]))


def test_merge_of_a_state_of_unknown_chunk_sizes_is_refused():
    rng = np.random.default_rng(23)
    out, lse = cuonline.attention(*(rng.standard_normal((6, 4)) for _ in range(3)),
                                  return_lse=True)
    keep = da.from_array(lse, chunks=3) > -np.inf
    lazy_out, lazy_lse = da.from_array(out, chunks=(3, 4))[keep], da.from_array(lse)[keep]
    with pytest.raises(ValueError, match=r"state 1: `lse` has unknown chunk sizes .*"
                                         r"states\[1\]\[1\]\.compute_chunk_sizes\(\)"):
        cuonline.merge((out, lse), (out, lazy_lse))
    with pytest.raises(ValueError, match=r"state 0: `out` has unknown chunk sizes"):
        cuonline.merge((lazy_out, lse), (out, lse))


# --------------------------------------------------------------------------------------------
# CuPy-backed chunks


@pytest.mark.gpu
@needs_gpu
def test_cupy_chunks_run_the_cuda_engine():
    import cupy
    (q, k, v), _ = square(64, 16, dtype=np.float32)
    dq, dk, dv = (da.from_array(cupy.asarray(x), chunks=(16, 8), asarray=False)
                  for x in (q, k, v))
    out = cuonline.attention(dq, dk, dv, causal=True).compute()
    assert isinstance(out, cupy.ndarray)
    np.testing.assert_allclose(out.get(), cuonline.attention(q, k, v, causal=True), atol=2e-5)


# --------------------------------------------------------------------------------------------
# dask.distributed: two worker processes


@pytest.fixture(scope="module")
def client():
    distributed = pytest.importorskip("distributed")
    cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                       dashboard_address=None, memory_limit="1GiB")
    with cluster, distributed.Client(cluster) as c:
        yield c


@pytest.mark.slow
def test_two_worker_processes_give_the_same_result(client):
    (q, k, v), (dq, dk, dv) = square(256, 64)
    out, lse = cuonline.attention(dq, dk, dv, causal=True, return_lse=True)
    got = client.compute([out, lse], sync=True)
    ref = cuonline.attention(q, k, v, causal=True, return_lse=True)
    assert np.array_equal(got[0], out.compute(scheduler="synchronous"))
    np.testing.assert_allclose(got[0], ref[0], atol=1e-14)
    np.testing.assert_allclose(got[1], ref[1], atol=1e-14)
    ran_on = client.run(lambda: os.getpid())
    assert len(set(ran_on.values())) == 2


@pytest.mark.slow
def test_a_killed_worker_is_retried_and_the_result_is_exact(client, tmp_path):
    (q, k, v), (dq, dk, dv) = square(128, 32)
    marker = str(tmp_path / "killed")

    def kill_once(block):
        # the first worker to compute this block dies (its nanny restarts it); the retry lives
        # (size 0: Dask's meta probe in this process, not a block)
        if block.size and not os.path.exists(marker):
            open(marker, "w").close()
            os._exit(1)
        return block

    dk = dk.map_blocks(kill_once, meta=dk._meta)
    out = cuonline.attention(dq, dk, dv, causal=True)
    got = client.compute(out, sync=True)
    assert os.path.exists(marker)              # a worker did die mid-computation
    np.testing.assert_allclose(got, cuonline.attention(q, k, v, causal=True), atol=1e-14)
    assert np.array_equal(got, out.compute(scheduler="synchronous"))


# --------------------------------------------------------------------------------------------
# out of core: keys and values in a zarr store


def zarr_kv(path, lk, d, chunk, seed=0, dtype=np.float32):
    """K and V of ``lk`` keys written chunk by chunk to a zarr store: Dask arrays over it."""
    zarr = pytest.importorskip("zarr")
    rng = np.random.default_rng(seed)
    root = zarr.open_group(str(path), mode="w")
    for name in ("k", "v"):
        arr = root.create_array(name, shape=(lk, d), chunks=(chunk, d), dtype=dtype,
                                compressors=None)
        for j in range(0, lk, chunk):
            arr[j:j + chunk] = rng.standard_normal((min(chunk, lk - j), d)).astype(dtype)
    return (da.from_zarr(str(path), component="k"), da.from_zarr(str(path), component="v"))


def test_keys_from_a_zarr_store_in_bounded_memory(tmp_path):
    # K and V of 256 MiB together, read 8 MiB chunks at a time: the peak stays below 128 MiB
    lk, d, chunk = 1 << 19, 64, 1 << 15
    dk, dv = zarr_kv(tmp_path / "kv.zarr", lk, d, chunk)
    assert dk.nbytes + dv.nbytes == 256 << 20
    rng = np.random.default_rng(1)
    q = rng.standard_normal((64, d)).astype(np.float32)
    out = cuonline.attention(da.from_array(q), dk, dv)
    tracemalloc.start()
    try:
        got = out.compute(scheduler="threads", num_workers=2)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 128 << 20, f"peak {peak / 2**20:.0f} MiB"
    rows = rng.choice(64, size=4, replace=False)
    k, v = dk.compute(), dv.compute()
    np.testing.assert_allclose(got[rows], cuonline.attention(q[rows], k, v), atol=2e-6)
    shutil.rmtree(tmp_path / "kv.zarr")                         # 256 MiB: not left behind


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("CUONLINE_DASK_BIG") != "1",
                    reason="4 GiB on disk and minutes of CPU: set CUONLINE_DASK_BIG=1")
def test_four_gib_of_keys_on_workers_of_one_gib(tmp_path):
    distributed = pytest.importorskip("distributed")
    import resource
    lk, d, chunk = 1 << 23, 64, 1 << 17                          # 2 x 2 GiB, 32 MiB chunks
    store = tmp_path / "kv.zarr"
    try:
        dk, dv = zarr_kv(store, lk, d, chunk)
        rng = np.random.default_rng(2)
        q = rng.standard_normal((256, d)).astype(np.float32)
        with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                      dashboard_address=None, memory_limit="1GiB") as cluster, \
                distributed.Client(cluster) as c:
            got = c.compute(cuonline.attention(da.from_array(q, chunks=(128, d)), dk, dv),
                            sync=True)
            # peak resident memory of each worker process, in KiB on Linux
            peaks = c.run(lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
        assert max(peaks.values()) < 1 << 20, peaks
        rows = rng.choice(256, size=3, replace=False)
        ref = cuonline.attention(q[rows], dk.compute(), dv.compute())
        np.testing.assert_allclose(got[rows], ref, atol=2e-6)
    finally:
        shutil.rmtree(store, ignore_errors=True)                # 4 GiB: not left behind


@pytest.mark.slow
def test_the_benchmark_prints_its_figures():
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_dask.py"), "--quick"],
        capture_output=True, text=True, check=True, cwd=ROOT, timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    rows = [line.split("|") for line in result.stdout.splitlines()
            if line.startswith(("| 1 |", "| 2 |"))]
    assert len(rows) == 4                  # 1 and 2 worker processes, two malloc settings
    assert all(float(cells[7]) < 1e-5 and int(cells[5]) == 16 for cells in rows)
    assert "36 chunk tasks (0.56 of the pairs)" in result.stdout    # 8 x 8 pairs, causal
    assert result.stdout.count("us/task") == 2


# --------------------------------------------------------------------------------------------
# the backward pass (through the engine: cuonline.attention_backward's Dask dispatch is the
# coordinator's line in cuonline/_api.py)


def dask_backward(*args, **options):
    from cuonline.engines.dask import attention_backward
    return attention_backward(cuonline.attention_backward, *args, **options)


BACKWARD_CASES = {
    "plain": {},
    "causal+bias+kv_lengths": dict(causal=True, kv_lengths=np.array([[20], [31]]), bias=True),
    "window+mask+alibi": dict(window=(6, 2), mask=True, alibi_slopes=np.array([0.2, 0.3, 0.4])),
    "softcap+offsets": dict(softcap=2.0, q_offset=40, k_offset=30, causal=True),
    "relative": dict(rel_bias=True, rel_qk=True),
}


@pytest.mark.parametrize("case", BACKWARD_CASES)
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_backward_matches_the_numpy_engine(case, dtype):
    rng = np.random.default_rng(9)
    # grouped queries: k and v broadcast over the 3 query heads, their gradients summed
    q = rng.standard_normal((2, 3, 29, 8)).astype(dtype)
    k, v = (rng.standard_normal((2, 1, 31, n)).astype(dtype) for n in (8, 5))
    opts = dict(BACKWARD_CASES[case])
    if opts.pop("bias", False):
        opts["bias"] = rng.standard_normal((3, 29, 31))          # shared by the batch
    if opts.pop("mask", False):
        opts["mask"] = rng.random((29, 31)) < 0.7
    if opts.pop("rel_bias", False):
        opts["rel_bias"] = rng.standard_normal((3, 7))
    if opts.pop("rel_qk", False):
        opts["rel_q"], opts["rel_k"] = rng.standard_normal((29, 4)), rng.standard_normal((9, 4))
    out, lse = cuonline.attention(q, k, v, return_lse=True, **opts)
    dout = rng.standard_normal(out.shape).astype(dtype)
    ref = cuonline.attention_backward(dout, q, k, v, out, lse, **opts)
    chunked = {n: (da.from_array(x, chunks=tuple(max(1, s // 2) for s in x.shape))
                   if isinstance(x, np.ndarray) and x.dtype.kind == "f" else x)
               for n, x in opts.items()}
    got = dask_backward(da.from_array(dout, chunks=(1, 2, (10, 19), 5)),
                        da.from_array(q, chunks=(1, 2, (10, 19), 8)),
                        da.from_array(k, chunks=(1, 1, 7, 8)), v, out, lse, **chunked)
    for field in ("dq", "dk", "dv", "dbias", "drel_bias", "drel_q", "drel_k"):
        want = getattr(ref, field)
        if want is None:
            assert getattr(got, field) is None
            continue
        assert isinstance(getattr(got, field), da.Array), field
        have = getattr(got, field).compute()
        assert have.shape == want.shape and have.dtype == want.dtype, field
        np.testing.assert_allclose(have, want, rtol=0, atol={np.float64: 1e-12,
                                                               np.float32: 2e-5}[dtype],
                                   err_msg=field)


def test_backward_skips_invisible_pairs_and_zeroes_unread_keys():
    (q, k, v), (dq, dk, dv) = square(64, 8, batch=(2,))
    lengths = np.array([10, 30])
    out, lse = cuonline.attention(q, k, v, causal=True, kv_lengths=lengths, return_lse=True)
    dout = np.ones_like(out)
    grads = dask_backward(dout, *(x.rechunk((1, 8, 8)) for x in (dq, dk, dv)), out, lse,
                          causal=True, kv_lengths=lengths)
    chunks = sum(1 for key in dict(grads.dq.__dask_graph__())
                 if isinstance(key, tuple) and key[0].endswith("-chunk"))
    # batch 0 reads key chunks 0-1, batch 1 chunks 0-3; causal: query chunk i reads 0..i
    assert chunks == (1 + 2 * 7) + (1 + 2 + 3 + 4 * 5)
    got = grads.dk.compute()
    assert np.all(got[0, 16:] == 0) and np.all(got[1, 32:] == 0)
    ref = cuonline.attention_backward(dout, q, k, v, out, lse, causal=True, kv_lengths=lengths)
    np.testing.assert_allclose(got, ref.dk, atol=1e-12)


def test_one_gradient_reads_only_its_own_pieces_of_each_task():
    # a task's Gradients bundle is split at once: the sums of dq read dq pieces only, so
    # computing dq alone frees each task's dk and dv as soon as the task ends
    from dask.core import get_dependencies
    from dask.optimization import cull
    (q, k, v), (dq, dk, dv) = square(64, 8)
    out, lse = cuonline.attention(q, k, v, return_lse=True)
    grads = cuonline.attention_backward(np.ones_like(out), dq, dk, dv, out, lse,
                                        bias=np.zeros((64, 64)))
    for field in ("dq", "dk", "dv", "dbias"):
        x = getattr(grads, field)
        graph, _ = cull(dict(x.__dask_graph__()), list(dask.core.flatten(x.__dask_keys__())))
        tasks = [key for key in graph if isinstance(key, tuple) and key[0].endswith("-chunk")]
        assert len(tasks) == 64, field
        readers = [key for key in graph if set(get_dependencies(graph, key)) & set(tasks)]
        assert readers and all(key[0].endswith(f"-{field}-piece") for key in readers), \
            (field, {key[0] for key in readers})


def test_backward_errors_are_those_of_the_numpy_engine():
    q = np.zeros((6, 4))
    out, lse = cuonline.attention(q, q, q, return_lse=True)
    with pytest.raises(ValueError) as numpy_error:
        cuonline.attention_backward(np.zeros((6, 4)), q, q, q, out[:5], lse)
    lazy_q = da.from_array(q).map_blocks(_raise_if_computed, dtype=q.dtype)
    with pytest.raises(ValueError) as dask_error:
        dask_backward(np.zeros((6, 4)), lazy_q, q, q, out[:5], lse)
    assert str(dask_error.value) == str(numpy_error.value)
