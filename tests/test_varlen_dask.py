"""Packed variable-length batches (``cu_seqlens_q``, ``cu_seqlens_k``) on Dask arrays, and
the packed statistics and vjp on NumPy.

The Dask graph (cuonline/engines/dask.py) against the float64 oracle run one sequence at a time
(tests/oracle.py) by the one accuracy rule, and against the in-memory NumPy engine: chunks that
cut sequences anywhere (one-token chunks included), chunks on sequence boundaries (a
block-diagonal graph), empty and one-token sequences, every per-sequence option, return_lse,
float32 and float64, gradients packed and chunked like their inputs, determinism, and bad input
refused by name before anything is computed. The chunks run on the NumPy engine.
"""

from __future__ import annotations

import numpy as np
import pytest
from oracle import (naive_attention, naive_attention_backward, reference_attention_stats,
                    reference_varlen_attention, reference_varlen_attention_backward)
from support import (GRADIENT_NAMES, accumulation_of, assert_accurate, boundaries, fast_tier,
                     lse_rounding, packed_case, packed_option_cases, precision_of)

import cuonline

da = pytest.importorskip("dask.array")
import dask  # noqa: E402 - after the skip: dask is an extra

CHUNK = "cuonline-attention-chunk-"

# per sequence: Lq != Lk both ways, a sequence without queries (1) and one without keys (4),
# one-token sequences (7), lengths around the engine's tiles
LENGTHS_Q = [5, 0, 17, 5, 3, 64, 65, 1, 5]
LENGTHS_K = [5, 4, 17, 5, 0, 64, 30, 1, 5]

CQ, CK = boundaries(LENGTHS_Q), boundaries(LENGTHS_K)
F64 = precision_of(np.float64)


def case(seed, dtype=np.float64, heads=2, d=6, dv=4, cq=CQ, ck=CK):
    """Packed q (heads, total_q, D); k and v shared by the heads (a broadcast batch axis)."""
    rng, q, k, v, _, _ = packed_case(seed, dtype, np.diff(cq), np.diff(ck), heads=heads, d=d,
                                     dv=dv)
    return rng, q, k, v


options_cases = packed_option_cases


OPTION_NAMES = list(options_cases(np.random.default_rng(0), 1))

#: chunkings of the query and key axes: (q chunk, k chunk) sizes, or "sequences" (one chunk
#: per sequence, boundaries on the sequences')
CHUNKINGS = {"cut": (7, 11), "cut-other": (40, 13), "sequences": "sequences"}


def chunked(x, size, axis=-2, boundaries=None):
    """``x`` as a Dask array chunked along ``axis`` in pieces of ``size`` (or at
    ``boundaries``), the other axes whole."""
    chunks = list(x.shape)
    if boundaries is not None:
        chunks[axis] = tuple(int(n) for n in np.diff(boundaries) if n) or (0,)
    else:
        chunks[axis] = size
    return da.from_array(x, chunks=tuple(chunks))


def dask_arguments(chunking, q, k, v, options, cq=CQ, ck=CK):
    """q, k, v (and rel_q) as Dask arrays chunked by ``chunking``."""
    if chunking == "sequences":
        qd, kd, vd = (chunked(q, None, boundaries=cq), chunked(k, None, boundaries=ck),
                      chunked(v, None, boundaries=ck))
        size_q = None
    else:
        size_q, size_k = chunking
        qd, kd, vd = chunked(q, size_q), chunked(k, size_k), chunked(v, size_k + 3)
    options = dict(options)
    if options.get("rel_q") is not None:
        options["rel_q"] = chunked(options["rel_q"], size_q or 9,
                                   boundaries=cq if chunking == "sequences" else None)
    return qd, kd, vd, options


