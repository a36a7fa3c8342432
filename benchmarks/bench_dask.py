"""Dask benchmark: cuonline.attention on Dask arrays, 1 and 2 worker processes, and the graph
of a 10**6-long sequence.

    python benchmarks/bench_dask.py            # N = 32768, D = 64; N = 10**6 with 16k chunks
    python benchmarks/bench_dask.py --quick    # a tiny smoke run (tests/test_dask.py)
    python benchmarks/bench_dask.py --part backward   # the backward's memory alone

Prints, in one run:

* **scaling**: one in-process ``cuonline.attention`` call on NumPy arrays (the NumPy engine on
  every core), then the same call on Dask arrays computed by a ``distributed.LocalCluster`` of
  1 and of 2 worker processes with one thread each; the ratio of each to the in-process call
  (inputs persisted on the workers first, workers warmed up, so the times are attention's),
  with distributed's default worker environment and with larger malloc thresholds (see
  ``MALLOC``); each worker's peak resident memory (``ru_maxrss``) before and after;
* **graph**: for ``N = --big-n`` keys and queries in ``--big-chunk`` chunks, causal: the time to
  build the graph, its tasks (per visible chunk pair, merges, all), the time of the first query
  chunk (one task) beside a direct call on the same chunks, and the scheduling overhead per
  task: the whole graph run with a chunk function that returns zeros at once, so what is
  timed is Dask (threaded scheduler and the 2-process cluster), not attention;
* **backward memory**: ``attention_backward`` of 64 queries against ``--bwd-keys`` keys
  (D = 16, float32, ``--bwd-chunk`` keys per chunk, keys and values generated chunk by chunk):
  the peak of memory allocated (``tracemalloc``) while computing one gradient alone, ``dq``
  then ``dk``, on the synchronous and the threaded scheduler, beside one in-memory call on
  one key chunk (the memory of one task).

Figures move with whatever else the machine does: each is the best of --repeat runs, and the
ratios of one run are what to compare.
"""

from __future__ import annotations

import argparse
import itertools
import resource
import time
import tracemalloc

import numpy as np

import cuonline
from cuonline.engines import dask as dask_engine


#: Worker environments. distributed's nannies start workers with MALLOC_TRIM_THRESHOLD_=65536
#: (its default "pre-spawn-environ"), which fixes glibc's thresholds: every large temporary
#: of the NumPy engine is then a fresh mmap, page-faulted in (measured 1.7x slower per task).
#: "large" gives the thresholds back room: trim above 128 MiB, mmap above 64 MiB (set through
#: the config key distributed.nanny.pre-spawn-environ: Nanny(env=...) is applied too late).
MALLOC = {
    "distributed default": {},
    "large": {"MALLOC_TRIM_THRESHOLD_": str(128 << 20), "MALLOC_MMAP_THRESHOLD_": str(64 << 20)},
}


