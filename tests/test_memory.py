"""Memory bounds of the NumPy engine, measured with tracemalloc (NumPy reports to it)."""

from __future__ import annotations

import numpy as np
from support import peak_traced_bytes

import cuonline


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