def naive_varlen(q, k, v, rounding, cq=CQ, ck=CK, dout=None, **options):
    """The naive same-precision computation (oracle.naive_attention, or its backward with
    ``dout``) one sequence at a time, packed as the reference is."""
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    if dout is None:
        out = np.zeros(batch + (q.shape[-2], v.shape[-1]))
        lse = np.full(batch + (q.shape[-2],), -np.inf)
    else:
        grads = {"dq": np.zeros(q.shape), "dk": np.zeros(k.shape), "dv": np.zeros(v.shape)}
        for name in ("rel_bias", "rel_q", "rel_k"):
            if options.get(name) is not None:
                grads["d" + name] = np.zeros(np.shape(options[name]))
    for b in range(len(cq) - 1):
        sq, sk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        if sq.start == sq.stop:
            continue
        here = dict(options)
        if here.get("rel_q") is not None:
            here["rel_q"] = here["rel_q"][..., sq, :]
        if dout is None:
            out[..., sq, :], lse[..., sq] = naive_attention(q[..., sq, :], k[..., sk, :],
                                                            v[..., sk, :], rounding=rounding,
                                                            **here)
            continue
        g = naive_attention_backward(dout[..., sq, :], q[..., sq, :], k[..., sk, :],
                                     v[..., sk, :], rounding=rounding, **here)
        grads["dq"][..., sq, :] += g["dq"]
        grads["dk"][..., sk, :] += g["dk"]
        grads["dv"][..., sk, :] += g["dv"]
        if "drel_q" in grads:
            grads["drel_q"][..., sq, :] += g["drel_q"]
        for name in ("drel_bias", "drel_k"):
            if name in grads:
                grads[name] += g[name]
    return (out, lse) if dout is None else grads


def chunk_tasks(x) -> int:
    return sum(1 for key in dict(x.__dask_graph__())
               if isinstance(key, tuple) and key[0].startswith(CHUNK))


# --------------------------------------------------------------------------------------------
# against the oracle


@pytest.mark.parametrize("chunking", list(CHUNKINGS))
@pytest.mark.parametrize("name", OPTION_NAMES)
def test_forward_matches_the_oracle(name, chunking):
    rng, q, k, v = case(1)
    options = options_cases(rng, q.shape[-2])[name]
    qd, kd, vd, dask_options = dask_arguments(CHUNKINGS[chunking], q, k, v, options)
    out, lse = cuonline.attention(qd, kd, vd, cu_seqlens_q=CQ, cu_seqlens_k=CK,
                                  return_lse=True, **dask_options)
    assert isinstance(out, da.Array) and isinstance(lse, da.Array)
    assert out.chunks[-2] == qd.chunks[-2] and lse.chunks[-1] == qd.chunks[-2]
    out, lse = dask.compute(out, lse)
    ref_out, ref_lse = reference_varlen_attention(q, k, v, CQ, CK, **options)
    naive_out, naive_lse = naive_varlen(q, k, v, F64, **options)
    assert out.dtype == np.float64 and lse.dtype == np.float64
    assert_accurate("out", out, ref_out, naive_out, F64)
    assert_accurate("lse", lse, ref_lse, naive_lse, F64)
    assert np.isneginf(lse[:, CQ[4]:CQ[5]]).all()           # the sequence without keys
    assert not out[:, CQ[4]:CQ[5]].any()