def rss_mib() -> float:
    """Peak resident memory of this process in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def warm():
    # the NumPy engine's tile kernel compiles on its first call in each process
    rng = np.random.default_rng(0)
    x = rng.standard_normal((300, 64)).astype(np.float32)
    cuonline.attention(x, x, x, workers=1)
    return rss_mib()


def scaling(args, dask, distributed, da):
    n, d, h = args.n, args.d, args.heads
    # inputs made by Dask, chunk by chunk on the workers; the same values in memory here
    rng = da.random.default_rng(0)
    lazy = [rng.standard_normal((h, n, d), chunks=(1, args.chunk, d), dtype=np.float32)
            for _ in range(3)]
    q, k, v = (x.compute() for x in lazy)
    warm()
    ref = cuonline.attention(q, k, v)
    single = best_of(args.repeat, lambda: cuonline.attention(q, k, v))
    print(f"in-process call: N={n} D={d} H={h} float32, {single:.2f} s "
          f"(each time: the best of {args.repeat})")
    print("| workers | malloc | s | ratio to in-process | chunk tasks | peak RSS per worker, "
          "MiB (before -> after) | max error |")
    print("|---|---|---|---|---|---|---|")
    for (malloc, env), n_workers in itertools.product(MALLOC.items(), (1, 2)):
        # the environment a nanny sets before it spawns its worker: glibc reads it at start
        spawn_env = {**dask.config.get("distributed.nanny.pre-spawn-environ"), **env}
        with dask.config.set({"distributed.nanny.pre-spawn-environ": spawn_env}), \
                distributed.LocalCluster(n_workers=n_workers, threads_per_worker=1,
                                         processes=True, dashboard_address=None) as cluster, \
                distributed.Client(cluster) as client:
            before = client.run(warm)
            dq, dk, dv = client.persist(lazy)
            distributed.wait([dq, dk, dv])
            out = cuonline.attention(dq, dk, dv)
            tasks = sum(1 for key in dict(out.__dask_graph__())
                        if isinstance(key, tuple) and key[0].startswith("cuonline-attention-chunk"))
            got = client.compute(out, sync=True)
            took = best_of(args.repeat, lambda: client.compute(out, sync=True))
            after = client.run(rss_mib)
        rss = ", ".join(f"{before[w]:.0f} -> {after[w]:.0f}" for w in sorted(after))
        err = float(np.abs(got - ref).max())
        print(f"| {n_workers} | {malloc} | {took:.2f} | {took / single:.2f} | {tasks} | {rss} "
              f"| {err:.1e} |")


def best_of(repeats, fn) -> float:
    """The shortest of ``repeats`` wall times of ``fn()``, in seconds."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def zero_states(q, k, v, **options):
    """A chunk function that does no attention: the zero state of the chunk's queries."""
    shape = np.broadcast_shapes(q.shape[:-2], k.shape[:-2]) + q.shape[-2:-1]
    return (np.zeros(shape + v.shape[-1:], dtype=q.dtype), np.full(shape, -np.inf, np.float32))


def graph(args, distributed, da):
    n, c, d = args.big_n, args.big_chunk, args.d
    q, k, v = (da.zeros((n, d), chunks=(c, d), dtype=np.float32) for _ in range(3))
    t = time.perf_counter()
    out = cuonline.attention(q, k, v, causal=True)
    build = time.perf_counter() - t
    keys = list(dict(out.__dask_graph__()))
    kinds = {kind: sum(1 for key in keys if isinstance(key, tuple)
                       and key[0].startswith(f"cuonline-attention-{kind}-"))
             for kind in ("chunk", "merge")}
    blocks = -(-n // c)
    print(f"\ngraph: N={n}, chunks of {c} ({blocks} x {blocks} pairs), causal: built in "
          f"{build:.2f} s; {kinds['chunk']} chunk tasks ({kinds['chunk'] / blocks**2:.2f} of "
          f"the pairs), {kinds['merge']} merges, {len(keys)} tasks in all")

    rng = np.random.default_rng(1)
    qa, ka, va = (rng.standard_normal((c, d)).astype(np.float32) for _ in range(3))
    real = cuonline.attention(da.from_array(qa, chunks=c), da.from_array(ka, chunks=c),
                              da.from_array(va, chunks=c), causal=True, q_offset=0)
    t = time.perf_counter()
    real.compute(scheduler="threads")
    sliced = time.perf_counter() - t
    t = time.perf_counter()
    cuonline.attention(qa, ka, va, causal=True, q_offset=0, workers=1)
    direct = time.perf_counter() - t
    print(f"first query chunk (1 task, {c} x {c}): Dask {sliced:.3f} s, direct call "
          f"{direct:.3f} s")

    # the same graph (its shape depends on N and the chunks only) over 1-wide heads, so the
    # merges of the zero states cost next to nothing either
    thin = [da.zeros((n, 1), chunks=(c, 1), dtype=np.float32) for _ in range(3)]
    stub = dask_engine.attention(zero_states, *thin, causal=True)
    n_tasks = len(dict(stub.__dask_graph__()))
    threaded = best_of(2, lambda: stub.compute(scheduler="threads", num_workers=2))
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                  dashboard_address=None) as cluster, \
            distributed.Client(cluster) as client:
        client.run(warm)
        spread = best_of(2, lambda: client.compute(stub, sync=True))   # the first run warms
        peak = client.run(rss_mib)
    print(f"scheduling overhead, {n_tasks} tasks, a zero-cost chunk function, D = Dv = 1: "
          f"threaded "
          f"(2 threads) {threaded:.2f} s = {threaded / n_tasks * 1e6:.0f} us/task; "
          f"2 worker processes {spread:.2f} s = {spread / n_tasks * 1e6:.0f} us/task; "
          f"peak RSS per worker {', '.join(f'{m:.0f}' for m in peak.values())} MiB")


