"""CPU benchmark: cuonline's NumPy engine beside naive NumPy and torch, in one run.

    python benchmarks/bench_cpu.py [--lengths 1024 4096 16384] [--heads 8] [--dim 64]
                                   [--causal] [--memory-length 32768] [--repeat 3]

Prints throughput (GFLOP/s, counting 4 * Lq * Lk * D per head, halved when causal) and the
peak extra memory that tracemalloc sees (NumPy's allocations; torch's own allocator is not
traced, so its column reads near 0), for each engine side by side; a ratio line gives
cuonline / torch from the same run. ``cuonline-blas`` is the same engine without its thread
pool (one task at a time, BLAS threading itself), the alternative the pool was measured
against. Naive NumPy (softmax(q k^T) v with the scores materialised) is skipped where its
score matrix would exceed --naive-limit-gib. torch is used when importable. Finally it runs cuonline alone at --memory-length to show the memory bound.
"""

from __future__ import annotations

import argparse
import gc
import time
import tracemalloc

import numpy as np

import cuonline


def naive(q, k, v, causal):
    s = q @ np.swapaxes(k, -1, -2) * np.float32(1 / np.sqrt(q.shape[-1]))
    if causal:
        s[..., np.triu(np.ones(s.shape[-2:], dtype=bool), 1)] = -np.inf
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    return s @ v


def blas_threaded(q, k, v, causal):
    """cuonline's NumPy engine without its thread pool: tasks in one thread, BLAS threading
    itself. The design alternative the pool is measured against."""
    from cuonline.engines import numpy as numpy_engine

    saved = numpy_engine.workers
    numpy_engine.workers = lambda: 1
    try:
        return cuonline.attention(q, k, v, causal=causal)
    finally:
        numpy_engine.workers = saved


def torch_sdpa():
    try:
        import torch
    except ImportError:
        return None

    def run(q, k, v, causal):
        with torch.no_grad():
            return torch.nn.functional.scaled_dot_product_attention(
                torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v), is_causal=causal
            ).numpy()

    return run


def measure(fn, repeat):
    """Best wall time of ``repeat`` runs after one warm-up, and the peak traced allocation."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        gc.collect()
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    gc.collect()
    tracemalloc.start()
    fn()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return best, peak


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--naive-limit-gib", type=float, default=4.0)
    parser.add_argument("--memory-length", type=int, default=32768)
    args = parser.parse_args()

    torch_run = torch_sdpa()
    engines = {
        "cuonline": lambda q, k, v, c: cuonline.attention(q, k, v, causal=c),
        "cuonline-blas": blas_threaded,
        "naive-numpy": naive,
    }
    if torch_run is not None:
        engines["torch-sdpa"] = torch_run
    from cuonline.engines.numpy import workers

    print(f"H={args.heads} D={args.dim} float32 causal={args.causal}; {workers()} cores; "
          f"torch {'found' if torch_run else 'not installed'}")
    print(f"{'N':>6} {'engine':<13} {'GFLOP/s':>9} {'peak MiB':>10}")
    rng = np.random.default_rng(0)
    for n in args.lengths:
        q, k, v = (rng.standard_normal((args.heads, n, args.dim), dtype=np.float32)
                   for _ in range(3))
        flops = 4 * args.heads * n * n * args.dim / (2 if args.causal else 1)
        results = {}
        for name, fn in engines.items():
            if name == "naive-numpy" and args.heads * n * n * 4 / 2**30 > args.naive_limit_gib:
                print(f"{n:>6} {name:<13} {'skipped: scores would need':>20} "
                      f"{args.heads * n * n * 4 / 2**30:.0f} GiB")
                continue
            seconds, peak = measure(lambda: fn(q, k, v, args.causal), args.repeat)
            results[name] = flops / seconds / 1e9
            print(f"{n:>6} {name:<13} {results[name]:>9.1f} {peak / 2**20:>10.1f}")
        if "torch-sdpa" in results:
            print(f"{n:>6} {'ratio':<13} cuonline / torch = "
                  f"{results['cuonline'] / results['torch-sdpa']:.2f}")

    n = args.memory_length
    q, k, v = (rng.standard_normal((args.heads, n, args.dim), dtype=np.float32)
               for _ in range(3))
    start = time.perf_counter()
    tracemalloc.start()
    cuonline.attention(q, k, v, causal=args.causal)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    seconds = time.perf_counter() - start
    output = args.heads * n * args.dim * 4
    print(f"memory: N={n} H={args.heads} D={args.dim}: cuonline peak traced allocation "
          f"{peak / 2**20:.1f} MiB (output {output / 2**20:.1f} MiB; naive scores would need "
          f"{args.heads * n * n * 4 / 2**30:.0f} GiB); {seconds:.1f} s")


if __name__ == "__main__":
    main()