@pytest.mark.parametrize("chunking", ["cut", "sequences"])
# fast tier: chunked rel_q (rel_qk) and summed rel_bias (softcap_bias); every option's
# gradient on one chunk is test_varlen.py's
@pytest.mark.parametrize("name", fast_tier(OPTION_NAMES, ("plain", "rel_qk", "softcap_bias")))
def test_backward_matches_the_oracle(name, chunking):
    """Gradients packed (and chunked) like their inputs; the keys of the sequence without
    queries receive nothing."""
    rng, q, k, v = case(2)
    options = options_cases(rng, q.shape[-2])[name]
    out, lse = cuonline.attention(q, k, v, cu_seqlens_q=CQ, cu_seqlens_k=CK, return_lse=True,
                                  **options)
    dout = rng.standard_normal(out.shape)
    qd, kd, vd, dask_options = dask_arguments(CHUNKINGS[chunking], q, k, v, options)
    g = cuonline.attention_backward(dout, qd, kd, vd, out, lse, cu_seqlens_q=CQ,
                                    cu_seqlens_k=CK, **dask_options)
    inputs = {"dq": qd, "dk": kd, "dv": vd, "drel_q": dask_options.get("rel_q")}
    for field, x in inputs.items():
        if x is not None:
            assert getattr(g, field).chunks == x.chunks, field
    exact = reference_varlen_attention_backward(dout, q, k, v, CQ, CK, **options)
    naive = naive_varlen(q, k, v, F64, dout=dout, **options)
    for field in GRADIENT_NAMES:
        got = getattr(g, field)
        if field not in exact:
            assert got is None, field
            continue
        got = got.compute()
        assert got.dtype == np.float64, field
        assert_accurate(field, got, exact[field], naive[field], F64)
    dk = g.dk.compute()
    assert not dk[:, CK[1]:CK[2]].any()


@pytest.mark.parametrize("name", fast_tier(["plain", "causal", "window", "alibi", "rel_qk"],
                                           ("alibi",)))
def test_float32_forward_and_backward(name):
    rng, q, k, v = case(3, dtype=np.float32)
    options = options_cases(rng, q.shape[-2])[name]
    if "rel_q" in options:
        options = dict(options, rel_q=options["rel_q"].astype(np.float32),
                       rel_k=options["rel_k"].astype(np.float32))
    qd, kd, vd, dask_options = dask_arguments((9, 10), q, k, v, options)
    out, lse = dask.compute(*cuonline.attention(qd, kd, vd, cu_seqlens_q=CQ, cu_seqlens_k=CK,
                                                return_lse=True, **dask_options))
    assert out.dtype == np.float32 and lse.dtype == accumulation_of(np.float32)
    rounding = precision_of(np.float32)
    ref_out, ref_lse = reference_varlen_attention(q, k, v, CQ, CK, **options)
    naive_out, naive_lse = naive_varlen(q, k, v, rounding, **options)
    assert_accurate("out", out, ref_out, naive_out, rounding)
    assert_accurate("lse", lse, ref_lse, naive_lse, rounding)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    g = cuonline.attention_backward(dout, qd, kd, vd, out, lse, cu_seqlens_q=CQ,
                                    cu_seqlens_k=CK, **dask_options)
    exact = reference_varlen_attention_backward(dout, q, k, v, CQ, CK, **options)
    naive = naive_varlen(q, k, v, rounding, dout=dout, **options)
    for field, want in exact.items():
        got = getattr(g, field).compute()
        assert got.dtype == np.float32, field
        assert_accurate(field, got, want, naive[field], rounding,
                        lse_rounding(ref_lse, np.float32))


# --------------------------------------------------------------------------------------------
# against the in-memory engine; the graph's shape


@pytest.mark.parametrize("sizes", [pytest.param((1, 1), id="one-token", marks=pytest.mark.slow),
                                   pytest.param((3, 2), id="small"),
                                   pytest.param((64, 7), id="mixed"),
                                   pytest.param((200, 200), id="one-chunk")])
def test_matches_the_numpy_engine(sizes):
    """Any chunking, down to one token per chunk, gives the in-memory call's results to
    rounding (only the order of the key merges differs); one chunk gives them exactly."""
    rng, q, k, v = case(4)
    options = {"causal": True, "rel_bias": rng.standard_normal(7)}
    ref = cuonline.attention(q, k, v, cu_seqlens_q=CQ, cu_seqlens_k=CK, return_lse=True,
                             **options)
    qd, kd, vd, _ = dask_arguments(sizes, q, k, v, {})
    got = dask.compute(*cuonline.attention(qd, kd, vd, cu_seqlens_q=CQ, cu_seqlens_k=CK,
                                           return_lse=True, **options))
    for g, r in zip(got, ref):
        assert np.array_equal(np.isneginf(g), np.isneginf(r))
        finite = np.isfinite(r)
        if sizes == (200, 200):
            np.testing.assert_array_equal(g, r)
        else:
            np.testing.assert_allclose(g[finite], r[finite], rtol=0, atol=1e-13)


