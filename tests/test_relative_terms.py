"""The genomics score terms on the NumPy engine: block bias, relative bias, relative logits.

Each term against the float64 oracle (tests/oracle.py builds it densely from its definition),
alone and with every other option; chunkings of queries and keys, each chunk called with its
positions and merged, against the unchunked call; bad input; memory at genome-scale lengths.
The CUDA kernels' side is tests/test_kernel_terms.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from oracle import reference_attention
from support import check_attention, peak_traced_bytes

import cuonline
from cuonline.engines import numpy as numpy_engine
from cuonline.engines import numpy_scores


def case(seed, *, batch=(2, 3), lq=45, lk=70, d=8, dv=5, dr=4, dtype=np.float64):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal(batch + (n, e)).astype(dtype)
               for n, e in ((lq, d), (lk, d), (lk, dv)))
    return rng, q, k, v


def terms(rng, lq, lk, dr=4, *, heads=3):
    """Every new term with broadcast shapes: tables shorter than the distances (clamped) and
    longer ones, a block bias with tails in both directions."""
    return {
        "bias_block": dict(bias=rng.standard_normal((heads, -(-lq // 4), -(-lk // 7))),
                           bias_block=(4, 7)),
        "square_block": dict(bias=rng.standard_normal((1, -(-lq // 5), -(-lk // 5))),
                             bias_block=5),
        "rel_bias": dict(rel_bias=rng.standard_normal((heads, 31))),
        "rel_bias_long": dict(rel_bias=rng.standard_normal(2 * (lq + lk) + 1)),
        "rel_qk": dict(rel_q=rng.standard_normal((heads, lq, dr)),
                       rel_k=rng.standard_normal((1, 2 * lk + 1, dr))),
        "rel_qk_clamped": dict(rel_q=rng.standard_normal((lq, dr)),
                               rel_k=rng.standard_normal((heads, 9, dr))),
    }


OTHERS = {
    "plain": {},
    "causal": dict(causal=True),
    "window": dict(window=(12, 3)),
    "alibi": dict(alibi_slopes=np.array([0.05, 0.2, 0.7])),
    "softcap": dict(softcap=1.5),
    "softcap_bias": dict(softcap=1.5, softcap_bias=True),
    "kv_lengths": dict(kv_lengths=np.array([[60], [33]])),
    "positions": dict(q_offset=300, k_offset=280, causal=True),
    "mask": "mask",
}


def resolve(option, rng, lq, lk):
    if option == "mask":
        return dict(mask=rng.random((lq, lk)) < 0.7)
    return option


@pytest.mark.parametrize("other", list(OTHERS))
@pytest.mark.parametrize("term", ["bias_block", "square_block", "rel_bias", "rel_bias_long",
                                  "rel_qk", "rel_qk_clamped"])
def test_each_term_with_every_option_matches_the_oracle(term, other):
    rng, q, k, v = case(1)
    options = dict(terms(rng, 45, 70)[term], **resolve(OTHERS[other], rng, 45, 70))
    out, lse = cuonline.attention(q, k, v, return_lse=True, **options)
    ref_out, ref_lse = reference_attention(q, k, v, **options)
    np.testing.assert_allclose(out, ref_out, atol=1e-12, rtol=0)
    np.testing.assert_allclose(lse, ref_lse, atol=1e-12, rtol=0)


def test_all_terms_together_over_several_tiles(monkeypatch):
    # small tiles: several query blocks and key tiles, tails in both, at a small size
    monkeypatch.setattr(numpy_engine, "BLOCK_Q", 16)
    monkeypatch.setattr(numpy_engine, "BLOCK_K", 32)
    monkeypatch.setattr(numpy_engine, "MAX_KEY_TILE", 32)
    monkeypatch.setattr(numpy_scores, "REL_ROWS", 5)      # groups of rows with a tail
    rng, q, k, v = case(2, lq=75, lk=101)
    options = dict(bias=rng.standard_normal((3, 19, 15)), bias_block=(4, 7),
                   rel_bias=rng.standard_normal((3, 61)), rel_q=rng.standard_normal((75, 4)),
                   rel_k=rng.standard_normal((3, 41, 4)), alibi_slopes=np.array([0.1, 0.0, 0.3]),
                   softcap=3.0, softcap_bias=True, window=(40, 20), q_offset=10, k_offset=-5)
    out, lse = cuonline.attention(q, k, v, return_lse=True, **options)
    ref_out, ref_lse = reference_attention(q, k, v, **options)
    np.testing.assert_allclose(out, ref_out, atol=1e-12, rtol=0)
    np.testing.assert_allclose(lse, ref_lse, atol=1e-12, rtol=0)
    # any thread count gives the same bits
    again = cuonline.attention(q, k, v, workers=1, **options)
    assert np.array_equal(again, out)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_low_precision_inputs_use_float32_terms(dtype):
    rng, q, k, v = case(3, dtype=dtype)
    options = dict(terms(rng, 45, 70)["rel_qk"], rel_bias=rng.standard_normal(21).astype(dtype),
                   bias=rng.standard_normal((12, 10)).astype(np.float32), bias_block=(4, 7))
    out = cuonline.attention(q, k, v, **options)
    assert out.dtype == dtype
    check_attention(q, k, v, out, None, options)


def test_block_bias_equals_its_dense_expansion():
    rng, q, k, v = case(4)
    coarse = rng.standard_normal((2, 3, 12, 5))
    dense = np.repeat(np.repeat(coarse, 4, axis=-2), 16, axis=-1)[..., :45, :70]
    a = cuonline.attention(q, k, v, bias=coarse, bias_block=(4, 16))
    b = cuonline.attention(q, k, v, bias=dense)
    np.testing.assert_allclose(a, b, atol=1e-14, rtol=0)


def test_relative_terms_equal_a_dense_toeplitz_bias():
    # rel_bias and rel_q . rel_k[delta] against the same terms written as a dense bias
    rng, q, k, v = case(5, batch=(), lq=30, lk=50)
    rel_bias, rel_q, rel_k = (rng.standard_normal(s) for s in ((15,), (30, 4), (11, 4)))
    delta = np.arange(50)[None, :] - (np.arange(30)[:, None] + 20)
    dense = (rel_bias[7 + np.clip(delta, -7, 7)]
             + np.einsum("id,ijd->ij", rel_q, rel_k[5 + np.clip(delta, -5, 5)]))
    a = cuonline.attention(q, k, v, rel_bias=rel_bias, rel_q=rel_q, rel_k=rel_k)
    b = cuonline.attention(q, k, v, bias=dense)
    np.testing.assert_allclose(a, b, atol=1e-14, rtol=0)


@pytest.mark.parametrize("seed", range(4))
def test_chunked_calls_merge_exactly(seed):
    """Random chunkings of queries and keys, each chunk at its positions, merged: the same as
    one call, for causal, window, ALiBi and both relative terms."""
    rng, q, k, v = case(10 + seed, lq=57, lk=83)
    options = dict(rel_bias=rng.standard_normal((3, 41)), rel_q=rng.standard_normal((57, 4)),
                   rel_k=rng.standard_normal((1, 61, 4)), alibi_slopes=np.array([0.1, 0.2, 0.3]),
                   **([dict(causal=True), dict(window=(20, 9))][seed % 2]))
    whole, whole_lse = cuonline.attention(q, k, v, return_lse=True, **options)

    def cuts(n):
        inner = np.sort(rng.choice(np.arange(1, n), size=rng.integers(1, 4), replace=False))
        return [0, *map(int, inner), n]

    qc, kc = cuts(57), cuts(83)
    for a, b in zip(qc, qc[1:]):
        states = []
        for c, e in zip(kc, kc[1:]):
            states.append(cuonline.attention(
                q[..., a:b, :], k[..., c:e, :], v[..., c:e, :], return_lse=True,
                q_offset=a + (83 - 57), k_offset=c,
                **dict(options, rel_q=options["rel_q"][a:b])))
        out, lse = cuonline.merge(*states)
        np.testing.assert_allclose(out, whole[..., a:b, :], atol=1e-12, rtol=0)
        np.testing.assert_allclose(lse, whole_lse[..., a:b], atol=1e-12, rtol=0)


def test_block_bias_chunks_with_whole_blocks():
    rng, q, k, v = case(20, lq=48, lk=64)
    coarse = rng.standard_normal((3, 6, 4))                 # blocks of 8 x 16
    whole = cuonline.attention(q, k, v, bias=coarse, bias_block=(8, 16), causal=True)
    parts = [cuonline.attention(q, k[..., c:c + 32, :], v[..., c:c + 32, :], causal=True,
                                bias=coarse[..., c // 16:(c + 32) // 16], bias_block=(8, 16),
                                q_offset=16, k_offset=c, return_lse=True) for c in (0, 32)]
    np.testing.assert_allclose(cuonline.merge(*parts)[0], whole, atol=1e-12, rtol=0)


@pytest.mark.parametrize("options, error, words", [
    (dict(rel_bias=np.zeros(8)), ValueError, ["rel_bias", "odd", "R = 8"]),
    (dict(rel_q=np.zeros((45, 4)), rel_k=np.zeros((10, 4))), ValueError, ["rel_k", "odd"]),
    (dict(rel_q=np.zeros((45, 4)), rel_k=np.zeros((9, 3))), ValueError, ["Dr", "(9, 3)"]),
    (dict(rel_q=np.zeros((45, 4))), ValueError, ["rel_q", "without `rel_k`"]),
    (dict(rel_k=np.zeros((9, 4))), ValueError, ["rel_k", "without `rel_q`"]),
    (dict(rel_q=np.zeros((44, 4)), rel_k=np.zeros((9, 4))), ValueError,
     ["rel_q", "S + (Lq, Dr)"]),
    (dict(rel_q=np.zeros(4), rel_k=np.zeros((9, 4))), ValueError, ["rel_q", "2 dimensions"]),
    (dict(rel_bias=np.zeros((4, 9))), ValueError, ["rel_bias", "S + (R,)"]),
    (dict(rel_bias=np.zeros(9, dtype=np.int32)), TypeError, ["rel_bias", "integer"]),
    (dict(rel_q=np.zeros((45, 4), dtype=bool), rel_k=np.zeros((9, 4))), TypeError, ["rel_q"]),
    (dict(bias=np.zeros((45, 70)), bias_block=4), ValueError,
     ["bias", "ceil(Lq / 4)", "(2, 3, 12, 18)"]),
    (dict(bias_block=4), ValueError, ["bias_block", "`bias` is None"]),
    (dict(bias=np.zeros((12, 10)), bias_block=(4, 0)), ValueError, ["bias_block", ">= 1"]),
    (dict(bias=np.zeros((12, 10)), bias_block=(4, 7, 1)), TypeError, ["bias_block", "pair"]),
    (dict(bias=np.zeros((12, 10)), bias_block=4.0), TypeError, ["bias_block"]),
    (dict(bias=np.zeros((12, 10)), bias_block=(True, 7)), TypeError, ["bias_block"]),
    (dict(q_offset=1.5), TypeError, ["q_offset", "int"]),
    (dict(k_offset="3"), TypeError, ["k_offset", "int"]),
])
def test_bad_input_names_the_argument(options, error, words):
    _, q, k, v = case(0)
    with pytest.raises(error) as info:
        cuonline.attention(q, k, v, **options)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_toeplitz_views_are_read_not_expanded():
    # a rel_bias broadcast over a big batch costs its own size, not the batch's
    rng, q, k, v = case(30, batch=(64,), lq=8, lk=8)
    rel_bias = np.broadcast_to(rng.standard_normal(15).astype(np.float32), (64, 15))
    q, k, v = (x.astype(np.float32) for x in (q, k, v))
    out = cuonline.attention(q, k, v, rel_bias=rel_bias)
    check_attention(q, k, v, out, None, dict(rel_bias=rel_bias))


def _peak_extra_bytes(fn):
    x = np.zeros((1, 8, 4), dtype=np.float32)
    return peak_traced_bytes(fn, warm_up=(lambda: cuonline.attention(
        x, x, x, rel_q=x[0], rel_k=np.zeros((3, 4), np.float32)),))


@pytest.mark.slow
@pytest.mark.parametrize("term", ["rel_qk", "block_bias"])
def test_memory_at_genome_scale(term):
    """S = 32,768 positions, 8 heads: within 1 GiB beyond the output on the NumPy engine, where
    the dense equivalent would be a (8, S, S) float32 bias of 32 GiB. Queries are a sample of
    256 rows at the end of the sequence (their keys: all 32,768), so the test runs in seconds;
    the working memory per task does not depend on the number of queries."""
    rng = np.random.default_rng(0)
    s, h, d, dr, nq = 32768, 8, 64, 64, 256
    q = rng.standard_normal((h, nq, d), dtype=np.float32)
    k, v = (rng.standard_normal((h, s, d), dtype=np.float32) for _ in range(2))
    if term == "rel_qk":
        options = dict(rel_q=rng.standard_normal((h, nq, dr), dtype=np.float32),
                       rel_k=rng.standard_normal((2 * s - 1, dr), dtype=np.float32))
    else:
        options = dict(bias=rng.standard_normal((h, s // 16, s // 16), dtype=np.float32),
                       bias_block=16, q_offset=s - nq)
        options["bias"] = options["bias"][:, -(nq // 16):]     # the rows of these queries
    peak, out = _peak_extra_bytes(lambda: cuonline.attention(q, k, v, **options))
    assert peak - out.nbytes < 1 << 30, peak
    # sampled rows of head 0 against the oracle, each alone at its position
    for r in (0, 100, nq - 1):
        if term == "rel_qk":
            row = dict(rel_q=options["rel_q"][:1, r:r + 1], rel_k=options["rel_k"])
        else:
            row = dict(bias=options["bias"][:1, r // 16:r // 16 + 1], bias_block=16)
        ref, _ = reference_attention(q[:1, r:r + 1], k[:1], v[:1], q_offset=s - nq + r, **row)
        np.testing.assert_allclose(out[:1, r:r + 1], ref, atol=2e-4)


def test_block_bias_on_whole_and_partial_column_blocks(monkeypatch):
    # tiles of 32 keys: blocks of 16 keys fill the first three (a broadcast add), the tail
    # tile of 4 keys and blocks of 6 keys do not (a gather)
    monkeypatch.setattr(numpy_engine, "BLOCK_K", 32)
    monkeypatch.setattr(numpy_engine, "MAX_KEY_TILE", 32)
    rng, q, k, v = case(40, lq=30, lk=100)
    for block in ((4, 16), (3, 6)):
        coarse = rng.standard_normal((3, -(-30 // block[0]), -(-100 // block[1])))
        out = cuonline.attention(q, k, v, bias=coarse, bias_block=block)
        ref, _ = reference_attention(q, k, v, bias=coarse, bias_block=block)
        np.testing.assert_allclose(out, ref, atol=1e-12, rtol=0)


def test_cuda_limits_of_the_relative_terms_are_checked_before_any_work():
    # no compiler needed: validation refuses before a kernel is planned
    _, q, k, v = case(0, batch=())
    with pytest.raises(ValueError, match=r"Dr up to 256, got Dr = 257"):
        cuonline.attention(q, k, v, rel_q=np.zeros((45, 257)), rel_k=np.zeros((3, 257)),
                           backend="emulate")
    huge = np.broadcast_to(np.zeros(1), (2**31 + 1,))      # a zero-stride table: no memory
    with pytest.raises(ValueError, match=r"`rel_bias` with R = 2147483649"):
        cuonline.attention(q, k, v, rel_bias=huge, backend="emulate")
    # the NumPy engine takes both
    assert cuonline.attention(q, k, v, rel_bias=huge).shape == (45, 5)