def backward_memory(args, dask, da):
    n, lk, c, d = 64, args.bwd_keys, args.bwd_chunk, 16
    rng = da.random.default_rng(3)
    q = rng.standard_normal((n, d), chunks=(n, d), dtype=np.float32)
    k, v = (rng.standard_normal((lk, d), chunks=(c, d), dtype=np.float32) for _ in range(2))
    out, lse = dask.compute(*cuonline.attention(q, k, v, return_lse=True))
    dout = np.ones_like(out)
    grads = cuonline.attention_backward(dout, q, k, v, out, lse)
    # one task's work: the in-memory call on one key chunk with its own state
    q0, k0, v0 = dask.compute(q, k[:c], v[:c])
    out0, lse0 = cuonline.attention(q0, k0, v0, return_lse=True)
    task = traced_peak(lambda: cuonline.attention_backward(dout, q0, k0, v0, out0, lse0,
                                                           workers=1))[0]
    print(f"\nbackward memory: {n} queries, {lk} keys in chunks of {c} ({lk // c} tasks), "
          f"D = {d}, float32; one in-memory call on one key chunk peaks at {task:.1f} MiB; "
          f"k and v are {k.nbytes / 2**20:.0f} MiB each")
    print("| scheduler | gradient computed alone | peak traced MiB | s |")
    print("|---|---|---|---|")
    for scheduler, kwargs in (("synchronous", {}), ("threads", {"num_workers": 2})):
        for field in ("dq", "dk"):
            x = getattr(grads, field)
            peak, took = traced_peak(lambda: x.compute(scheduler=scheduler, **kwargs))
            print(f"| {scheduler} | {field} | {peak:.1f} | {took:.2f} |")


def traced_peak(fn):
    """``(peak MiB that tracemalloc saw, seconds)`` of ``fn()`` (NumPy reports its buffers to
    tracemalloc, so this is the arrays' memory, not the process's resident size)."""
    tracemalloc.start()
    try:
        t = time.perf_counter()
        fn()
        took = time.perf_counter() - t
        return tracemalloc.get_traced_memory()[1] / 2**20, took
    finally:
        tracemalloc.stop()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=32768)
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument("--heads", type=int, default=1)
    parser.add_argument("--chunk", type=int, default=8192)
    parser.add_argument("--big-n", type=int, default=10**6)
    parser.add_argument("--big-chunk", type=int, default=16384)
    parser.add_argument("--repeat", type=int, default=3,
                        help="time each configuration this many times, keep the best")
    parser.add_argument("--bwd-keys", type=int, default=1 << 20)
    parser.add_argument("--bwd-chunk", type=int, default=1 << 16)
    parser.add_argument("--part", choices=("all", "scaling", "graph", "backward"), default="all")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    args = parser.parse_args(argv)
    if args.quick:
        args.n, args.chunk, args.big_n, args.big_chunk, args.repeat = 1024, 256, 8192, 1024, 1
        args.bwd_keys, args.bwd_chunk = 1 << 13, 1 << 10
    import dask
    import dask.array as da
    import distributed

    if args.part in ("all", "scaling"):
        scaling(args, dask, distributed, da)
    if args.part in ("all", "graph"):
        graph(args, distributed, da)
    if args.part in ("all", "backward"):
        backward_memory(args, dask, da)


if __name__ == "__main__":
    main()