def test_far_offsets():
    """Explicit offsets far past every length (clamped once by validation, never again by a
    piece's call): all keys visible, or none (then no task at all)."""
    _, q, k, v = case(18)
    qd, kd, vd, _ = dask_arguments((7, 11), q, k, v, {})
    for q_offset, visible in ((2**62, True), (-2**62, False)):
        options = {"q_offset": q_offset, "causal": True, "rel_bias": np.arange(5.0)}
        out, lse = cuonline.attention(qd, kd, vd, cu_seqlens_q=CQ, cu_seqlens_k=CK,
                                      return_lse=True, **options)
        assert (chunk_tasks(out) > 0) == visible
        ref = cuonline.attention(q, k, v, cu_seqlens_q=CQ, cu_seqlens_k=CK, return_lse=True,
                                 **options)
        out, lse = dask.compute(out, lse)
        finite = np.isfinite(ref[1])
        assert np.array_equal(np.isfinite(lse), finite) and finite.any() == visible
        np.testing.assert_allclose(lse[finite], ref[1][finite], rtol=0, atol=1e-13)
        np.testing.assert_allclose(out, ref[0], rtol=0, atol=1e-13)
        assert visible or not out.any()


def test_one_token_sequences():
    """Many one-token sequences (and some empty ones) across chunks of three."""
    lengths_q = [1, 1, 0, 1, 1, 1, 1, 0, 1, 1]
    lengths_k = [1, 0, 1, 1, 1, 1, 1, 1, 1, 1]
    cq, ck = boundaries(lengths_q), boundaries(lengths_k)
    rng, q, k, v = case(5, cq=cq, ck=ck)
    options = {"causal": True, "alibi_slopes": np.array([0.5, 1.0])}
    qd, kd, vd, _ = dask_arguments((3, 3), q, k, v, {}, cq, ck)
    out, lse = dask.compute(*cuonline.attention(qd, kd, vd, cu_seqlens_q=cq, cu_seqlens_k=ck,
                                                return_lse=True, **options))
    ref_out, ref_lse = reference_varlen_attention(q, k, v, cq, ck, **options)
    naive_out, naive_lse = naive_varlen(q, k, v, F64, cq, ck, **options)
    assert_accurate("out", out, ref_out, naive_out, F64)
    assert_accurate("lse", lse, ref_lse, naive_lse, F64)
    # one-token self-attention: each query sees its one key, with weight 1
    own = [b for b in range(len(lengths_q)) if lengths_q[b] and lengths_k[b]]
    np.testing.assert_array_equal(out[:, cq[own]], np.broadcast_to(v[:, ck[own]], (2, 7, 4)))


def test_chunks_on_sequence_boundaries_make_a_block_diagonal_graph():
    """With each sequence its own chunk on both sides, the only tasks are the diagonal
    pairs of the sequences that have queries and keys; cut chunks add the pairs a cut
    sequence spans, and causal prunes those no query sees."""
    _, q, k, v = case(6)
    qd, kd, vd, _ = dask_arguments("sequences", q, k, v, {})
    out = cuonline.attention(qd, kd, vd, cu_seqlens_q=CQ, cu_seqlens_k=CK)
    both = sum(1 for a, b in zip(LENGTHS_Q, LENGTHS_K) if a and b)
    assert chunk_tasks(out) == both
    # one chunk per side: one task
    qd, kd, vd, _ = dask_arguments((200, 200), q, k, v, {})
    assert chunk_tasks(cuonline.attention(qd, kd, vd, cu_seqlens_q=CQ, cu_seqlens_k=CK)) == 1
    # sequence 5 (64 x 64) alone in chunks of 16: all 16 pairs, causal keeps the 10 at or
    # below the diagonal
    cq, ck = boundaries([64]), boundaries([64])
    _, q, k, v = case(6, cq=cq, ck=ck)
    qd, kd, vd = chunked(q, 16), chunked(k, 16), chunked(v, 16)
    assert chunk_tasks(cuonline.attention(qd, kd, vd, cu_seqlens_q=cq, cu_seqlens_k=ck)) == 16
    causal = cuonline.attention(qd, kd, vd, cu_seqlens_q=cq, cu_seqlens_k=ck, causal=True)
    assert chunk_tasks(causal) == 10


