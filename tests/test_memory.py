"""Memory bounds of the NumPy engine, measured with tracemalloc (NumPy reports to it)."""

from __future__ import annotations

import numpy as np
from support import peak_traced_bytes

import cuonline
from cuonline.engines import numpy_scores


def peak_extra_bytes(fn):
    x = np.zeros((2, 8, 4), dtype=np.float32)
    x64 = x.astype(np.float64)
    return peak_traced_bytes(fn, warm_up=(lambda: cuonline.attention(x, x, x, causal=True),
                                          lambda: cuonline.attention(x64, x64, x64)))


def test_scores_and_broadcast_bias_never_materialised():
    rng = np.random.default_rng(0)
    b, n, d = 16, 1024, 16
    q, k, v = (rng.standard_normal((b, n, d), dtype=np.float32) for _ in range(3))
    bias = rng.standard_normal((n, n), dtype=np.float32)[None]   # broadcast over the batch
    peak, out = peak_extra_bytes(lambda: cuonline.attention(q, k, v, bias=bias, causal=True))
    scores_one_head = n * n * 4
    # output (1 MiB) + a few 256x512 tiles per worker (about 5 MiB in all, measured); one
    # head's scores per worker would add 8 MiB, the broadcast bias 64 MiB

    assert peak < out.nbytes + 2 * scores_one_head, peak


def test_queries_and_keys_broadcast_along_the_head_dimension_are_not_copied():
    """Issue 22, item 8: q and k of D = 2**24 broadcast from one float64 each (8 real bytes):
    the products read them in slices of the head dimension, so the call's memory is a few
    tiles, where copying the query block and a key tile took 192-256 MiB and more."""
    d = 2 ** 24
    q = np.broadcast_to(np.float64(0.5), (2, 3, d))
    k = np.broadcast_to(np.float64(0.25), (2, 5, d))
    v = np.arange(2 * 5 * 4, dtype=np.float64).reshape(2, 5, 4)
    peak, (out, lse) = peak_extra_bytes(lambda: cuonline.attention(q, k, v, return_lse=True))
    # per task (one per batch element, two at a time here): a query slice, its scaled copy and
    # a key slice, each at most SLICE_BYTES (measured 13 MiB in all; the copies were 2 GiB)
    assert peak < 8 * numpy_scores.SLICE_BYTES, peak
    # every score is 0.5 * 0.25 * d / sqrt(d): equal weights, lse = score + log(5)
    score = 0.125 * np.sqrt(d)
    np.testing.assert_allclose(lse, score + np.log(5), rtol=1e-12)
    np.testing.assert_allclose(out, np.broadcast_to(v.mean(axis=1, keepdims=True), out.shape),
                               rtol=1e-12)
