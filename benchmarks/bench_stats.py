"""CPU benchmark: attention statistics (issue 21) beside attention and the dense computation.

    python benchmarks/bench_stats.py                 # N = 1024, 2048, 4096, 8192; memory at 32768
    python benchmarks/bench_stats.py --sizes 1024 2048 --memory-n 32768
    python benchmarks/bench_stats.py --quick         # a tiny smoke run
    python benchmarks/bench_stats.py --backend cupy --out bench-out   # the CUDA kernels (GPU)

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

``--backend cupy`` (a GPU; benchmarks/gpu_check.sh runs it) times the CUDA kernels
(``kernels_cu/attention_stats.cu``) on CuPy arrays beside ``attention`` on the same engine and
the dense CuPy computation, synchronised, and first checks every statistic against the NumPy
engine on host copies at a small size (max errors printed; a wrong index fails the run). The
memory line then gives the CuPy pool's peak bytes. ``--out DIR`` also writes the table to
``DIR/gpu_stats.md`` (``--backend cupy``) or ``DIR/bench_stats.md``.
"""

from __future__ import annotations

import argparse
import gc
import os
import tracemalloc

import numpy as np
from bench_cpu import best_seconds

import cuonline


def dense_stats(xp, q, k):
    s = q @ k.T * np.float32(q.shape[-1] ** -0.5)
    s -= s.max(axis=1, keepdims=True)
    p = xp.exp(s)
    p /= p.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        entropy = -xp.where(p > 0, p * xp.log(p), 0).sum(axis=1)
    return entropy, p.argmax(axis=1), p.sum(axis=0)


def check_against_numpy(xp, backend, rng):
    """Every statistic of ``backend`` against the NumPy engine on host copies (small: causal
    with an offset, top_k, received with weights, rows); prints the max errors, raises on a
    wrong index."""
    q = rng.standard_normal((2, 300, 64), dtype=np.float32)
    k = rng.standard_normal((2, 700, 64), dtype=np.float32)
    w = rng.random((2, 300)).astype(np.float32)
    kw = dict(causal=True, k_offset=400, received=True, top_k=8, rows=[0, 299])
    got = cuonline.attention_stats(xp.asarray(q), xp.asarray(k), query_weights=xp.asarray(w),
                                   backend=backend, **kw)
    want = cuonline.attention_stats(q, k, query_weights=w, **kw)
    errors = {}
    for name in ("lse", "entropy", "max_weight", "argmax", "received", "top_indices",
                 "top_weights", "weights"):
        a = np.asarray(getattr(got, name).get() if xp is not np else getattr(got, name))
        b = getattr(want, name)
        if name in ("argmax", "top_indices"):
            # a disagreement must be a near-tie of float32 weights
            errors[name] = int((a != b).sum())
            continue
        errors[name] = float(np.abs(a - b).max())
    print("check against the NumPy engine (max abs error; indices: count differing):",
          ", ".join(f"{n} {e:.2e}" if isinstance(e, float) else f"{n} {e}"
                    for n, e in errors.items()))
    if errors["argmax"] > 2 or errors["top_indices"] > 8:
        raise SystemExit(f"{backend}: indices differ from the NumPy engine: {errors}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="numpy", choices=("numpy", "cupy", "emulate"))
    parser.add_argument("--out", default=None, help="write the table into this directory too")
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
    xp, backend, sync = np, "auto", (lambda: None)
    if args.backend == "cupy":
        import cupy  # noqa: PLC0415 - only on a GPU
        xp, backend = cupy, "cupy"
        sync = cupy.cuda.get_current_stream().synchronize
    elif args.backend == "emulate":
        backend = "emulate"
    if args.backend != "numpy":
        check_against_numpy(xp, backend, rng)

    def timed(fn):
        return best_seconds(lambda: (fn(), sync()), args.repeat)

    lines = [f"backend {args.backend}, float32, D = {d}, one head, best of {args.repeat}",
             "| N | attention s | lse+H+argmax s | ratio | received s | ratio | dense s |",
             "|---|---|---|---|---|---|---|"]
    print("\n".join(lines))
    for n in args.sizes:
        q, k, v = (xp.asarray(rng.standard_normal((n, d), dtype=np.float32)) for _ in range(3))
        t_att = timed(lambda: cuonline.attention(q, k, v, backend=backend))
        t_row = timed(lambda: cuonline.attention_stats(q, k, backend=backend))
        t_rec = timed(lambda: cuonline.attention_stats(q, k, entropy=False, received=True,
                                                       backend=backend))
        dense = "-"
        if n * n * 4 * 3 <= args.dense_limit and args.backend != "emulate":
            dense = f"{timed(lambda: dense_stats(xp, q, k)):.3f}"
        lines.append(f"| {n} | {t_att:.3f} | {t_row:.3f} | {t_row / t_att:.2f} | {t_rec:.3f} "
                     f"| {t_rec / t_att:.2f} | {dense} |")
        print(lines[-1])

    n, m = args.memory_n, args.memory_queries
    q = xp.asarray(rng.standard_normal((m, d), dtype=np.float32))
    k = xp.asarray(rng.standard_normal((n, d), dtype=np.float32))
    gc.collect()
    if xp is np:
        tracemalloc.start()
        try:
            st = cuonline.attention_stats(q, k, received=True, top_k=8, backend=backend)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        where = "peak"
    else:
        pool = xp.get_default_memory_pool()
        pool.free_all_blocks()
        before = pool.total_bytes()
        st = cuonline.attention_stats(q, k, received=True, top_k=8, backend=backend)
        sync()
        peak = pool.total_bytes() - before
        where = "CuPy pool grew by"
    results = sum(x.nbytes for x in (st.lse, st.entropy, st.max_weight, st.argmax,
                                     st.received, st.top_indices, st.top_weights))
    lines.append(f"memory: {m} queries x N={n} keys: {where} {peak / 2**20:.1f} MiB "
                 f"(results {results / 2**20:.2f} MiB); the dense P would be "
                 f"{m * n * 4 / 2**20:.0f} MiB")
    print(lines[-1])
    if args.out:
        name = "gpu_stats.md" if args.backend == "cupy" else "bench_stats.md"
        with open(os.path.join(args.out, name), "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