def test_a_query_chunk_of_a_sequence_without_keys_is_zeros():
    """A query chunk that holds only the queries of the sequence without keys has no task:
    0 and -inf."""
    _, q, k, v = case(7)
    bounds = sorted({0, int(CQ[4]), int(CQ[5]), int(CQ[-1])})
    qd = chunked(q, None, boundaries=bounds)
    out, lse = cuonline.attention(qd, chunked(k, 20), chunked(v, 20), cu_seqlens_q=CQ,
                                  cu_seqlens_k=CK, return_lse=True)
    out, lse = dask.compute(out, lse)
    assert not out[:, CQ[4]:CQ[5]].any() and np.isneginf(lse[:, CQ[4]:CQ[5]]).all()
    ref_out, ref_lse = reference_varlen_attention(q, k, v, CQ, CK)
    naive_out, naive_lse = naive_varlen(q, k, v, F64)
    assert_accurate("out", out, ref_out, naive_out, F64)
    assert_accurate("lse", lse, ref_lse, naive_lse, F64)


def test_empty_chunks():
    """Chunkings with empty chunks (Dask allows them) read as the others."""
    _, q, k, v = case(20)
    n_q, n_k = int(CQ[-1]), int(CK[-1])
    qd = da.from_array(q, chunks=(2, (40, 0, n_q - 40), 6))
    kd = da.from_array(k, chunks=(1, (0, 30, 0, n_k - 30), 6))
    vd = da.from_array(v, chunks=(1, (30, n_k - 30), 4))
    out, lse = dask.compute(*cuonline.attention(qd, kd, vd, cu_seqlens_q=CQ, cu_seqlens_k=CK,
                                                causal=True, return_lse=True))
    ref = cuonline.attention(q, k, v, cu_seqlens_q=CQ, cu_seqlens_k=CK, causal=True,
                             return_lse=True)
    finite = np.isfinite(ref[1])
    assert np.array_equal(np.isfinite(lse), finite)
    np.testing.assert_allclose(lse[finite], ref[1][finite], rtol=0, atol=1e-13)
    np.testing.assert_allclose(out, ref[0], rtol=0, atol=1e-13)


def test_out_alone_and_boundaries_of_any_integer_kind():
    """Without return_lse one Dask array; boundaries as lists or int32 give the same graph's
    values."""
    _, q, k, v = case(8)
    qd, kd, vd, _ = dask_arguments((10, 10), q, k, v, {})
    out = cuonline.attention(qd, kd, vd, cu_seqlens_q=list(CQ),
                             cu_seqlens_k=CK.astype(np.int32), window=(5, 5))
    assert isinstance(out, da.Array) and out.shape == (2, CQ[-1], 4)
    again = cuonline.attention(qd, kd, vd, cu_seqlens_q=CQ, cu_seqlens_k=CK, window=(5, 5))
    np.testing.assert_array_equal(out.compute(), again.compute())


def test_boundaries_of_another_library():
    """Boundaries are host integers of any library, as in memory (torch here)."""
    torch = pytest.importorskip("torch")
    _, q, k, v = case(19)
    qd, kd, vd, _ = dask_arguments((10, 10), q, k, v, {})
    out = cuonline.attention(qd, kd, vd, cu_seqlens_q=torch.from_numpy(CQ), cu_seqlens_k=CK)
    ref = cuonline.attention(q, k, v, cu_seqlens_q=CQ, cu_seqlens_k=CK)
    np.testing.assert_allclose(out.compute(), ref, rtol=0, atol=1e-13)


