"""CPU benchmark: attention statistics (issue 21) beside attention and the dense computation.

    python benchmarks/bench_stats.py                 # N = 1024, 2048, 4096, 8192; memory at 32768
    python benchmarks/bench_stats.py --sizes 1024 2048 --memory-n 32768
    python benchmarks/bench_stats.py --quick         # a tiny smoke run

Per N (one head, float32, D = Dv = 64, no mask), the best wall time of:

* ``attention``: ``cuonline.attention(q, k, v)`` with ``v`` of width D: the goal's yardstick;
* ``lse+H+argmax``: ``attention_stats(q, k)`` (entropy and argmax, no received);
* ``received``: ``attention_stats(q, k, entropy=False, received=True)`` (both passes);
* ``dense``: ``P = softmax(q k^T / 8)`` in NumPy, then entropy, argmax and ``P.sum(0)`` (only
  where the ``N x N`` float32 matrix fits ``--dense-limit`` bytes).

Then the peak traced allocation (tracemalloc) of ``attention_stats(..., received=True,
top_k=8)`` at ``--memory-n`` keys for ``--memory-queries`` queries, beside the bytes of the
dense ``P`` it never forms. Figures move with whatever else the machine does: compare the
columns of one run.
"""

from __future__ import annotations

import argparse
import gc
import tracemalloc

import numpy as np
from bench_cpu import best_seconds

import cuonline


def dense_stats(q, k):
    s = q @ k.T * np.float32(q.shape[-1] ** -0.5)
    s -= s.max(axis=1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        entropy = -np.where(p > 0, p * np.log(p), 0).sum(axis=1)
    return entropy, p.argmax(axis=1), p.sum(axis=0)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--memory-n", type=int, default=32768)
    parser.add_argument("--memory-queries", type=int, default=1024)
    parser.add_argument("--dense-limit", type=float, default=2**30)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.memory_n, args.memory_queries, args.repeat = [256], 4096, 64, 1
    rng = np.random.default_rng(0)
    d = 64
    print("| N | attention s | lse+H+argmax s | ratio | received s | ratio | dense s |")
    print("|---|---|---|---|---|---|---|")
    for n in args.sizes:
        q, k, v = (rng.standard_normal((n, d), dtype=np.float32) for _ in range(3))
        t_att = best_seconds(lambda: cuonline.attention(q, k, v), args.repeat)
        t_row = best_seconds(lambda: cuonline.attention_stats(q, k), args.repeat)
        t_rec = best_seconds(lambda: cuonline.attention_stats(q, k, entropy=False,
                                                              received=True), args.repeat)
        dense = "-"
        if n * n * 4 * 3 <= args.dense_limit:
            dense = f"{best_seconds(lambda: dense_stats(q, k), args.repeat):.3f}"
        print(f"| {n} | {t_att:.3f} | {t_row:.3f} | {t_row / t_att:.2f} | {t_rec:.3f} | "
              f"{t_rec / t_att:.2f} | {dense} |")

    n, m = args.memory_n, args.memory_queries
    q = rng.standard_normal((m, d), dtype=np.float32)
    k = rng.standard_normal((n, d), dtype=np.float32)
    gc.collect()
    tracemalloc.start()
    try:
        st = cuonline.attention_stats(q, k, received=True, top_k=8)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    results = sum(x.nbytes for x in (st.lse, st.entropy, st.max_weight, st.argmax,
                                     st.received, st.top_indices, st.top_weights))
    print(f"memory: {m} queries x N={n} keys: peak {peak / 2**20:.1f} MiB "
          f"(results {results / 2**20:.2f} MiB); the dense P would be "
          f"{m * n * 4 / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
