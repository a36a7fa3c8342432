"""CPU benchmark: the genomics score terms (issue 12) beside their dense-bias equivalents.

    python benchmarks/bench_genomics.py            # Enformer-style at L = 1536 and 4096,
                                                   # AlphaGenome-style at L = 4096
    python benchmarks/bench_genomics.py --quick    # a tiny smoke run (CI)

Every row runs one layer (batch 1) on the NumPy engine twice on the same arrays:

* ``native``: the term from its small arrays (``rel_q``/``rel_k`` for Enformer's relative
  logits, ``bias=pair map, bias_block=16`` for AlphaGenome's block bias);
* ``dense``: the same logits as a dense ``(H, L, L)`` float32 ``bias=`` (what a library without
  the terms needs), its construction timed apart (``build``: per head ``rel_q @ r.T`` against
  every distance and a skewed view, or ``np.repeat`` of the pair map) and not counted in
  ``dense``.

It prints the best wall time of each, the ratio dense / native (> 1: native is faster), the
bytes the caller holds for the term (the dense bias against the term's own arrays) and the peak
traced allocation of each call beyond its output (tracemalloc; NumPy reports to it). The two
outputs are compared (max abs difference) so both compute the same thing. Figures move with
whatever else the machine does: compare the columns of one run.
"""

from __future__ import annotations

import argparse
import gc
import os
import tracemalloc

import numpy as np
from bench_cpu import best_seconds

import cuonline


def peak_beyond(fn):
    """Peak traced bytes of ``fn()`` beyond what it returns."""
    gc.collect()
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        result = fn()
        return tracemalloc.get_traced_memory()[1] - base - result.nbytes
    finally:
        tracemalloc.stop()


def enformer(length, heads, dk, dv, rng):
    """Enformer's layer: content (q scale + u) . k plus relative logits (q scale + w) . r[delta]."""
    q, k = (rng.standard_normal((1, heads, length, dk), dtype=np.float32) for _ in range(2))
    v = rng.standard_normal((1, heads, length, dv), dtype=np.float32)
    u, w = (0.1 * rng.standard_normal((heads, 1, dk), dtype=np.float32) for _ in range(2))
    r = rng.standard_normal((heads, 2 * length - 1, dk), dtype=np.float32)
    qs = q * np.float32(dk ** -0.5)
    content, rel_q = qs + u, qs + w
    native = dict(rel_q=rel_q, rel_k=r)

    def build():
        # per head: every query against every distance, (L, 2L - 1), then the Toeplitz
        # (skewed) view picks distance j - i for each (i, j): the cheapest dense construction
        out = np.empty((1, heads, length, length), dtype=np.float32)
        for h in range(heads):
            products = rel_q[0, h] @ r[h].T                       # entry (i, L - 1 + delta)
            flat = products.reshape(-1)[length - 1:]
            item = flat.itemsize
            out[0, h] = np.lib.stride_tricks.as_strided(
                flat, shape=(length, length), strides=((2 * length - 2) * item, item))
        return out

    return (content, k, v), dict(scale=1.0), native, build, rel_q.nbytes + r.nbytes


def alphagenome(length, heads, dk, dv, rng, block=16):
    """AlphaGenome's layer: 8 query heads on one kv head, a 16 x 16 block pair bias, the soft
    cap after the bias."""
    q = rng.standard_normal((1, heads, length, dk), dtype=np.float32)
    k = rng.standard_normal((1, 1, length, dk), dtype=np.float32)
    v = rng.standard_normal((1, 1, length, dv), dtype=np.float32)
    pair = rng.standard_normal((1, heads, length // block, length // block), dtype=np.float32)
    native = dict(bias=pair, bias_block=block)

    def build():
        return np.repeat(np.repeat(pair, block, axis=-2), block, axis=-1)

    return (q, k, v), dict(softcap=5.0, softcap_bias=True), native, build, pair.nbytes


def row(name, length, make, repeat, rng):
    (q, k, v), common, native, build, native_bytes = make(rng)
    t_build = best_seconds(build, 1)
    dense = build()

    def run_native():
        return cuonline.attention(q, k, v, **common, **native)

    def run_dense():
        return cuonline.attention(q, k, v, **common, bias=dense)

    diff = float(np.max(np.abs(run_native() - run_dense())))
    t_native, t_dense = best_seconds(run_native, repeat), best_seconds(run_dense, repeat)
    m_native, m_dense = peak_beyond(run_native), peak_beyond(run_dense)
    mib = 2.0 ** -20
    print(f"| {name:<11} | {length:>5} | {t_native * 1e3:>9.1f} | {t_dense * 1e3:>9.1f} | "
          f"{t_dense / t_native:>5.2f} | {t_build * 1e3:>9.1f} | {native_bytes * mib:>8.1f} | "
          f"{dense.nbytes * mib:>8.1f} | {m_native * mib:>8.1f} | {m_dense * mib:>8.1f} | "
          f"{diff:.1e} |", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    if args.quick:
        cases = [("enformer", 256, 2, 16, 24), ("alphagenome", 256, 2, 16, 24)]
        args.repeat = 1
    else:
        cases = [("enformer", 1536, 8, 64, 192), ("enformer", 4096, 8, 64, 192),
                 ("alphagenome", 4096, 8, 128, 192)]
    print(f"cuonline {cuonline.__version__}, NumPy engine, {os.cpu_count()} cores, float32, "
          f"best of {args.repeat}")
    print("| layer       |     L | native ms |  dense ms | ratio |  build ms | term MiB | "
          "dense MiB | peak MiB | peak MiB | max diff |")
    print("|             |       |           |           | d / n | (dense)   | (native) | "
          "(bias)    | native   | dense    |          |")
    for name, length, heads, dk, dv in cases:
        make = enformer if name == "enformer" else alphagenome
        row(name, length, lambda r, m=make: m(length, heads, dk, dv, r), args.repeat, rng)


if __name__ == "__main__":
    main()