@pytest.mark.slow   # several full runs; the fast tier's graphs are checked once each
def test_deterministic_across_runs_and_schedulers():
    rng, q, k, v = case(9)
    options = {"causal": True}
    qd, kd, vd, _ = dask_arguments((7, 5), q, k, v, {})
    out, lse = cuonline.attention(qd, kd, vd, cu_seqlens_q=CQ, cu_seqlens_k=CK,
                                  return_lse=True, **options)
    first = dask.compute(out, lse, scheduler="sync")
    second = dask.compute(out, lse, scheduler="threads")
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)
    dout = rng.standard_normal(out.shape)
    runs = [cuonline.attention_backward(dout, qd, kd, vd, first[0], first[1], cu_seqlens_q=CQ,
                                        cu_seqlens_k=CK, **options) for _ in range(2)]
    for field in ("dq", "dk", "dv"):
        a = getattr(runs[0], field).compute(scheduler="threads")
        b = getattr(runs[1], field).compute(scheduler="sync")
        np.testing.assert_array_equal(a, b)


def test_vjp_on_dask_and_numpy():
    """attention_vjp takes the packed keywords on both engines; its gradients are the
    backward's."""
    rng, q, k, v = case(10)
    out, vjp = cuonline.attention_vjp(q, k, v, cu_seqlens_q=CQ, cu_seqlens_k=CK, causal=True)
    dout = rng.standard_normal(out.shape)
    exact = reference_varlen_attention_backward(dout, q, k, v, CQ, CK, causal=True)
    naive = naive_varlen(q, k, v, F64, dout=dout, causal=True)
    g = vjp(dout)
    for field in ("dq", "dk", "dv"):
        assert_accurate(field, getattr(g, field), exact[field], naive[field], F64)
    qd, kd, vd, _ = dask_arguments((16, 12), q, k, v, {})
    out_d, vjp_d = cuonline.attention_vjp(qd, kd, vd, cu_seqlens_q=CQ, cu_seqlens_k=CK,
                                          causal=True)
    assert isinstance(out_d, da.Array)
    g_d = vjp_d(dout)
    for field in ("dq", "dk", "dv"):
        got = getattr(g_d, field).compute()
        assert_accurate(field, got, exact[field], naive[field], F64)


# --------------------------------------------------------------------------------------------
# bad input: refused by name when the graph is built


def test_dask_boundaries_are_refused_by_name():
    _, q, k, v = case(11)
    qd = chunked(q, 10)
    with pytest.raises(TypeError, match=r"`cu_seqlens_q` must be a computed array.*compute"):
        cuonline.attention(qd, k, v, cu_seqlens_q=da.from_array(CQ), cu_seqlens_k=CK)
    # the boundaries alone being Dask arrays still goes through the same check
    with pytest.raises(TypeError, match=r"`cu_seqlens_k` must be a computed array"):
        cuonline.attention(q, k, v, cu_seqlens_q=CQ, cu_seqlens_k=da.from_array(CK))


@pytest.mark.parametrize("boundaries, error, message", [
    (([0, 5, 3, CQ[-1]], CK[:4]), ValueError, r"`cu_seqlens_q` must be non-decreasing"),
    ((CQ, CK[:-1]), ValueError, r"`cu_seqlens_k` must end at"),
    ((CQ[:-1], CK[:-1]), ValueError, r"`cu_seqlens_q` must end at"),
    ((CQ.astype(float), CK), TypeError, r"`cu_seqlens_q` must be a 1-D integer array"),
    ((CQ, None), ValueError, r"`cu_seqlens_q` was given without `cu_seqlens_k`"),
], ids=["decreasing", "short", "wrong-total", "float", "alone"])
def test_bad_boundaries_are_refused_before_any_work(boundaries, error, message):
    _, q, k, v = case(12)
    qd, kd, vd, _ = dask_arguments((10, 10), q, k, v, {})
    cq, ck = boundaries
    with pytest.raises(error, match=message):
        cuonline.attention(qd, kd, vd, cu_seqlens_q=cq, cu_seqlens_k=ck)
    out, lse = cuonline.attention(q, k, v, cu_seqlens_q=CQ, cu_seqlens_k=CK, return_lse=True)
    with pytest.raises(error, match=message):
        cuonline.attention_backward(np.ones_like(out), qd, kd, vd, out, lse, cu_seqlens_q=cq,
                                    cu_seqlens_k=ck)


@pytest.mark.parametrize("option", ["bias", "mask", "kv_lengths"])
def test_options_without_meaning_across_sequences_are_refused(option):
    _, q, k, v = case(13)
    qd, kd, vd, _ = dask_arguments((10, 10), q, k, v, {})
    value = {"bias": np.zeros((CQ[-1], CK[-1])), "mask": np.ones((CQ[-1], CK[-1]), bool),
             "kv_lengths": np.array([3, 4])}[option]
    with pytest.raises(ValueError, match=rf"`{option}` cannot be combined with `cu_seqlens_q`"):
        cuonline.attention(qd, kd, vd, cu_seqlens_q=CQ, cu_seqlens_k=CK, **{option: value})


# --------------------------------------------------------------------------------------------
# attention_stats of a packed batch (NumPy engine)


def reference_varlen_stats(q, k, cq, ck, query_weights, top_k, rows, **options):
    """The oracle's statistics one sequence at a time, packed: row statistics at the
    sequence's query rows (key indices of the packed keys), ``received`` at its keys,
    ``weights`` of the requested packed rows over the packed keys."""
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2])
    total_q, total_k = q.shape[-2], k.shape[-2]
    ref = {"lse": np.full(batch + (total_q,), -np.inf), "entropy": np.zeros(batch + (total_q,)),
           "max_weight": np.zeros(batch + (total_q,)),
           "argmax": np.full(batch + (total_q,), -1),
           "top_indices": np.full(batch + (total_q, top_k), -1),
           "top_weights": np.zeros(batch + (total_q, top_k)),
           "received": np.zeros(batch + (total_k,)), "P": np.zeros(batch + (total_q, total_k))}
    for b in range(len(cq) - 1):
        sq, sk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        if sq.start == sq.stop:
            continue
        here = dict(options)
        if here.get("rel_q") is not None:
            here["rel_q"] = here["rel_q"][..., sq, :]
        r = reference_attention_stats(q[..., sq, :], k[..., sk, :], top_k=top_k,
                                      query_weights=query_weights[..., sq],
                                      rows=np.arange(sq.stop - sq.start), **here)
        for name in ("lse", "entropy", "max_weight"):
            ref[name][..., sq] = r[name]
        ref["top_weights"][..., sq, :] = r["top_weights"]
        ref["argmax"][..., sq] = np.where(r["argmax"] < 0, -1, r["argmax"] + sk.start)
        ref["top_indices"][..., sq, :] = np.where(r["top_indices"] < 0, -1,
                                                  r["top_indices"] + sk.start)
        ref["received"][..., sk] = r["received"]
        ref["P"][..., sq, sk] = r["weights"]
    ref["weights"] = ref.pop("P")[..., np.asarray(rows) % total_q, :]
    return ref


@pytest.mark.parametrize("name", ["plain", "causal", "window", "alibi", "softcap_bias",
                                  "rel_qk", "q_offset"])
def test_packed_statistics_match_the_oracle(name):
    rng, q, k, _ = case(15)
    options = options_cases(rng, q.shape[-2])[name]
    weights = rng.random((2, CQ[-1]))
    rows = np.array([0, 3, CQ[2], CQ[4] + 1, CQ[6] + 40, CQ[7], 22, -1])
    st = cuonline.attention_stats(q, k, cu_seqlens_q=CQ, cu_seqlens_k=CK, received=True,
                                  query_weights=weights, top_k=3, rows=rows, **options)
    ref = reference_varlen_stats(q, k, CQ, CK, weights, 3, rows, **options)
    for field in ("lse", "entropy", "max_weight", "received", "top_weights", "weights"):
        got = getattr(st, field)
        assert got.shape == ref[field].shape and got.dtype == np.float64, field
        np.testing.assert_allclose(got, ref[field], rtol=1e-10, atol=1e-12, err_msg=field)
    for field in ("argmax", "top_indices"):
        np.testing.assert_array_equal(getattr(st, field), ref[field], err_msg=field)
    # the sequence without keys: no key seen; the sequence without queries receives nothing
    assert np.isneginf(st.lse[:, CQ[4]:CQ[5]]).all() and (st.argmax[:, CQ[4]:CQ[5]] == -1).all()
    assert not st.received[:, CK[1]:CK[2]].any()


@pytest.mark.parametrize("sizes", [(7, 11), (40, 13), "sequences"],
                         ids=["cut", "cut-other", "sequences"])
@pytest.mark.parametrize("name", fast_tier(["plain", "causal", "q_offset", "rel_qk"],
                                           ("causal",)))
def test_packed_statistics_on_dask(name, sizes):
    """Every statistic of the Dask graph is the in-memory packed call's to rounding (the
    indices exactly), and the oracle's, for chunks that cut sequences anywhere."""
    rng, q, k, _ = case(17)
    options = options_cases(rng, q.shape[-2])[name]
    weights = rng.random((2, CQ[-1]))
    rows = np.array([0, 3, CQ[2], CQ[4] + 1, CQ[6] + 40, CQ[7], 22, -1])
    qd, kd, _, dask_options = dask_arguments(sizes, q, k, k[..., :0], options)
    size_q = 9 if sizes == "sequences" else sizes[0]
    got = cuonline.attention_stats(qd, kd, cu_seqlens_q=CQ, cu_seqlens_k=CK, received=True,
                                   query_weights=chunked(weights, size_q, axis=-1), top_k=3,
                                   rows=rows, **dask_options)
    assert isinstance(got.lse, da.Array) and got.lse.chunks[-1] == qd.chunks[-2]
    want = cuonline.attention_stats(q, k, cu_seqlens_q=CQ, cu_seqlens_k=CK, received=True,
                                    query_weights=weights, top_k=3, rows=rows, **options)
    ref = reference_varlen_stats(q, k, CQ, CK, weights, 3, rows, **options)
    for field in ("lse", "entropy", "max_weight", "argmax", "top_indices", "top_weights",
                  "received", "weights"):
        g = getattr(got, field).compute()
        w = getattr(want, field)
        assert g.shape == w.shape and g.dtype == w.dtype, field
        if field in ("argmax", "top_indices"):
            np.testing.assert_array_equal(g, w, err_msg=field)
            np.testing.assert_array_equal(g, ref[field], err_msg=field)
            continue
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-13, err_msg=field)
        np.testing.assert_allclose(g, ref[field], rtol=1e-10, atol=1e-12, err_msg=field)


def test_packed_statistics_are_those_of_attention():
    """lse of the statistics is the lse of attention on the same packed batch, float32."""
    rng, q, k, v = case(16, dtype=np.float32)
    _, lse = cuonline.attention(q, k, v, cu_seqlens_q=CQ, cu_seqlens_k=CK, causal=True,
                                return_lse=True)
    st = cuonline.attention_stats(q, k, cu_seqlens_q=CQ, cu_seqlens_k=CK, causal=True)
    assert st.lse.dtype == np.float32 and st.entropy.shape == (2, CQ[-1])
    finite = np.isfinite(lse)
    assert np.array_equal(finite, np.isfinite(st.lse))
    np.testing.assert_allclose(st.lse[finite], lse[finite], rtol=0, atol=1e-5)
